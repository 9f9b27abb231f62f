"""The typed scheme (formats, bytes, fake quantization), the quantization units and precision plans."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from quantkit.arch import get_adapter
from quantkit.checkpoint.synth import tiny_config
from quantkit.core.errors import QuantkitError
from quantkit.quant.int4 import dequantize_group, pack_int, quantize_rtn, unpack_int
from quantkit.quant.precision import PrecisionPlan, resolve_precision
from quantkit.quant.recipe import load_recipe
from quantkit.quant.scheme import FORMATS, get_format
from quantkit.quant.units import list_units, unit_of

CONFIGS = Path(__file__).resolve().parents[1] / "quantkit" / "plan" / "configs"


@pytest.mark.parametrize("group_size", [32, 128])
def test_int8_matches_compressed_tensors_compressor(group_size):
    from compressed_tensors.compressors.pack_quantized import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    gen = torch.Generator().manual_seed(group_size)
    w = (torch.randn(64, 256, generator=gen) * torch.logspace(-3, 1, 64).unsqueeze(1)).to(torch.bfloat16)
    w[5, :group_size] = 0  # an all-zero group: eps scale
    args = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="group", group_size=group_size)
    grouped = w.unflatten(-1, (-1, group_size))
    scale, _ = calculate_qparams(grouped.amin(-1), grouped.amax(-1), args)
    reference = PackedQuantizationCompressor.compress(
        {"weight": w, "weight_scale": scale}, QuantizationScheme(targets=["Linear"], weights=args))
    q, s = quantize_rtn(w, group_size, bits=8)
    ours = pack_int(q, s, bits=8)
    assert torch.equal(ours.weight_scale, reference["weight_scale"])
    assert torch.equal(ours.weight_packed, reference["weight_packed"])
    assert torch.equal(unpack_int(ours.weight_packed, bits=8), q)
    assert int(q.min()) < -100 and int(q.max()) > 100  # the whole 8-bit range is used


def test_format_bytes_are_what_is_stored():
    shape = (256, 512)
    for fmt in FORMATS.values():
        stored = fmt.stored(shape)
        assert fmt.matrix_bytes(shape) == sum(t[2][0] * (t[2][1] if len(t[2]) > 1 else 1) * t[1].itemsize
                                              for t in stored)
    assert get_format("int4-g32").matrix_bytes(shape) == 256 * 512 // 2 + 256 * 16 * 2 + 16
    assert get_format("int8-g128").matrix_bytes(shape) == 256 * 512 + 256 * 4 * 2 + 16
    assert get_format("bf16").matrix_bytes(shape) == 256 * 512 * 2
    assert get_format("fp8-block").matrix_bytes(shape) == 256 * 512 + 2 * 4 * 4
    assert get_format("int4-g128").bits_per_weight() == pytest.approx(4.125, abs=1e-4)
    with pytest.raises(QuantkitError, match="unknown weight format 'int3'"):
        get_format("int3")


def test_fake_quantize_errors_order_by_bits():
    w = torch.randn(128, 256, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16).float()

    def err(name: str) -> float:
        return float((FORMATS[name].fake_quantize(w) - w).pow(2).sum() / w.pow(2).sum())

    e = {n: err(n) for n in ("int4-g32", "int4-g64", "int4-g128", "int8-g128", "nvfp4a16", "bf16")}
    assert e["int8-g128"] < e["int4-g32"] < e["int4-g64"] < e["int4-g128"]
    assert e["bf16"] == 0.0 and 0 < e["nvfp4a16"] < 0.05
    q, s = quantize_rtn(w, 32)
    assert torch.equal(FORMATS["int4-g32"].fake_quantize(w), dequantize_group(q, s, 32))


def test_units_of_an_mla_model():
    a = get_adapter(tiny_config("deepseek_v3"))
    units = {u.name: u for u in list_units(a)}
    assert sorted(units) == sorted(["layers.0.attention", "layers.0.mlp"] + [
        f"layers.{i}.{k}" for i in (1, 2, 3) for k in ("experts", "shared_experts", "attention")])
    assert units["layers.3.experts"].mtp and not units["layers.2.experts"].mtp
    c = a.config
    assert units["layers.1.experts"].params == int(c["n_routed_experts"]) * 3 * c["hidden_size"] * c[
        "moe_intermediate_size"]
    assert unit_of(a, "model.layers.1.mlp.experts.5.down_proj.weight_packed") == "layers.1.experts"
    assert unit_of(a, "model.layers.1.mlp.experts.5.down_proj.weight_scale_inv") == "layers.1.experts"
    assert unit_of(a, "model.layers.2.self_attn.o_proj.weight") == "layers.2.attention"
    assert unit_of(a, "model.layers.2.self_attn.q_b_proj") == "layers.2.attention"
    for kept in ("model.layers.2.self_attn.kv_b_proj.weight", "model.layers.2.self_attn.q_a_proj.weight",
                 "model.layers.2.self_attn.kv_a_proj_with_mqa.weight", "model.layers.1.mlp.gate.weight",
                 "lm_head.weight", "model.layers.3.eh_proj.weight", "model.layers.2.input_layernorm.weight"):
        assert unit_of(a, kept) is None, kept
    assert unit_of(a, "model.layers.0.mlp.down_proj.weight") == "layers.0.mlp"


def test_units_of_a_gqa_model_and_a_release_config():
    a = get_adapter(tiny_config("glm4_moe"))
    assert unit_of(a, "model.layers.1.self_attn.k_proj.weight") == "layers.1.attention"
    assert unit_of(a, "model.layers.1.self_attn.k_proj.bias") == "layers.1.attention"
    glm5 = json.loads((CONFIGS / "glm-5.2" / "config.json").read_text())
    units = list_units(get_adapter(glm5))
    experts = [u for u in units if u.kind == "experts"]
    assert experts[-1].mtp and len({u.params for u in experts}) == 1
    total = sum(u.params for u in units)
    assert 0.9 < sum(u.params for u in experts) / total < 1.0  # routed experts dominate


def test_precision_plan_from_recipe_round_trips():
    cfg = tiny_config("deepseek_v3")
    a = get_adapter(cfg)
    recipe = load_recipe(None, cfg, {"units": {"layers.1.experts": "int8-g128", "layers.*.shared_experts":
                                               "int4-g128", "layers.2.shared_experts": "bf16"}})
    plan = resolve_precision(recipe, a)
    assert plan.units["layers.1.experts"] == "int8-g128" and plan.units["layers.2.experts"] == "int4-g32"
    assert plan.units["layers.1.shared_experts"] == "int4-g128" and plan.units["layers.2.shared_experts"] == "bf16"
    assert plan.units["layers.0.mlp"] == "bf16" and plan.units["layers.1.attention"] == "bf16"
    assert PrecisionPlan.from_json(plan.to_json()) == plan
    assert "units:" in recipe.to_yaml()
    uniform = load_recipe(None, cfg)
    assert "units" not in uniform.model_dump() and "units" not in uniform.to_yaml()
    assert set(resolve_precision(uniform, a).formats_used()) == {"int4-g32", "bf16"}


@pytest.mark.parametrize(("units", "message"), [
    ({"layers.9.experts": "int8-g128"}, "unit 'layers.9.experts' does not exist"),
    ({"layers.*.router": "int8-g128"}, "unit 'layers.\\*.router': expected"),
    ({"layers.1.experts": "mxfp4a16"}, "uniform recipes only"),
    ({"layers.1?.experts": "int8-g128"}, "matches no unit"),
])
def test_bad_unit_entries_are_one_line_errors(units, message):
    cfg = tiny_config("deepseek_v3")
    with pytest.raises(QuantkitError, match=message):
        resolve_precision(load_recipe(None, cfg, {"units": units}), get_adapter(cfg))


def test_bad_plan_json_is_one_line_error(tmp_path):
    p = tmp_path / "plan.json"
    p.write_text('{"units": {"layers.1.experts": "int5"}}')
    with pytest.raises(QuantkitError, match="plan.json: not a precision plan"):
        PrecisionPlan.load(p)
