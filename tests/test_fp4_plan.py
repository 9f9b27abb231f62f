"""Planner and card for FP4: bytes per weight with scales, Blackwell in the catalog, `--compare` adds NVFP4
only on GPUs with FP4 tensor cores, a converted FP4 checkpoint sizes and states its scheme."""

from __future__ import annotations

import json

from quantkit.convert.pipeline import convert
from quantkit.plan.catalog import get_gpu, load_catalog
from quantkit.plan.inventory import PrecisionPlan, format_bytes, native_plan
from quantkit.plan.models import resolve_model
from quantkit.plan.planner import Deployment, plan_compare, plan_one
from quantkit.quant.recipe import load_recipe


def test_fp4_bytes_per_weight_include_scales():
    out, cols = 2048, 7168
    n = out * cols
    assert format_bytes((out, cols), "nvfp4") * 8 / n == 4.5 + 32 / n  # E2M1 + e4m3 per 16 (+ fp32 global)
    assert format_bytes((out, cols), "mxfp4") * 8 / n == 4.25  # E2M1 + E8M0 per 32
    assert abs(format_bytes((out, cols), "int4", 32) - format_bytes((out, cols), "nvfp4")) <= 16  # same size


def test_blackwell_in_catalog_and_compare_adds_nvfp4_only_there():
    catalog = load_catalog()
    assert {"b200", "b300", "gb200"} <= set(catalog)
    assert all(catalog[k].fp4_tflops for k in ("b200", "b300", "gb200"))
    assert catalog["h200"].fp4_tflops is None
    source = resolve_model("kimi-k2.6")
    for gpu, expect in (("b300", True), ("h200", False)):
        rows = plan_compare(source, Deployment(get_gpu(gpu), 8))
        assert any(r["weights"] == "nvfp4a16" for r in rows) is expect
    row = plan_one(source, Deployment(get_gpu("gb200"), 8), PrecisionPlan("nvfp4"), "fp8")
    assert 570e9 < row["checkpoint_bytes"] < 610e9  # published Kimi-K2.6 NVFP4 builds are ~590 GB
    assert row["checkpoint_by_format"]["nvfp4"] > 0.9 * row["checkpoint_bytes"]


def test_fp4_checkpoint_is_sized_and_the_card_states_the_scheme(ckpt_factory, tmp_path):
    src = ckpt_factory("deepseek_v3", "fp8")
    out = tmp_path / "out"
    convert(src, out, load_recipe("deepseek-v3-w4a16-g32", {}, {"scheme": "nvfp4a16"}))
    assert native_plan(json.loads((out / "config.json").read_text())) == PrecisionPlan("nvfp4")
    card = (out / "README.md").read_text()
    assert "| scheme | NVFP4A16 |" in card and "nvfp4-pack-quantized" in card and "- nvfp4a16" in card
    assert "Not available" not in card  # the per-GPU plan table sizes the FP4 checkpoint
    serving = json.loads((out / "quantkit.json").read_text())["serving"]
    assert "Marlin" in serving["sglang"]["gpus"]["hopper (SM90)"]
