"""Kernel benchmark: time, achieved bandwidth and % of the HBM roofline for W4A16 GEMM and MoE.

On a GPU it runs every backend over M = 1..128 on the real Kimi K2.x and GLM-5.x expert and attention
shapes and compares with BF16 `torch.matmul` (the grouped MoE with a BF16 grouped GEMM on the same routing,
and SGLang's Triton int4 MoE when importable). On a CPU it runs a tiny smoke configuration of the torch
path only: CPU timings say nothing about serving speed, so the report marks the GPU figures as pending.
`run_sweep` is the configurable sweep (shapes sharded for tensor parallelism, FP8 KV-cache quantization
throughput) that `bench/gpu_check.sh` runs.

Bytes moved per call (the roofline numerator): packed weights `N*K/2`, scales `2*N*K/g`, activations
`2*M*K`, output `2*M*N`; for MoE only the experts the routing touches count; FP8 KV quantization reads
`2*rows*D` (bf16), writes `rows*D` and reads the int32 slot of each row.
"""

from __future__ import annotations

import datetime as dt
import importlib.util
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

from quantkit.core.errors import QuantkitError
from quantkit.core.locations import PLAN_CONFIGS
from quantkit.kernels import dispatch, reference
from quantkit.kernels.baselines import BASELINE_MODULES, bf16_moe_fn, sglang_moe_baseline

__all__ = ["MODELS", "BenchRow", "config_dims", "linear_shapes", "moe_shapes", "run_benchmark", "run_sweep",
           "format_rows"]

# Architecture numbers from the published configs (/work/shared/model-configs, see docs/kernels.md).
MODELS: dict[str, dict[str, int]] = {
    "kimi-k2.6": {"hidden": 7168, "moe_inter": 2048, "experts": 384, "top_k": 8, "heads": 64, "q_lora": 1536,
                  "kv_lora": 512, "nope": 128, "rope": 64, "v": 128, "group": 32},
    "glm-5.2": {"hidden": 6144, "moe_inter": 2048, "experts": 256, "top_k": 8, "heads": 64, "q_lora": 2048,
                "kv_lora": 512, "nope": 192, "rope": 64, "v": 256, "group": 32},
}
HBM_GBPS = {"H200": 4800.0, "H100": 3350.0, "H800": 3350.0, "B200": 8000.0, "A100": 2039.0, "L40S": 864.0}
GPU_M_VALUES = (1, 2, 4, 8, 16, 32, 64, 128)
GPU_MOE_TOKENS = (1, 4, 8, 16, 32, 64, 128)
MLA_KV_ROW = 576  # kv_lora_rank 512 + rope 64: one FP8 KV row per token and layer (Kimi K2.x, GLM-5.x)


@dataclass
class BenchRow:
    """One measured configuration; `None` where a figure does not apply or a baseline is missing."""

    kind: str  # "linear", "moe" or "fp8_kv"
    model: str
    layer: str
    m: int
    n: int
    k: int
    group_size: int
    backend: str
    time_us: float
    gbytes: float
    gbps: float
    pct_roofline: float | None
    bf16_us: float | None = None
    speedup_vs_bf16: float | None = None
    baseline: str | None = None
    baseline_us: float | None = None
    speedup_vs_baseline: float | None = None
    notes: list[str] = field(default_factory=list)


def config_dims(model: str, group_size: int = 32) -> dict[str, int]:
    """The `MODELS` entry of `model` read from its bundled `quantkit/plan/configs/<model>/config.json`."""
    cfg = json.loads((PLAN_CONFIGS / model / "config.json").read_text(encoding="utf-8"))
    cfg = cfg.get("text_config", cfg)
    keys = {"hidden": "hidden_size", "moe_inter": "moe_intermediate_size", "experts": "n_routed_experts",
            "top_k": "num_experts_per_tok", "heads": "num_attention_heads", "q_lora": "q_lora_rank",
            "kv_lora": "kv_lora_rank", "nope": "qk_nope_head_dim", "rope": "qk_rope_head_dim", "v": "v_head_dim"}
    return {**{mine: int(cfg[theirs]) for mine, theirs in keys.items()}, "group": group_size}


def linear_shapes(model: str | dict[str, int], tp: int = 1) -> list[tuple[str, int, int]]:
    """(layer, N, K) of the dense and expert projections a W4A16 kernel would serve on one of `tp` GPUs.

    Tensor parallelism as SGLang shards MLA and TP-MoE: `q_b_proj` / `kv_b_proj` (and the experts'
    gate/up) split their outputs, `o_proj` (and the experts' down) their inputs; `q_a_proj` and
    `kv_a_proj_with_mqa` are replicated. `model` is a `MODELS` key or a dict of the same fields.
    """
    c = MODELS[model] if isinstance(model, str) else model
    return [
        ("expert.gate_up_proj", 2 * c["moe_inter"] // tp, c["hidden"]),
        ("expert.down_proj", c["hidden"], c["moe_inter"] // tp),
        ("attn.q_a_proj", c["q_lora"], c["hidden"]),
        ("attn.kv_a_proj_with_mqa", c["kv_lora"] + c["rope"], c["hidden"]),
        ("attn.q_b_proj", c["heads"] * (c["nope"] + c["rope"]) // tp, c["q_lora"]),
        ("attn.kv_b_proj", c["heads"] * (c["nope"] + c["v"]) // tp, c["kv_lora"]),
        ("attn.o_proj", c["hidden"], c["heads"] * c["v"] // tp),
    ]


def moe_shapes(model: str | dict[str, int], tp: int = 1) -> list[tuple[str, int, int]]:
    """(layer, N, K) of one routed expert's two grouped GEMMs on one of `tp` GPUs (TP-MoE sharding)."""
    return [(layer.replace("expert.", "experts.").removesuffix("_proj"), n, k)
            for layer, n, k in linear_shapes(model, tp)[:2]]


def w4_bytes(m: int, n: int, k: int, group_size: int, n_matrices: int = 1) -> int:
    """Bytes a memory-bound W4A16 call must move: weights + scales (per matrix) + activations + output."""
    weights = n_matrices * (n * k // 2 + 2 * n * (-(-k // group_size)))
    return weights + 2 * m * k + 2 * m * n


def hbm_gbps(device: torch.device, override: float | None) -> float | None:
    """Peak HBM bandwidth of the GPU by name (GB/s), unless given; None on CPU."""
    if override:
        return override
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((bw for key, bw in HBM_GBPS.items() if key in name), None)


def time_us(fn: Callable[[], object], device: torch.device, reps: int) -> float:
    """Median-ish time of one call: Triton's do_bench on GPU (flushes L2 between calls), a loop on CPU."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return 1000.0 * do_bench(fn, warmup=25, rep=100, return_mode="median")
    fn()
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return 1e6 * sorted(samples)[len(samples) // 2]


def random_w4(n: int, k: int, group_size: int, device: torch.device, experts: int | None = None):
    """Random packed weights in the compressed-tensors layout (int32 words of random nibbles)."""
    lead = () if experts is None else (experts,)
    words = torch.randint(-(2**31), 2**31 - 1, (*lead, n, -(-k // 8)), dtype=torch.int32, device=device)
    scales = (torch.rand(*lead, n, -(-k // group_size), device=device) * 0.02 + 1e-3).to(torch.bfloat16)
    return words, scales


def _row(kind: str, model: str, layer: str, m: int, n: int, k: int, g: int, backend: str, t: float,
         nbytes: int, peak: float | None) -> BenchRow:
    gbps = nbytes / t / 1e3
    pct = 100.0 * gbps / peak if peak else None
    return BenchRow(kind, model, layer, m, n, k, g, backend, t, nbytes / 1e9, gbps, pct)


def bench_linear(model: str, layer: str, n: int, k: int, m: int, g: int, backends: list[str],
                 device: torch.device, peak: float | None, reps: int) -> list[BenchRow]:
    """All backends for one dense shape, each compared with BF16 torch.matmul on the same x."""
    wp, ws = random_w4(n, k, g, device)
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    w_bf16 = torch.randn(n, k, device=device, dtype=torch.bfloat16)
    bf16 = time_us(lambda: torch.matmul(x, w_bf16.T), device, reps)
    rows = []
    for backend in backends:
        try:
            t = time_us(lambda b=backend: dispatch.w4a16_linear(x, wp, ws, g, backend=b), device, reps)
        except Exception as exc:  # a backend that cannot run here is reported, not fatal
            row = _row("linear", model, layer, m, n, k, g, backend, float("nan"), w4_bytes(m, n, k, g), peak)
            row.notes.append(f"failed: {type(exc).__name__}: {exc}"[:200])
            rows.append(row)
            continue
        row = _row("linear", model, layer, m, n, k, g, backend, t, w4_bytes(m, n, k, g), peak)
        row.bf16_us, row.speedup_vs_bf16 = bf16, bf16 / t
        rows.append(row)
    return rows


def bench_moe(model: str, layer: str, n: int, k: int, tokens: int, experts: int, top_k: int, g: int,
              backends: list[str], device: torch.device, peak: float | None, reps: int) -> list[BenchRow]:
    """Grouped MoE GEMM at one batch size with random routing; SGLang's int4 Triton MoE if importable."""
    wp, ws = random_w4(n, k, g, device, experts)
    x = torch.randn(tokens, k, device=device, dtype=torch.bfloat16)
    ids = torch.stack([torch.randperm(experts, device=device)[:top_k] for _ in range(tokens)]).to(torch.int32)
    weights = torch.softmax(torch.randn(tokens, top_k, device=device), dim=-1)
    nbytes = w4_bytes(tokens * top_k, n, k, g, n_matrices=int(torch.unique(ids).numel()))
    baseline = sglang_moe_baseline(x, wp, ws, weights, ids, g)
    bf16_fn, bf16_how = bf16_moe_fn(x, torch.randn(experts, n, k, device=device, dtype=torch.bfloat16), weights, ids)
    bf16 = time_us(bf16_fn, device, reps)
    rows = []
    for backend in backends:
        try:
            t = time_us(lambda b=backend: dispatch.w4a16_moe(x, wp, ws, weights, ids, g, backend=b), device, reps)
        except Exception as exc:  # reported in the row, the sweep goes on
            row = _row("moe", model, layer, tokens, n, k, g, backend, float("nan"), nbytes, peak)
            row.notes.append(f"failed: {type(exc).__name__}: {exc}"[:200])
            rows.append(row)
            continue
        row = _row("moe", model, layer, tokens, n, k, g, backend, t, nbytes, peak)
        row.bf16_us, row.speedup_vs_bf16 = bf16, bf16 / t
        row.notes.append(f"bf16: {bf16_how}")
        if isinstance(baseline, str):
            row.notes.append(baseline)
        elif baseline is not None:
            name, fn = baseline
            row.baseline, row.baseline_us = name, time_us(fn, device, reps)
            row.speedup_vs_baseline = row.baseline_us / t
        rows.append(row)
    return rows


def bench_fp8_kv(rows: int, d: int, backends: list[str], device: torch.device, peak: float | None,
                 reps: int) -> list[BenchRow]:
    """FP8 KV-cache write: quantize `rows` bf16 rows of width `d` and scatter them into cache slots.

    The torch reference is timed too; each backend's row carries it as its baseline.
    """
    x = torch.randn(rows, d, device=device, dtype=torch.bfloat16)
    cache = torch.empty(2 * rows, d, device=device, dtype=torch.float8_e4m3fn)
    slots = torch.randperm(2 * rows, device=device)[:rows].to(torch.int32)
    scale = torch.tensor(0.05, device=device)
    nbytes = 2 * rows * d + rows * d + 4 * rows

    def run(backend: str) -> float:
        return time_us(lambda: dispatch.fp8_kv_quant(x, scale, out=cache, slot_mapping=slots, backend=backend),
                       device, reps)

    torch_us = run("torch")
    out = []
    for backend in backends:
        try:
            t = torch_us if backend == "torch" else run(backend)
        except Exception as exc:  # reported in the row, the sweep goes on
            row = _row("fp8_kv", "mla", f"kv_cache.d{d}", rows, d, 1, 0, backend, float("nan"), nbytes, peak)
            row.notes.append(f"failed: {type(exc).__name__}: {exc}"[:200])
            out.append(row)
            continue
        row = _row("fp8_kv", "mla", f"kv_cache.d{d}", rows, d, 1, 0, backend, t, nbytes, peak)
        row.baseline, row.baseline_us, row.speedup_vs_baseline = "torch-reference", torch_us, torch_us / t
        out.append(row)
    return out


def run_benchmark(device: torch.device | None = None, smoke: bool | None = None, hbm: float | None = None,
                  group_size: int | None = None, reps: int = 5) -> dict:
    """Run the benchmark; `smoke` (default on CPU) uses tiny shapes and the torch backend only."""
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    smoke = (device.type != "cuda") if smoke is None else smoke
    if not smoke and device.type != "cuda":
        raise QuantkitError("the full kernel sweep needs a CUDA GPU; on CPU only --smoke runs")
    peak = hbm_gbps(device, hbm)
    rows: list[BenchRow] = []
    if smoke:
        backends = ["torch"] if device.type == "cpu" else ["torch", "triton", "cuda"]
        g = group_size or 32
        for m in (1, 16):
            rows += bench_linear("smoke", "tiny", 256, 512, m, g, backends, device, peak, reps)
        rows += bench_moe("smoke", "tiny-experts", 128, 256, 4, 8, 2, g, backends[:2], device, peak, reps)
    else:
        rows = run_sweep(MODELS, device, 1, GPU_M_VALUES, GPU_MOE_TOKENS, (), group_size=group_size, peak=peak,
                         reps=reps)
    return {
        "date": dt.date.today().isoformat(),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "smoke": smoke,
        "hbm_gbps": peak,
        "gpu_figures_pending": device.type != "cuda",
        "rows": [asdict(r) for r in rows],
        "max_abs_err_smoke": _smoke_accuracy(device) if smoke else None,
        "baselines": {name: importlib.util.find_spec(mod) is not None for name, mod in BASELINE_MODULES.items()},
        "notes": "Marlin is detected but not wired in (needs vLLM's repack); compare against SGLang's Triton MoE.",
    }


def run_sweep(models: dict[str, dict[str, int]], device: torch.device, tp: int, m_values: tuple[int, ...],
              moe_tokens: tuple[int, ...], fp8_rows: tuple[int, ...],
              linear_backends: tuple[str, ...] = ("triton", "cuda"), moe_backends: tuple[str, ...] = ("triton",),
              fp8_backends: tuple[str, ...] = ("triton",), group_size: int | None = None,
              peak: float | None = None, reps: int = 5,
              on_rows: Callable[[list[BenchRow]], None] | None = None) -> list[BenchRow]:
    """Dense shapes at every M, the grouped MoE at every batch, then FP8 KV rows; `on_rows` sees each batch.

    The CUDA GEMV runs only where it applies (M <= its row limit); the other backends everywhere.
    """
    from quantkit.kernels.cuda_ext import MAX_ROWS

    rows: list[BenchRow] = []

    def add(new: list[BenchRow]) -> None:
        rows.extend(new)
        if on_rows is not None:
            on_rows(new)

    for model, cfg in models.items():
        g = group_size or cfg["group"]
        for layer, n, k in linear_shapes(cfg, tp):
            for m in m_values:
                backends = [b for b in linear_backends if b != "cuda" or m <= MAX_ROWS]
                add(bench_linear(model, layer, n, k, m, g, backends, device, peak, reps))
        for layer, n, k in moe_shapes(cfg, tp):
            for tokens in moe_tokens:
                add(bench_moe(model, layer, n, k, tokens, cfg["experts"], cfg["top_k"], g, list(moe_backends),
                              device, peak, reps))
    for count in fp8_rows:
        add(bench_fp8_kv(count, MLA_KV_ROW, list(fp8_backends), device, peak, reps))
    return rows


def _smoke_accuracy(device: torch.device) -> float:
    """Dispatch result vs the fp32 oracle on one tiny layer, so a smoke run also checks the numbers."""
    wp, ws = random_w4(64, 256, 32, device)
    x = torch.randn(3, 256, device=device)
    ref = reference.w4a16_linear_ref(x, wp, ws, 32)
    return float((dispatch.w4a16_linear(x, wp, ws, 32) - ref).abs().max())


def format_rows(result: dict) -> str:
    """Plain-text table (Markdown-compatible) of a benchmark result."""
    head = "| kind | model | layer | M | N | K | g | backend | us | GB/s | % roof | x BF16 | x baseline |"
    lines = [f"device: {result['device']}  date: {result['date']}  smoke: {result['smoke']}", "",
             head, "|" + "---|" * 13]
    for r in result["rows"]:
        lines.append(
            f"| {r['kind']} | {r['model']} | {r['layer']} | {r['m']} | {r['n']} | {r['k']} | {r['group_size']} "
            f"| {r['backend']} | {r['time_us']:.1f} | {r['gbps']:.1f} | {_fmt(r['pct_roofline'])} "
            f"| {_fmt(r['speedup_vs_bf16'], 'x')} | {_fmt(r['speedup_vs_baseline'], 'x')} |"
        )
    if result["gpu_figures_pending"]:
        lines += ["", "GPU figures pending: CPU timings of the torch reference only (run on a GPU machine: "
                  "`quantkit bench kernels --json`)."]
    return "\n".join(lines)


def _fmt(v: float | None, suffix: str = "") -> str:
    return "-" if v is None else f"{v:.2f}{suffix}"
