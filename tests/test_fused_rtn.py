"""The fused CPU RTN kernels and the device-generic torch path give the same bytes as each other and as
compressed-tensors (its compressor on BF16 values; llm-compressor's model_free_ptq end to end is in
test_int4_parity.py), NaN/Inf/overflow are refused, and `--device` is plumbed through the converter."""

from __future__ import annotations

import pytest
import torch
from checkpoint_refs import read_all

from quantkit.checkpoint.source import open_source
from quantkit.convert import worker as W
from quantkit.convert.pipeline import convert
from quantkit.quant import fused
from quantkit.quant.int4 import fp8_block_to_float32, pack_int4, pack_nibbles, quantize_rtn, unpack_nibbles
from quantkit.quant.recipe import Recipe


def _fp8_weight(rows: int, cols: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 values over a wide exponent range (subnormals included), one zero group, random block scales."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * torch.logspace(-4, 2.6, rows).unsqueeze(1)
    raw = w.clamp(-448, 448).to(torch.float8_e4m3fn)
    raw.view(torch.uint8)[1, :128] = 0
    scale = torch.rand(-(-rows // 128), -(-cols // 128), generator=g) * 1e-2 + 1e-5
    return raw, scale


def _ct_reference(w_bf16: torch.Tensor, group_size: int) -> dict[str, torch.Tensor]:
    from compressed_tensors.compressors.pack_quantized import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=group_size)
    grouped = w_bf16.unflatten(-1, (-1, group_size))
    scale, _ = calculate_qparams(grouped.amin(-1), grouped.amax(-1), args)
    return PackedQuantizationCompressor.compress({"weight": w_bf16, "weight_scale": scale},
                                                 QuantizationScheme(targets=["Linear"], weights=args))


@pytest.mark.parametrize(("rows", "cols"), [(256, 384), (576, 256), (72, 160)])  # whole and partial blocks
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_fused_fp8_and_bf16_match_torch_path_and_compressed_tensors(rows, cols, group_size):
    if cols % group_size:
        pytest.skip("group does not divide in_features")
    raw, scale = _fp8_weight(rows, cols, rows + group_size)
    w = fp8_block_to_float32(raw, scale, (128, 128))
    torch_path = pack_int4(*quantize_rtn(w, group_size))
    packed, scales, bad = fused.rtn_fp8_block(raw, scale, (128, 128), group_size)
    assert bad == 0
    assert torch.equal(packed, torch_path.weight_packed) and torch.equal(scales, torch_path.weight_scale)
    reference = _ct_reference(w.to(torch.bfloat16), group_size)
    assert torch.equal(packed, reference["weight_packed"]) and torch.equal(scales, reference["weight_scale"])
    packed16, scales16, bad16 = fused.rtn_bf16(w.to(torch.bfloat16), group_size)
    assert bad16 == 0 and torch.equal(packed16, packed) and torch.equal(scales16, scales)
    dequant, bad = fused.dequant_fp8_block_bf16(raw, scale, (128, 128))
    assert bad == 0 and torch.equal(dequant, w.to(torch.bfloat16))


def test_fused_kernels_count_nan_inf_and_bf16_overflow():
    raw, scale = _fp8_weight(128, 256, 7)
    raw.view(torch.uint8)[5, 9] = 0x7F  # e4m3fn NaN
    assert fused.rtn_fp8_block(raw, scale, (128, 128), 32)[2] >= 1
    assert fused.dequant_fp8_block_bf16(raw, scale, (128, 128))[1] >= 1
    raw, _ = _fp8_weight(128, 256, 8)
    huge = torch.full((1, 2), 3.40e38 / 448)  # 448 x huge is finite in fp32 but rounds to Inf in BF16
    assert fused.rtn_fp8_block(raw, huge, (128, 128), 32)[2] > 0
    w = torch.randn(64, 128).to(torch.bfloat16)
    assert fused.rtn_bf16(w, 32)[2] == 0
    w[3, 4], w[10, 100] = float("inf"), float("nan")
    assert fused.rtn_bf16(w, 32)[2] == 2
    assert fused.count_nonfinite(w) == 2 and fused.count_nonfinite(w.half()) == 2
    assert fused.count_nonfinite(w.float()) == 2


def test_unpack_nibbles_inverts_packing_like_compressed_tensors():
    from compressed_tensors.compressors.pack_quantized import unpack_from_int32

    q = torch.randint(-8, 8, (48, 256), dtype=torch.int8, generator=torch.Generator().manual_seed(3))
    packed = pack_nibbles(q)
    assert torch.equal(unpack_nibbles(packed), q)
    assert torch.equal(unpack_from_int32(packed, num_bits=4, shape=torch.Size(q.shape)), q)


def test_torch_device_path_writes_the_same_bytes_as_the_fused_path(ckpt_factory):
    """What `--device cuda` runs (torch ops, FP8 decoded by torch's own cast), exercised on the CPU."""
    src = ckpt_factory("glm_moe_dsa", "fp8")
    source, recipe = open_source(src), Recipe()
    cpu = torch.device("cpu")
    experts = [t for n, t in source.logical.items() if ".mlp.experts." in n and t.fmt == "fp8_block"]
    assert experts
    for t in experts:
        assert W._fused_ok(source, t, cpu)
        a = W.quantize_rtn_tensor(source, t, recipe, cpu)
        b = W._rtn_torch(source, t, recipe, cpu)
        assert torch.equal(a.weight_packed, b.weight_packed) and torch.equal(a.weight_scale, b.weight_scale), t.name
        assert a.weight_shape.tolist() == b.weight_shape.tolist() == list(t.shape)


def test_whole_conversion_same_bytes_without_fused_kernels(ckpt_factory, tmp_path, monkeypatch):
    src = ckpt_factory("glm_moe_dsa", "fp8")
    convert(src, tmp_path / "fused", Recipe(), device="cpu")
    monkeypatch.setattr(fused, "available", lambda: False)  # as on a machine the kernels do not support
    convert(src, tmp_path / "torch", Recipe())
    a, b = read_all(tmp_path / "fused"), read_all(tmp_path / "torch")
    assert a.keys() == b.keys() and any(k.endswith(".weight_packed") for k in a)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def test_device_option_refuses_unavailable_cuda(cli, ckpt_factory, tmp_path):
    src = ckpt_factory("glm_moe_dsa", "fp8")
    code, _, err = cli("convert", str(src), str(tmp_path / "o"), "--device", "tpu", "--quiet")
    assert code == 2 and "--device" in err and "Traceback" not in err
    if not torch.cuda.is_available():
        code, _, err = cli("convert", str(src), str(tmp_path / "o"), "--device", "cuda", "--quiet")
        assert code == 2 and "CUDA is not available" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("kv_cache", [False, True])
@pytest.mark.parametrize("group_size", [32, 128])
def test_quantization_config_is_compressed_tensors_serialization(group_size, kv_cache):
    """The literal config block equals what compressed-tensors' own models serialize (and parses back)."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme

    from quantkit.checkpoint.qconfig import FP8_KV_CACHE_SCHEME, build_quantization_config

    ignore = ["lm_head", "re:.*self_attn.*"]
    weights = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=group_size,
                               dynamic=False, actorder=None, observer="minmax")
    reference = QuantizationConfig(
        config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=weights)},
        quant_method="compressed-tensors", format="pack-quantized", quantization_status="compressed", ignore=ignore,
        kv_cache_scheme=QuantizationArgs(**FP8_KV_CACHE_SCHEME) if kv_cache else None,
    ).model_dump(mode="json")
    ours = build_quantization_config(group_size, ignore, kv_cache=kv_cache)
    assert ours == reference
    assert QuantizationConfig.model_validate(ours).model_dump(mode="json") == reference


def test_device_auto_is_cuda_only_when_a_gpu_is_present(monkeypatch):
    from quantkit.convert.pipeline import check_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert check_device("auto") == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert check_device("auto") == "cuda"
