"""Kimi K2.5/K2.6 ship a multimodal wrapper (`kimi_k25`): the language model sits under `language_model.`."""

from __future__ import annotations

import json

from checkpoint_refs import read_all

from quantkit.checkpoint.synth import KIMI_PROCESSOR_FILES, wrap_multimodal
from quantkit.convert.pipeline import convert
from quantkit.quant.recipe import load_recipe
from quantkit.validate.checkpoint import validate_checkpoint


def wrap_as_kimi_k25(src, dst):
    """Prefix every tensor with `language_model.`, add a vision tower tensor, wrap the config."""
    return wrap_multimodal(src, dst, "kimi_k25")


def test_kimi_wrapper_int4_passes_through_and_validates(ckpt_factory, tmp_path):
    src = wrap_as_kimi_k25(ckpt_factory("deepseek_v3", "int4"), tmp_path / "kimi")
    out = tmp_path / "out"
    result = convert(src, out, load_recipe(None, json.loads((src / "config.json").read_text())))
    assert result.actions["passthrough"] == 3 * 8 * 3  # routed experts of 2 MoE layers + MTP, unchanged
    before, after = read_all(src), read_all(out)
    assert after["vision_tower.patch_embed.proj.weight"].equal(before["vision_tower.patch_embed.proj.weight"])
    name = "language_model.model.layers.1.mlp.experts.0.up_proj.weight_packed"
    assert after[name].equal(before[name])
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert r"re:.*vision_tower.*" in qc["ignore"]
    for name in KIMI_PROCESSOR_FILES:  # the image processor vLLM reads while it builds the model: carried over
        assert (out / name).read_bytes() == (src / name).read_bytes(), name
    report = validate_checkpoint(out, src)
    assert report.ok, [c for c in report.checks if c.status == "fail"]
