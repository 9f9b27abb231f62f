"""Per-unit (mixed-precision) conversion: what is written for each unit, read back, validated, refused.

The engines' loader code on these outputs: tests/engines/test_mixed_conformance.py."""

from __future__ import annotations

import json

import pytest
import torch
from checkpoint_refs import read_all

from quantkit.checkpoint.source import open_source
from quantkit.convert.pipeline import convert
from quantkit.core.errors import QuantkitError
from quantkit.quant.int4 import dequantize_packed
from quantkit.quant.recipe import load_recipe
from quantkit.quant.scheme import FORMATS
from quantkit.validate.checkpoint import validate_checkpoint

UNITS = {"layers.1.experts": "int8-g128", "layers.2.experts": "fp8-block", "layers.3.experts": "int4-g64",
         "layers.1.shared_experts": "int8-g128", "layers.2.attention": "int4-g128", "layers.0.mlp": "bf16"}


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    from quantkit.checkpoint.synth import make_checkpoint

    root = tmp_path_factory.mktemp("mixed")
    src = make_checkpoint(root / "src", "deepseek_v3", "fp8", size="small")
    convert(src, root / "out", load_recipe("deepseek-v3-w4a16-g32", {}, {"units": UNITS}))
    return src, root / "out"


def _packed(tensors: dict[str, torch.Tensor], module: str):
    from quantkit.quant.int4 import PackedInt4

    return PackedInt4(*(tensors[f"{module}.{p}"] for p in ("weight_packed", "weight_scale", "weight_shape")))


def test_each_unit_is_written_in_its_format(mixed):
    src, out = mixed
    source, tensors = open_source(src), read_all(out)
    m = "model.layers.{}.mlp.experts.5.down_proj"
    for layer, fmt in ((1, "int8-g128"), (3, "int4-g64"), (4, "int4-g32")):  # 4: the MTP layer, uniform format
        module = m.format(layer)
        w = source.read(module + ".weight", torch.float32)
        assert torch.equal(dequantize_packed(_packed(tensors, module)), FORMATS[fmt].fake_quantize(w)), fmt
        bits = 32 * tensors[module + ".weight_packed"].shape[1] // w.shape[1]
        assert (bits, w.shape[1] // tensors[module + ".weight_scale"].shape[1]) == (FORMATS[fmt].bits,
                                                                                     FORMATS[fmt].group)
    fp8 = m.format(2)  # kept as the source's FP8 blocks, bit for bit, scale renamed
    raw = read_all(src)
    assert torch.equal(tensors[fp8 + ".weight"].view(torch.uint8), raw[fp8 + ".weight"].view(torch.uint8))
    assert torch.equal(tensors[fp8 + ".weight_scale"], raw[fp8 + ".weight_scale_inv"])
    assert tensors["model.layers.0.mlp.down_proj.weight"].dtype == torch.bfloat16  # kept: FP8 dequantized
    assert "model.layers.1.self_attn.o_proj.weight" in tensors  # attention kept in layers without a format
    assert "model.layers.2.self_attn.kv_b_proj.weight" in tensors  # never part of the attention unit
    assert "model.layers.2.self_attn.q_b_proj.weight_packed" in tensors


def test_config_groups_record_and_card(mixed):
    _, out = mixed
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["format"] == "pack-quantized"  # not compressed-tensors' "mixed-precision" (SGLang refuses it)
    formats = {g["format"] for g in qc["config_groups"].values()}
    assert formats == {"pack-quantized", "float-quantized"}
    fp8 = next(g for g in qc["config_groups"].values() if g["format"] == "float-quantized")
    assert "Linear" in fp8["targets"] and r"re:.*layers\.2\.mlp\.experts\..*" in fp8["targets"]
    assert r"re:.*mlp\.(gate|up|gate_up|down)_proj.*" in qc["ignore"]  # no dense MLP unit quantized: the role's entry
    assert r"re:.*(layers\.(0|1|3|4)|decoder)\.self_attn\.(q_b|o)_proj$" in qc["ignore"]  # kept attention units
    record = json.loads((out / "quantkit.json").read_text())
    units = {u["unit"]: u for u in record["precision"]["units"]}
    assert {u: units[u]["format"] for u in UNITS} == UNITS
    assert units["layers.4.experts"]["format"] == "int4-g32" and units["layers.4.experts"]["mtp"]
    assert units["layers.1.experts"]["bytes"] > 1.9 * units["layers.3.experts"]["bytes"]  # 8 vs 4.25 bits
    assert record["serving"]["sglang"]["args"][:2] == ["--moe-runner-backend", "auto"]  # an FP8 MoE layer
    assert "units:" in (out / "quantkit_recipe.yaml").read_text()
    card = (out / "README.md").read_text()
    assert "## Per-layer precision" in card and "| 4 (MTP) |" in card and "INT8 g128" in card


def test_mixed_output_validates_and_reads_back(mixed, tmp_path):
    src, out = mixed
    report = validate_checkpoint(out, source=src)
    assert report.ok, [c for c in report.checks if c.status == "fail"]
    assert all(v.verdict == "loads" for v in report.engines.values())
    again = open_source(out)  # INT8, per-tensor groups, FP8 weight_scale: a source again
    assert {t.fmt for t in again.logical.values()} == {"plain", "int4_packed", "int8_packed", "fp8_block"}
    convert(out, tmp_path / "again", load_recipe("deepseek-v3-w4a16-g32", {}))  # re-conversion to uniform INT4
    redo = read_all(tmp_path / "again")
    assert redo["model.layers.1.mlp.experts.0.up_proj.weight_packed"].shape[1] * 8 == 256
    assert "model.layers.3.mlp.experts.0.up_proj.weight_packed" in redo


def test_uniform_recipe_record_has_no_precision_block(ckpt_factory, tmp_path):
    src = ckpt_factory("deepseek_v3", "bf16")
    convert(src, tmp_path / "out", load_recipe("deepseek-v3-w4a16-g32", {}))
    assert "precision" not in json.loads((tmp_path / "out" / "quantkit.json").read_text())
    assert "units" not in (tmp_path / "out" / "quantkit_recipe.yaml").read_text()
    assert "Per-layer precision" not in (tmp_path / "out" / "README.md").read_text()


@pytest.mark.parametrize(("family", "fmt", "units", "message"), [
    ("deepseek_v3", "bf16", {"layers.1.experts": "fp8-block"}, "unit layers.1.experts is fp8-block .* source "
     "stores it as plain"),
    ("deepseek_v3", "bf16", {"layers.1.experts": "nvfp4a16"}, "sglang: unit layers.1.experts: FP4 units beside"),
    ("glm4_moe", "bf16", {"layers.1.shared_experts": "int8-g128"}, "sglang: unit layers.1.shared_experts: INT "
     "shared experts fail in SGLang"),
    ("deepseek_v3", "bf16", {"layers.7.experts": "int8-g128"}, "unit 'layers.7.experts' does not exist"),
])
def test_refused_plans_are_one_line_errors_and_write_nothing(ckpt_factory, tmp_path, family, fmt, units, message):
    src = ckpt_factory(family, fmt, size="small")
    config = json.loads((src / "config.json").read_text())
    with pytest.raises(QuantkitError, match=message) as err:
        convert(src, tmp_path / "out", load_recipe(None, config, {"units": units}))
    assert "\n" not in str(err.value)
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


def test_cli_exit_2_for_a_refused_plan(ckpt_factory, tmp_path, cli):
    src = ckpt_factory("glm4_moe", "bf16", size="small")
    recipe = tmp_path / "r.yaml"
    recipe.write_text("architecture: glm4_moe\nunits:\n  layers.2.shared_experts: int4-g32\n")
    code, _, err = cli("convert", str(src), str(tmp_path / "out"), "--recipe", str(recipe))
    assert code == 2 and "layers.2.shared_experts" in err and "glm4_moe.py" in err


@pytest.fixture(scope="module")
def tiny_gptq(tmp_path_factory):
    """GPTQ on the tiny trained MLA-MoE: the uniform recipe, and a plan that changes only the last layer's units
    (so layers 0-2 see the same inputs in both runs)."""
    from quantkit.calibrate.runner import RunOptions, run
    from quantkit.calibrate.tiny import build_tiny
    from quantkit.quant.recipe import Recipe

    src = open_source(build_tiny("deepseek_v3"))
    tokens = torch.randint(1, 500, (4, 64), generator=torch.Generator().manual_seed(1))
    base = {"method": "gptq", "calibration": {"samples": 4, "seq_len": 64}}
    units = {"layers.3.experts": "int8-g128", "layers.3.shared_experts": "int4-g64", "layers.3.attention": "int4-g32"}
    out = {}
    for name, recipe in (("uniform", Recipe(**base)),
                         ("mixed", Recipe(**base, units=units))):
        out[name] = run(src, recipe, tmp_path_factory.mktemp(name), None, RunOptions(tokens=tokens, batch_size=2))
    return out


@pytest.mark.slow  # two GPTQ runs of the tiny model (~40 s on a quiet 2-core machine)
def test_gptq_follows_each_units_scheme(tiny_gptq):
    uniform, mixed = tiny_gptq["uniform"], tiny_gptq["mixed"]
    for layer in range(3):  # unchanged units, same inputs: the same bytes as the uniform recipe's (layer by layer)
        module = f"model.layers.{layer}.mlp.experts.2.down_proj"
        a, b = uniform.quantized(module), mixed.quantized(module)
        assert torch.equal(a.weight_packed, b.weight_packed) and torch.equal(a.weight_scale, b.weight_scale)
    assert mixed.quantized("model.layers.2.mlp.shared_experts.down_proj") is None  # kept: its role is not quantized
    int8 = mixed.quantized("model.layers.3.mlp.experts.2.down_proj")
    assert int8.weight_packed.shape[1] * 4 == 128 and int8.weight_scale.shape[1] == 1  # INT8 g128
    assert mixed.quantized("model.layers.3.mlp.shared_experts.up_proj").weight_scale.shape[1] == 2  # g64
    q_b = mixed.quantized("model.layers.3.self_attn.q_b_proj")
    assert q_b is not None and mixed.quantized("model.layers.2.self_attn.q_b_proj") is None  # only layer 3's unit
    assert mixed.quantized("model.layers.3.self_attn.kv_b_proj") is None  # never part of the attention unit
    err = {r["layer"]: r["rel_error"]["down_proj"] for r in mixed.coverage if r["expert"] == 2}
    rtn = {r["layer"]: r["rtn_rel_error"]["down_proj"] for r in mixed.coverage if r["expert"] == 2}
    assert err[3] < err[2] / 8 and err[3] <= rtn[3]  # INT8 GPTQ: far below INT4, not worse than INT8 RTN
    assert mixed.coverage_report()["units"]["layers.3.experts"] == "int8-g128"


def test_eval_loads_a_mixed_output(mixed):
    """`quantkit eval` reads a mixed output through the source reader: INT8, INT4 and FP8-kept units dequantized."""
    from quantkit.calibrate.eval import load_model

    src, out = mixed
    model = load_model(out)
    experts = model.model.layers[2].mlp.experts  # the FP8-kept unit: the source's values exactly
    w = open_source(src).read("model.layers.2.mlp.experts.5.down_proj.weight", torch.float32)
    got = experts.down_proj[5] if hasattr(experts, "down_proj") else experts[5].down_proj.weight
    assert torch.equal(got.float(), w)
    w1 = open_source(src).read("model.layers.1.mlp.experts.5.down_proj.weight", torch.float32)
    got1 = model.model.layers[1].mlp.experts
    got1 = got1.down_proj[5] if hasattr(got1, "down_proj") else got1[5].down_proj.weight
    assert torch.equal(got1.float(), FORMATS["int8-g128"].fake_quantize(w1))


def test_validate_cli_shows_both_engines_verdicts_for_a_mixed_output(mixed, cli):
    _, out = mixed
    code, stdout, err = cli("validate", str(out), "--engine", "all")
    assert code == 0, err
    assert "sglang 0.5.23: loads" in stdout and "vllm 0.33.0: loads" in stdout
    assert "--moe-runner-backend auto" in stdout and "per-unit formats" in stdout
