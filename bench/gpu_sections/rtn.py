"""rtn: RTN + packing of the real-size layer on cuda: GB/s, and codes compared with the CPU's."""

from __future__ import annotations

import time

from gpu_sections.common import Context, Report, SectionData, expert_weights, fmt, start_layer, sync


def run(ctx: Context, rep: Report) -> None:
    """RTN + nibble packing of every expert matrix of the real-size layer on the device (bf16 in)."""
    import torch

    from quantkit.quant.int4 import pack_nibbles, quantize_rtn

    device, dims = start_layer(ctx, rep)
    first = expert_weights(0, dims, device, torch.bfloat16)
    same = total = 0
    for w in first.values():  # correctness first: the device's codes and scales against the CPU's
        q, s = quantize_rtn(w, 32)
        q_cpu, s_cpu = quantize_rtn(w.cpu(), 32)
        same += int((q.cpu() == q_cpu).sum()) + int((s.cpu() == s_cpu).sum())
        total += q.numel() + s.numel()
    rep.figures["codes_and_scales_identical_to_cpu"] = same / total
    seconds, nbytes, matrices = 0.0, 0, 0
    for e in range(dims["experts"]):
        for w in expert_weights(e, dims, device, torch.bfloat16).values():
            sync(device)
            t = time.perf_counter()
            q, s = quantize_rtn(w, 32)
            pack_nibbles(q)
            sync(device)
            seconds += time.perf_counter() - t
            nbytes += w.numel() * w.element_size()
            matrices += 1
        rep.figures["throughput"] = {"matrices": matrices, "experts_done": e + 1, "source_gb": nbytes / 1e9,
                                     "seconds": seconds, "gb_per_s": nbytes / seconds / 1e9,
                                     "partial": e + 1 < dims["experts"]}
        if e % 16 == 15:
            rep.save()
        ctx.check_budget(margin=5)



def summary_lines(rtn: SectionData) -> list[str]:
    f = rtn["figures"]
    t = f.get("throughput")
    lines = [f"Codes and scales identical to the CPU's (one expert): "
             f"{fmt(f.get('codes_and_scales_identical_to_cpu', 0) * 100, '.4f', '%')}"]
    if t:
        lines.append(f"RTN + packing of {t['matrices']} bf16 matrices ({t['source_gb']:.2f} GB) in "
                     f"{t['seconds']:.3f} s: **{t['gb_per_s']:.1f} GB/s** of source weights"
                     + (" (time box hit: part of the layer)" if t["partial"] else ""))
    return lines
