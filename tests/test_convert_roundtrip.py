"""Converted checkpoints load in transformers (fresh process) and match a compressed-tensors fake-quant reference."""

from __future__ import annotations

import json

import pytest
from checkpoint_refs import fake_quant_reference, load_in_fresh_process, read_all

from quantkit.convert.pipeline import convert
from quantkit.quant.recipe import load_recipe
from quantkit.validate.checkpoint import validate_checkpoint

FAMILIES = ["glm_moe_dsa", "deepseek_v3", "glm4_moe"]
FORMATS = ["fp8", "bf16", "int4"]


@pytest.fixture(scope="module")
def converted(ckpt_factory, tmp_path_factory):
    """(family, fmt) -> (source, output, reference) for every family and source format."""
    out = {}
    for family in FAMILIES:
        for fmt in FORMATS:
            src = ckpt_factory(family, fmt)
            work = tmp_path_factory.mktemp(f"conv-{family}-{fmt}")
            convert(src, work / "out", load_recipe(None, {"model_type": family}))
            out[(family, fmt)] = (src, work / "out", fake_quant_reference(src, work / "ref"))
    return out


def test_outputs_load_in_transformers_and_match_reference(converted):
    keys = list(converted)
    results = load_in_fresh_process([(converted[k][2], converted[k][1]) for k in keys])
    for key, r in zip(keys, results, strict=True):
        num_layers = json.loads((converted[key][0] / "config.json").read_text())["num_hidden_layers"]
        assert r["missing"] == [], key
        assert r["mismatched"] == [], key
        # transformers does not implement MTP layers: their tensors are the only "unexpected" ones
        assert all(k.startswith(f"model.layers.{num_layers}.") for k in r["unexpected"]), (key, r["unexpected"])
        assert r["max_abs_diff"] <= 1e-2 * r["logit_scale"], (key, r)
        assert r["argmax_agree"] == 1.0, key


@pytest.mark.parametrize("family", FAMILIES)
def test_validate_passes_with_source(converted, family):
    for fmt in FORMATS:
        src, out, _ = converted[(family, fmt)]
        report = validate_checkpoint(out, src)
        assert report.ok, [c for c in report.checks if c.status == "fail"]
        assert {c.name for c in report.checks} >= {"files", "ignore list", "source accounting", "quantization error"}


def test_every_source_tensor_accounted_and_index_matches_headers(converted):
    from quantkit.checkpoint.safetensors_header import read_header

    src, out, _ = converted[("glm_moe_dsa", "fp8")]
    manifest = json.loads((out / "quantkit.json").read_text())
    source_names = set(read_all(src))
    assert set(manifest["tensors"]) == source_names
    actions = {row["action"] for row in manifest["tensors"].values()}
    assert actions == {"quantize", "keep", "dequantize", "absorbed"}
    absorbed = [n for n, r in manifest["tensors"].items() if r["action"] == "absorbed"]
    assert absorbed and all(n.endswith("_scale_inv") for n in absorbed)
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    from_headers = {n: f for f in set(index.values()) for n in read_header(out / f).tensors}
    assert index == from_headers
    # MTP layer kept, non-weight files carried over, source FP8 config replaced
    num_layers = json.loads((src / "config.json").read_text())["num_hidden_layers"]
    assert any(n.startswith(f"model.layers.{num_layers}.") for n in index)
    for f in ("generation_config.json", "tokenizer_config.json", "chat_template.jinja", "configuration_custom.py"):
        assert (out / f).read_bytes() == (src / f).read_bytes()
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "pack-quantized"
    assert qc["config_groups"]["group_0"]["targets"] == ["Linear"]


def test_int4_source_passes_through_unchanged(converted):
    src, out, _ = converted[("deepseek_v3", "int4")]
    before, after = read_all(src), read_all(out)
    packed = [n for n in before if n.endswith((".weight_packed", ".weight_scale", ".weight_shape"))]
    assert packed
    for n in packed:
        assert before[n].dtype == after[n].dtype and before[n].equal(after[n]), n
