"""The model dtype reaches calibration (an FP16 source gets FP16 scales, bit-compatible with its RTN
modules), and the memory layout of calibration: experts held in the model dtype, quantized experts held
packed, down_proj Hessians rebuilt from kept MoE inputs equal to the ones accumulated on the fly."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from checkpoint_refs import read_all
from safetensors.torch import load_file, save_file

from quantkit.calibrate import layers as L
from quantkit.calibrate.experts import quantize_experts
from quantkit.calibrate.gptq import GPTQScheme
from quantkit.calibrate.moe import ExpertMoE
from quantkit.calibrate.tiny import CORPUS, build_tiny
from quantkit.checkpoint.source import open_source
from quantkit.convert.pipeline import convert
from quantkit.quant.int4 import PackedInt4
from quantkit.quant.recipe import GPTQSettings, Recipe


def _as_fp16(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    for f in dst.glob("*.safetensors"):
        tensors = load_file(f)
        save_file({k: v.half() if v.dtype == torch.bfloat16 else v for k, v in tensors.items()}, f,
                  metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config.pop("dtype", None)
    config["torch_dtype"] = "float16"
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_gptq_on_fp16_source_writes_fp16_scales(tmp_path):
    """Regression: `convert --method gptq` on an FP16 source failed (weight_scale bf16, planned fp16)."""
    from compressed_tensors.compressors.pack_quantized import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    src = _as_fp16(build_tiny("deepseek_v3"), tmp_path / "fp16")
    calib = {"dataset": str(CORPUS), "samples": 4, "seq_len": 64, "seed": 0}
    convert(src, tmp_path / "out", Recipe(method="gptq", calibration=calib))
    out = read_all(tmp_path / "out")
    scales = [k for k in out if k.endswith(".mlp.experts.0.down_proj.weight_scale")]
    assert scales and all(out[k].dtype == torch.float16 for k in out if k.endswith(".weight_scale"))
    assert all(out[k].dtype == torch.float16 for k in out if k.endswith("norm.weight"))
    cov = json.loads((tmp_path / "out" / "calibration_coverage.json").read_text())
    assert cov["summary"]["modules"] > 0 and not cov["fallbacks"]
    m = scales[0].removesuffix(".weight_scale")
    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=32)
    weight = PackedQuantizationCompressor.decompress(
        {p: out[f"{m}.{p}"] for p in ("weight_packed", "weight_scale", "weight_shape")},
        QuantizationScheme(targets=["Linear"], weights=args))["weight"]
    source = load_file(next(src.glob("*.safetensors")))[f"{m}.weight"].float()
    assert weight.dtype == torch.float16 and torch.isfinite(weight).all()
    assert (weight.float() - source).abs().max() < 0.5 * source.abs().max()


@pytest.fixture(scope="module")
def layer():
    source = open_source(build_tiny("deepseek_v3"))
    cfg = L.hf_config(source.config)
    return source, cfg, L.build_layer(source, cfg, 1, source.adapter.prefix)


def _collect(module, cfg, keep_inputs: bool) -> ExpertMoE:
    g = torch.Generator().manual_seed(0)
    moe = module.mlp
    moe.start_collecting("all", keep_inputs=keep_inputs)
    with torch.no_grad():
        for _ in range(2):
            moe(torch.randn(2, 32, cfg.hidden_size, generator=g))
    return moe


def test_experts_held_in_model_dtype_then_packed(layer):
    source, cfg, module = layer
    moe = module.mlp
    assert isinstance(moe, ExpertMoE)
    assert all(w.dtype == source.model_dtype for e in moe.experts for w in e.values())
    probe = torch.linspace(-1, 1, 4 * cfg.hidden_size).reshape(1, 4, cfg.hidden_size)
    with torch.no_grad():
        before = moe(probe)
    _collect(module, cfg, keep_inputs=True)
    packed, records = quantize_experts(moe, "x.", 1, GPTQScheme(32, 4, source.model_dtype, GPTQSettings()))
    moe.stop_collecting()
    assert all(isinstance(w, PackedInt4) for e in moe.experts for w in e.values())
    assert len(packed) == 3 * len(moe.experts) and all(r["samples"]["down"] == 128 for r in records)
    assert all(r["rel_error"][p] < r["rtn_rel_error"][p] * 1.05 for r in records for p in r["rel_error"])
    with torch.no_grad():
        after = moe(probe)  # runs from the packed codes
    assert torch.isfinite(after).all() and not torch.equal(after, before)
    assert float((after - before).norm() / before.norm()) < 0.2


def test_down_hessians_from_kept_inputs_equal_accumulated(layer):
    source, cfg, _ = layer
    fresh = L.build_layer(source, cfg, 1, source.adapter.prefix)
    kept = _collect(fresh, cfg, keep_inputs=True)
    a = [kept.down_hessian(e) for e in range(len(kept.experts))]
    fresh2 = L.build_layer(source, cfg, 1, source.adapter.prefix)
    acc = _collect(fresh2, cfg, keep_inputs=False)
    b = [acc.down_hessian(e) for e in range(len(acc.experts))]
    for (ha, na), (hb, nb) in zip(a, b, strict=True):
        assert na == nb == 128 and torch.allclose(ha, hb, rtol=1e-4, atol=1e-6)


def test_routed_token_weighting_weights_routed_tokens(layer):
    """With kept inputs, expert e's Hessians count its routed tokens 1 + w times (weights of mean 1)."""
    source, cfg, _ = layer
    moe = _collect(L.build_layer(source, cfg, 1, source.adapter.prefix), cfg, keep_inputs=True)
    x = torch.cat(moe.inputs)
    routed = torch.cat(moe.routes)
    e = int(routed[0, 0])
    mask = (routed == e).any(dim=-1)
    assert 0 < int(mask.sum()) < len(mask)
    weight = 1 + 4.0 * mask.float()
    weight = weight / weight.mean()
    expected = (x * weight[:, None]).t() @ x / len(x)
    h, count = moe.in_hessian(e, 4.0)
    assert count == len(x) and torch.allclose(h, expected, rtol=1e-4, atol=1e-6)
    assert not torch.allclose(h, moe.in_hessian(e)[0], rtol=1e-3)
    hd, _ = moe.down_hessian(e, 4.0)
    a = moe._inner(e, x)
    assert torch.allclose(hd, (a * weight[:, None]).t() @ a / len(x), rtol=1e-4, atol=1e-6)


def _quantize_counting_held(moe: ExpertMoE, source, monkeypatch) -> tuple[dict[str, PackedInt4], int]:
    """quantize_experts on 2-expert chunks; the most routed-expert weights held unquantized at once."""
    import quantkit.calibrate.experts as experts_module

    monkeypatch.setattr(experts_module, "ROWS_PER_CHUNK", {"cpu": 2 * 128, "cuda": 2 * 128})  # 2 experts per chunk
    held = [0]
    load = moe.load

    def counting_load(experts, projs):
        load(experts, projs)
        held[0] = max(held[0], sum(isinstance(w, torch.Tensor) for e in moe.experts for w in e.values()))

    monkeypatch.setattr(moe, "load", counting_load)
    packed, _ = quantize_experts(moe, "x.", 1, GPTQScheme(32, 4, source.model_dtype, GPTQSettings()))
    return packed, held[0]


def test_lazy_experts_are_read_a_chunk_at_a_time_with_identical_results(layer, monkeypatch):
    """Memory regression guard: with kept inputs the statistics pass needs no routed expert, GPTQ reads
    one chunk of experts at a time and drops each source weight once packed; results are unchanged."""
    from quantkit.calibrate.moe import SourceWeight

    source, cfg, _ = layer
    eager = _collect(L.build_layer(source, cfg, 1, source.adapter.prefix), cfg, keep_inputs=True)
    lazy_layer = L.build_layer(source, cfg, 1, source.adapter.prefix, lazy_experts=True)
    assert all(isinstance(w, SourceWeight) for e in lazy_layer.mlp.experts for w in e.values())
    lazy = lazy_layer.mlp
    lazy.start_collecting("all", keep_inputs=True, outputs=False)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _ in range(2):
            lazy(torch.randn(2, 32, cfg.hidden_size, generator=g))
    # the statistics pass read no routed expert
    assert all(isinstance(w, SourceWeight) for e in lazy.experts for w in e.values())
    assert torch.equal(lazy.routed_tokens, eager.routed_tokens)
    want, held_eager = _quantize_counting_held(eager, source, monkeypatch)
    got, held_lazy = _quantize_counting_held(lazy, source, monkeypatch)
    assert held_eager == 3 * len(eager.experts)  # the eager layer holds every expert until it is packed
    assert held_lazy <= 3 * 2  # a 2-expert chunk at most (down first, then gate/up; packed ones dropped)
    assert all(isinstance(w, PackedInt4) for e in lazy.experts for w in e.values())
    assert want.keys() == got.keys()
    for name in want:
        for part in ("weight_packed", "weight_scale", "weight_shape"):
            a, b = getattr(want[name], part), getattr(got[name], part)
            assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8)), (name, part)


def test_runner_releases_free_memory_at_phase_boundaries(layer, tmp_path, monkeypatch):
    """Each calibrated layer returns the allocator's free memory at its phase boundaries (glibc malloc_trim)."""
    import quantkit.calibrate.experts as moe_module  # the experts' GPTQ (split out of moe.py)
    import quantkit.calibrate.layer_pass as layer_pass
    import quantkit.calibrate.runner as runner
    from quantkit.calibrate.memory import release_free_memory

    assert isinstance(release_free_memory(), bool)
    calls = []
    monkeypatch.setattr(runner, "release_free_memory", lambda: calls.append("runner") or True)
    monkeypatch.setattr(layer_pass, "release_free_memory", lambda: calls.append("runner") or True)  # one layer
    monkeypatch.setattr(moe_module, "release_free_memory", lambda: calls.append("moe") or True)
    source = layer[0]
    tokens = torch.randint(0, 100, (4, 32), generator=torch.Generator().manual_seed(0))
    runner.run(source, Recipe(method="gptq", calibration={"samples": 4, "seq_len": 32}), tmp_path / "w", None,
               runner.RunOptions(tokens=tokens, threads=1))
    layers = source.adapter.num_layers
    assert calls.count("runner") >= 4 * layers and calls.count("moe") >= 2 * layers
