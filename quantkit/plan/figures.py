"""The production figures next to what the planner computes, as a Markdown table.

`python -m quantkit.plan.figures` prints the table docs/benchmarks.md shows, so the doc can be
regenerated whenever a default or the model changes.
"""

from __future__ import annotations

from quantkit.core.jsontypes import JSONObject
from quantkit.plan.catalog import GIB, get_gpu
from quantkit.plan.inventory import PrecisionPlan
from quantkit.plan.models import resolve_model
from quantkit.plan.planner import Deployment, plan_one
from quantkit.plan.prefill import prefill_tok_s
from quantkit.plan.throughput import PRODUCTION, decode_gain, decode_step_seconds

__all__ = ["figures", "main"]


def _row(model: str, weights: str, kv: str, context: int = 32768) -> JSONObject:
    dep = Deployment(get_gpu("h200"), tp=8, context=context)
    return plan_one(resolve_model(model), dep, PrecisionPlan(weights), kv)


def figures() -> list[tuple[str, float, float, str]]:
    """(figure, production value, planner value, unit) for every figure the report gives."""
    kimi_ctx = 686_000 // 32
    k_bf16, k_fp8 = _row("kimi-k2.6", "int4", "bf16", kimi_ctx), _row("kimi-k2.6", "int4", "fp8", kimi_ctx)
    g_fp8, g_int4 = _row("glm-5.2", "fp8", "fp8"), _row("glm-5.2", "int4", "fp8")
    config = resolve_model("glm-5.2").config
    h200 = get_gpu("h200")
    out = [
        ("Kimi K2.6 KV capacity, BF16 KV", 686_000, k_bf16["node_kv_capacity_tokens"], "tokens"),
        ("Kimi K2.6 KV capacity, FP8 KV", 1_370_000, k_fp8["node_kv_capacity_tokens"], "tokens"),
        (
            f"Kimi max requests at {kimi_ctx:,} tokens, BF16 KV (OOM at 32)",
            32,
            k_bf16["max_concurrent_requests"],
            "requests",
        ),
        (
            f"Kimi max requests at {kimi_ctx:,} tokens, FP8 KV (serves 64)",
            64,
            k_fp8["max_concurrent_requests"],
            "requests",
        ),
        ("GLM-5.2 checkpoint FP8", 705, g_fp8["checkpoint_bytes"] / GIB, "GiB"),
        ("GLM-5.2 checkpoint INT4", 421, g_int4["checkpoint_bytes"] / GIB, "GiB"),
        ("GLM-5.2 weights per GPU TP8, FP8 (SGLang layout)", 88, g_fp8["weights_per_gpu_bytes"] / GIB, "GiB"),
        (
            "GLM-5.2 weights per GPU TP8, INT4 (SGLang layout)",
            52,
            g_int4["weights_per_gpu_bytes"] / GIB,
            "GiB",
        ),
        (
            "GLM-5.2 weights per GPU TP8, INT4 (checkpoint / 8)",
            52,
            g_int4["weights_even_split_bytes"] / GIB,
            "GiB",
        ),
        ("GLM-5.2 KV capacity after INT4, FP8 KV", 1_180_000, g_int4["node_kv_capacity_tokens"], "tokens"),
        ("GLM-5.2 decode 1 request, FP8", 60, 1 / decode_step_seconds("glm-5.2", weights="fp8"), "tok/s"),
        ("GLM-5.2 decode 1 request, INT4", 92, 1 / decode_step_seconds("glm-5.2", weights="int4"), "tok/s"),
    ]
    for batch, gain in PRODUCTION["decode_gain"].items():
        fitted = " (fitted)" if batch == 1 else " (predicted)"
        out.append(
            (
                f"INT4 vs FP8 decode gain at {batch}{fitted}",
                100 * gain,
                100 * decode_gain("glm-5.2", batch),
                "%",
            )
        )
    for weights, target in PRODUCTION["prefill_tok_s"].items():
        value = prefill_tok_s(config, PrecisionPlan(weights), h200, 8, PRODUCTION["context"])
        out.append((f"GLM-5.2 prefill, {weights.upper()} (fitted)", target, value, "tok/s"))
    peak = k_fp8["decode_tok_s_at_full_batch"] / k_bf16["decode_tok_s_at_full_batch"] - 1
    out.append((f"Kimi FP8-KV peak decode throughput gain (fitted on flashmla; plan pins "
                f"{k_fp8['attention']['pinned']})", 41, 100 * peak, "%"))
    return out + attention_figures()


def attention_figures() -> list[tuple[str, float, float, str]]:
    """The FP8 KV terms (quantkit/plan/attention.py, fitted in throughput.fit_decode) on the figures they were
    fitted on and on figures they never saw (sources in docs/planner.md)."""
    from quantkit.plan.attention import FP8_WRITE_FLASHMLA_S
    from quantkit.plan.throughput import PRODUCTION_KV, fit_decode

    kv, out = PRODUCTION_KV, []
    one = (decode_step_seconds(kv.model, "h200", 8, 1, kv.context_1, "int4", "fp8", "flashmla")
           / decode_step_seconds(kv.model, "h200", 8, 1, kv.context_1, "int4", "bf16", "flashmla") - 1)
    out.append(("Kimi FP8-KV decode step time vs BF16 KV, one request (fitted, flashmla)", 100 * kv.slower_at_1,
                100 * one, "%"))
    b200 = ((5275, 1, 65, 62), (5275, 44, 885, 912), (1536, 1, 79, 78), (1536, 64, 1969, 1998))  # sglang#8638
    for context, batch, fp16, fp8 in b200:
        model = (decode_step_seconds("deepseek-v3", "b200", 8, batch, context, "fp8", "bf16", "trtllm_mla")
                 / decode_step_seconds("deepseek-v3", "b200", 8, batch, context, "fp8", "fp8", "trtllm_mla") - 1)
        out.append((f"B200 trtllm_mla FP8-KV decode speed vs FP16, {batch} req at {context} (held out)",
                    100 * (fp8 / fp16 - 1),
                    100 * model, "%"))
    out.append(("flashmla FP8 write per 61-layer step (held out)", FP8_WRITE_FLASHMLA_S * 61e3,
                2 * fit_decode().c_w * 61e3, "ms"))
    fa3 = decode_step_seconds("deepseek-v3", "h200", 8, 1, 2048, "fp8", "fp8", "fa3", 131072)
    flashmla = decode_step_seconds("deepseek-v3", "h200", 8, 1, 2048, "fp8", "fp8", "flashmla", 131072)
    out.append(("fa3 minus flashmla step, FP8 KV, 131K pool (consistency: C_POOL is from it)", 13.84,
                (fa3 - flashmla) * 1e3, "ms"))
    return out


def main() -> None:
    """Print the Markdown table."""
    print("| figure | production | planner | error |")
    print("|---|---:|---:|---:|")
    for name, target, value, unit in figures():
        if unit == "requests":
            ok = value < target if "OOM" in name else value >= target
            print(
                f"| {name} | {target:.0f} {'do not fit' if 'OOM' in name else 'fit'} | max {value:.0f} | "
                f"{'consistent' if ok else 'INCONSISTENT'} |"
            )
        elif unit == "%":
            err = f"{value - target:+.1f} points"
            print(f"| {name} | {target:+.0f}% | {value:+.1f}% | {err} |")
        else:
            fmt = ",.0f" if unit in ("tokens", "requests", "tok/s") else ",.1f"
            err = (value - target) / target
            print(f"| {name} | {target:{fmt}} {unit} | {value:{fmt}} {unit} | {err:+.1%} |")


if __name__ == "__main__":
    main()
