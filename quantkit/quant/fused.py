"""Fused single-pass RTN kernels for the CPU converter (numba), bit-identical to `quantkit.quant.int4`.

One pass per row of a weight does what the torch path does in six full-size passes: decode the stored
values (FP8-E4M3 through a 256-entry table times the 128x128 block scale, or BF16 bits), round them to
BF16 exactly as torch does (round to nearest even), take each group's absmax, round `absmax / 7.5` to
BF16 (zero -> BF16 eps), round `w / scale` to BF16, round half to even, clamp to [-8, 7] and pack two
offset-binary nibbles per byte (compressed-tensors' `pack_to_int32` layout on a little-endian machine).
Every arithmetic step is a single IEEE fp32 operation followed by the same BF16 rounding torch applies,
so the output equals the torch path's bit for bit (tests compare the two and compressed-tensors).

Non-finite values are counted, not propagated: callers raise a one-line error when the count is not 0.
Only the BF16 model dtype is fused; FP16 models and other devices use the torch path.
"""

from __future__ import annotations

import sys

import numpy as np
import torch
from numba import njit

__all__ = ["available", "count_nonfinite", "dequant_fp8_block_bf16", "rtn_bf16", "rtn_fp8_block"]

_FP8_TABLE = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float32).numpy()
_BF16_EPS = float(torch.finfo(torch.bfloat16).eps)


def available() -> bool:
    """The fused kernels assume little-endian byte order (the packed int32 words are byte-packed)."""
    return sys.byteorder == "little"


@njit(cache=True, nogil=True, inline="always")
def _round_bf16_inplace(bits: np.ndarray, n: int) -> None:
    """fp32 bit patterns -> the fp32 bit patterns of their BF16 rounding (round to nearest even, as torch).

    Branch-free so that it vectorises; NaN inputs may come out as other patterns, which is fine: callers
    count non-finite values before (NaN, Inf) and after (overflow to Inf) rounding and refuse the tensor.
    """
    for i in range(n):
        b = bits[i]
        bits[i] = (b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000)


@njit(cache=True, nogil=True, inline="always")
def _count_nonfinite32(bits: np.ndarray, n: int) -> int:
    bad = 0
    for i in range(n):
        bad += (bits[i] & np.uint32(0x7F800000)) == np.uint32(0x7F800000)
    return bad


@njit(cache=True, nogil=True, inline="always")
def _decode_fp8_row(raw_row: np.ndarray, srow: np.ndarray, bw: int, table: np.ndarray, row: np.ndarray) -> None:
    cols = raw_row.shape[0]
    for cb in range(srow.shape[0]):
        s = srow[cb]
        for c in range(cb * bw, min(cols, (cb + 1) * bw)):
            row[c] = table[raw_row[c]] * s


@njit(cache=True, nogil=True, fastmath={"reassoc", "nnan", "ninf", "nsz"})
def _group_absmax(row: np.ndarray, groups: int, gs: int, out: np.ndarray) -> None:
    """Per-group max |x| of a finite row. Only max is reassociated here (exact in any order); the row's
    non-finite values were counted before, and such a tensor is refused whatever this returns."""
    for g in range(groups):
        m = np.float32(0.0)
        for j in range(g * gs, (g + 1) * gs):
            m = max(m, abs(row[j]))
        out[g] = m


@njit(cache=True, nogil=True)
def _quantize_row(row: np.ndarray, groups: int, gs: int, eps: np.float32,
                  packed_row: np.ndarray, scale_row: np.ndarray, work: np.ndarray) -> None:
    """RTN of one BF16-valued (finite) fp32 row into packed nibbles and BF16 scale bits.

    Row-wide stages (scales, quotients, BF16 rounding, round/clamp, packing) so that each loop vectorises.
    `work` is scratch: `cols` quotients then `groups` scales.
    """
    cols = row.shape[0]
    quot, scale = work[:cols], work[cols:cols + groups]
    _group_absmax(row, groups, gs, scale)
    half_range = np.float32(7.5)
    for g in range(groups):
        scale[g] = scale[g] / half_range
    sbits = scale.view(np.uint32)
    _round_bf16_inplace(sbits, groups)
    for g in range(groups):
        if scale[g] == 0:
            scale[g] = eps
        scale_row[g] = np.uint16(sbits[g] >> np.uint32(16))
    for g in range(groups):
        s = scale[g]
        for j in range(g * gs, (g + 1) * gs):
            quot[j] = row[j] / s
    _round_bf16_inplace(quot.view(np.uint32), cols)
    for c in range(cols):
        quot[c] = min(max(np.rint(quot[c]), np.float32(-8.0)), np.float32(7.0)) + np.float32(8.0)
    for k in range(cols // 2):
        packed_row[k] = np.uint8(quot[2 * k]) | (np.uint8(quot[2 * k + 1]) << np.uint8(4))


@njit(cache=True, nogil=True)
def _rtn_fp8_kernel(raw: np.ndarray, scale_inv: np.ndarray, bh: int, bw: int, gs: int, table: np.ndarray,
                    eps: np.float32, packed: np.ndarray, scales: np.ndarray) -> int:
    rows, cols = raw.shape
    row = np.empty(cols, dtype=np.float32)
    rbits = row.view(np.uint32)
    work = np.empty(cols + cols // gs, dtype=np.float32)
    bad = 0
    for r in range(rows):
        _decode_fp8_row(raw[r], scale_inv[r // bh], bw, table, row)
        bad += _count_nonfinite32(rbits, cols)
        _round_bf16_inplace(rbits, cols)
        bad += _count_nonfinite32(rbits, cols)  # values that overflow BF16 count too
        _quantize_row(row, cols // gs, gs, eps, packed[r], scales[r], work)
    return bad


@njit(cache=True, nogil=True)
def _rtn_bf16_kernel(bits16: np.ndarray, gs: int, eps: np.float32, packed: np.ndarray, scales: np.ndarray) -> int:
    rows, cols = bits16.shape
    row = np.empty(cols, dtype=np.float32)
    rbits = row.view(np.uint32)
    work = np.empty(cols + cols // gs, dtype=np.float32)
    bad = 0
    for r in range(rows):
        for c in range(cols):
            rbits[c] = np.uint32(bits16[r, c]) << np.uint32(16)
        bad += _count_nonfinite32(rbits, cols)
        _quantize_row(row, cols // gs, gs, eps, packed[r], scales[r], work)
    return bad


@njit(cache=True, nogil=True)
def _dequant_fp8_kernel(raw: np.ndarray, scale_inv: np.ndarray, bh: int, bw: int, table: np.ndarray,
                        out: np.ndarray) -> int:
    rows, cols = raw.shape
    row = np.empty(cols, dtype=np.float32)
    rbits = row.view(np.uint32)
    bad = 0
    for r in range(rows):
        _decode_fp8_row(raw[r], scale_inv[r // bh], bw, table, row)
        bad += _count_nonfinite32(rbits, cols)
        _round_bf16_inplace(rbits, cols)
        bad += _count_nonfinite32(rbits, cols)
        for c in range(cols):
            out[r, c] = np.uint16(rbits[c] >> np.uint32(16))
    return bad


@njit(cache=True, nogil=True)
def _nonfinite16_kernel(bits: np.ndarray, exp_mask: np.uint16) -> int:
    bad = 0
    for i in range(bits.size):
        if (bits[i] & exp_mask) == exp_mask:
            bad += 1
    return bad


def _outputs(rows: int, cols: int, gs: int) -> tuple[np.ndarray, np.ndarray]:
    return np.empty((rows, cols // 2), dtype=np.uint8), np.empty((rows, cols // gs), dtype=np.uint16)


def _as_torch(packed: np.ndarray, scales: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.from_numpy(packed).view(torch.int32), torch.from_numpy(scales).view(torch.bfloat16)


def rtn_fp8_block(raw: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], group_size: int
                  ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """RTN INT4 of an FP8-block weight: (packed int32 `[out, in/8]`, bf16 scales `[out, in/group]`, non-finite
    count). `raw` is the stored float8_e4m3fn (or its bytes), `scale_inv` the fp32 per-block scales."""
    u8 = raw.contiguous().view(torch.uint8).numpy()
    packed, scales = _outputs(u8.shape[0], u8.shape[1], group_size)
    bad = _rtn_fp8_kernel(u8, scale_inv.to(torch.float32).contiguous().numpy(), block[0], block[1], group_size,
                          _FP8_TABLE, np.float32(_BF16_EPS), packed, scales)
    return (*_as_torch(packed, scales), int(bad))


def rtn_bf16(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """RTN INT4 of a BF16 weight: (packed int32, bf16 scales, non-finite count)."""
    bits = weight.contiguous().view(torch.uint16).numpy()
    packed, scales = _outputs(bits.shape[0], bits.shape[1], group_size)
    bad = _rtn_bf16_kernel(bits, group_size, np.float32(_BF16_EPS), packed, scales)
    return (*_as_torch(packed, scales), int(bad))


def dequant_fp8_block_bf16(raw: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]
                           ) -> tuple[torch.Tensor, int]:
    """An FP8-block weight as BF16 (`fp8 * scale_inv` in fp32, rounded to nearest even) and its non-finite count."""
    u8 = raw.contiguous().view(torch.uint8).numpy()
    out = np.empty(u8.shape, dtype=np.uint16)
    bad = _dequant_fp8_kernel(u8, scale_inv.to(torch.float32).contiguous().numpy(), block[0], block[1],
                              _FP8_TABLE, out)
    return torch.from_numpy(out).view(torch.bfloat16), int(bad)


def count_nonfinite(t: torch.Tensor) -> int:
    """NaN + Inf values in a floating tensor (a bit test for 16-bit dtypes, no full-size float copy)."""
    if t.dtype in (torch.bfloat16, torch.float16):
        mask = 0x7F80 if t.dtype == torch.bfloat16 else 0x7C00
        return int(_nonfinite16_kernel(t.contiguous().view(torch.uint16).numpy().reshape(-1), np.uint16(mask)))
    return int((~torch.isfinite(t)).sum())
