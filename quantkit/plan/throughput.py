"""A throughput *model* for decode, calibrated on the production GLM-5.2 and Kimi-K2.6 figures (prefill:
quantkit/plan/prefill.py).

It is a model, not a measurement. Decode at small batch is bound by memory traffic plus fixed
per-step costs, so one decode step is modelled as

    t_step = layers * t_layer                      fixed per-layer cost (launches, all-reduces)
           + fp8_calls * t_fp8_call                extra cost of each FP8 block-scaled Linear call
           + bytes_read / (bandwidth * eff_bw)     weights touched (+ the DSA indexer's keys)
           + flops / (peak * eff_compute)          matters only at large batch
           + layers * t_attn(backend)              decode attention of the SGLang backend (quantkit.plan.attention:
                                                   published kernel figures; FP8 KV adds its write kernels, a
                                                   per-token read cost and, on fa3 / flashinfer MLA, the
                                                   per-layer conversion of the whole pool)

where `bytes_read` counts the weights every step reads (attention, shared experts, dense MLPs,
lm_head, as SGLang shards them) plus the routed experts the batch activates: with uniform routing
a batch of b tokens touches E * (1 - (1 - k/E)^b) distinct experts per MoE layer.

Four constants are solved from four production figures (one linear system, `fit_decode`): `t_layer` and
`t_fp8_call` from GLM-5.2's 60 (FP8) and 92 (INT4) tok/s at one request (FP8 KV, context 8192 assumed); `c_w`
(per extra FP8 KV kernel) and `c_fp8` (per KV token read) from Kimi-K2.6 INT4 on 8 x H200: FP8 KV "a few percent
slower" than BF16 at one request (3%) and +41% maximum throughput (31 BF16 vs 64 FP8 requests at 21,437
tokens), the production attention backend assumed (`PRODUCTION_ATTENTION`). The efficiencies are priors, not
fits. GLM-5.2's 8- and 32-request gains, B200's FP8-KV figures and flashmla's measured write cost are
predictions, reported with their error (docs/benchmarks.md, tests/test_plan_attention.py).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import lru_cache

from quantkit.arch import Adapter, Role, get_adapter
from quantkit.core.errors import QuantkitError
from quantkit.core.jsontypes import JSONObject
from quantkit.engines.pd import gpu_arch
from quantkit.plan.attention import kernel, layer_seconds
from quantkit.plan.catalog import GPU, get_gpu
from quantkit.plan.inventory import PrecisionPlan, native_plan, size_model
from quantkit.plan.kv import kv_layer_bytes
from quantkit.plan.memory import shard_divisor
from quantkit.plan.models import resolve_model

__all__ = [
    "PRODUCTION",
    "PRODUCTION_ATTENTION",
    "PRODUCTION_KV",
    "ProductionKV",
    "DecodeFit",
    "StepProfile",
    "decode_gain",
    "attention_seconds",
    "decode_step_seconds",
    "decode_tok_s",
    "fit_decode",
    "reference_backend",
    "step_profile",
]

# The production report's figures (GLM-5.2, 8 x H200, TP8, SGLang). Context lengths are not
# stated there; the model assumes 8192 tokens for both.
PRODUCTION: JSONObject = {
    "model": "glm-5.2",
    "gpu": "h200",
    "tp": 8,
    "context": 8192,
    "decode_tok_s_1": {"fp8": 60.0, "int4": 92.0},
    "decode_gain": {1: 0.55, 8: 0.21, 32: 0.27},
    "prefill_tok_s": {"fp8": 10160.0, "int4": 8660.0},
}
EFF_BANDWIDTH = 0.70  # prior: achieved share of peak HBM bandwidth by decode GEMV / grouped-GEMM kernels
EFF_COMPUTE = 0.50  # prior: achieved share of dense tensor-core peak, decode and prefill GEMMs
# prior: Marlin W4A16 on Hopper reaches ~2.2x over BF16 at batch 1 where bytes allow 3.56x (g=32), so
# INT4 weights stream at 2.2 / 3.56 of the BF16 kernels' bandwidth efficiency.
INT4_STREAM_RATIO = 2.2 / 3.56


@dataclass(frozen=True)
class DecodeFit:
    """Fitted decode constants (seconds)."""

    t_layer: float
    t_fp8_call: float
    c_w: float = 0.0  # per extra FP8 KV kernel (write, query quantization) and attention layer
    c_fp8: float = 0.0  # FP8 KV read overhead per KV token and attention layer
    t_req: float = 0.0  # per request and step (not fitted: 0; kept for sensitivity studies)
    eff_bandwidth: float = EFF_BANDWIDTH
    eff_compute: float = EFF_COMPUTE
    int4_stream_ratio: float = INT4_STREAM_RATIO


@dataclass(frozen=True)
class StepProfile:
    """What one GPU reads and computes per decode step, for one model, plan and TP degree."""

    tp: int
    layers: int
    moe_layers: int
    n_experts: int
    top_k: int
    static_bytes: float  # read every step whatever the batch
    expert_bytes: float  # one routed expert (all projections) on one GPU
    expert_fmt: str  # storage format of the routed experts (int4 streams slower, see INT4_STREAM_RATIO)
    fp8_calls: int  # FP8 block-scaled Linear calls per step
    flops_per_token: dict[str, float]  # Linear FLOPs per token on one GPU, by compute dtype
    kv_layer: int  # KV bytes per token per attention layer on one GPU
    indexer_layer: int  # DSA indexer-cache bytes per token per layer (0 if none)
    indexer_layers: int
    index_topk: int  # DSA: KV rows attention reads per request (0 = all)
    attn_flops_per_pos: float  # attention FLOPs per (token, past position), whole model, all GPUs
    kv_layout: str = "mla"
    heads_local: int = 1  # query heads per GPU
    latent: int = 512  # V width the attention produces per head (MLA: kv_lora_rank; GQA: head_dim)
    kv: str = "fp8"


def _compute_dtype(fmt: str) -> str:
    # FP4 (A16) experts are modelled as INT4's weight-only streaming: no FP4 measurement to fit (docs/fp4.md)
    return "fp8" if fmt == "fp8" else "int4" if fmt in ("int4", "nvfp4", "mxfp4") else "bf16"


def _attention_flops_per_pos(text: JSONObject, adapter: Adapter) -> float:
    heads, layers = int(text["num_attention_heads"]), int(text["num_hidden_layers"])
    if adapter.kv_layout == "gqa":
        head_dim = int(text.get("head_dim") or int(text["hidden_size"]) // heads)
        return 4.0 * heads * head_dim * layers
    qk = int(text["qk_nope_head_dim"]) + int(text["qk_rope_head_dim"])
    return 2.0 * heads * (qk + int(text["v_head_dim"])) * layers


_PROFILES: dict[tuple[str, PrecisionPlan, int, str], StepProfile] = {}


def step_profile(config: JSONObject, plan: PrecisionPlan, tp: int, kv: str) -> StepProfile:
    """Per-GPU bytes and FLOPs of one decode step (target model only; MTP layers excluded)."""
    key = (json.dumps(config, sort_keys=True), plan, tp, kv)
    if key not in _PROFILES:
        _PROFILES[key] = _build_profile(config, plan, tp, kv)
    return _PROFILES[key]


def _build_profile(config: JSONObject, plan: PrecisionPlan, tp: int, kv: str) -> StepProfile:
    adapter = get_adapter(config)
    text = adapter.config
    static = 0.0
    expert_total, expert_count, moe_layer_set = 0.0, 0, set()
    flops: dict[str, float] = {"bf16": 0.0, "fp8": 0.0, "int4": 0.0}
    fp8_calls = 0
    expert_fmt = "bf16"
    top_k = int(text.get("num_experts_per_tok") or 0)
    for t in size_model(config, plan):
        if t.mtp or t.role in (Role.EMBEDDING, Role.OTHER) or len(t.shape) != 2:
            continue
        share = t.nbytes / shard_divisor(t, adapter, tp, False)
        params = t.count * t.shape[0] * t.shape[1] / shard_divisor(t, adapter, tp, False)
        if t.role == Role.ROUTED_EXPERT:
            expert_total += share
            moe_layer_set.add(t.layer)
            expert_fmt = t.fmt
            flops[_compute_dtype(t.fmt)] += 2.0 * params * top_k / int(text["n_routed_experts"])
            continue
        static += share
        flops[_compute_dtype(t.fmt)] += 2.0 * params
        fp8_calls += t.fmt == "fp8"
    moe_layers = len(moe_layer_set)
    n_experts = int(text.get("n_routed_experts") or 0)
    expert_count = moe_layers * n_experts
    if plan.weights == "fp8" and moe_layers:
        fp8_calls += 2 * moe_layers  # fused gate_up + down grouped GEMMs
    per_layer = kv_layer_bytes(text, adapter.kv_layout, kv, tp)
    types = text.get("indexer_types")
    layers = adapter.num_layers
    indexer_layers = sum(1 for x in types if x == "full") if isinstance(types, list) and types else layers
    return StepProfile(
        tp=tp,
        layers=layers,
        moe_layers=moe_layers,
        n_experts=n_experts,
        top_k=top_k,
        static_bytes=static,
        expert_bytes=expert_total / max(1, expert_count),
        expert_fmt=expert_fmt,
        fp8_calls=fp8_calls,
        flops_per_token=flops,
        kv_layer=per_layer["kv"],
        indexer_layer=per_layer["indexer"],
        indexer_layers=indexer_layers if per_layer["indexer"] else 0,
        index_topk=int(text.get("index_topk") or 0) if adapter.kv_layout == "dsa" else 0,
        attn_flops_per_pos=_attention_flops_per_pos(text, adapter),
        kv_layout=str(adapter.kv_layout.value),
        heads_local=max(1, int(text["num_attention_heads"]) // tp),
        latent=int(text.get("kv_lora_rank") or text.get("head_dim") or int(text["hidden_size"]) // int(
            text["num_attention_heads"])) if adapter.kv_layout != "gqa" else int(
            text.get("head_dim") or int(text["hidden_size"]) // int(text["num_attention_heads"])),
        kv=kv,
    )


def distinct_experts(n_experts: int, top_k: int, batch: int) -> float:
    """Expected distinct experts a batch activates in one MoE layer under uniform routing."""
    if n_experts == 0:
        return 0.0
    return n_experts * (1.0 - (1.0 - top_k / n_experts) ** batch)


def _indexer_read_bytes(p: StepProfile, batch: int, context: int) -> float:
    """DSA: the indexer reads its keys of the whole context on its layers (the attention term reads the rest)."""
    return float(batch * context * p.indexer_layer * p.indexer_layers)


def _variable_seconds(p: StepProfile, gpu: GPU, batch: int, context: int, fit: DecodeFit) -> float:
    """Bandwidth and compute time of one step outside attention (everything but the fixed costs)."""
    experts = distinct_experts(p.n_experts, p.top_k, batch) * p.moe_layers * p.expert_bytes
    if p.expert_fmt in ("int4", "nvfp4", "mxfp4"):
        experts /= fit.int4_stream_ratio
    read = p.static_bytes + experts + _indexer_read_bytes(p, batch, context)
    t = read / (gpu.bandwidth_bytes_s * fit.eff_bandwidth)
    for dtype, f in p.flops_per_token.items():
        t += batch * f / (gpu.flops("fp8" if dtype == "fp8" else "bf16") * fit.eff_compute)
    return t


def reference_backend(layout: str, gpu: GPU) -> str:
    """The backend the planner assumes when none is named: the fastest unit-scale one SGLang runs on the GPU
    (FlashMLA on Hopper, trtllm-gen on Blackwell, per docs/planner.md), DSA's default, fa3 / flashinfer for GQA."""
    arch = gpu_arch(gpu.key)
    if layout == "dsa":
        return "trtllm" if arch == "sm100" else "flashmla_kv"
    if layout == "gqa":
        return "fa3" if arch == "sm90" else "flashinfer"
    return {"sm90": "flashmla", "sm100": "trtllm_mla"}.get(arch, "triton")


def attention_seconds(p: StepProfile, gpu: GPU, batch: int, context: int, fit: DecodeFit, backend: str | None,
                      pool_tokens: int = 0) -> float:
    """Decode attention of the whole step (every attention layer) on one GPU."""
    k = kernel(gpu_arch(gpu.key), backend or reference_backend(p.kv_layout, gpu))
    per_layer = layer_seconds(k, gpu, p.kv_layout, p.kv, p.heads_local, p.latent, p.kv_layer, batch,  # type: ignore[arg-type]
                              context, p.index_topk, pool_tokens, fit.c_w, fit.c_fp8)
    return p.layers * per_layer


def _step(p: StepProfile, gpu: GPU, batch: int, context: int, fit: DecodeFit, backend: str | None = None,
          pool_tokens: int = 0) -> float:
    fixed = p.layers * fit.t_layer + p.fp8_calls * fit.t_fp8_call + batch * fit.t_req
    return (fixed + _variable_seconds(p, gpu, batch, context, fit)
            + attention_seconds(p, gpu, batch, context, fit, backend, pool_tokens))


def decode_tok_s(
    config: JSONObject, plan: PrecisionPlan, gpu: GPU, tp: int, batch: int, context: int, kv: str,
    backend: str | None = None, pool_tokens: int = 0,
) -> float:
    """Modelled aggregate decode throughput (tokens/s) of `batch` requests at `context` tokens on the attention
    `backend` (None: `reference_backend`); `pool_tokens` (KV tokens per GPU) matters for fa3 / flashinfer FP8 MLA."""
    p = step_profile(config, plan, tp, kv)
    return batch / _step(p, gpu, batch, context, fit_decode(), backend, pool_tokens)


def _plan_for(config: JSONObject, weights: str) -> PrecisionPlan:
    if weights == "native":
        return native_plan(config)
    if weights not in ("bf16", "fp8", "int4", "nvfp4", "mxfp4"):
        raise QuantkitError(f"weights {weights!r}: expected native, bf16, fp8, int4, nvfp4 or mxfp4")
    return PrecisionPlan(weights)


def decode_step_seconds(
    model: str,
    gpu: str = "h200",
    tp: int = 8,
    batch: int = 1,
    context: int = 8192,
    weights: str = "int4",
    kv: str = "fp8",
    backend: str | None = None,
    pool_tokens: int = 0,
) -> float:
    """Modelled seconds of one decode step of `batch` requests at `context` tokens each.

    `model` is a bundled name (`glm-5.2`, `kimi-k2.6`, ...) or a path to a config.json / checkpoint; `backend`
    an SGLang attention backend (None: the planner's reference backend for the GPU).
    """
    if batch < 1 or context < 1 or tp < 1:
        raise QuantkitError("decode_step_seconds: batch, context and tp must be >= 1")
    return _step(_named_profile(model, tp, weights, kv), get_gpu(gpu), batch, context, fit_decode(), backend,
                 pool_tokens)


@lru_cache(maxsize=256)
def _named_profile(model: str, tp: int, weights: str, kv: str) -> StepProfile:
    """Step profile by model name (cached: other code calls decode_step_seconds in loops)."""
    config = resolve_model(model).config
    return step_profile(config, _plan_for(config, weights), tp, kv)


def decode_gain(model: str, batch: int, gpu: str = "h200", tp: int = 8, context: int = 8192) -> float:
    """Modelled INT4-vs-FP8 decode speed-up at `batch` requests (0.55 = +55%), FP8 KV both."""
    fp8 = decode_step_seconds(model, gpu, tp, batch, context, "fp8", "fp8")
    int4 = decode_step_seconds(model, gpu, tp, batch, context, "int4", "fp8")
    return fp8 / int4 - 1.0


@dataclass(frozen=True)
class ProductionKV:
    """FP8 vs BF16 KV in production: `slower_at_1` at one request of `context_1` tokens; `gain` in maximum
    throughput with `requests_bf16` vs `requests_fp8` requests of `context_full` tokens."""

    model: str = "kimi-k2.6"
    weights: str = "int4"
    context_1: int = 8192
    slower_at_1: float = 0.03
    context_full: int = 686_000 // 32
    requests_bf16: int = 31
    requests_fp8: int = 64
    gain: float = 0.41


PRODUCTION_KV = ProductionKV()
# The attention backends the production figures ran on: GLM-5.2 DSA on SGLang's Hopper default; Kimi's report
# names none: FlashMLA is assumed (fa3 or flashinfer would make FP8 KV ~10x slower at Kimi's pool, sglang#35291).
PRODUCTION_ATTENTION: dict[str, str] = {"glm-5.2": "flashmla_kv", "kimi-k2.6": "flashmla"}

# The fitted unknowns, in the order of DecodeFit's constructor arguments.
_UNKNOWNS = ("t_layer", "t_fp8_call", "c_w", "c_fp8")


def _fit_rows() -> list[tuple[list[float], float]]:
    """The four production equations as rows (coefficients of _UNKNOWNS, right-hand side): each is linear in
    the unknowns, so its coefficients are differences of the model at unit values of each."""
    prod, kv = PRODUCTION, PRODUCTION_KV
    h200 = get_gpu(prod["gpu"])

    def linear(terms: list[tuple[float, str, str, str, int, int]]) -> tuple[list[float], float]:
        # terms: (weight, model, weights, kv, batch, context); the row is sum(weight * t_step) = 0
        def total(fit: DecodeFit) -> float:
            return sum(w * _step(_named_profile(m, prod["tp"], wt, k), h200, b, c, fit,
                                 PRODUCTION_ATTENTION[m]) for w, m, wt, k, b, c in terms)

        base = DecodeFit(0.0, 0.0)
        zero = total(base)
        return [total(DecodeFit(**{**_fit_fields(base), u: 1.0})) - zero for u in _UNKNOWNS], -zero

    rows = []
    for weights in ("fp8", "int4"):  # GLM-5.2 at one request: t_step = 1 / tok_s
        coeffs, rhs = linear([(1.0, prod["model"], weights, "fp8", 1, prod["context"])])
        rows.append((coeffs, rhs + 1.0 / prod["decode_tok_s_1"][weights]))
    m, w, c1 = kv.model, kv.weights, kv.context_1
    rows.append(linear([(1.0, m, w, "fp8", 1, c1), (-(1.0 + kv.slower_at_1), m, w, "bf16", 1, c1)]))
    n16, n8, c = kv.requests_bf16, kv.requests_fp8, kv.context_full
    rows.append(linear([(n8, m, w, "bf16", n16, c), (-(1.0 + kv.gain) * n16, m, w, "fp8", n8, c)]))
    return rows


def _fit_fields(fit: DecodeFit) -> dict[str, float]:
    return {f: getattr(fit, f) for f in (*_UNKNOWNS, "t_req")}


def _solve(rows: list[tuple[list[float], float]]) -> list[float]:
    """Gaussian elimination with partial pivoting (a 4 x 4 system; no numpy in the planner's import path)."""
    a = [list(coeffs) + [rhs] for coeffs, rhs in rows]
    n = len(a)
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        if abs(a[pivot][col]) < 1e-300:
            raise QuantkitError("decode fit: the production equations do not determine the constants")
        a[col], a[pivot] = a[pivot], a[col]
        for r in range(n):
            if r != col:
                f = a[r][col] / a[col][col]
                a[r] = [x - f * y for x, y in zip(a[r], a[col], strict=True)]
    return [a[i][n] / a[i][i] for i in range(n)]


@lru_cache(maxsize=1)
def fit_decode() -> DecodeFit:
    """Solve t_layer, t_fp8_call, c_fp8 and t_req from the four production figures (see the module docstring)."""
    values = _solve(_fit_rows())
    fit = DecodeFit(**dict(zip(_UNKNOWNS, values, strict=True)))
    _check_positive(fit)
    return fit


def _check_positive(fit: DecodeFit) -> None:
    if not (fit.t_layer > 0 and fit.t_fp8_call > 0 and fit.c_fp8 >= 0 and fit.t_req >= 0
            and all(math.isfinite(v) for v in _fit_fields(fit).values())):
        raise QuantkitError(f"decode fit produced non-physical constants {fit}")
