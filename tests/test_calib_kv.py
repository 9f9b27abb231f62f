"""FP8 KV-cache scales: MLA statistic checked against an independent transformers forward, k == v for
MLA, per-tensor K/V for GQA, no scales for DSA, saturation/underflow report, `kv-scales` on a checkpoint."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from quantkit.arch import get_adapter
from quantkit.calibrate import kv
from quantkit.calibrate.runner import RunOptions, run
from quantkit.calibrate.tiny import build_tiny
from quantkit.checkpoint.source import open_source
from quantkit.quant.recipe import Recipe

TOKENS = torch.randint(1, 500, (4, 48), generator=torch.Generator().manual_seed(0))


def _recipe(**kw) -> Recipe:
    """The calibration's own scales (`--kv-scales calibrated`): these tests check the statistics."""
    kw.setdefault("kv_scales", "calibrated")
    return Recipe(method="rtn", kv_cache="fp8", calibration={"samples": 4, "seq_len": 48}, **kw)


def _kv_only(src: Path, work: Path):
    return run(open_source(src), _recipe(), work, None, RunOptions(quantize=False, tokens=TOKENS, batch_size=2))


@torch.no_grad()
def _reference_stats(src: Path, rope_from: int = 0) -> tuple[list[float], list[float], list[float]]:
    """Per layer: max |K[..., rope_from:]|, max |V| as transformers' own forward caches them, and max
    |latent| from a hook on kv_a_layernorm."""
    from transformers import AutoModelForCausalLM, DynamicCache

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    latent: dict[int, float] = {}
    hooks = []
    for i, layer in enumerate(model.model.layers):
        norm = getattr(layer.self_attn, "kv_a_layernorm", None)
        if norm is not None:
            hooks.append(norm.register_forward_hook(
                lambda m, a, out, i=i: latent.__setitem__(i, max(latent.get(i, 0.0), float(out.abs().max())))))
    cache = DynamicCache(config=model.config)
    model(input_ids=TOKENS, past_key_values=cache, use_cache=True)
    for h in hooks:
        h.remove()
    n = len(model.model.layers)
    keys = [float(cache.layers[i].keys[..., rope_from:].abs().max()) for i in range(n)]
    values = [float(cache.layers[i].values.abs().max()) for i in range(n)]
    return keys, values, [latent.get(i, 0.0) for i in range(n)]


@pytest.fixture(scope="module")
def tiny_ds() -> Path:
    return build_tiny("deepseek_v3")


def test_mla_scale_is_latent_and_rope_key_absmax_over_448(tiny_ds, tmp_path):
    res = _kv_only(tiny_ds, tmp_path / "w")
    keys, values, latent = _reference_stats(tiny_ds)
    assert res.kv_cache_scheme == kv.KV_CACHE_SCHEME
    for layer, (k, v) in res.kv_scales.items():
        # MLA caches (latent after kv_a_layernorm, k_pe after rope): transformers' cache holds exactly these
        assert latent[layer] == pytest.approx(keys[layer], rel=1e-6)
        assert values[layer] > 0  # the rope key part
        expected = max(latent[layer], values[layer]) / 448.0
        assert k == v
        assert k == pytest.approx(expected, rel=1e-4)


def test_report_fractions_match_an_exact_fp8_cast():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(200_000, generator=g) * torch.exp(torch.randn(200_000, generator=g) * 3)
    x[:1000] = 0
    t = kv.Tally()
    t.add(x[:100_000])
    t.add(x[100_000:])
    assert t.absmax == float(x.abs().max())
    for scale in (t.absmax / 448, 1.0, 1e-3, 50.0):
        exact = kv.fp8_fractions_exact(x, scale)
        est = t.fractions(scale)
        assert est["saturated"] == pytest.approx(exact["saturated"], abs=2e-3)
        assert est["underflow"] == pytest.approx(exact["underflow"], abs=2e-3)
    assert t.fractions(t.absmax / 448)["saturated"] == 0.0
    assert kv.Tally.from_json(t.to_json()).fractions(1.0) == t.fractions(1.0)


def test_gqa_has_separate_k_and_v_scales(tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = AutoConfig.for_model("glm4_moe", vocab_size=512, hidden_size=64, intermediate_size=128,
                               moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=16, n_routed_experts=4, num_experts_per_tok=2,
                               n_shared_experts=1, first_k_dense_replace=1, use_qk_norm=True,
                               num_nextn_predict_layers=0, partial_rotary_factor=0.5)
    src = tmp_path / "glm4"
    AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16).save_pretrained(src)
    res = _kv_only(src, tmp_path / "w")
    keys, values, _ = _reference_stats(src)
    for layer, (k, v) in res.kv_scales.items():
        assert k == pytest.approx(keys[layer] / 448, rel=1e-4)
        assert v == pytest.approx(values[layer] / 448, rel=1e-4)
        assert k != v


def test_dsa_writes_no_scales_but_reports(tmp_path):
    src = build_tiny("glm_moe_dsa")
    res = _kv_only(src, tmp_path / "w")
    assert res.kv_scales is None and res.kv_cache_scheme is None
    # statistics describe the engine's DSA cache row (latent + rope key), not transformers' expanded K/V
    nope = json.loads((src / "config.json").read_text())["qk_nope_head_dim"]
    rope, _, latent = _reference_stats(src, rope_from=nope)
    for layer, stats in res.kv.items():
        assert stats.k.absmax == pytest.approx(max(rope[layer], latent[layer]), rel=1e-4)
    files = res.write_reports(tmp_path)
    assert files == ["kv_cache_report.json"]
    rep = json.loads((tmp_path / "kv_cache_report.json").read_text())
    assert rep["layout"] == "dsa" and "per-tile" in rep["note"]
    assert len(rep["layers"]) == 4 and all("scale" not in layer["kv"] for layer in rep["layers"])
    assert "no checkpoint scales" in res.summary()


def test_kv_scales_command_adds_scales_without_rewriting_shards(tiny_ds, tmp_path):
    """An existing INT4 checkpoint (converted with RTN) gets scales, index entries and kv_cache_scheme;
    its weight shards are untouched, and it still loads in transformers with the scales in place."""
    from typer.testing import CliRunner

    from quantkit.cli import app
    from quantkit.convert.pipeline import convert

    int4 = tmp_path / "int4"
    convert(tiny_ds, int4, Recipe(method="rtn"))
    shards = {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in int4.glob("model-*.safetensors")}
    out = CliRunner().invoke(app, ["kv-scales", str(int4), "--samples", "4", "--seq-len", "48", "--kv-scales",
                                   "calibrated"])
    assert out.exit_code == 0, out.output
    assert "FP8 KV (mla)" in out.output
    for name, (mtime, data) in shards.items():
        assert (int4 / name).stat().st_mtime_ns == mtime and (int4 / name).read_bytes() == data
    config = json.loads((int4 / "config.json").read_text())
    assert config["quantization_config"]["kv_cache_scheme"]["type"] == "float"
    index = json.loads((int4 / "model.safetensors.index.json").read_text())
    # MLA: transformers' name and the k_proj/v_proj names SGLang's DeepSeek loader remaps to attn_mqa
    for name in ("self_attn.k_scale", "self_attn.v_scale", "self_attn.k_proj.k_scale", "self_attn.v_proj.v_scale"):
        assert index["weight_map"][f"model.layers.0.{name}"] == kv.KV_SHARD
    assert not (int4 / "kv_cache_scales.json").exists()  # the legacy JSON loads in no engine for these models
    report = json.loads((int4 / "kv_cache_report.json").read_text())
    assert all(layer["kv"]["at_calibrated_scale"]["saturated"] == 0.0 for layer in report["layers"])

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(int4, dtype=torch.float32)
    k = model.model.layers[2].self_attn.k_scale.detach().item()
    assert k == pytest.approx(report["layers"][2]["kv"]["scale"], rel=1e-6)
    serving = json.loads((int4 / "quantkit.json").read_text())["serving"]  # recomputed for the new scales
    assert serving["sglang"]["kv_cache"]["scale"] == "calibrated" and serving["vllm"]["kv_cache"]["scale"] == "none"
    assert not os.path.exists(tmp_path / ".int4.kv-scales.partial")


def test_kv_scales_command_ships_the_rules_scales(tiny_ds, tmp_path):
    """Without --kv-scales the measured rule decides (quantkit/engines/kv_choice.py: MLA ships 1.0): the scale
    tensors are 1.0, the report says why, the record pins the fastest backend and shows both options."""
    from typer.testing import CliRunner

    from quantkit.cli import app
    from quantkit.convert.pipeline import convert
    from quantkit.engines.kv_choice import UNIT_BACKEND, choose_scale_mode

    assert choose_scale_mode(get_adapter(json.loads((tiny_ds / "config.json").read_text())).kv_layout)[0] == "unit"
    int4 = tmp_path / "int4"
    convert(tiny_ds, int4, Recipe(method="rtn"))
    out = CliRunner().invoke(app, ["kv-scales", str(int4), "--samples", "4", "--seq-len", "48"])
    assert out.exit_code == 0, out.output
    report = json.loads((int4 / "kv_cache_report.json").read_text())
    assert report["scales"]["written"] == "unit" and "measured" in report["scales"]["why"]
    from safetensors import safe_open

    with safe_open(int4 / kv.KV_SHARD, "pt") as f:
        assert {float(f.get_tensor(n)) for n in f.keys()} == {1.0}
    sglang = json.loads((int4 / "quantkit.json").read_text())["serving"]["sglang"]
    assert sglang["kv_cache"]["scale"] == "1.0" and sglang["kv_cache"]["attention_backend"] == UNIT_BACKEND["sm90"]
    assert sglang["kv_choice"]["shipped"] == "unit" and sglang["kv_choice"]["options"]["calibrated"]["kl"] > 0


def test_kv_scales_refuses_to_invent_a_config_for_bf16(tiny_ds, tmp_path):
    from quantkit.core.errors import QuantkitError

    out = tmp_path / "copy"
    kv.link_checkpoint(tiny_ds, out)
    with pytest.raises(QuantkitError, match="no kv_cache_scheme"):
        kv.write_kv_scales(out, {0: (0.1, 0.1)}, get_adapter(json.loads((out / "config.json").read_text())))
