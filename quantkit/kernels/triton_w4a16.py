"""Triton W4A16 GEMM that reads the compressed-tensors `pack-quantized` layout as stored (no repack).

One kernel, two launch shapes chosen by `pick_config`:
- GEMV / split-K (M <= 16): the decode case, bound by weight bandwidth. M == 1 skips `tl.dot` and reduces
  `q * x` on the CUDA cores; M in 2..16 uses a 16-row `tl.dot`. The K range is split across programs
  (`SPLIT_K`, fp32 `atomic_add`) so a layer with few output tiles still fills every SM.
- tiled (M > 16): classic `BLOCK_M x BLOCK_N` output tiles, one program per tile, full K loop.

Inside the K loop a program loads `BLOCK_K / 8` int32 words per output row, unpacks the eight nibbles of
each word with shifts into `[BLOCK_N, BLOCK_K]`, and subtracts the offset 8. Scales are applied per group:
when a K block sits inside one group (BLOCK_K <= group_size) the scale multiplies the fp32 partial dot
afterwards (one multiply per output instead of per weight); otherwise the block is viewed as
`[BLOCK_N, BLOCK_K / group, group]` and each group slice is scaled. Accumulation is always fp32.

The interpreter (`TRITON_INTERPRET=1`) runs the same kernel on CPU tensors; there `tl.dot` on bf16 is
unreliable, so dot operands are upcast to fp32 (`DOT_DTYPE`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

__all__ = [
    "W4A16Config", "pick_config", "gpu_config", "triton_w4a16_linear", "interpreting", "dot_dtype_for",
    "dot_precision_for",
]


def interpreting() -> bool:
    """True when Triton runs kernels with its numpy interpreter (set before triton is imported)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def dot_dtype_for(x: torch.Tensor) -> tl.dtype:
    """Operand dtype for `tl.dot`: fp32 in the interpreter (bf16 dots are wrong there), else x's dtype."""
    if interpreting() or x.dtype == torch.float32:
        return tl.float32
    return tl.float16 if x.dtype == torch.float16 else tl.bfloat16


def dot_precision_for(x: torch.Tensor) -> str:
    """fp32 activations get exact ("ieee") dots; the GPU default for fp32 would be TF32 (10-bit mantissa)."""
    return "ieee" if x.dtype == torch.float32 or interpreting() else "tf32"


def check_device(x: torch.Tensor) -> None:
    """Triton needs a GPU tensor, or a CPU tensor with the interpreter switched on."""
    if x.device.type == "cpu" and not interpreting():
        raise ValueError("triton backend on CPU tensors needs TRITON_INTERPRET=1 set before triton is imported")


@dataclass(frozen=True)
class W4A16Config:
    """Launch shape of the W4A16 kernel; BLOCK_M == 1 selects the dot-free GEMV body."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1


def _split_k(n_tiles: int, k_blocks: int, sms: int) -> int:
    """Smallest power-of-two split that gives about two waves of programs, never more than the K blocks."""
    split = 1
    while n_tiles * split < 2 * sms and split * 2 <= k_blocks:
        split *= 2
    return split


def pick_config(m: int, n: int, k: int, group_size: int, device: torch.device) -> W4A16Config:
    """Heuristic launch shape by batch size (untuned: GPU tuning tables come with the GPU benchmark)."""
    if device.type == "cpu":  # interpreter: few, large programs (each program costs ~ms of numpy)
        block_m = 1 if m == 1 else min(max(16, triton.next_power_of_2(m)), 64)
        block_n = min(max(triton.next_power_of_2(n), 16), 128)
        return W4A16Config(block_m, block_n, min(max(triton.next_power_of_2(k), 32), 256))
    return gpu_config(m, n, k, group_size, _num_sms(device))


def gpu_config(m: int, n: int, k: int, group_size: int, sms: int) -> W4A16Config:
    """GPU launch shape: GEMV/split-K up to M = 16, tiles above; split-K fills ~2 waves of `sms`."""
    if m <= 16:
        block_m, block_n, block_k = (1, 32, 256) if m == 1 else (16, 64, 128)
        split = _split_k(triton.cdiv(n, block_n), triton.cdiv(k, block_k), sms)
        return W4A16Config(block_m, block_n, block_k, split, num_warps=4, num_stages=4)
    # (rows, cols, warps) per tile; 128x128 spills registers on sm_90 (aot_check), so 128x64 above M = 64
    block_m, block_n, warps = (32, 128, 4) if m <= 32 else (64, 128, 8) if m <= 64 else (128, 64, 8)
    block_k = min(64, group_size)
    n_tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    split = _split_k(n_tiles, triton.cdiv(k, block_k), sms)
    return W4A16Config(block_m, block_n, block_k, split, num_warps=warps, num_stages=3)


@triton.jit
def _load_w4_block(wp_ptr, ws_ptr, offs_n, k0, N, K, stride_wn, stride_sn,
                   GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   SUB: tl.constexpr):
    """Unpacked signed nibbles `[BLOCK_N, BLOCK_K]` (int32) and their scales `[BLOCK_N, BLOCK_K // SUB]`."""
    NSUB: tl.constexpr = BLOCK_K // SUB
    offs_w = k0 // 8 + tl.arange(0, BLOCK_K // 8)
    n_mask = offs_n < N
    words = tl.load(wp_ptr + offs_n[:, None] * stride_wn + offs_w[None, :],
                    mask=n_mask[:, None] & (offs_w < tl.cdiv(K, 8))[None, :], other=0,
                    eviction_policy="evict_first")  # weights are read once: keep L2 for x and scales
    shifts = tl.arange(0, 8) * 4
    q = (words[:, :, None] >> shifts[None, None, :]) & 0xF
    q = tl.reshape(q, (BLOCK_N, BLOCK_K)) - 8
    offs_g = (k0 + tl.arange(0, NSUB) * SUB) // GROUP
    scale = tl.load(ws_ptr + offs_n[:, None] * stride_sn + offs_g[None, :],
                    mask=n_mask[:, None] & (offs_g < tl.cdiv(K, GROUP))[None, :], other=0.0)
    return q, scale.to(tl.float32)


@triton.jit
def _w4a16_kernel(x_ptr, wp_ptr, ws_ptr, out_ptr, M, N, K,
                  stride_xm, stride_wn, stride_sn, stride_om,
                  GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, SUB: tl.constexpr, SPLIT_K: tl.constexpr,
                  DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr):
    """out[M, N] (+)= x[M, K] @ dequant(W)[N, K].T over this program's share of the K blocks."""
    NSUB: tl.constexpr = BLOCK_K // SUB
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(pid_k, tl.cdiv(K, BLOCK_K), SPLIT_K):
        k0 = kb * BLOCK_K
        q, scale = _load_w4_block(wp_ptr, ws_ptr, offs_n, k0, N, K, stride_wn, stride_sn,
                                  GROUP, BLOCK_N, BLOCK_K, SUB)
        offs_k = k0 + tl.arange(0, BLOCK_K)
        xb = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                     mask=(offs_m < M)[:, None] & (offs_k < K)[None, :], other=0.0)
        if BLOCK_M == 1:  # GEMV: no tensor cores needed, reduce each group then scale it
            prod = q.to(tl.float32) * xb.to(tl.float32)
            part = tl.sum(tl.reshape(prod, (BLOCK_N, NSUB, SUB)), axis=2)
            acc += tl.reshape(tl.sum(part * scale, axis=1), (1, BLOCK_N))
        elif NSUB == 1:  # the K block lies in one group: scale the partial dot, not the weights
            part = tl.dot(xb.to(DOT_DTYPE), tl.trans(q.to(DOT_DTYPE)), out_dtype=tl.float32, input_precision=PRECISION)
            acc += part * tl.reshape(scale, (1, BLOCK_N))
        else:
            w = tl.reshape(tl.reshape(q.to(tl.float32), (BLOCK_N, NSUB, SUB)) * scale[:, :, None],
                           (BLOCK_N, BLOCK_K))
            acc += tl.dot(xb.to(DOT_DTYPE), tl.trans(w.to(DOT_DTYPE)), out_dtype=tl.float32, input_precision=PRECISION)
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    out_mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    if SPLIT_K == 1:
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        tl.atomic_add(out_ptrs, acc, mask=out_mask)


def sub_block(block_k: int, group_size: int, *blocks: int) -> int:
    """Width of the per-scale slice of a K block: the group, or the whole block when it fits in one group.

    Also checks that all blocks are powers of two (`tl.arange` needs it).
    """
    if any(b < 1 or b & (b - 1) for b in (block_k, *blocks)):
        raise ValueError(f"block sizes must be powers of two, got {(block_k, *blocks)}")
    if block_k % 8 or (block_k % group_size and group_size % block_k):
        raise ValueError(f"BLOCK_K={block_k} must be a multiple of 8 and divide or be divided by {group_size}")
    return min(block_k, group_size)


def triton_w4a16_linear(
    x: torch.Tensor,
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    group_size: int,
    config: W4A16Config | None = None,
) -> torch.Tensor:
    """`[M, K] -> [M, N]` with the Triton kernel; `config` overrides the heuristic (tests, tuning)."""
    check_device(x)
    m, k = x.shape
    n = weight_packed.shape[0]
    x = x if x.stride(-1) == 1 else x.contiguous()
    weight_packed, weight_scale = weight_packed.contiguous(), weight_scale.contiguous()
    cfg = config or pick_config(m, n, k, group_size, x.device)
    out_dtype = torch.float32 if cfg.split_k > 1 else x.dtype
    alloc = torch.zeros if cfg.split_k > 1 else torch.empty
    out = alloc((m, n), dtype=out_dtype, device=x.device)
    grid = (triton.cdiv(n, cfg.block_n), cfg.split_k, triton.cdiv(m, cfg.block_m))
    _w4a16_kernel[grid](
        x, weight_packed, weight_scale, out, m, n, k,
        x.stride(0), weight_packed.stride(0), weight_scale.stride(0), out.stride(0),
        GROUP=group_size, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        SUB=sub_block(cfg.block_k, group_size, cfg.block_m, cfg.block_n), SPLIT_K=cfg.split_k,
        DOT_DTYPE=dot_dtype_for(x), PRECISION=dot_precision_for(x),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out.to(x.dtype)
