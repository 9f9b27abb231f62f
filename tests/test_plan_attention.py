"""The planner's attention term (quantkit/plan/attention.py) and the FP8 KV conversion term fitted in
quantkit/plan/throughput.py: fitted on Kimi-K2.6's production FP8-vs-BF16 KV figures (and GLM-5.2's one-request
speeds), checked on figures the fit never saw; and the record's backend choice traced to the term."""

from __future__ import annotations

import pytest

from quantkit.engines.kv_choice import UNIT_BACKEND
from quantkit.engines.pd import gpu_arch
from quantkit.plan.attention import C_POOL_S, FP8_WRITE_FLASHMLA_S, consistent_backends, triton_splits
from quantkit.plan.catalog import get_gpu
from quantkit.plan.throughput import PRODUCTION_KV, decode_gain, decode_step_seconds, fit_decode

# Held out: SGLang trtllm_mla on 8 x B200, DeepSeek-R1 (FP8 weights), FP8 vs FP16 KV at the achieved concurrency
# (https://github.com/sgl-project/sglang/pull/8638): (input + output / 2, requests, tok/s FP16 KV, tok/s FP8 KV)
B200_TRTLLM = [(5158 + 235 // 2, 1, 65, 62), (5158 + 235 // 2, 44, 885, 912), (1024 + 512, 1, 79, 78),
               (1024 + 512, 64, 1969, 1998)]
B200_TOLERANCE = 0.06  # the model misses the one-request slowdown by ~5 points: recorded, not fitted away


def _ratio(model: str, gpu: str, weights: str, batch: int, context: int, backend: str, pool: int = 0) -> float:
    """FP8-KV over BF16-KV decode speed."""
    bf16 = decode_step_seconds(model, gpu, 8, batch, context, weights, "bf16", backend, pool)
    return bf16 / decode_step_seconds(model, gpu, 8, batch, context, weights, "fp8", backend, pool)


def test_the_fit_reproduces_the_kimi_figures_it_was_fitted_on() -> None:
    kv = PRODUCTION_KV
    assert _ratio(kv.model, "h200", "int4", 1, kv.context_1, "flashmla") == pytest.approx(
        1 / (1 + kv.slower_at_1), rel=1e-9)
    n16, n8, c = kv.requests_bf16, kv.requests_fp8, kv.context_full
    gain = (n8 / decode_step_seconds(kv.model, "h200", 8, n8, c, "int4", "fp8", "flashmla")) / (
        n16 / decode_step_seconds(kv.model, "h200", 8, n16, c, "int4", "bf16", "flashmla"))
    assert gain == pytest.approx(1 + kv.gain, rel=1e-9)


def test_the_fitted_fp8_terms_are_physical() -> None:
    """c_fp8 within [0, 0.21 ns] (FlashMLA's fully serialized dequant: 50 cycles per token on 132 SMs at 1.83 GHz,
    FlashMLA's FP8 sparse deep dive); c_w a few microseconds per small kernel."""
    fit = fit_decode()
    assert 0 < fit.c_fp8 <= 50 / (132 * 1.83e9)
    assert 0.5e-6 < fit.c_w < 10e-6


def test_held_out_flashmla_write_cost_sglang_35291() -> None:
    """Not fitted: sglang#35291 measured flashmla's unfused FP8 write at +0.425 ms per 61-layer step; the fit's
    two kernels x c_w must land within a factor 2 of it."""
    predicted = 2 * fit_decode().c_w
    assert FP8_WRITE_FLASHMLA_S / 2 < predicted < FP8_WRITE_FLASHMLA_S * 2, (predicted, FP8_WRITE_FLASHMLA_S)


@pytest.mark.parametrize(("context", "batch", "fp16", "fp8"), B200_TRTLLM)
def test_held_out_b200_trtllm_fp8_kv(context: int, batch: int, fp16: float, fp8: float) -> None:
    """Another GPU, backend and model than the fit: the FP8/FP16 KV decode ratio within 6 points."""
    predicted = _ratio("deepseek-v3", "b200", "fp8", batch, context, "trtllm_mla")
    print(f"B200 trtllm_mla ctx {context} b {batch}: FP8/FP16 KV model {predicted:.3f} vs measured {fp8 / fp16:.3f}")
    assert abs(predicted - fp8 / fp16) < B200_TOLERANCE


def test_held_out_glm_gains_stay_within_their_documented_error() -> None:
    """GLM-5.2's INT4-vs-FP8 gains at 8 and 32 requests (21% / 27%) stay predictions (docs/benchmarks.md)."""
    errors = {b: decode_gain("glm-5.2", b) - g for b, g in ((8, 0.21), (32, 0.27))}
    assert all(abs(e) < 0.20 for e in errors.values()), errors


def test_pool_conversion_reproduces_its_own_measurement() -> None:
    """A consistency check, not a hold-out (C_POOL comes from the same issue): DeepSeek-R1 on 8 x H200 with a
    131,072-token FP8 pool, fa3 minus flashmla = 13.84 ms per step (sglang#35291)."""
    fa3 = decode_step_seconds("deepseek-v3", "h200", 8, 1, 2048, "fp8", "fp8", "fa3", 131072)
    flashmla = decode_step_seconds("deepseek-v3", "h200", 8, 1, 2048, "fp8", "fp8", "flashmla", 131072)
    assert fa3 - flashmla == pytest.approx(13.84e-3, rel=0.10)
    assert 61 * 131072 * C_POOL_S == pytest.approx(13.77e-3, rel=0.01)


@pytest.mark.parametrize("model", ["deepseek-v3", "kimi-k2.6"])
@pytest.mark.parametrize("gpu", ["h200", "b200"])
def test_the_record_pins_the_fastest_unit_backend_of_the_planner(model: str, gpu: str) -> None:
    """`kv_choice.UNIT_BACKEND` (what a unit-scale record pins) is the planner's fastest consistent backend at
    8K / 32K / 128K, one request and 64, with the FP8 pool of a real deployment (1.39M tokens per GPU)."""
    arch = gpu_arch(gpu)
    backends = consistent_backends("mla", "unit", arch)
    for context in (8192, 32768, 131072):
        for batch in (1, 64):
            speed = {b: batch / decode_step_seconds(model, gpu, 8, batch, context, "int4", "fp8", b, 1_388_160)
                     for b in backends}
            assert max(speed, key=speed.__getitem__) == UNIT_BACKEND[arch], (context, batch, speed)


def test_fa3_fp8_mla_pays_for_the_pool_and_bf16_does_not() -> None:
    """sglang#35291: fa3 with FP8 MLA KV converts the whole pool every layer, so it is slower than its own BF16
    KV and gets worse with the pool; BF16 KV is unaffected by the pool size."""
    small = decode_step_seconds("kimi-k2.6", "h200", 8, 1, 8192, "int4", "fp8", "fa3", 131072)
    big = decode_step_seconds("kimi-k2.6", "h200", 8, 1, 8192, "int4", "fp8", "fa3", 1_388_160)
    bf16 = decode_step_seconds("kimi-k2.6", "h200", 8, 1, 8192, "int4", "bf16", "fa3", 1_388_160)
    assert bf16 < small < big
    assert decode_step_seconds("kimi-k2.6", "h200", 8, 1, 8192, "int4", "bf16", "fa3", 131072) == pytest.approx(bf16)


def test_triton_split_count_follows_sglang() -> None:
    """metadata.py's heuristic: one request of 8K on 132 SMs takes the MLA cap (256)
    and 64 requests need fewer splits each; GQA caps at 8."""
    one, many = triton_splits(1, 8192, 8, 132), triton_splits(64, 8192, 8, 132)
    assert one > many >= 1
    assert triton_splits(1, 8192, 8, 132, mla=False) <= 8
    assert one == 256  # cdiv(132 x log2(128), 1) = 924, capped at min(next_pow2(132), next_pow2(8192 / 32)) = 256


def test_plan_prints_the_pinned_and_the_fastest_backend_at_three_contexts() -> None:
    from quantkit.plan.attention_plan import CONTEXTS, attention_text
    from quantkit.plan.inventory import PrecisionPlan
    from quantkit.plan.models import resolve_model
    from quantkit.plan.planner import Deployment, plan_one

    row = plan_one(resolve_model("kimi-k2.6"), Deployment(get_gpu("h200")), PrecisionPlan("int4"), "fp8")
    table = row["attention"]
    assert table["pinned"] in table["by_backend"] and table["fastest_consistent"] in table["by_backend"]
    assert set(table["by_backend"][table["pinned"]]) == {str(c) for c in CONTEXTS}
    text = attention_text(table)
    assert "pinned by the record" in text and "fastest" in text and "128K" in text
    assert row["decode_curve_tok_s"]["1"] == pytest.approx(table["by_backend"][table["pinned"]]["32768"]["b1"])
