"""Which precision for prefill and which for decode, and the SGLang flags for each side.

Prefill is compute-bound: the plan with the highest modelled prefill speed wins, with BF16 KV
(the cache it writes is read once by decode; BF16 keeps it exact). Decode is bandwidth- and
capacity-bound: the plan with the highest modelled throughput at the largest batch that fits the
context wins. The numbers decide, not a fixed rule; for GLM-5.2 / Kimi on H200 they give the
production choice (prefill FP8 + BF16 KV, decode INT4 + FP8 KV).

The checkpoint-specific SGLang flags of an INT4 side (MoE backend, shared-expert fusion, what KV scale is
really applied) come from `quantkit.engines`, the same record `convert` writes into quantkit.json.
"""

from __future__ import annotations

from typing import Any

from quantkit.engines import engine_verdicts, facts_from_recipe

__all__ = ["int4_engine_args", "recommend", "sglang_flags"]

_KV_FLAGS = ("--kv-cache-dtype",)


def int4_engine_args(config: dict[str, Any], group_size: int, kv_fp8: bool) -> tuple[list[str], str | None]:
    """SGLang's args for quantkit's default INT4 checkpoint of `config` (KV flags left to the planner),
    and a note when FP8 KV would not get calibrated scales in SGLang."""
    from quantkit.recipe import load_recipe

    roles = load_recipe(None, config).quantize_roles
    verdict = engine_verdicts(facts_from_recipe(config, group_size, roles, kv_fp8), ("sglang",))["sglang"]
    args, skip = [], False
    for a in verdict.args:
        if skip or a in _KV_FLAGS:
            skip = not skip
            continue
        args.append(a)
    note = None
    if kv_fp8 and verdict.kv_cache.scale not in ("calibrated", "per-tile"):
        note = f"FP8 KV in SGLang runs at scale 1.0 for this model: {verdict.kv_cache.detail}"
    return args, note


def _best(rows: list[dict[str, Any]], key: str, kv: str | None = None) -> dict[str, Any] | None:
    candidates = [  # FP4 rows are shown, not recommended: modelled as INT4's bytes (no FP4 kernel measured)
        r for r in rows if r["fits"] and r["max_concurrent_requests"] > 0 and (kv is None or r["kv"] == kv)
        and not r["weights"].endswith("fp4a16")
    ]
    return max(candidates, key=lambda r: r[key]) if candidates else None


def sglang_flags(row: dict[str, Any], mode: str, engine_args: list[str]) -> str:
    """`python -m sglang.launch_server` arguments for one side of a PD-disaggregated deployment."""
    a = row["assumptions"]
    kv = "fp8_e4m3" if row["kv"] == "fp8" else "auto"
    parts = [
        "python -m sglang.launch_server",
        f"--model-path <{row['weights']}-checkpoint>",
        f"--tp-size {a['tp']}",
        f"--disaggregation-mode {mode}",
        f"--kv-cache-dtype {kv}",
        f"--mem-fraction-static {row['mem_fraction_effective']}",
        f"--page-size {a['page_size']}",
        f"--chunked-prefill-size {a['headroom_tokens']}",
        f"--context-length {a['context']}",
        "--trust-remote-code",
    ]
    if a["ep"]:
        parts.append(f"--ep-size {a['tp']}")
    if a["dp_attention"]:
        parts.append(f"--enable-dp-attention --dp-size {a['tp']}")
    if engine_args:
        parts.append(" ".join(engine_args))
    if mode == "decode":
        parts.append(f"--max-running-requests {max(1, row['max_concurrent_requests'])}")
    return " \\\n    ".join(parts)


def recommend(rows: list[dict[str, Any]], config: dict[str, Any], group_size: int = 32) -> dict[str, Any]:
    """Pick the prefill and decode plans from a `plan_compare` table, with launch flags."""
    prefill = _best(rows, "prefill_tok_s", kv="bf16") or _best(rows, "prefill_tok_s")
    decode = _best(rows, "decode_tok_s_at_full_batch")
    out: dict[str, Any] = {"prefill": None, "decode": None}
    notes = []

    def flags(row: dict[str, Any], mode: str) -> str:
        args: list[str] = []
        if row["weights"].startswith("int4"):
            args, note = int4_engine_args(config, group_size, row["kv"] == "fp8")
            if note:
                notes.append(f"{mode}: {note}")
        return sglang_flags(row, mode, args)

    if prefill:
        out["prefill"] = {
            "weights": prefill["weights"],
            "kv": prefill["kv"],
            "prefill_tok_s": prefill["prefill_tok_s"],
            "sglang": flags(prefill, "prefill"),
        }
    if decode:
        out["decode"] = {
            "weights": decode["weights"],
            "kv": decode["kv"],
            "max_concurrent_requests": decode["max_concurrent_requests"],
            "decode_tok_s_at_full_batch": decode["decode_tok_s_at_full_batch"],
            "sglang": flags(decode, "decode"),
        }
    out["note"] = (
        "PD disaggregation with BF16 KV on prefill and FP8 KV on decode needs a KV transfer that "
        "converts dtypes (the production setup); without it run both sides with --kv-cache-dtype fp8_e4m3."
    )
    if notes:
        out["note"] += " " + " ".join(notes)
    return out
