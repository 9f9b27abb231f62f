"""The production figures, reproduced from the real configs with the planner's printed defaults."""

from __future__ import annotations

import pytest

from quantkit.plan.catalog import GIB, get_gpu
from quantkit.plan.inventory import PrecisionPlan
from quantkit.plan.kv import kv_bytes_per_token_per_gpu
from quantkit.plan.memory import Assumptions
from quantkit.plan.models import bundled_names, resolve_model
from quantkit.plan.planner import Deployment, plan_compare, plan_one, resolve_plan

TOL = 0.05


def _rel(value: float, target: float) -> float:
    return abs(value - target) / target


def _row(model: str, weights: str, kv: str, context: int = 32768, tp: int = 8) -> dict:
    dep = Deployment(get_gpu("h200"), tp=tp, context=context)
    source = resolve_model(model)
    return plan_one(source, dep, resolve_plan(source.config, weights, 32), kv)


def test_defaults_are_printed_with_every_plan() -> None:
    row = _row("kimi-k2.6", "int4", "bf16")
    a = row["assumptions"]
    defaults = Assumptions()
    for key in ("mem_fraction", "multimodal_factor", "reserve_gib", "page_size", "headroom_tokens"):
        assert a[key] == getattr(defaults, key)
    assert a["gpu_memory_mib"] == 143771 and a["tp"] == 8
    assert row["mem_fraction_effective"] == pytest.approx(0.88 * 0.95)  # Kimi K2.6 has a vision tower


def test_kimi_k26_kv_capacity_on_8x_h200() -> None:
    bf16 = _row("kimi-k2.6", "native", "bf16")  # K2.6 ships INT4: native = int4-g32
    fp8 = _row("kimi-k2.6", "int4", "fp8")
    assert bf16["kv_bytes_per_token_per_gpu"] == 576 * 61 * 2 == 70272
    assert fp8["kv_bytes_per_token_per_gpu"] == 35136
    assert _rel(bf16["kv_capacity_tokens"], 686_000) < TOL, bf16["kv_capacity_tokens"]
    assert _rel(fp8["kv_capacity_tokens"], 1_370_000) < TOL, fp8["kv_capacity_tokens"]


def test_kimi_k26_32_requests_fail_in_bf16_while_64_fit_in_fp8() -> None:
    # The report's figures imply ~21.4K tokens per request (686K / 32 = 1.37M / 64).
    context = 686_000 // 32
    bf16 = _row("kimi-k2.6", "int4", "bf16", context=context)
    fp8 = _row("kimi-k2.6", "int4", "fp8", context=context)
    assert bf16["max_concurrent_requests"] < 32
    assert fp8["max_concurrent_requests"] >= 64


def test_glm52_checkpoint_fp8_to_int4() -> None:
    fp8 = _row("glm-5.2", "fp8", "fp8")
    int4 = _row("glm-5.2", "int4", "fp8")
    assert _rel(fp8["checkpoint_bytes"] / GIB, 705) < TOL, fp8["checkpoint_gib"]
    assert _rel(int4["checkpoint_bytes"] / GIB, 421) < TOL, int4["checkpoint_gib"]
    assert int4["checkpoint_by_format"]["int4"] > 0.9 * int4["checkpoint_by_role"]["routed_expert"]


def test_glm52_per_gpu_weights_at_tp8() -> None:
    fp8 = _row("glm-5.2", "fp8", "fp8")
    int4 = _row("glm-5.2", "int4", "fp8")
    # The report's 88 -> 52 is checkpoint / TP ...
    assert _rel(fp8["weights_even_split_bytes"] / GIB, 88) < TOL
    assert _rel(int4["weights_even_split_bytes"] / GIB, 52) < TOL
    # ... SGLang's layout adds the replicated MLA down-projections, indexers (on the 22 "full" layers of
    # IndexShare) and routers (MTP layer off).
    assert _rel(fp8["weights_per_gpu_bytes"] / GIB, 88) < TOL
    extra = int4["weights_per_gpu_bytes"] - int4["weights_even_split_bytes"]
    assert 1 * GIB < extra < 4 * GIB
    assert _rel(int4["weights_per_gpu_bytes"] / GIB, 52) < 0.07


def test_glm52_kv_capacity_after_int4() -> None:
    row = _row("glm-5.2", "int4", "fp8")
    assert row["kv_bytes_per_token_per_gpu"] == 78 * (656 + 132) == 61464
    assert _rel(row["node_kv_capacity_tokens"], 1_180_000) < TOL, row["node_kv_capacity_tokens"]


def test_kv_layouts() -> None:
    glm47 = resolve_model("glm-4.7").config
    assert kv_bytes_per_token_per_gpu(glm47, "gqa", "bf16", tp=8) == 2 * 1 * 128 * 92 * 2
    assert kv_bytes_per_token_per_gpu(glm47, "gqa", "bf16", tp=4) == 2 * 2 * 128 * 92 * 2
    assert kv_bytes_per_token_per_gpu(glm47, "gqa", "fp8", tp=16) == 2 * 1 * 128 * 92  # heads replicated
    glm52 = resolve_model("glm-5.2").config
    assert kv_bytes_per_token_per_gpu(glm52, "dsa", "bf16", tp=8) == 78 * (1152 + 132)
    assert kv_bytes_per_token_per_gpu(glm52, "dsa", "fp8", tp=8, draft_layers=1) == 79 * 788
    assert kv_bytes_per_token_per_gpu(glm52, "dsa", "fp8", tp=8, shared_indexer=True) == 78 * 656 + 21 * 132
    ds = resolve_model("deepseek-v3").config
    assert kv_bytes_per_token_per_gpu(ds, "mla", "bf16", tp=1) == kv_bytes_per_token_per_gpu(
        ds, "mla", "bf16", 8
    )


def test_compare_table_and_bundled_models() -> None:
    assert {"kimi-k2.6", "kimi-k2-thinking", "glm-5.2", "glm-5.1", "glm-4.7", "deepseek-v3"} <= set(
        bundled_names()
    )
    rows = plan_compare(resolve_model("glm-5.1"), Deployment(get_gpu("h200")))
    assert [(r["weights"], r["kv"]) for r in rows] == [
        (w, kv) for w in ("bf16", "fp8", "int4-g32") for kv in ("bf16", "fp8")
    ]
    by = {(r["weights"], r["kv"]): r for r in rows}
    assert not by[("bf16", "bf16")]["fits"]  # 1.4 TiB of BF16 does not fit 8 x 141 GB
    assert by[("int4-g32", "fp8")]["kv_capacity_tokens"] > by[("fp8", "fp8")]["kv_capacity_tokens"]
    # GLM-5.1 has no IndexShare: an indexer in every layer, GLM-5.2 only on its "full" layers; else identical.
    glm52 = _row("glm-5.2", "int4", "fp8")
    assert 0 < by[("int4-g32", "fp8")]["checkpoint_bytes"] - glm52["checkpoint_bytes"] < 2 * GIB


def test_dp_attention_replicates_attention_and_multiplies_capacity() -> None:
    src = resolve_model("deepseek-v3")
    tp = plan_one(src, Deployment(get_gpu("h200")), PrecisionPlan("fp8"), "fp8")
    dp = plan_one(src, Deployment(get_gpu("h200"), dp_attention=True), PrecisionPlan("fp8"), "fp8")
    assert dp["weights_per_gpu_by_role"]["attention"] > 7 * tp["weights_per_gpu_by_role"]["attention"] / 2
    assert dp["node_kv_capacity_tokens"] == 8 * dp["kv_capacity_tokens"]
    assert dp["kv_capacity_tokens"] < tp["kv_capacity_tokens"]
