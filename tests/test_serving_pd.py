"""The PD pair record and its checks (no engine needed; tests/engines/test_pd_pair.py runs SGLang's own)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from quantkit.engines import engine_verdicts, facts_from_recipe
from quantkit.plan.models import resolve_model
from quantkit.recipe import load_recipe
from quantkit.serving.kv_backends import BACKENDS, sglang_default_backend
from quantkit.serving.pd import PDPair, pd_pair, pd_problems


def _facts(model: str, kv_scales: bool = True):
    config = resolve_model(model).config
    return facts_from_recipe(config, 32, load_recipe(None, config).quantize_roles, kv_scales)


@pytest.mark.parametrize("model", ["deepseek-v3", "kimi-k2.6", "glm-5.2", "glm-4.7"])
@pytest.mark.parametrize("arch", ["sm90", "sm100"])
def test_default_pair_passes_its_checks_and_roundtrips(model: str, arch: str) -> None:
    pair = pd_pair(_facts(model), arch=arch)
    assert pd_problems(pair) == []
    assert PDPair.from_dict(pair.to_dict()) == pair
    for side in (pair.prefill, pair.decode):
        assert side.args[side.args.index("--kv-cache-dtype") + 1] == "fp8_e4m3" == side.kv_dtype_resolved
        assert side.args[side.args.index("--page-size") + 1] == str(side.page_size)
    assert "BF16" in pair.gives_up and "FP8" in pair.gives_up  # what the prefill gives up, stated


def test_each_check_names_the_flag() -> None:
    pair = pd_pair(_facts("glm-5.2"))
    p, d = pair.prefill, pair.decode
    cases = {
        "--page-size": replace(pair, decode=replace(d, page_size=1)),
        "--kv-cache-dtype": replace(pair, prefill=replace(p, kv_cache_dtype="auto", kv_dtype_resolved="auto")),
        "--dsa-prefill-backend/--dsa-decode-backend": replace(pair, decode=replace(d, kv_row="dsa-576",
                                                                                     kv_row_bytes=576)),
        "--attention-backend": replace(pair, decode=replace(d, kv_scale="calibrated")),
    }
    for flag, broken in cases.items():
        problems = pd_problems(broken)
        assert len(problems) == 1 and flag in problems[0], (flag, problems)
    auto = replace(pair, prefill=replace(p, kv_dtype_resolved="auto", dtype="float16"),
                   decode=replace(d, kv_dtype_resolved="auto"))
    assert any("--dtype" in x for x in pd_problems(auto))


def test_mla_record_pins_a_backend_that_applies_the_calibrated_scale() -> None:
    """Calibrated MLA scales: SGLang's defaults read x k_scale without dividing on write (trtllm_mla on SM100)
    or ignore it (fa3 on SM90); the record pins the backend that divides on write and multiplies on read."""
    sglang = engine_verdicts(_facts("deepseek-v3"), ("sglang",))["sglang"]
    assert sglang.kv_cache.scale == "calibrated"
    backend = sglang.args[sglang.args.index("--attention-backend") + 1]
    verdicts = {b.name: b.verdict for b in BACKENDS if b.engine == "sglang"}
    assert verdicts[backend] == "consistent" and sglang.kv_cache.attention_backend == backend
    from quantkit.arch import KVLayout

    assert {verdicts[sglang_default_backend(KVLayout.MLA, a)] for a in ("sm90", "sm100")} == {"ignored", "inconsistent"}


def test_pd_pair_runs_one_scale_on_both_sides() -> None:
    """The prefill's FP8 source has no KV scales: the decode must not apply its calibrated one to those pages."""
    pair = pd_pair(_facts("deepseek-v3"), arch="sm100")
    assert pair.prefill.kv_scale == pair.decode.kv_scale == "1.0"
    assert pair.decode.attention_backend != "triton" and pair.notes


def test_pd_plugin_is_a_no_op_unless_switched_on(monkeypatch) -> None:
    import torch

    from quantkit.serving import sglang_pd

    monkeypatch.delenv(sglang_pd.ENV, raising=False)
    assert sglang_pd.register() is None
    monkeypatch.setenv(sglang_pd.ENV, sglang_pd.MODE)
    with pytest.raises(sglang_pd.PluginNotReady, match="quantkit plan --pd"):
        sglang_pd.register()  # not wired into SGLang's send path yet: refuses instead of serving a broken pair
    monkeypatch.setenv(sglang_pd.ENV, "fp8-to-bf16")
    with pytest.raises(sglang_pd.PluginNotReady, match="only mode"):
        sglang_pd.register()
    pages = (torch.randn(2, 64, 576) * 3).to(torch.bfloat16)
    scaled = sglang_pd.mla_pages_to_fp8(pages, 0.05)
    assert scaled.shape == pages.shape and scaled.dtype == torch.uint8
    assert not torch.equal(scaled, pages.to(torch.float8_e4m3fn).view(torch.uint8))  # the scale is applied


def test_pair_on_one_checkpoint_applies_the_calibrated_scale_on_both_sides() -> None:
    """Kimi on 8 x H200: only INT4 fits, both sides load quantkit's output with its calibrated MLA scales, so both
    pin the backend that applies them (divide on write, multiply on read) and agree."""
    pair = pd_pair(_facts("kimi-k2.6"), weights="int4-g32", prefill_weights="int4-g32")
    assert pd_problems(pair) == [] and pair.prefill.checkpoint == pair.decode.checkpoint == "<MODEL>"
    assert pair.prefill.kv_scale == pair.decode.kv_scale == "calibrated"
    assert pair.prefill.attention_backend == pair.decode.attention_backend == "triton"
    assert "--moe-runner-backend" in pair.prefill.args and "the calibrated scale" in pair.gives_up
