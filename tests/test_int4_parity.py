"""Bit-identical INT4 packing and scales versus compressed-tensors and llm-compressor's model_free_ptq."""

from __future__ import annotations

import json

import pytest
import torch
from checkpoint_refs import read_all

from quantkit.convert.pipeline import convert
from quantkit.quant.int4 import dequantize_group, mse_group_scales, pack_int4, quantize_rtn, unpack_int4
from quantkit.quant.recipe import load_recipe


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_matches_compressed_tensors_compressor(group_size):
    from compressed_tensors.compressors.pack_quantized import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    gen = torch.Generator().manual_seed(group_size)
    w = (torch.randn(96, 256, generator=gen) * torch.logspace(-3, 1, 96).unsqueeze(1)).to(torch.bfloat16)
    w[3, :group_size] = 0  # an all-zero group: eps scale
    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=group_size)
    grouped = w.unflatten(-1, (-1, group_size))
    scale, _ = calculate_qparams(grouped.amin(-1), grouped.amax(-1), args)
    reference = PackedQuantizationCompressor.compress(
        {"weight": w, "weight_scale": scale}, QuantizationScheme(targets=["Linear"], weights=args))
    ours = pack_int4(*quantize_rtn(w, group_size))
    assert torch.equal(ours.weight_scale, reference["weight_scale"])
    assert torch.equal(ours.weight_packed, reference["weight_packed"])
    assert ours.weight_shape.tolist() == list(w.shape)


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_matches_llmcompressor_model_free_ptq(ckpt_factory, tmp_path, fmt):
    """Same source, same scheme (W4A16 g32 symmetric, routed experts): identical packed tensors."""
    from compressed_tensors.entrypoints.convert.converters.fp8block_dequantizer import FP8BlockDequantizer
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from llmcompressor import model_free_ptq

    # "small": expert shapes are whole 128x128 blocks (the peer's dequantizer saves partial blocks non-contiguous)
    src = ckpt_factory("deepseek_v3", fmt, size="small")
    scheme = QuantizationScheme(targets=["re:.*mlp\\.experts\\.\\d+\\.(gate|up|down)_proj$"], weights=QuantizationArgs(
        num_bits=4, type="int", symmetric=True, strategy="group", group_size=32))
    converter = None
    if fmt == "fp8":
        names = read_all(src)
        fp8 = [n.removesuffix(".weight_scale_inv") for n in names if n.endswith(".weight_scale_inv")]
        experts = [m for m in fp8 if ".mlp.experts." in m]
        converter = FP8BlockDequantizer(targets=experts, ignore=[m for m in fp8 if m not in experts],
                                        weight_block_size=(128, 128))
    model_free_ptq(str(src), str(tmp_path / "ref"), scheme=scheme, ignore=[], max_workers=1, converter=converter)
    convert(src, tmp_path / "ours", load_recipe("deepseek-v3-w4a16-g32", {}))
    ref, ours = read_all(tmp_path / "ref"), read_all(tmp_path / "ours")
    packed = [n for n in ref if n.endswith((".weight_packed", ".weight_scale"))]
    assert len(packed) == 2 * 4 * 16 * 3  # 4 MoE layers (3 + MTP) x 16 experts x 3 projections
    for n in packed:
        assert ours[n].dtype == ref[n].dtype and torch.equal(ours[n], ref[n]), n
    assert json.loads((tmp_path / "ours" / "config.json").read_text())["quantization_config"]["format"] == \
        json.loads((tmp_path / "ref" / "config.json").read_text())["quantization_config"]["format"]


def test_pack_roundtrip_and_error_bound():
    w = torch.randn(64, 128)
    q, scale = quantize_rtn(w, 32, torch.float32)
    assert q.min() >= -8 and q.max() <= 7
    assert torch.equal(unpack_int4(pack_int4(q, scale).weight_packed, (64, 128)), q)
    err = (dequantize_group(q, scale, 32) - w).abs()
    assert (err <= scale.repeat_interleave(32, 1) / 2 + 1e-6).all()


def test_mse_scale_search_never_worse_than_minmax():
    w = torch.randn(128, 256) * (1 + 10 * (torch.rand(128, 256) < 0.01))
    rtn_q, rtn_s = quantize_rtn(w, 32, torch.float32)
    rtn_err = (dequantize_group(rtn_q, rtn_s, 32) - w).pow(2).sum()
    from quantkit.quant.int4 import quantize_group

    s = mse_group_scales(w, 32, torch.float32)
    mse_err = (dequantize_group(quantize_group(w, s, 32, torch.float32), s, 32) - w).pow(2).sum()
    assert mse_err < rtn_err * 0.97
