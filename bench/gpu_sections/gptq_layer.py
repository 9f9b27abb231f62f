"""gptq_layer: one real-size GLM-5.2 MoE layer (256 experts, generated on the GPU from a seed) through
quantkit's expert statistics and GPTQ solver on cuda: seconds, peak memory, and a labelled projection."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from gpu_sections.common import (
    Context,
    JSONObject,
    Report,
    SectionData,
    expert_weights,
    fmt,
    peak_gib,
    start_layer,
    sync,
)

if TYPE_CHECKING:
    import torch

# `quantkit calibrate` defaults (128 samples x 2048 tokens) and the runner's 8 sequences per forward
CALIB_TOKENS = 128 * 2048
CALIB_BATCH_TOKENS = 8 * 2048
EXPERT_GROUP = 32  # experts quantized per timed step of the real-size layer (a multiple of the chunking)


def _router(weight: torch.Tensor, top_k: int) -> torch.nn.Module:
    """A softmax top-k router module in the form `ExpertMoE` calls it: x -> (logits, weights, ids)."""
    import torch
    from torch import nn

    class Router(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = weight

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            logits = x @ self.weight.T
            w, ids = torch.topk(logits.softmax(-1), top_k, dim=-1)
            return logits, w / w.sum(-1, keepdim=True), ids

    return Router()


def run(ctx: Context, rep: Report) -> None:
    """Expert statistics over a realistic token count, then GPTQ of every expert, on the GPU, time-boxed.

    The layer is quantkit's `ExpertMoE` with every token sent to every expert (the runner's default);
    the statistics pass and the solver (`quantize_experts`, i.e. `quantkit.calibrate.gptq`) are timed in
    steps. A step beyond the time box is not run: its time is extrapolated linearly and labelled so.
    """
    import torch

    from quantkit.calibrate.experts import quantize_experts
    from quantkit.calibrate.gptq import GPTQScheme
    from quantkit.calibrate.moe import ExpertMoE
    from quantkit.quant.recipe import GPTQSettings

    settings = GPTQSettings(dampening_frac=0.01, block_size=128, actorder="static")

    device, dims = start_layer(ctx, rep)
    tokens, batch = (256, 64) if ctx.smoke else (CALIB_TOKENS, CALIB_BATCH_TOKENS)
    rep.figures.update(damping=0.01, block_size=128, tokens=tokens, tokens_per_forward=batch)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t = time.perf_counter()
    experts = [expert_weights(e, dims, device, torch.float32) for e in range(dims["experts"])]
    gen = torch.Generator(device=device).manual_seed(1)
    gate = torch.randn(dims["experts"], dims["hidden"], generator=gen, device=device) * dims["hidden"] ** -0.5
    moe = ExpertMoE(_router(gate, dims["top_k"]), None, experts, torch.nn.functional.silu)
    sync(device)
    rep.figures["generate_s"] = time.perf_counter() - t
    collect_until = ctx.budget_s * 0.45
    moe.start_collecting("all")
    done, t = 0, time.perf_counter()
    with torch.no_grad():
        while done < tokens and (done == 0 or time.monotonic() - ctx.start < collect_until):
            x = torch.randn(min(batch, tokens - done), dims["hidden"], generator=gen, device=device)
            moe(x)
            sync(device)
            done += x.shape[0]
    h_in, h_down = moe.h_in, moe.h_down  # stop_collecting drops the per-expert accumulators
    moe.stop_collecting()
    measured = time.perf_counter() - t
    rep.figures["statistics"] = {"tokens_done": done, "seconds_measured": measured,
                                 "seconds_full": measured * tokens / done, "extrapolated": done < tokens}
    rep.figures["peak_gib_after_statistics"] = peak_gib(device)
    rep.save()
    solve_s, quantized, records = 0.0, 0, []
    step = 4 if ctx.smoke else EXPERT_GROUP  # several steps in the smoke run too
    for lo in range(0, dims["experts"], step):
        if quantized and ctx.remaining(margin=15) < solve_s / quantized * step:
            break
        part = ExpertMoE(moe.gate, None, moe.experts[lo : lo + step], moe.act)
        part.h_in, part.h_down = h_in, h_down[lo : lo + step]
        part.routed_tokens = moe.routed_tokens[lo : lo + step]
        t = time.perf_counter()
        _, recs = quantize_experts(part, "model.layers.3.mlp.experts.", 3, GPTQScheme(32, 4, torch.bfloat16, settings))
        sync(device)
        solve_s += time.perf_counter() - t
        quantized += len(part.experts)
        records += recs
        rep.figures["solver"] = _solver_figures(solve_s, quantized, dims["experts"], records)
        rep.save()
    rep.figures["peak_gib"] = peak_gib(device)
    if device.type != "cuda":
        rep.notes.append("smoke: CPU; no GPU memory figure")
    per_layer = rep.figures["statistics"]["seconds_full"] + rep.figures["solver"]["seconds_full"]
    rep.figures["projection"] = _projection(per_layer, dims["moe_layers"], rep.figures["peak_gib"])


def _solver_figures(seconds: float, done: int, experts: int, records: list[JSONObject]) -> JSONObject:
    """Solver time (extrapolated to every expert when the time box stopped it) and GPTQ-vs-RTN error."""
    errors = [(r["rel_error"][p], r["rtn_rel_error"][p]) for r in records for p in r["rel_error"]]
    return {
        "experts_done": done, "seconds_measured": seconds, "seconds_full": seconds * experts / done,
        "extrapolated": done < experts, "matrices": len(errors),
        "mean_rel_error": sum(g for g, _ in errors) / len(errors),
        "mean_rtn_rel_error": sum(r for _, r in errors) / len(errors),
        "gptq_better_than_rtn": sum(g < r for g, r in errors) / len(errors),
        "fallbacks": sum(bool(r["fallback"]) for r in records),
    }


def _projection(per_layer_s: float, moe_layers: int, peak: dict[str, float] | None) -> JSONObject:
    """Whole-model routed-expert calibration time from one layer's, labelled as the projection it is."""
    one_gpu_h = per_layer_s * moe_layers / 3600
    return {
        "label": "PROJECTION, not a measurement",
        "seconds_per_moe_layer": per_layer_s,
        "moe_layers": moe_layers,
        "one_gpu_hours": one_gpu_h,
        "eight_h200_hours": one_gpu_h / 8,
        "peak_gib_per_gpu": peak["allocated"] if peak else None,
        "assumes": "one layer's statistics + GPTQ x the MoE layer count (MTP not calibrated); 8xH200 = each "
                   "layer's experts split 8 ways with linear scaling (the runner uses one device today); "
                   "attention/dense forwards, activation I/O and the quantized second pass are not included",
    }



def summary_lines(layer: SectionData) -> list[str]:
    f = layer["figures"]
    d, st, so, pj = f.get("dims", {}), f.get("statistics"), f.get("solver"), f.get("projection")
    lines = [f"Layer: {f.get('model')} MoE, {d.get('experts')} experts of {d.get('hidden')} x {d.get('moe_inter')} "
             f"(gate, up, down), fp32 on the device, every token to every expert; {f.get('tokens')} calibration "
             f"tokens, {f.get('tokens_per_forward')} per forward; GPTQ group {f.get('group_size')}, damping "
             f"{f.get('damping')}, block {f.get('block_size')}, static act-order.", ""]
    if st:
        lines.append(f"- statistics: {st['tokens_done']} tokens in {st['seconds_measured']:.1f} s -> "
                     f"{st['seconds_full']:.1f} s for all {f.get('tokens')}"
                     + (" (EXTRAPOLATED linearly)" if st["extrapolated"] else ""))
    if so:
        lines.append(f"- GPTQ solver: {so['experts_done']} experts in {so['seconds_measured']:.1f} s -> "
                     f"{so['seconds_full']:.1f} s for the layer" + (" (EXTRAPOLATED linearly)" if so["extrapolated"]
                                                                     else "")
                     + f"; mean relative error {so['mean_rel_error']:.4f} vs RTN {so['mean_rtn_rel_error']:.4f} "
                     f"(GPTQ better on {100 * so['gptq_better_than_rtn']:.1f}% of {so['matrices']} matrices, "
                     f"{so['fallbacks']} RTN fallbacks)")
    peak = f.get("peak_gib")
    lines.append(f"- peak GPU memory: {fmt(peak and peak['allocated'], '.1f', ' GiB')} allocated, "
                 f"{fmt(peak and peak['reserved'], '.1f', ' GiB')} reserved")
    if pj:
        lines.append(f"- **{pj['label']}**: {pj['seconds_per_moe_layer']:.1f} s per MoE layer x {pj['moe_layers']} "
                     f"layers = {pj['one_gpu_hours']:.2f} h on one GPU, {pj['eight_h200_hours']:.2f} h on 8xH200; "
                     f"assumes {pj['assumes']}")
    return lines
