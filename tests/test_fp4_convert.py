"""`quantkit convert --scheme nvfp4a16|mxfp4a16`: every quantized tensor byte-identical to compressed-tensors'
own path on the model-dtype weights, with one global scale per fused group (gate/up per expert, shared experts,
MLA q_a/kv_a), from FP8-block, BF16 and INT4 sources; resumable; and the peer's data-free path for contrast."""

from __future__ import annotations

import json

import pytest
import torch
from checkpoint_refs import read_all
from fp4_refs import ct_compress

from quantkit.checkpoint.source import open_source
from quantkit.convert.fp4 import fused_group, fused_groups, read_model_dtype
from quantkit.convert.pipeline import convert
from quantkit.core.errors import QuantkitError
from quantkit.quant.recipe import load_recipe

_PRESET = {"nvfp4a16": "NVFP4A16", "mxfp4a16": "MXFP4A16"}


def _fp4_recipe(scheme: str, roles: list[str] | None = None):
    fields: dict[str, object] = {"scheme": scheme}
    if roles:
        fields["quantize_roles"] = roles
    return load_recipe("deepseek-v3-w4a16-g32", {}, fields)


def _reference(src, ours: dict[str, torch.Tensor], scheme: str) -> dict[str, torch.Tensor]:
    """CT's bytes for every module quantkit quantized, fused groups observed together (llm-compressor's fusion)."""
    source = open_source(src)
    modules = sorted(n.removesuffix(".weight_packed") for n in ours if n.endswith(".weight_packed"))
    groups = fused_groups(modules) if scheme == "nvfp4a16" else {}
    grouped = {m for ms in groups.values() for m in ms}
    batches = list(groups.values()) + [[m] for m in modules if m not in grouped]
    ref: dict[str, torch.Tensor] = {}
    for batch in batches:
        weights = [read_model_dtype(source, source.logical[f"{m}.weight"]) for m in batch]
        for m, r in zip(batch, ct_compress(weights, _PRESET[scheme]), strict=True):
            ref |= {f"{m}.{k}": v for k, v in r.items()}
    return ref


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype == torch.float8_e4m3fn:
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    return a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.parametrize(("family", "fmt", "scheme", "roles"), [
    ("deepseek_v3", "fp8", "nvfp4a16", ["routed_expert", "shared_expert"]),
    ("deepseek_v3", "bf16", "mxfp4a16", None),
    ("deepseek_v3", "int4", "nvfp4a16", None),
    ("glm4_moe", "bf16", "nvfp4a16", ["routed_expert", "shared_expert", "attention"])])
def test_convert_fp4_matches_compressed_tensors(ckpt_factory, tmp_path, family, fmt, scheme, roles):
    src = ckpt_factory(family, fmt)
    recipe = load_recipe(None, json.loads((src / "config.json").read_text()),
                         {"scheme": scheme, **({"quantize_roles": roles} if roles else {})})
    convert(src, tmp_path / "out", recipe)
    ours = read_all(tmp_path / "out")
    ref = _reference(src, ours, scheme)
    quantized = [n for n in ours if n.endswith((".weight_packed", ".weight_scale", ".weight_global_scale"))]
    assert sorted(quantized) == sorted(ref)
    assert len(quantized) >= 3 * 16 * 2
    for n in quantized:
        assert _same(ours[n], ref[n]), n
    qc = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert qc["format"] == ("nvfp4-pack-quantized" if scheme == "nvfp4a16" else "mxfp4-pack-quantized")
    if scheme == "nvfp4a16":  # every fused group shares one global scale
        modules = [n.removesuffix(".weight_global_scale") for n in ours if n.endswith(".weight_global_scale")]
        groups = fused_groups(modules)
        assert any(".experts." in g for g in groups)
        if roles:
            assert any("shared_experts" in g for g in groups)
        if roles and "attention" in roles:
            assert any(g.endswith("qkv_proj") for g in groups)
        for members in groups.values():
            assert len({float(ours[f"{m}.weight_global_scale"]) for m in members}) == 1, members


def test_fused_group_names():
    assert fused_group("model.layers.3.mlp.experts.7.gate_proj") == "model.layers.3.mlp.experts.7.gate_up_proj"
    assert fused_group("model.layers.3.mlp.shared_experts.up_proj") == "model.layers.3.mlp.shared_experts.gate_up_proj"
    attn = "model.layers.0.self_attn."
    assert fused_group(attn + "kv_a_proj_with_mqa") == fused_group(attn + "q_a_proj") == attn + "fused_qkv_a_proj"
    assert fused_group("model.layers.3.mlp.experts.7.down_proj") is None


def test_fp4_conversion_resumes_to_the_same_bytes(ckpt_factory, tmp_path, monkeypatch):
    from quantkit.convert import worker

    src = ckpt_factory("deepseek_v3", "fp8")
    convert(src, tmp_path / "clean", _fp4_recipe("nvfp4a16"))
    real = worker.convert_shard
    calls = {"n": 0}

    def dies_on_second(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr("quantkit.convert.pipeline.convert_shard", dies_on_second)
    with pytest.raises(KeyboardInterrupt):
        convert(src, tmp_path / "out", _fp4_recipe("nvfp4a16"))
    assert (tmp_path / "out.partial" / "journal" / "fp4_amax.json").exists()
    monkeypatch.setattr("quantkit.convert.pipeline.convert_shard", real)
    convert(src, tmp_path / "out", _fp4_recipe("nvfp4a16"))
    a, b = read_all(tmp_path / "clean"), read_all(tmp_path / "out")
    assert sorted(a) == sorted(b) and all(_same(a[n], b[n]) for n in a)


def test_w4a4_needs_calibration_and_gptq_is_int4_only():
    with pytest.raises(QuantkitError, match="GPTQ"):
        load_recipe("deepseek-v3-w4a16-g32", {}, {"scheme": "nvfp4a16", "method": "gptq"})
    assert load_recipe("deepseek-v3-w4a16-g32", {}, {"scheme": "nvfp4"}).needs_calibration


def test_cli_scheme_option_and_w4a4_refusals(cli, ckpt_factory, tmp_path):
    src = ckpt_factory("deepseek_v3", "fp8")
    code, _, err = cli("convert", str(src), str(tmp_path / "w4a4"), "--scheme", "nvfp4", "--quiet")
    assert code == 2 and "--calib" in err and not (tmp_path / "w4a4.partial").exists()
    code, _, err = cli("convert", str(src), str(tmp_path / "mx"), "--scheme", "mxfp4a16", "--quiet")
    assert code == 0, err
    qc = json.loads((tmp_path / "mx" / "config.json").read_text())["quantization_config"]
    assert qc["format"] == "mxfp4-pack-quantized"


@pytest.mark.parametrize("scheme", ["nvfp4a16", "mxfp4a16", "nvfp4"])
@pytest.mark.parametrize("kv", [False, True])
def test_fp4_config_equals_compressed_tensors_models(scheme, kv):
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, preset_name_to_scheme

    from quantkit.checkpoint.qconfig import FP8_KV_CACHE_SCHEME, build_fp4_quantization_config

    fmt = "mxfp4-pack-quantized" if scheme == "mxfp4a16" else "nvfp4-pack-quantized"
    ref = QuantizationConfig(config_groups={"group_0": preset_name_to_scheme(scheme.upper(), ["Linear"])}, format=fmt,
                             ignore=["re:.*lm_head$"], quantization_status="compressed",
                             kv_cache_scheme=QuantizationArgs(**FP8_KV_CACHE_SCHEME) if kv else None)
    ours = build_fp4_quantization_config(scheme, ["re:.*lm_head$"], kv_cache=kv)
    assert json.dumps(ours) == json.dumps(ref.model_dump(mode="json"))  # same keys, order and values


def test_fp4_presets_and_refused_combinations():
    for family in ("glm5", "deepseek-v3", "kimi-k2", "glm4"):
        assert load_recipe(f"{family}-nvfp4a16", {}).scheme == "nvfp4a16"
    with pytest.raises(QuantkitError, match="minmax"):
        load_recipe("glm5-nvfp4a16", {}, {"scale_search": "mse"})
