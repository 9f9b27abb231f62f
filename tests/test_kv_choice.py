"""The FP8 KV-scale rule (quantkit/engines/kv_choice.py) and every record that follows it: the standalone SGLang
launch line, the PD pairs, the plugin split, what `convert` / `kv-scales` write and what `validate` shows."""

from __future__ import annotations

import json

import pytest
import torch

from quantkit.arch import KVLayout
from quantkit.calibrate.kv import KVStats, kv_report, resolve_scales
from quantkit.engines import kv_choice
from quantkit.engines.kv_backends import BACKENDS
from quantkit.engines.kv_choice import UNIT_BACKEND, MeasuredKL, choose_scale_mode
from quantkit.engines.pd import pd_pair, pd_problems, pd_split
from quantkit.engines.record import serving_record
from quantkit.engines.verdicts import engine_verdicts, facts_from_recipe
from quantkit.plan.models import resolve_model
from quantkit.quant.recipe import load_recipe

UNIT_WINS = MeasuredKL("deepseek_v3", kl_calibrated=1.0e-4, kl_unit=1.1e-4, unit_read="a_flashmla", delta=1e-5,
                       se=2e-5, kl_int4=4e-4, kl_eager=6e-2)
UNIT_LOSES = MeasuredKL("deepseek_v3", kl_calibrated=1.0e-4, kl_unit=5e-4, unit_read="a_flashmla", delta=4e-4,
                        se=1e-5, kl_int4=4e-4, kl_eager=6e-2)


def _facts(model: str, mode: str | None = None):
    config = resolve_model(model).config
    return facts_from_recipe(config, 32, load_recipe(None, config).quantize_roles, True, kv_scale_mode=mode)


def test_the_rule_compares_against_a_tenth_of_the_int4_kl_or_two_standard_errors(monkeypatch) -> None:
    assert UNIT_WINS.threshold == pytest.approx(4e-5) and UNIT_WINS.choice == "unit"
    assert UNIT_LOSES.threshold == pytest.approx(4e-5) and UNIT_LOSES.choice == "calibrated"
    noisy = MeasuredKL("m", 1e-4, 5e-4, "a", delta=4e-4, se=3e-4, kl_int4=4e-4)
    assert noisy.choice == "unit"  # a difference within 2 se does not decide
    monkeypatch.setitem(kv_choice.MEASURED, KVLayout.MLA, UNIT_WINS)
    assert choose_scale_mode(KVLayout.MLA)[0] == "unit"
    assert choose_scale_mode(KVLayout.MLA, "calibrated") == ("calibrated", "--kv-scales calibrated")
    mode, why = choose_scale_mode(KVLayout.MLA, "auto", saturated_at_1=1e-4)
    assert mode == "calibrated" and "saturate" in why  # this checkpoint's own values would clip at 1.0
    monkeypatch.setitem(kv_choice.MEASURED, KVLayout.MLA, UNIT_LOSES)
    assert choose_scale_mode(KVLayout.MLA)[0] == "calibrated"
    monkeypatch.delitem(kv_choice.MEASURED, KVLayout.MLA)
    assert choose_scale_mode(KVLayout.MLA)[0] == "calibrated"  # nothing measured: keep the calibrated scales


@pytest.mark.parametrize("model", ["deepseek-v3", "kimi-k2.6"])
def test_unit_scale_records_pin_the_fastest_backend(model: str) -> None:
    """Scale 1.0 shipped: SGLang's record pins the fastest consistent backend (flashmla on Hopper, page 64)."""
    sglang = engine_verdicts(_facts(model, "unit"), ("sglang",))["sglang"]
    args = sglang.args
    assert args[args.index("--attention-backend") + 1] == UNIT_BACKEND["sm90"] == sglang.kv_cache.attention_backend
    assert args[args.index("--page-size") + 1] == "64" and args[args.index("--kv-cache-dtype") + 1] == "fp8_e4m3"
    assert sglang.kv_cache.scale == "1.0" and sglang.verdict == "loads" and not sglang.problems


def test_calibrated_records_pin_triton_and_say_when_it_is_not_consistent() -> None:
    """Calibrated MLA scales: triton, with the eager-prefill caveat (F2: prompt rows written by a plain cast)."""
    sglang = engine_verdicts(_facts("deepseek-v3", "calibrated"), ("sglang",))["sglang"]
    assert sglang.kv_cache.attention_backend == "triton" and sglang.kv_cache.scale == "calibrated"
    verdicts = {b.name: b.verdict for b in BACKENDS if b.engine == "sglang"}
    assert verdicts["triton"] == "consistent"
    assert sglang.verdict == "loads-with-warnings" and any("eager" in w and "MHA" in w for w in sglang.warnings)


@pytest.mark.parametrize("arch", ["sm90", "sm100"])
def test_pd_pairs_follow_the_rule(arch: str) -> None:
    """FP8-source pair: unit-scale decode -> the fastest backend on both sides; calibrated decode -> a backend
    that ignores the scale (the source's pages are a plain cast), with a note. Kimi (one checkpoint, both sides):
    unit -> the fastest; calibrated -> triton on both. Every pair passes SGLang's checks."""
    for model in ("deepseek-v3", "kimi-k2.6"):
        same = model == "kimi-k2.6"
        kwargs = {"weights": "int4-g32", "prefill_weights": "int4-g32"} if same else {}
        unit = pd_pair(_facts(model, "unit"), arch=arch, **kwargs)
        assert unit.prefill.attention_backend == unit.decode.attention_backend == UNIT_BACKEND[arch]
        assert unit.prefill.kv_scale == unit.decode.kv_scale == "1.0" and pd_problems(unit) == []
        assert unit.decode.args.count("--page-size") == 1
        cal = pd_pair(_facts(model, "calibrated"), arch=arch, **kwargs)
        assert pd_problems(cal) == [] and cal.notes
        if same:
            assert cal.decode.attention_backend == "triton" and cal.decode.kv_scale == "calibrated"
        else:
            assert cal.decode.kv_scale == "1.0" and cal.decode.attention_backend in ("fa3", "flashinfer")


@pytest.mark.parametrize("mode", ["unit", "calibrated"])
def test_plugin_split_follows_the_rule(mode: str) -> None:
    pair = pd_split(_facts("deepseek-v3", mode))
    d = pair.decode
    assert pd_problems(pair) == []
    assert d.attention_backend == ("triton" if mode == "calibrated" else UNIT_BACKEND["sm90"])
    assert d.kv_scale == ("calibrated" if mode == "calibrated" else "1.0")


def test_gqa_unit_scales_let_sglang_serve_fp8_kv() -> None:
    """GLM-4.x: SGLang loads no KV scale for the family (1.0 applied); a checkpoint shipping 1.0 is consistent in
    FP8, one shipping calibrated scales keeps SGLang on BF16 KV."""
    unit = engine_verdicts(_facts("glm-4.7", "unit"), ("sglang",))["sglang"]
    assert unit.args[unit.args.index("--kv-cache-dtype") + 1] == "fp8_e4m3" and unit.kv_cache.scale == "1.0"
    cal = engine_verdicts(_facts("glm-4.7", "calibrated"), ("sglang",))["sglang"]
    assert cal.args[cal.args.index("--kv-cache-dtype") + 1] == "bfloat16"
    vllm = {m: engine_verdicts(_facts("glm-4.7", m), ("vllm",))["vllm"].kv_cache.scale for m in ("unit", "calibrated")}
    assert vllm == {"unit": "1.0", "calibrated": "calibrated"}  # vLLM applies whichever the checkpoint ships


def _stats(absmax: float) -> dict[int, KVStats]:
    s = KVStats("mla")
    s.observe(torch.tensor([0.5, -absmax]), torch.tensor([0.25]))
    return {0: s, 1: s}


def test_calibration_writes_the_chosen_scales_and_reports_why(monkeypatch) -> None:
    monkeypatch.setitem(kv_choice.MEASURED, KVLayout.MLA, UNIT_WINS)
    scales, block = resolve_scales(_stats(8.0), "mla", "auto")
    assert scales == {0: (1.0, 1.0), 1: (1.0, 1.0)} and block["written"] == "unit"
    scales, block = resolve_scales(_stats(8.0), "mla", "calibrated")
    assert scales == {0: (8.0 / 448, 8.0 / 448), 1: (8.0 / 448, 8.0 / 448)} and block["written"] == "calibrated"
    scales, block = resolve_scales(_stats(1000.0), "mla", "auto")  # 1000 saturates at 1.0: keep the calibration
    assert block["written"] == "calibrated" and "saturate" in block["why"]
    assert kv_report(_stats(8.0), "mla", block)["scales"] == block
    assert resolve_scales(_stats(8.0), "dsa", "unit")[0] is None


def test_record_and_validate_show_both_options(monkeypatch, tmp_path) -> None:
    from quantkit.validate.report import ValidationReport
    from quantkit.validate.serving import check_kv_choice

    monkeypatch.setitem(kv_choice.MEASURED, KVLayout.MLA, UNIT_WINS)
    speed = {"gpu": "h200", "context": 32768, "requests": 42, "speed_delta_unit_over_calibrated": 0.14}
    for mode, status in (("unit", "ok"), ("calibrated", "warn")):
        record = serving_record(_facts("deepseek-v3", mode), speed)["sglang"]["kv_choice"]
        assert record["shipped"] == mode and record["rule_choice"] == "unit"
        assert record["options"]["calibrated"]["backend"] == "triton" and record["options"]["unit"]["kl"] == 1.1e-4
        (tmp_path / "quantkit.json").write_text(json.dumps({"serving": {"sglang": {"kv_choice": record}}}))
        report = ValidationReport(str(tmp_path))
        check_kv_choice(tmp_path, report)
        check = next(c for c in report.checks if c.name == "KV scale choice")
        assert check.status == status and "+14.0%" in check.detail and "+1.00e-05" in check.detail


def test_pd_plugin_reads_a_unit_split_as_scale_one(tmp_path) -> None:
    """The PD plugin on a decode shipping scales of 1.0: the split record says 1.0, so the plugin converts pages
    at 1.0 (a plain cast, what flashmla's own write stores) without reading any scale tensor."""
    from quantkit.serving.pd.sglang import decode_target

    split = serving_record(_facts("deepseek-v3", "unit"))["sglang"]["pd_split"]
    (tmp_path / "quantkit.json").write_text(json.dumps({"serving": {"sglang": {"pd_split": split}}}))
    target = decode_target(tmp_path)
    assert (target.kv_dtype, target.row, target.scales) == ("fp8_e4m3", "mla", {})
    assert target.k_scale(0) == target.k_scale(60) == 1.0


def test_the_recorded_measurement_is_the_documented_table() -> None:
    """kv_choice.MEASURED (what every record's choice is traced to) and docs/serving.md's table, from one run of
    `bench/kv_backend_kl.py`, agree: every recorded KL appears in the model's section of the table."""
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[1] / "docs" / "serving.md").read_text()
    for m in kv_choice.MEASURED.values():
        section = doc[doc.index(f"#### {m.model}"):]
        section = section[:section.index("rule:")]
        for value in (m.kl_calibrated, m.kl_unit, m.kl_int4, *([m.kl_eager] if m.kl_eager else [])):
            assert f"{value:.2e}" in section, (m.model, value)
        assert f"{m.delta:+.2e}" in doc
