"""kernels: W4A16 GEMV/GEMM and the grouped MoE vs BF16 at GLM-5.2 / Kimi K2.6 TP8 shapes, % of the HBM
roofline, CUDA GEMV vs Triton, FP8 KV-cache quantization (quantkit.kernels.bench)."""

from __future__ import annotations

import importlib.util
from dataclasses import asdict
from typing import TYPE_CHECKING

from gpu_sections.common import (
    REAL_MODELS,
    Context,
    JSONObject,
    Report,
    SectionData,
    Skip,
    device_name,
    fmt,
    interpreting,
    torch_device,
)

if TYPE_CHECKING:
    import torch

    from quantkit.kernels.bench import BenchRow

TP = 8
M_VALUES = (1, 8, 32, 64, 256)
FP8_ROWS = (64, 8192, 262144)
# Tiny stand-ins for the smoke run: the same fields as quantkit.kernels.bench.MODELS.
SMOKE_DIMS = {"hidden": 256, "moe_inter": 128, "experts": 8, "top_k": 2, "heads": 2, "q_lora": 64, "kv_lora": 32,
              "nope": 16, "rope": 16, "v": 16, "group": 32}


def hbm_peak(device: torch.device) -> tuple[float, str]:
    """Peak HBM GB/s of the GPU (of an H200 in the smoke run) from quantkit/plan/gpus.yaml."""
    import torch

    name = torch.cuda.get_device_name(device).lower() if device.type == "cuda" else "nvidia h200"
    try:
        from quantkit.plan.catalog import load_catalog

        catalog = load_catalog()
    except ImportError as exc:  # pyyaml missing: the kernel bench's own table (same datasheet figures)
        from quantkit.kernels import bench

        peak = next((bw for key, bw in bench.HBM_GBPS.items() if key.lower() in name), None)
        if peak is None:
            raise Skip(f"GPU {name!r} not in quantkit.kernels.bench.HBM_GBPS and gpus.yaml unreadable ({exc})") from exc
        return peak, f"quantkit.kernels.bench.HBM_GBPS ({exc.name} missing, gpus.yaml not read)"
    keys = [key for key in catalog if key in name.replace(" ", "")]
    if not keys:
        raise Skip(f"GPU {name!r} is not in quantkit/plan/gpus.yaml (add it there)")
    key = max(keys, key=len)  # "h200" over "h20"
    return catalog[key].bandwidth_tbs * 1000.0, f"quantkit/plan/gpus.yaml: {key}"


def run(ctx: Context, rep: Report) -> None:
    """The kernel sweep at TP8 shapes; rows are saved as they come in."""
    device = torch_device(ctx)
    rep.device = device_name(device)
    from quantkit.kernels import bench
    from quantkit.kernels.baselines import BASELINE_MODULES

    peak, source = hbm_peak(device)
    if ctx.smoke:
        models = {"smoke": SMOKE_DIMS}
        tp, m_values, tokens, fp8 = 1, (1, 8), (1, 4), (16,)
        extra = ("triton",) if interpreting() else ()
        linear, moe, fp8_b = ("torch", *extra), ("torch", *extra), extra or ("torch",)
        rep.notes.append("smoke: CPU timings of tiny shapes; the roofline % uses the H200 peak and means nothing")
    else:
        models = {m: bench.config_dims(m) for m in REAL_MODELS}
        tp, m_values, tokens, fp8 = TP, M_VALUES, M_VALUES, FP8_ROWS
        linear, moe, fp8_b = ("triton", "cuda"), ("triton",), ("triton",)
    rep.figures.update(hbm_gbps=peak, hbm_source=source, tp=tp, models=models, m_values=list(m_values), rows=[])
    rep.figures["baselines_importable"] = {n: importlib.util.find_spec(m) is not None
                                           for n, m in BASELINE_MODULES.items()}

    def on_rows(new: list[BenchRow]) -> None:
        rep.figures["rows"] += [asdict(row) for row in new]
        rep.save()
        ctx.check_budget(margin=10)

    bench.run_sweep(models, device, tp, m_values, tokens, fp8, linear, moe, fp8_b, peak=peak,
                    reps=1 if ctx.smoke else 5, on_rows=on_rows)



def summary_lines(kernels: SectionData) -> list[str]:
    """Dense rows (Triton, CUDA GEMV, BF16 side by side), grouped MoE rows, FP8 KV rows."""
    rows = kernels["figures"].get("rows", [])
    dense: dict[tuple[str, str, int], JSONObject] = {}
    for r in rows:
        if r["kind"] == "linear":
            dense.setdefault((r["model"], r["layer"], r["m"]), {"n": r["n"], "k": r["k"]})[r["backend"]] = r
    lines = ["### W4A16 dense projections", "",
             "| model | layer | N | K | M | Triton us | CUDA us | BF16 us | best % roof | best x BF16 "
             "| CUDA vs Triton |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for (model, layer, m), d in dense.items():
        timed = [r for b, r in d.items() if b not in ("n", "k") and r["time_us"] is not None]
        best = min(timed, key=lambda r: r["time_us"]) if timed else None
        tri, cu = d.get("triton"), d.get("cuda")
        t_us = tri["time_us"] if tri else (d["torch"]["time_us"] if "torch" in d else None)
        c_us = cu["time_us"] if cu else None
        bf16 = best["bf16_us"] if best else None
        vs = f"{t_us / c_us:.2f}x" if t_us and c_us else "-"
        lines.append(f"| {model} | {layer} | {d['n']} | {d['k']} | {m} | {fmt(t_us)} | {fmt(c_us)} | {fmt(bf16)} "
                     f"| {fmt(best and best['pct_roofline'])} | {fmt(best and best['speedup_vs_bf16'], '.2f', 'x')} "
                     f"| {vs} |")
    lines += ["", "(`Triton us` is the torch reference in a smoke run without the interpreter; CUDA vs Triton > 1: "
              "the CUDA GEMV is faster.)", "", "### Grouped W4A16 MoE vs a BF16 grouped GEMM (same routing)", "",
              "| model | layer | N | K | tokens | backend | us | GB/s | % roof | BF16 us | x BF16 | BF16 path |",
              "|---|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        if r["kind"] == "moe":
            how = next((n[6:] for n in r["notes"] if n.startswith("bf16: ")), "-")
            lines.append(f"| {r['model']} | {r['layer']} | {r['n']} | {r['k']} | {r['m']} | {r['backend']} "
                         f"| {fmt(r['time_us'])} | {fmt(r['gbps'])} | {fmt(r['pct_roofline'])} | {fmt(r['bf16_us'])} "
                         f"| {fmt(r['speedup_vs_bf16'], '.2f', 'x')} | {how} |")
    lines += ["", "### FP8 KV-cache quantization (576-wide MLA rows, scattered into cache slots)", "",
              "| rows | backend | us | GB/s | % roof | x torch reference |", "|---:|---|---:|---:|---:|---:|"]
    for r in rows:
        if r["kind"] == "fp8_kv":
            lines.append(f"| {r['m']} | {r['backend']} | {fmt(r['time_us'])} | {fmt(r['gbps'])} "
                         f"| {fmt(r['pct_roofline'])} | {fmt(r['speedup_vs_baseline'], '.2f', 'x')} |")
    failed = [f"{r['model']} {r['layer']} M={r['m']} {r['backend']}: {n}" for r in rows for n in r["notes"]
              if n.startswith("failed")]
    if failed:
        lines += ["", "Failed rows:", *[f"- {f}" for f in failed[:20]]]
    return lines
