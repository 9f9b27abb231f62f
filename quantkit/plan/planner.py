"""One precision plan, end to end: checkpoint bytes, per-GPU memory, KV capacity, requests, speed.

`plan_one` is what `quantkit plan` prints (and `--json` emits) for one weights x KV choice;
`plan_compare` runs the weights {bf16, fp8, int4} x KV {bf16, fp8} table.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from quantkit.arch import get_adapter
from quantkit.core.errors import QuantkitError
from quantkit.core.jsontypes import JSONObject
from quantkit.engines.kv_choice import RequestedScales, choose_scale_mode
from quantkit.plan.attention_plan import attention_table, pinned_backend
from quantkit.plan.catalog import GIB, GPU
from quantkit.plan.inventory import (
    PrecisionPlan,
    SizedTensor,
    native_plan,
    size_model,
    totals_by,
)
from quantkit.plan.kv import KV_DTYPES
from quantkit.plan.memory import Assumptions, max_concurrent_requests, plan_memory
from quantkit.plan.models import ModelSource
from quantkit.plan.prefill import fit_prefill, prefill_tok_s
from quantkit.plan.throughput import (
    EFF_BANDWIDTH,
    EFF_COMPUTE,
    decode_tok_s,
    fit_decode,
)

__all__ = ["Deployment", "plan_compare", "plan_one", "resolve_plan"]

DECODE_CURVE = (1, 8, 32, 64)


@dataclass(frozen=True)
class Deployment:
    """Where and how the model is served."""

    gpu: GPU
    tp: int = 8
    ep: bool = False
    dp_attention: bool = False
    context: int = 32768
    batch: int = 1
    assumptions: Assumptions = field(default_factory=Assumptions)

    def __post_init__(self) -> None:
        if self.tp < 1 or self.context < 1 or self.batch < 1:
            raise QuantkitError("--tp, --context and --batch must be >= 1")
        if not 0.0 < self.assumptions.mem_fraction <= 1.0:
            raise QuantkitError(f"--mem-fraction {self.assumptions.mem_fraction}: expected 0 < f <= 1")


def resolve_plan(config: JSONObject, weights: str, group_size: int) -> PrecisionPlan:
    """`native` -> the release's own plan; otherwise the named one."""
    if weights == "native":
        return native_plan(config)
    if weights not in ("bf16", "fp8", "int4", "nvfp4", "mxfp4"):
        raise QuantkitError(f"--weights {weights!r}: expected native, bf16, fp8, int4, nvfp4 or mxfp4")
    if group_size not in (32, 64, 128):
        raise QuantkitError(f"--group-size {group_size}: SGLang's Marlin kernels take 32, 64 or 128")
    return PrecisionPlan(weights, group_size)


def _assumption_table(source: ModelSource, dep: Deployment, tensors_from: str) -> JSONObject:
    a = dep.assumptions.to_dict()
    dfit, pfit = fit_decode(), fit_prefill()
    a.update(
        {
            "gpu": dep.gpu.key,
            "gpu_memory_mib": dep.gpu.memory_mib,
            "gpu_bandwidth_tbs": dep.gpu.bandwidth_tbs,
            "gpu_bf16_tflops": dep.gpu.bf16_tflops,
            "gpu_fp8_tflops": dep.gpu.fp8_tflops,
            "tp": dep.tp,
            "ep": dep.ep,
            "dp_attention": dep.dp_attention,
            "context": dep.context,
            "decode_batch": dep.batch,
            "tensors_from": tensors_from,
            "config_note": source.note,
            "throughput_model": "fitted model, not a measurement (docs/planner.md)",
            "eff_bandwidth": EFF_BANDWIDTH,
            "eff_compute": EFF_COMPUTE,
            "decode_t_layer_s": dfit.t_layer,
            "decode_t_fp8_call_s": dfit.t_fp8_call,
            "decode_c_w_s": dfit.c_w,
            "decode_c_fp8_s": dfit.c_fp8,
            "prefill_int4_dequant_penalty": pfit.int4_dequant_penalty,
            "prefill_t_layer_token_s": pfit.t_layer_token,
        }
    )
    return a


def plan_one(
    source: ModelSource,
    dep: Deployment,
    plan: PrecisionPlan,
    kv: str,
    tensors: list[SizedTensor] | None = None,
    tensors_from: str = "config.json inventory",
    kv_scales: RequestedScales = "auto",
) -> JSONObject:
    """Everything `quantkit plan` reports for one weights plan and KV dtype (JSON-ready); decode speeds are on
    the attention backend the serving record pins for the KV scales `kv_scales` resolves to."""
    if kv not in KV_DTYPES:
        raise QuantkitError(f"--kv {kv!r}: expected one of {', '.join(KV_DTYPES)}")
    config = source.config
    adapter = get_adapter(config)
    if tensors is None:
        tensors = size_model(config, plan)
    checkpoint = sum(t.nbytes for t in tensors)
    mem = plan_memory(tensors, adapter, config, dep.gpu, dep.tp, kv, dep.assumptions, dep.dp_attention)
    a = dep.assumptions
    concurrent = max_concurrent_requests(
        mem.node_kv_capacity_tokens, dep.context, a.page_size, a.headroom_tokens
    )
    full_batch = max(1, concurrent)
    mode = choose_scale_mode(adapter.kv_layout, kv_scales)[0]
    backend, pool = pinned_backend(config, kv, mode, dep.gpu), mem.kv_capacity_tokens

    def tok_s(batch: int) -> float:
        return decode_tok_s(config, plan, dep.gpu, dep.tp, batch, dep.context, kv, backend, pool)

    curve = {str(b): tok_s(b) for b in DECODE_CURVE}
    return {
        "model": source.name,
        "weights": plan.label,
        "kv": kv,
        "fits": mem.fits,
        "checkpoint_bytes": checkpoint,
        "checkpoint_gib": round(checkpoint / GIB, 2),
        "checkpoint_gb": round(checkpoint / 1e9, 2),
        "checkpoint_by_role": totals_by(tensors, "role"),
        "checkpoint_by_format": totals_by(tensors, "fmt"),
        "weights_per_gpu_bytes": mem.weights_per_gpu_bytes,
        "weights_per_gpu_gib": round(mem.weights_per_gpu_bytes / GIB, 2),
        "weights_per_gpu_by_role": mem.weights_per_gpu_by_role,
        "weights_even_split_bytes": checkpoint // dep.tp,
        "gpu_memory_bytes": mem.gpu_memory_bytes,
        "mem_fraction_effective": mem.mem_fraction_effective,
        "reserve_bytes": mem.reserve_bytes,
        "activation_bytes": mem.activation_bytes,
        "kv_pool_bytes": mem.kv_pool_bytes,
        "kv_bytes_per_token_per_gpu": mem.kv_bytes_per_token_per_gpu,
        "kv_capacity_tokens": mem.kv_capacity_tokens,
        "node_kv_capacity_tokens": mem.node_kv_capacity_tokens,
        "context": dep.context,
        "max_concurrent_requests": concurrent,
        "decode_tok_s": curve.get(str(dep.batch)) or tok_s(dep.batch),
        "decode_tok_s_per_request_at_full_batch": tok_s(full_batch) / full_batch,
        "decode_tok_s_at_full_batch": tok_s(full_batch) if concurrent else 0.0,
        "decode_curve_tok_s": curve,
        "attention": attention_table(config, plan, dep.gpu, dep.tp, kv, pool, mem.node_kv_capacity_tokens,
                                     a.page_size, a.headroom_tokens, mode),
        "prefill_tok_s": prefill_tok_s(config, plan, dep.gpu, dep.tp, dep.context),
        "assumptions": _assumption_table(source, dep, tensors_from),
    }


def plan_compare(source: ModelSource, dep: Deployment, group_size: int = 32,
                 kv_scales: RequestedScales = "auto") -> list[JSONObject]:
    """The weights {bf16, fp8, int4} (+ nvfp4 on a GPU with FP4 tensor cores) x KV {bf16, fp8} table."""
    weights = ("bf16", "fp8", "int4") + (("nvfp4",) if dep.gpu.fp4_tflops else ())
    return [plan_one(source, dep, PrecisionPlan(w, group_size), kv, kv_scales=kv_scales) for w in weights
            for kv in KV_DTYPES]
