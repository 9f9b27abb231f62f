"""The element-wise half of FP4 quantization as one numba pass: divide by the group scale, clamp to +-6, round
to E2M1 (CT's thresholds), sign bit, pack two codes per byte (low nibble = even column).

`quantkit.quant.fp4` computes the (small) scale tensors with torch and hands the full-size work here on the
CPU; the result is the torch path's bytes exactly (the same single IEEE fp32 division per element, and for
MXFP4 the same BF16 rounding of the quotient); tests compare both and compressed-tensors.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit

__all__ = ["e2m1_pack", "group_amax"]


@njit(cache=True, nogil=True, fastmath={"nnan", "ninf"})  # finite inputs (callers refuse NaN/Inf): no effect
def _kernel(x: np.ndarray, scale: np.ndarray, group: int, round_bf16: bool, out: np.ndarray) -> None:
    """Row by row, in stages that vectorise: quotients, (BF16 rounding), codes, packing."""
    rows, cols = x.shape
    q = np.empty(cols, dtype=np.float32)
    qbits = q.view(np.uint32)
    codes = np.empty(cols, dtype=np.uint8)
    for r in range(rows):
        for g in range(cols // group):
            s = scale[r, g]
            for j in range(g * group, (g + 1) * group):
                q[j] = x[r, j] / s
        if round_bf16:
            for c in range(cols):
                b = qbits[c]
                qbits[c] = (b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000)
        for c in range(cols):
            v = min(max(q[c], np.float32(-6.0)), np.float32(6.0))
            a = abs(v)
            code = (np.uint8(a > np.float32(0.25)) + np.uint8(a >= np.float32(0.75)) + np.uint8(a > np.float32(1.25))
                    + np.uint8(a >= np.float32(1.75)) + np.uint8(a > np.float32(2.5)) + np.uint8(a >= np.float32(3.5))
                    + np.uint8(a > np.float32(5.0)))
            codes[c] = code | (np.uint8(v < np.float32(0.0)) << np.uint8(3))
        for k in range(cols // 2):
            out[r, k] = codes[2 * k] | (codes[2 * k + 1] << np.uint8(4))


@njit(cache=True, nogil=True, fastmath={"reassoc", "nnan", "ninf", "nsz"})
def _group_amax_kernel(x: np.ndarray, group: int, out: np.ndarray) -> None:
    """max |x| per group of a finite fp32 array (max is exact in any order)."""
    rows, cols = x.shape
    for r in range(rows):
        for g in range(cols // group):
            m = np.float32(0.0)
            for j in range(g * group, (g + 1) * group):
                m = max(m, abs(x[r, j]))
            out[r, g] = m


def group_amax(x: torch.Tensor, group: int) -> torch.Tensor:
    """fp32 [rows, cols/group]: max |x| per group of a finite 2-D tensor (exact)."""
    xs = x.to(torch.float32).contiguous().numpy()
    out = np.empty((xs.shape[0], xs.shape[1] // group), dtype=np.float32)
    _group_amax_kernel(xs, group, out)
    return torch.from_numpy(out)


def e2m1_pack(x: torch.Tensor, scale: torch.Tensor, group: int, round_bf16: bool) -> torch.Tensor:
    """uint8 [rows, cols/2]: E2M1 codes of fp32 `x / scale` (per-group fp32 `scale` [rows, cols/group]),
    the quotient rounded to BF16 first when `round_bf16`."""
    xs = x.to(torch.float32).contiguous().numpy()
    out = np.empty((xs.shape[0], xs.shape[1] // 2), dtype=np.uint8)
    _kernel(xs, scale.to(torch.float32).contiguous().numpy(), group, round_bf16, out)
    return torch.from_numpy(out)
