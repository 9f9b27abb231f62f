"""Plain-text rendering of plans and reports: numbers with their units (GiB and GB side by side)."""

from __future__ import annotations

from quantkit.core.jsontypes import JSONObject
from quantkit.plan.catalog import GIB

__all__ = ["assumptions_text", "compare_text", "gib_gb", "plan_text", "recommend_text"]

_ASSUMPTION_FLAGS = {
    "mem_fraction": "--mem-fraction",
    "multimodal_factor": "--multimodal-factor",
    "reserve_gib": "--reserve-gib",
    "page_size": "--page-size",
    "headroom_tokens": "--headroom-tokens",
    "speculative": "--mtp/--no-mtp",
    "shared_indexer": "--shared-indexer",
    "context": "--context",
    "decode_batch": "--batch",
}


def gib_gb(nbytes: float) -> str:
    """`420.9 GiB (452.0 GB)`: the production report's 'GB' are GiB, so both are printed.

    Small sizes (tiny test checkpoints) switch to MiB/MB or KiB/kB so they do not print as 0.0.
    """
    for binary, decimal, unit in ((GIB, 1e9, "G"), (1024**2, 1e6, "M"), (1024, 1e3, "K")):
        if nbytes >= binary:
            return (
                f"{nbytes / binary:,.1f} {unit}iB ({nbytes / decimal:,.1f} {unit if unit != 'K' else 'k'}B)"
            )
    return f"{nbytes:,.0f} B"


def assumptions_text(a: JSONObject) -> str:
    """Every assumption with the flag that changes it."""
    lines = ["assumptions (every one is an input; see docs/planner.md):"]
    for key, value in a.items():
        if key == "config_note" and not value:
            continue
        flag = _ASSUMPTION_FLAGS.get(key)
        if isinstance(value, float):
            value = f"{value:.4g}"
        lines.append(f"  {key:<30} {value}" + (f"   [{flag}]" if flag else ""))
    return "\n".join(lines)


def plan_text(row: JSONObject) -> str:
    """One plan, human-readable."""
    a = row["assumptions"]
    even = row["weights_even_split_bytes"]
    curve = ", ".join(f"{float(v):,.0f} tok/s at {b}" for b, v in row["decode_curve_tok_s"].items())
    lines = [
        f"{row['model']} on {a['tp']} x {a['gpu']}: weights {row['weights']}, KV {row['kv']}, "
        f"context {row['context']:,}" + ("" if row["fits"] else "   ** DOES NOT FIT **"),
        f"  checkpoint             {gib_gb(row['checkpoint_bytes'])}",
        f"  weights per GPU        {gib_gb(row['weights_per_gpu_bytes'])}   (checkpoint / TP: {gib_gb(even)};"
        " SGLang replicates some tensors and loads the MTP layer only with --mtp)",
        f"  static budget per GPU  {row['mem_fraction_effective']} x {gib_gb(row['gpu_memory_bytes'])}",
        f"  outside the fraction   {gib_gb(row['activation_bytes'])} for activations and CUDA graphs",
        f"  reserve                {gib_gb(row['reserve_bytes'])} of other static buffers",
        f"  KV pool per GPU        {gib_gb(row['kv_pool_bytes'])}",
        f"  KV per token per GPU   {row['kv_bytes_per_token_per_gpu']:,} B",
        f"  KV capacity            {row['node_kv_capacity_tokens']:,} tokens",
        f"  max concurrent         {row['max_concurrent_requests']:,} requests of {row['context']:,} tokens",
        f"  decode (model)         {curve}" + ("" if row["fits"] else "   (if it fit)"),
        f"  prefill (model)        {row['prefill_tok_s']:,.0f} tok/s"
        + ("" if row["fits"] else "   (if it fit)"),
    ]
    if row.get("attention"):
        from quantkit.plan.attention_plan import attention_text

        lines.append(attention_text(row["attention"]))
    return "\n".join(lines)


def compare_text(rows: list[JSONObject]) -> str:
    """The weights x KV table."""
    head = (
        f"{'weights':<9} {'kv':<5} {'ckpt GiB':>9} {'W/GPU GiB':>10} {'KV B/tok':>9} {'KV tokens':>11} "
        f"{'max req':>8} {'dec@1':>7} {'dec@full':>9} {'prefill':>8}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['weights']:<9} {r['kv']:<5} {r['checkpoint_bytes'] / GIB:>9.1f} "
            f"{r['weights_per_gpu_bytes'] / GIB:>10.1f} {r['kv_bytes_per_token_per_gpu']:>9,} "
            f"{r['node_kv_capacity_tokens']:>11,} {r['max_concurrent_requests']:>8,} "
            f"{r['decode_curve_tok_s']['1']:>7,.0f} {r['decode_tok_s_at_full_batch']:>9,.0f} "
            f"{r['prefill_tok_s']:>8,.0f}"
        )
    lines.append(
        "(tok/s are from the fitted throughput model, not measurements; dec@full = all max req at once)"
    )
    return "\n".join(lines)


def recommend_text(rec: JSONObject) -> str:
    """The prefill / decode recommendation with launch commands."""
    lines = ["recommendation (PD-disaggregated):"]
    for side in ("prefill", "decode"):
        r = rec.get(side)
        if not r:
            lines.append(f"  {side}: no plan fits")
            continue
        lines.append(f"  {side}: weights {r['weights']} + KV {r['kv']}")
        lines.append("    " + r["sglang"].replace("\n", "\n  "))
    if rec.get("router"):
        lines.append("  router:")
        lines.append("    " + rec["router"].replace("\n", "\n  "))
    lines.append("  note: " + rec["note"])
    split = rec.get("pd_split")
    if split:
        from quantkit.plan.recommend import sglang_flags

        lines.append("production split (BF16 KV on the prefill, FP8 on the decode; quantkit's SGLang plugin, "
                     "`--pd --split --json` for the record):")
        for side in ("prefill", "decode"):
            env = " ".join(f"{k}={v}" for k, v in split[side].get("env", {}).items())
            lines.append(f"  {side}: " + (env + " \\\n    " if env else "")
                         + sglang_flags(split[side]["args"]).replace("\n", "\n  "))
    return "\n".join(lines)
