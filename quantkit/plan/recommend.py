"""Which precision for prefill and which for decode, and the SGLang flags for each side.

Prefill is compute-bound: the plan with the highest modelled prefill speed wins, with BF16 KV
(the cache it writes is read once by decode; BF16 keeps it exact). Decode is bandwidth- and
capacity-bound: the plan with the highest modelled throughput at the largest batch that fits the
context wins. The numbers decide, not a fixed rule; for GLM-5.2 / Kimi on H200 they give the
production choice (prefill FP8 + BF16 KV, decode INT4 + FP8 KV).
"""

from __future__ import annotations

from typing import Any

__all__ = ["recommend", "sglang_flags"]


def _best(rows: list[dict[str, Any]], key: str, kv: str | None = None) -> dict[str, Any] | None:
    candidates = [
        r for r in rows if r["fits"] and r["max_concurrent_requests"] > 0 and (kv is None or r["kv"] == kv)
    ]
    return max(candidates, key=lambda r: r[key]) if candidates else None


def sglang_flags(row: dict[str, Any], mode: str, model_type: str, shared_experts_fused: bool) -> str:
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
    if row["weights"].startswith("int4") and model_type == "deepseek_v3" and shared_experts_fused:
        parts.append("--disable-shared-experts-fusion")
    if mode == "decode":
        parts.append(f"--max-running-requests {max(1, row['max_concurrent_requests'])}")
    return " \\\n    ".join(parts)


def recommend(
    rows: list[dict[str, Any]], model_type: str = "", shared_experts_fused: bool = False
) -> dict[str, Any]:
    """Pick the prefill and decode plans from a `plan_compare` table, with launch flags."""
    prefill = _best(rows, "prefill_tok_s", kv="bf16") or _best(rows, "prefill_tok_s")
    decode = _best(rows, "decode_tok_s_at_full_batch")
    out: dict[str, Any] = {"prefill": None, "decode": None}
    if prefill:
        out["prefill"] = {
            "weights": prefill["weights"],
            "kv": prefill["kv"],
            "prefill_tok_s": prefill["prefill_tok_s"],
            "sglang": sglang_flags(prefill, "prefill", model_type, shared_experts_fused),
        }
    if decode:
        out["decode"] = {
            "weights": decode["weights"],
            "kv": decode["kv"],
            "max_concurrent_requests": decode["max_concurrent_requests"],
            "decode_tok_s_at_full_batch": decode["decode_tok_s_at_full_batch"],
            "sglang": sglang_flags(decode, "decode", model_type, shared_experts_fused),
        }
    out["note"] = (
        "PD disaggregation with BF16 KV on prefill and FP8 KV on decode needs a KV transfer that "
        "converts dtypes (the production setup); without it run both sides with --kv-cache-dtype fp8_e4m3."
    )
    return out
