"""Triton FP8 (e4m3fn) KV-cache quantize / dequantize with one per-tensor fp32 scale.

Quantize stores `fp8(clamp(x * (1/scale), -448, 448))`, rounding to nearest even, which is what SGLang and
vLLM write into an FP8 cache; dequantize reads `fp8 * scale`. Rows are the cache's last dimension: for
MLA (DeepSeek V3 / Kimi) one 576-wide row per token and layer (512 latent + 64 rope values, one scale
for both, as the row serves as K and V). A program handles BLOCK_R rows padded to the next power of two
(1024 for 576, masked). With `slot_mapping` the quantized rows are scattered into a cache at those slots,
the way a serving engine writes new tokens into its paged pool.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quantkit.kernels.reference import FP8_E4M3_MAX
from quantkit.kernels.triton_w4a16 import check_device

__all__ = ["triton_fp8_kv_quant", "triton_fp8_kv_dequant"]


@triton.jit
def _round_to_e4m3_grid(y):
    """Round fp32 `y` (already within +-448) to the nearest e4m3 value, ties to even, staying in fp32.

    Adding then subtracting `2^(e+20)` (e = the exponent of |y|, at least -6, the smallest normal e4m3
    exponent) makes the fp32 adder round at the e4m3 spacing `2^(e-3)`, subnormals included. The cast that
    follows is then exact everywhere, including Triton's interpreter, whose own fp32->fp8 rounding
    does not carry into the exponent (it turns 31.9 into 16).
    """
    bits = y.to(tl.int32, bitcast=True)
    exp_bits = (bits >> 23) & 0xFF
    magic = ((tl.maximum(exp_bits, 127 - 6) + 20) << 23).to(tl.float32, bitcast=True)
    mag = (tl.abs(y) + magic) - magic
    return (mag.to(tl.int32, bitcast=True) | (bits & -2147483648)).to(tl.float32, bitcast=True)


@triton.jit
def _fp8_quant_kernel(x_ptr, out_ptr, inv_scale_ptr, slot_ptr, n_rows, D, stride_x, stride_o,
                      FP8_MAX: tl.constexpr, HAS_SLOTS: tl.constexpr,
                      BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """Quantize BLOCK_R rows; row r goes to cache row slot[r] (or r)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_D)
    row_mask = rows < n_rows
    mask = row_mask[:, None] & (cols < D)[None, :]
    inv_scale = tl.load(inv_scale_ptr)  # 1/scale from the host: Triton's fp32 division is approximate
    x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    y = _round_to_e4m3_grid(tl.minimum(tl.maximum(x.to(tl.float32) * inv_scale, -FP8_MAX), FP8_MAX))
    dst = rows.to(tl.int64)
    if HAS_SLOTS:
        dst = tl.load(slot_ptr + rows, mask=row_mask, other=0).to(tl.int64)
    tl.store(out_ptr + dst[:, None] * stride_o + cols[None, :], y.to(tl.float8e4nv), mask=mask)


@triton.jit
def _fp8_dequant_kernel(q_ptr, out_ptr, scale_ptr, n_rows, D, stride_q, stride_o,
                        BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """Dequantize BLOCK_R rows: fp8 * scale, stored in out's dtype."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_D)
    mask = (rows < n_rows)[:, None] & (cols < D)[None, :]
    scale = tl.load(scale_ptr).to(tl.float32)
    q = tl.load(q_ptr + rows.to(tl.int64)[:, None] * stride_q + cols[None, :], mask=mask, other=0.0)
    y = q.to(tl.float32) * scale
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_o + cols[None, :],
             y.to(out_ptr.dtype.element_ty), mask=mask)


def _rows_per_program(d: int, device: torch.device) -> int:
    """About 4K elements per program on GPU; a few large programs in the interpreter."""
    block_d = triton.next_power_of_2(d)
    return max(1, (16384 if device.type == "cpu" else 4096) // block_d)


def _scale_tensor(scale: torch.Tensor | float, device: torch.device) -> torch.Tensor:
    return torch.as_tensor(scale, dtype=torch.float32, device=device).reshape(1)


def triton_fp8_kv_quant(
    x: torch.Tensor,
    scale: torch.Tensor | float,
    out: torch.Tensor | None = None,
    slot_mapping: torch.Tensor | None = None,
) -> torch.Tensor:
    """Quantize `[..., D]` rows to float8_e4m3fn; scatter into `out` rows at `slot_mapping` when given."""
    check_device(x)
    d = x.shape[-1]
    x2 = x.reshape(-1, d)
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    if out is None:
        if slot_mapping is not None:
            raise ValueError("slot_mapping needs the cache tensor to write into (out=)")
        out = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    if out.dtype != torch.float8_e4m3fn or out.shape[-1] != d:
        raise ValueError(f"out must be float8_e4m3fn with last dim {d}, got {out.dtype} {tuple(out.shape)}")
    out2 = out.view(-1, d)
    n_rows = x2.shape[0]
    rows = _rows_per_program(d, x.device)
    slots = slot_mapping.reshape(-1).contiguous() if slot_mapping is not None else out2
    _fp8_quant_kernel[(triton.cdiv(n_rows, rows),)](
        x2, out2, 1.0 / _scale_tensor(scale, x.device), slots, n_rows, d, x2.stride(0), out2.stride(0),
        FP8_MAX=FP8_E4M3_MAX, HAS_SLOTS=slot_mapping is not None, BLOCK_R=rows, BLOCK_D=triton.next_power_of_2(d),
    )
    return out


def triton_fp8_kv_dequant(
    q: torch.Tensor, scale: torch.Tensor | float, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """`fp8 * scale` for `[..., D]` float8_e4m3fn rows, returned in `dtype`."""
    check_device(q)
    d = q.shape[-1]
    q2 = q.reshape(-1, d)
    q2 = q2 if q2.stride(-1) == 1 else q2.contiguous()
    out = torch.empty(q.shape, dtype=dtype, device=q.device)
    out2 = out.view(-1, d)
    rows = _rows_per_program(d, q.device)
    _fp8_dequant_kernel[(triton.cdiv(q2.shape[0], rows),)](
        q2, out2, _scale_tensor(scale, q.device), q2.shape[0], d, q2.stride(0), out2.stride(0),
        BLOCK_R=rows, BLOCK_D=triton.next_power_of_2(d),
    )
    return out
