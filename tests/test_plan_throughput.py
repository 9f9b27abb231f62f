"""The decode/prefill model: fitted on the report's one-request decode and prefill figures only, it is
checked on figures it never saw (8 and 32 requests, Kimi's FP8-KV gain) and on physical behaviour."""

from __future__ import annotations

import inspect
import math

import pytest

from quantkit.core.errors import QuantkitError
from quantkit.plan.catalog import get_gpu
from quantkit.plan.inventory import PrecisionPlan
from quantkit.plan.models import resolve_model
from quantkit.plan.planner import Deployment, plan_one
from quantkit.plan.prefill import prefill_tok_s
from quantkit.plan.throughput import PRODUCTION, decode_gain, decode_step_seconds, fit_decode


def test_signature_is_the_one_other_code_depends_on() -> None:
    sig = inspect.signature(decode_step_seconds)
    assert [(p.name, p.default) for p in sig.parameters.values()] == [
        ("model", inspect.Parameter.empty),
        ("gpu", "h200"),
        ("tp", 8),
        ("batch", 1),
        ("context", 8192),
        ("weights", "int4"),
        ("kv", "fp8"),
        ("backend", None),
        ("pool_tokens", 0),
    ]
    assert isinstance(decode_step_seconds("glm-5.2"), float)


def test_the_fit_is_physical_and_never_sees_the_held_out_figures(monkeypatch) -> None:
    """Changing the held-out 8/32-request gains must not move the fitted constants (no peeking)."""
    import quantkit.plan.throughput as throughput

    fit = fit_decode()
    assert fit.t_layer > 0 and fit.t_fp8_call > 0  # seconds per layer and per FP8 call: positive
    from quantkit.plan import prefill as prefill_model

    prefill = prefill_model.fit_prefill()
    assert prefill.int4_dequant_penalty > 0 and prefill.t_layer_token > 0  # INT4 dequant costs prefill time
    monkeypatch.setitem(throughput.PRODUCTION, "decode_gain", {1: 0.55, 8: 5.0, 32: -0.9})
    fit_decode.cache_clear()
    try:
        assert fit_decode() == fit
    finally:
        fit_decode.cache_clear()


def test_predicts_the_8_and_32_request_gains_and_reports_the_error() -> None:
    errors = {}
    for batch in (8, 32):
        predicted = decode_gain("glm-5.2", batch)
        measured = PRODUCTION["decode_gain"][batch]
        errors[batch] = predicted - measured
        assert math.isfinite(predicted) and predicted > 0  # INT4 stays faster at every batch
    print(f"decode gain error (predicted - measured, points): {errors}")
    # Documented in docs/benchmarks.md: +17 points at 8 requests, -2 points at 32.
    assert all(abs(e) < 0.25 for e in errors.values()), errors


def test_step_time_grows_with_batch_and_context_and_shrinks_with_bandwidth() -> None:
    t1 = decode_step_seconds("kimi-k2.6", batch=1)
    t32 = decode_step_seconds("kimi-k2.6", batch=32)
    assert t1 < t32 < 32 * t1  # batching amortises the weights
    assert decode_step_seconds("kimi-k2.6", batch=8, context=65536) > decode_step_seconds(
        "kimi-k2.6", batch=8
    )
    assert decode_step_seconds("kimi-k2.6", gpu="b200") < t1 < decode_step_seconds("kimi-k2.6", gpu="h100")
    assert decode_step_seconds("glm-4.7", kv="fp8", batch=16, context=32768) < decode_step_seconds(
        "glm-4.7", kv="bf16", batch=16, context=32768
    )
    with pytest.raises(QuantkitError):
        decode_step_seconds("glm-5.2", batch=0)


def test_prefill_away_from_the_fitted_point() -> None:
    """Fitted at 8192 tokens on H200; elsewhere: longer prompts are slower, faster GPUs faster, FP8 stays
    ahead of INT4 (its GEMMs need no dequant) at every context."""
    config = resolve_model("glm-5.2").config
    h200, b200 = get_gpu("h200"), get_gpu("b200")
    for context in (2048, 32768, 131072):
        fp8 = prefill_tok_s(config, PrecisionPlan("fp8"), h200, 8, context)
        int4 = prefill_tok_s(config, PrecisionPlan("int4"), h200, 8, context)
        assert fp8 > int4 > 0
    short = prefill_tok_s(config, PrecisionPlan("int4"), h200, 8, 2048)
    long = prefill_tok_s(config, PrecisionPlan("int4"), h200, 8, 131072)
    assert long < short
    assert prefill_tok_s(config, PrecisionPlan("int4"), b200, 8, 8192) > prefill_tok_s(
        config, PrecisionPlan("int4"), h200, 8, 8192)


def test_fp8_kv_raises_kimi_peak_throughput() -> None:
    # Production: +41% peak throughput with FP8 KV (more requests fit). A prediction, error printed.
    context = 686_000 // 32
    dep = Deployment(get_gpu("h200"), context=context)
    src = resolve_model("kimi-k2.6")
    bf16 = plan_one(src, dep, PrecisionPlan("int4"), "bf16")["decode_tok_s_at_full_batch"]
    fp8 = plan_one(src, dep, PrecisionPlan("int4"), "fp8")["decode_tok_s_at_full_batch"]
    gain = fp8 / bf16 - 1
    print(f"Kimi K2.6 FP8-KV peak throughput gain: model {gain:+.0%} vs production +41%")
    assert 0.2 < gain < 1.0
