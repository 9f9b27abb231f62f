"""attention (issue 28): MLA decode attention on the lent GPU against the planner's attention term.

    python bench/gpu_sections/attention.py [--smoke] --out DIR   # stand-alone; the GPU check calls run(ctx, rep)

A section of the GPU check (`run(ctx, rep)`, `summary_lines`), registered as an extra one: the check's $OUT
returns at most 8 files and the 7 default sections plus summary.md fill them, so it runs in a second call,
`bench/gpu_check.sh --only attention`. `--smoke` runs the same code at tiny sizes on the CPU (the kernel under the
Triton interpreter).

Figures (each row also carries the planner's prediction, computed before the timing, and the ratio):
- `pool_upcast`: what SGLang's fa3 and flashinfer MLA backends do with FP8 KV on every layer of every decode
  step: the whole per-layer pool `[N, 1, 576]` e4m3 `.to(torch.bfloat16)` (`flashattention_backend.py`,
  `flashinfer_mla_backend.py`; sglang#35291). N = 131,072 (the issue's own pool), and quantkit's pools: Kimi-K2.6
  INT4 BF16 / FP8 KV (694,080 / 1,388,160 tokens per GPU) and DeepSeek-V3 INT4 FP8 KV (2,263,424). torch only.
  Against `quantkit.plan.attention.C_POOL_S` x N.
- `copy`: a device-to-device copy of the same bytes (read N x 576 + write N x 1152): the conversion's floor.
- `triton_mla`: SGLang 0.5.23's own Triton MLA decode kernel (`sglang/kernels/ops/attention/decode_attention.py`,
  loaded from the unpacked wheel under .cache/engines, or $QUANTKIT_SGLANG_SRC, with two stand-in modules for the
  only things it imports from SGLang's runtime: `sglang.srt.environ.envs`, read on AMD paths only, and
  `sglang.srt.utils` device probes) at 8 / 16 heads (Kimi / DeepSeek at TP8), BF16 and FP8 KV, 8K / 32K / 128K
  context, batch 1 and 64, splits as SGLang's heuristic computes them. Against the planner's triton term
  (`quantkit.plan.attention.layer_seconds`, its kernel part) and, modelled, fa3 = the measured pool upcast +
  fa3's read term. SGLang's default backends (fa3, FlashMLA) need sgl-kernel, which the GPU image lacks.
Without SGLang's source only the torch figures run (the row says why).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time
import types
from pathlib import Path
from typing import TYPE_CHECKING, Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/, for gpu_sections.common stand-alone
from gpu_sections.common import (  # noqa: E402
    REPO,
    Context,
    Report,
    SectionData,
    device_name,
    fmt,
    sync,
    torch_device,
)

if TYPE_CHECKING:
    import torch

    from quantkit.plan.attention import Kernel
    from quantkit.plan.catalog import GPU
    from quantkit.plan.throughput import DecodeFit

if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

POOLS = {"deepseek-r1 issue pool": 131_072, "kimi-k2.6 int4 bf16 kv": 694_080, "kimi-k2.6 int4 fp8 kv": 1_388_160,
         "deepseek-v3 int4 fp8 kv": 2_263_424}
CONTEXTS = (8192, 32768, 131072)
BATCHES = (1, 64)
HEADS = {"kimi-k2.6": 8, "deepseek-v3": 16}
LATENT, ROPE = 512, 64
SMOKE = {"pools": {"smoke": 4096}, "contexts": (256,), "batches": (1, 2), "heads": {"smoke": 4}, "latent": 256,
         "rope": 32}


def _time(fn: Any, device: torch.device, repeats: int) -> float:
    """Median seconds of `fn()` (CUDA events on a GPU, wall clock on the CPU), after one warm-up call."""
    import torch

    fn()
    sync(device)
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize(device)
            samples.append(start.elapsed_time(end) / 1e3)
        else:
            t = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t)
    return statistics.median(samples)


def _gpu(device: torch.device) -> GPU:
    """The catalog entry of the GPU (an H200 on the CPU smoke run)."""
    import torch

    from quantkit.plan.catalog import load_catalog

    name = torch.cuda.get_device_name(device).lower().replace(" ", "") if device.type == "cuda" else "h200"
    catalog = load_catalog()
    keys = [k for k in catalog if k in name]
    return catalog[max(keys, key=len)] if keys else catalog["h200"]


def load_sglang_decode() -> tuple[Any, str]:
    """SGLang's `decode_attention_fwd` from its unpacked source, with stand-ins for its two runtime imports."""
    root = Path(os.environ.get("QUANTKIT_SGLANG_SRC", REPO / ".cache" / "engines" / "src" / "sglang" / "sglang"))
    folder = root / "kernels" / "ops" / "attention"
    if not (folder / "decode_attention.py").is_file():
        raise FileNotFoundError(f"{folder}/decode_attention.py (run `make engines`, or carry the folder)")
    import torch

    class _Env:
        def get(self) -> bool:
            return False

    def package(name: str, path: Path | None = None) -> types.ModuleType:
        mod = types.ModuleType(name)
        mod.__path__ = [str(path)] if path else []  # type: ignore[attr-defined]
        sys.modules[name] = mod
        return mod

    for name in ("sglang", "sglang.srt", "sglang.kernels", "sglang.kernels.ops"):
        package(name)
    package("sglang.kernels.ops.attention", folder)
    environ = types.ModuleType("sglang.srt.environ")
    environ.envs = type("Envs", (), {"__getattr__": lambda self, n: _Env()})()  # type: ignore[attr-defined]
    utils = types.ModuleType("sglang.srt.utils")
    utils.is_hip = lambda: False  # type: ignore[attr-defined]
    utils.is_gfx95_supported = lambda: False  # type: ignore[attr-defined]
    utils.is_gfx1250_supported = lambda: False  # type: ignore[attr-defined]
    utils.get_device_core_count = lambda i=0: (  # type: ignore[attr-defined]
        torch.cuda.get_device_properties(i).multi_processor_count if torch.cuda.is_available() else 132)
    sys.modules.update({"sglang.srt.environ": environ, "sglang.srt.utils": utils})
    for mod in ("score_mod", "decode_attention"):
        spec = importlib.util.spec_from_file_location(f"sglang.kernels.ops.attention.{mod}", folder / f"{mod}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    return sys.modules["sglang.kernels.ops.attention.decode_attention"].decode_attention_fwd, str(folder)


def pool_rows(ctx: Context, rep: Report, device: torch.device) -> None:
    import torch

    from quantkit.plan.attention import C_POOL_S

    pools = SMOKE["pools"] if ctx.smoke else POOLS
    rep.figures["pool_upcast"] = []
    for name, tokens in pools.items():  # type: ignore[union-attr]
        predicted = tokens * C_POOL_S
        buf = torch.empty(tokens, 1, LATENT + ROPE, dtype=torch.uint8, device=device).view(torch.float8_e4m3fn)
        upcast = _time(lambda b=buf: b.to(torch.bfloat16), device, 2 if ctx.smoke else 20)
        dst = torch.empty(tokens, 1, LATENT + ROPE, dtype=torch.bfloat16, device=device)
        copy = _time(lambda d=dst, b=buf: d.copy_(b), device, 2 if ctx.smoke else 20)
        moved = tokens * (LATENT + ROPE) * 3
        rep.figures["pool_upcast"].append({
            "pool": name, "tokens": tokens, "predicted_us": predicted * 1e6, "upcast_us": upcast * 1e6,
            "copy_into_us": copy * 1e6, "upcast_gbs": moved / upcast / 1e9, "measured_over_predicted":
            upcast / predicted, "per_step_ms_61_layers": 61 * upcast * 1e3})
        del buf, dst
        rep.save()
        ctx.check_budget(margin=5)


def _splits(batch: int, context: int, heads: int, sms: int) -> int:
    from quantkit.plan.attention import triton_splits

    return triton_splits(batch, context, heads, sms)


def triton_rows(ctx: Context, rep: Report, device: torch.device, gpu: GPU) -> None:
    import torch

    from quantkit.plan.attention import kernel
    from quantkit.plan.throughput import fit_decode

    try:
        decode, where = load_sglang_decode()
    except (FileNotFoundError, ImportError, AttributeError) as exc:
        rep.notes.append(f"triton_mla skipped: SGLang's decode kernel not importable ({exc})")
        return
    rep.figures["triton_source"] = where
    latent, rope = (SMOKE["latent"], SMOKE["rope"]) if ctx.smoke else (LATENT, ROPE)
    heads_by_model = SMOKE["heads"] if ctx.smoke else HEADS
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132
    fit, triton, fa3 = fit_decode(), kernel("sm90", "triton"), kernel("sm90", "fa3")
    rep.figures["triton_mla"] = []
    for model, heads in heads_by_model.items():  # type: ignore[union-attr]
        for kv in ("bf16", "fp8"):
            dtype = torch.float8_e4m3fn if kv == "fp8" else torch.bfloat16
            row_bytes = (latent + rope) * (1 if kv == "fp8" else 2)
            for context in (SMOKE["contexts"] if ctx.smoke else CONTEXTS):  # type: ignore[union-attr]
                for batch in (SMOKE["batches"] if ctx.smoke else BATCHES):  # type: ignore[union-attr]
                    rep.figures["triton_mla"].append(_one(decode, device, gpu, heads, latent, rope, dtype, kv,
                                                          row_bytes, batch, context, sms, fit, triton, fa3, model,
                                                          ctx.smoke))
                    rep.save()
                    ctx.check_budget(margin=10)


def _one(decode: Any, device: torch.device, gpu: GPU, heads: int, latent: int, rope: int, dtype: torch.dtype,
         kv: str, row_bytes: int, batch: int, context: int, sms: int, fit: DecodeFit, triton: Kernel, fa3: Kernel,
         model: str, smoke: bool) -> dict[str, Any]:
    import torch

    from quantkit.plan.attention import layer_seconds

    predicted = layer_seconds(triton, gpu, "mla", kv, heads, latent, row_bytes, batch, context, 0, 0, 0.0, fit.c_fp8)
    lk = latent + rope
    tokens = batch * context
    k_buf = torch.randn(tokens, 1, lk, device=device, dtype=torch.bfloat16).to(dtype)
    q = torch.randn(batch, heads, lk, device=device, dtype=torch.bfloat16)
    o = torch.empty(batch, heads, latent, device=device, dtype=torch.bfloat16)
    splits = _splits(batch, context, heads, sms)
    kv_indptr = torch.arange(0, tokens + 1, context, device=device, dtype=torch.int32)
    kv_indices = torch.arange(tokens, device=device, dtype=torch.int32)
    logits = torch.empty(batch, heads, splits, latent, device=device, dtype=torch.float32)
    lse = torch.empty(batch, heads, splits, device=device, dtype=torch.float32)
    num_splits = torch.full((batch,), splits, device=device, dtype=torch.int32)

    def call() -> None:
        decode(q, k_buf, k_buf[..., :latent], o, kv_indptr, kv_indices, logits, lse, num_splits, splits,
               lk ** -0.5, 1.0, 1.0, has_mla=True, page_size=1)

    seconds = _time(call, device, 1 if smoke else 10)
    moved = tokens * row_bytes
    fa3_modelled = layer_seconds(fa3, gpu, "mla", kv, heads, latent, row_bytes, batch, context, 0, 1_388_160,
                                 0.0, 0.0)
    return {"model": model, "heads": heads, "kv": kv, "context": context, "batch": batch, "splits": splits,
            "us": seconds * 1e6, "gbs": moved / seconds / 1e9, "roofline": moved / seconds / gpu.bandwidth_bytes_s,
            "predicted_us": predicted * 1e6, "measured_over_predicted": seconds / predicted,
            "fa3_modelled_us_at_kimi_fp8_pool": fa3_modelled * 1e6}


def run(ctx: Context, rep: Report) -> None:
    """The section: pool conversion and copy (torch), then SGLang's Triton MLA decode; rows saved as they come."""
    device = torch_device(ctx)
    rep.device = device_name(device)
    if ctx.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        rep.notes.append("smoke: CPU timings of tiny shapes (the kernel under the Triton interpreter): no meaning")
    gpu = _gpu(device)
    rep.figures["gpu_catalog_key"] = gpu.key
    rep.notes.append("predicted_* come from quantkit.plan.attention (published figures; docs/planner.md) before "
                     "anything is timed; measured_over_predicted is the planner's error on this GPU")
    pool_rows(ctx, rep, device)
    triton_rows(ctx, rep, device, gpu)


def summary_lines(data: SectionData) -> list[str]:
    fig = data["figures"]
    lines = ["Pool upcast (fa3 / flashinfer FP8 MLA, per layer and step) vs the planner's C_POOL:", "",
             "| pool | tokens | upcast us | copy us | model us | measured / model |", "|---|---:|---:|---:|---:|---:|"]
    for r in fig.get("pool_upcast", []):
        lines.append(f"| {r['pool']} | {r['tokens']:,} | {fmt(r['upcast_us'])} | {fmt(r['copy_into_us'])} | "
                     f"{fmt(r['predicted_us'])} | {fmt(r['measured_over_predicted'], '.2f')} |")
    rows = fig.get("triton_mla", [])
    if rows:
        lines += ["", "SGLang Triton MLA decode per layer vs the planner's triton term (fa3 modelled at Kimi's pool):",
                  "", "| heads | kv | context | batch | splits | us | % roofline | model us | measured / model | "
                  "fa3 model us |", "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in rows:
            lines.append(f"| {r['heads']} | {r['kv']} | {r['context']} | {r['batch']} | {r['splits']} | "
                         f"{fmt(r['us'])} | {fmt(100 * r['roofline'])} | {fmt(r['predicted_us'])} | "
                         f"{fmt(r['measured_over_predicted'], '.2f')} | {fmt(r['fa3_modelled_us_at_kimi_fp8_pool'])} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--budget-s", type=float, default=240.0)
    a = ap.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    rep = Report("attention", "MLA decode attention vs the planner", a.smoke, a.out)
    run(Context(a.out, a.out, a.smoke, a.budget_s), rep)
    rep.status = "ok" if rep.status == "running" else rep.status
    rep.save()
    print("\n".join(summary_lines({"figures": rep.figures})))
    return 0


if __name__ == "__main__":
    sys.exit(main())
