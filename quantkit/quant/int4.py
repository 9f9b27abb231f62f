"""Symmetric group-wise INT4 and INT8 (W4A16 / W8A16) math, bit-compatible with compressed-tensors.

compressed-tensors computes the scale and the quantized values in the weight's own dtype (bf16 for
BF16 and FP8-block sources): `scale = absmax / 7.5`, `q = clamp(round(w / scale), -8, 7)` (INT8:
`absmax / 127.5`, `[-128, 127]`; the functions take `bits`, 4 by default), a zero
scale becomes the dtype's eps. bf16 arithmetic is slow on CPUs without AVX512-BF16, so we compute in
fp32 and round the two intermediates (scale and w/scale) to the model dtype exactly where torch's bf16
ops would: the result is bit-identical and ~4x faster. Packing follows compressed-tensors' own
`pack_to_int32` (offset-binary nibbles, lowest first, along the input dim); for 4 bits a byte-wise
equivalent is ~5x faster and is tested against it; 8 bits are offset-binary bytes, four to a word.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Literal

import torch

from quantkit.core.errors import QuantkitError

__all__ = [
    "PackedInt4",
    "QMAX",
    "QMIN",
    "check_group_size",
    "dequantize_group",
    "dequantize_packed",
    "fp8_block_to_float32",
    "group_scales",
    "mse_group_scales",
    "pack_int",
    "pack_int4",
    "pack_int8",
    "qrange",
    "pack_nibbles",
    "quantize_group",
    "unpack_nibbles",
    "quantize_rtn",
    "unpack_int",
    "unpack_int4",
    "unpack_int8",
]

QMIN, QMAX = -8, 7
IntBits = Literal[4, 8]


def qrange(bits: int) -> tuple[int, int, float]:
    """(qmin, qmax, divisor) of symmetric `bits`-bit codes: the divisor is compressed-tensors' `(qmax - qmin) / 2`."""
    qmin, qmax = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    return qmin, qmax, (qmax - qmin) / 2


@dataclass
class PackedInt4:
    """The three on-disk tensors of one quantized Linear (compressed-tensors pack-quantized, INT4 or INT8)."""

    weight_packed: torch.Tensor  # int32 [out, in/8] (INT8: [out, in/4])
    weight_scale: torch.Tensor  # model dtype [out, in/group]
    weight_shape: torch.Tensor  # int64 [2]

    def tensors(self, module: str) -> dict[str, torch.Tensor]:
        return {
            f"{module}.weight_packed": self.weight_packed,
            f"{module}.weight_scale": self.weight_scale,
            f"{module}.weight_shape": self.weight_shape,
        }


def check_group_size(shape: tuple[int, ...], group_size: int, name: str) -> None:
    """Raise a one-line error unless `name` is a 2-D weight whose input dim splits into whole groups."""
    if len(shape) != 2:
        raise QuantkitError(f"{name}: expected a 2-D Linear weight, got shape {list(shape)}")
    if shape[1] % group_size or shape[1] % 8:
        raise QuantkitError(
            f"{name}: in_features {shape[1]} is not a multiple of group size {group_size} (and of 8)"
        )


def _round_to(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Round fp32 values to `dtype` and back: what a torch op in `dtype` would have stored."""
    return x if dtype == torch.float32 else x.to(dtype).to(torch.float32)


def group_scales(w: torch.Tensor, group_size: int, scale_dtype: torch.dtype = torch.bfloat16,
                 bits: int = 4) -> torch.Tensor:
    """Per-group symmetric scales `[out, in/group]` (fp32 values representable in `scale_dtype`).

    NaN and Inf in a group propagate into its scale, so callers check the (small) scale for finiteness.
    """
    grouped = w.float().unflatten(-1, (-1, group_size))
    absmax = torch.maximum(grouped.amax(dim=-1), grouped.amin(dim=-1).neg_())  # no full-size abs() copy
    scale = _round_to(absmax / qrange(bits)[2], scale_dtype)
    eps = torch.finfo(scale_dtype).eps
    return torch.where(scale == 0, torch.full_like(scale, eps), scale)


def quantize_group(
    w: torch.Tensor, scale: torch.Tensor, group_size: int, scale_dtype: torch.dtype = torch.bfloat16, bits: int = 4
) -> torch.Tensor:
    """int8 codes in [-8, 7] (INT8: [-128, 127]) of `w` `[out, in]` with per-group `scale` `[out, in/group]`."""
    qmin, qmax, _ = qrange(bits)
    scaled = w.float().unflatten(-1, (-1, group_size)) / scale.float().unsqueeze(-1)
    if scale_dtype != torch.float32:
        scaled = scaled.to(scale_dtype)  # round() and clamp() are exact on these values, so stay in scale_dtype
    return scaled.round_().clamp_(qmin, qmax).flatten(-2).to(torch.int8)


def mse_group_scales(
    w: torch.Tensor,
    group_size: int,
    scale_dtype: torch.dtype = torch.bfloat16,
    grid: int = 20,
    min_ratio: float = 0.7,
    col_weight: torch.Tensor | None = None,
    bits: int = 4,
) -> torch.Tensor:
    """Per-group scales that minimise the squared quantization error over clipping ratios in [min_ratio, 1].

    Clipping a few outliers usually lowers the error of the other 31 values in a group; RTN's absmax
    scale is ratio 1.0, which is always among the candidates, so this is never worse than `group_scales`.
    `col_weight [in]` weights each input column's error (GPTQ passes `diag(H)`, the columns' input energy).
    """
    grouped = w.float().unflatten(-1, (-1, group_size))
    cw = None if col_weight is None else col_weight.float().to(w.device).unflatten(-1, (-1, group_size))
    qmin, qmax, _ = qrange(bits)
    base = group_scales(w, group_size, scale_dtype, bits)
    best_scale, best_err = base, None
    for ratio in torch.linspace(1.0, min_ratio, grid).tolist():
        scale = _round_to(base * ratio, scale_dtype).clamp_min(torch.finfo(scale_dtype).eps)
        q = _round_to(grouped / scale.unsqueeze(-1), scale_dtype).round_().clamp_(qmin, qmax)
        diff = (q * scale.unsqueeze(-1) - grouped).pow_(2)
        err = (diff if cw is None else diff.mul_(cw)).sum(-1)
        if best_err is None:
            best_err = err
            continue
        better = err < best_err
        best_scale = torch.where(better, scale, best_scale)
        best_err = torch.where(better, err, best_err)
    return best_scale


def quantize_rtn(
    w: torch.Tensor, group_size: int, scale_dtype: torch.dtype = torch.bfloat16, bits: int = 4
) -> tuple[torch.Tensor, torch.Tensor]:
    """Round-to-nearest INT4 / INT8: (int8 codes `[out, in]`, scales `[out, in/group]` in `scale_dtype`).

    `w` is first rounded to `scale_dtype`: the value a checkpoint in that dtype would hold.
    """
    w = _round_to(w.float(), scale_dtype)
    scale = group_scales(w, group_size, scale_dtype, bits)
    return quantize_group(w, scale, group_size, scale_dtype, bits), scale.to(scale_dtype)


def dequantize_group(q: torch.Tensor, scale: torch.Tensor, group_size: int) -> torch.Tensor:
    """fp32 weight `q * scale`, group g covering input columns [g*gs, (g+1)*gs)."""
    grouped = q.float().unflatten(-1, (-1, group_size)) * scale.float().unsqueeze(-1)
    return grouped.flatten(-2)


def fp8_block_to_float32(raw: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """`fp8 * scale_inv` per `block` (DeepSeek-style FP8-block weights) in fp32, on the tensors' device.

    Exact: every e4m3 value is an fp32 value, and the product is one fp32 rounding, as in the CPU reader.
    """
    weight = raw.view(torch.float8_e4m3fn).to(torch.float32)
    scale_inv = scale_inv.to(weight.device, torch.float32)
    (bh, bw), (rows, cols) = block, weight.shape
    if rows % bh == 0 and cols % bw == 0:  # broadcast the block scale, no full-size scale matrix
        return weight.view(rows // bh, bh, cols // bw, bw).mul_(scale_inv[:, None, :, None]).view(rows, cols)
    full = scale_inv.repeat_interleave(bh, 0)[:rows].repeat_interleave(bw, 1)[:, :cols]
    return weight.mul_(full)


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' 4-bit `pack_to_int32` layout, ~5x faster: two nibbles per byte, four bytes per word.

    Element 8k+i sits in bits [4i, 4i+4) of word k; on a little-endian machine that is byte-wise packing
    (low nibble first) viewed as int32. Elsewhere we defer to compressed-tensors. Tests check both agree.
    """
    if sys.byteorder != "little" or q.shape[-1] % 8:
        from compressed_tensors.compressors.pack_quantized import pack_to_int32

        return pack_to_int32(q.to(torch.int8), num_bits=4)
    u = (q.to(torch.int8) + 8).view(torch.uint8)
    return (u[..., 0::2] | (u[..., 1::2] << 4)).contiguous().view(torch.int32)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """int8 codes `[out, in]` from `pack_nibbles`' int32 words `[out, in/8]` (any device, little-endian).

    Cheap enough to run on every calibration forward, so calibration can hold quantized experts packed.
    """
    if sys.byteorder != "little":
        raise NotImplementedError("unpack_nibbles: byte-wise layout assumes a little-endian machine")
    u = packed.contiguous().view(torch.uint8)
    codes = torch.stack(((u & 0xF), (u >> 4)), dim=-1).flatten(-2)
    return codes.view(torch.int8).sub_(8)


def pack_int4(q: torch.Tensor, scale: torch.Tensor) -> PackedInt4:
    """Pack int8 codes into compressed-tensors' int32 layout."""
    return PackedInt4(
        weight_packed=pack_nibbles(q),
        weight_scale=scale.contiguous(),
        weight_shape=torch.tensor(list(q.shape), dtype=torch.int64),
    )


def unpack_int4(packed: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """int8 codes `[out, in]` back from compressed-tensors' int32 layout (imported lazily: it pulls in
    transformers, ~200 MB per worker process)."""
    from compressed_tensors.compressors.pack_quantized import unpack_from_int32

    return unpack_from_int32(packed, num_bits=4, shape=torch.Size(shape))


def pack_int8(q: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' 8-bit `pack_to_int32` layout: offset-binary bytes (code + 128), element 4k+i in bits
    [8i, 8i+8) of word k — on a little-endian machine the bytes viewed as int32 (tested against CT)."""
    if sys.byteorder != "little" or q.shape[-1] % 4:
        from compressed_tensors.compressors.pack_quantized import pack_to_int32

        return pack_to_int32(q.to(torch.int8), num_bits=8)
    return (q.to(torch.int16) + 128).to(torch.uint8).contiguous().view(torch.int32)


def unpack_int8(packed: torch.Tensor) -> torch.Tensor:
    """int8 codes `[out, in]` from `pack_int8`'s int32 words `[out, in/4]` (little-endian)."""
    if sys.byteorder != "little":
        raise NotImplementedError("unpack_int8: byte-wise layout assumes a little-endian machine")
    return (packed.contiguous().view(torch.uint8).to(torch.int16) - 128).to(torch.int8)


def pack_int(q: torch.Tensor, scale: torch.Tensor, bits: IntBits = 4) -> PackedInt4:
    """Pack int8 codes of `bits` bits into compressed-tensors' int32 layout."""
    return PackedInt4(
        weight_packed=pack_nibbles(q) if bits == 4 else pack_int8(q),
        weight_scale=scale.contiguous(),
        weight_shape=torch.tensor(list(q.shape), dtype=torch.int64),
    )


def unpack_int(packed: torch.Tensor, bits: IntBits = 4) -> torch.Tensor:
    """int8 codes `[out, in]` from either packed layout (fast paths; see `pack_nibbles` / `pack_int8`)."""
    return unpack_nibbles(packed) if bits == 4 else unpack_int8(packed)


def dequantize_packed(packed: PackedInt4) -> torch.Tensor:
    """fp32 weight of a packed INT4 / INT8 result, its bits told by the packed width and its group by the scale's
    (any device; cheap enough per calibration forward)."""
    rows, cols = int(packed.weight_shape[0]), int(packed.weight_shape[1])
    bits = 32 * packed.weight_packed.shape[-1] // cols
    codes = unpack_int(packed.weight_packed, 4 if bits == 4 else 8)
    return dequantize_group(codes[:rows], packed.weight_scale, cols // packed.weight_scale.shape[-1])
