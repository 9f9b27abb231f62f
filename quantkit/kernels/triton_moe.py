"""Triton grouped W4A16 MoE GEMM over expert-sorted token slots (the shape SGLang's fused MoE uses).

Routing is first turned into `moe_align` form: slots (token, choice) sorted by expert, each expert's run
padded to BLOCK_M. Program (i, j, s) takes sorted block i, which belongs to one expert, gathers its
BLOCK_M activation rows, and computes output columns block j from that expert's packed weights, read as
the checkpoint stores them (per-expert compressed-tensors tensors stacked: `[E, N, K/8]`, `[E, N, K/g]`).
The top-k routing weight of each slot multiplies its row before the store. At decode most blocks hold
one real row, so the kernel is bound by weight bytes; split-K (`s`) keeps all SMs busy for the few
experts a small batch touches.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quantkit.kernels.reference import moe_align
from quantkit.kernels.triton_w4a16 import (
    W4A16Config,
    _load_w4_block,
    _num_sms,
    _split_k,
    check_device,
    dot_dtype_for,
    dot_precision_for,
    sub_block,
)

__all__ = ["MoeConfig", "pick_moe_config", "gpu_moe_config", "triton_w4a16_moe"]


# The MoE kernel takes the same launch shape as the dense one (here BLOCK_M >= 16: rows go through `tl.dot`).
MoeConfig = W4A16Config


def pick_moe_config(num_slots: int, n: int, k: int, group_size: int, device: torch.device) -> MoeConfig:
    """Launch shape: large blocks in the interpreter, `gpu_moe_config` on a GPU."""
    if device.type == "cpu":
        return MoeConfig(16, min(max(triton.next_power_of_2(n), 16), 128), min(max(triton.next_power_of_2(k), 32), 256))
    return gpu_moe_config(num_slots, n, k, group_size, _num_sms(device))


def gpu_moe_config(num_slots: int, n: int, k: int, group_size: int, sms: int) -> MoeConfig:
    """16-row blocks with split-K at decode, larger tiles once experts see many tokens (untuned)."""
    if num_slots <= 64:
        n_tiles = num_slots * triton.cdiv(n, 64)  # at most one real block per slot
        return MoeConfig(16, 64, 128, _split_k(n_tiles, triton.cdiv(k, 128), sms), 4, 4)
    block_m = 64 if num_slots >= 1024 else 32
    return MoeConfig(block_m, 128, min(64, group_size), 1, 8 if block_m == 64 else 4, 3)  # 4 warps spill at 64


@triton.jit
def _w4a16_moe_kernel(x_ptr, wp_ptr, ws_ptr, out_ptr, topw_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr,
                      N, K, num_slots, rows_div,
                      stride_xm, stride_we, stride_wn, stride_se, stride_sn, stride_om,
                      GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, SUB: tl.constexpr, SPLIT_K: tl.constexpr,
                      MUL_ROUTED_WEIGHT: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr):
    """out[slot, n-block] (+)= route_w[slot] * x[row(slot)] @ dequant(W[expert(block)]).T."""
    NSUB: tl.constexpr = BLOCK_K // SUB
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    slots = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = slots < num_slots
    rows = (slots // rows_div).to(tl.int64)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    wp_e = wp_ptr + expert * stride_we
    ws_e = ws_ptr + expert * stride_se
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(pid_k, tl.cdiv(K, BLOCK_K), SPLIT_K):
        k0 = kb * BLOCK_K
        q, scale = _load_w4_block(wp_e, ws_e, offs_n, k0, N, K, stride_wn, stride_sn,
                                  GROUP, BLOCK_N, BLOCK_K, SUB)
        offs_k = k0 + tl.arange(0, BLOCK_K)
        xb = tl.load(x_ptr + rows[:, None] * stride_xm + offs_k[None, :],
                     mask=valid[:, None] & (offs_k < K)[None, :], other=0.0)
        if NSUB == 1:
            part = tl.dot(xb.to(DOT_DTYPE), tl.trans(q.to(DOT_DTYPE)), out_dtype=tl.float32, input_precision=PRECISION)
            acc += part * tl.reshape(scale, (1, BLOCK_N))
        else:
            w = tl.reshape(tl.reshape(q.to(tl.float32), (BLOCK_N, NSUB, SUB)) * scale[:, :, None],
                           (BLOCK_N, BLOCK_K))
            acc += tl.dot(xb.to(DOT_DTYPE), tl.trans(w.to(DOT_DTYPE)), out_dtype=tl.float32, input_precision=PRECISION)
    if MUL_ROUTED_WEIGHT:
        acc *= tl.load(topw_ptr + slots, mask=valid, other=0.0).to(tl.float32)[:, None]
    out_ptrs = out_ptr + slots.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    out_mask = valid[:, None] & (offs_n < N)[None, :]
    if SPLIT_K == 1:
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        tl.atomic_add(out_ptrs, acc, mask=out_mask)


def triton_w4a16_moe(
    x: torch.Tensor,
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    group_size: int,
    mul_routed_weight: bool = True,
    config: MoeConfig | None = None,
) -> torch.Tensor:
    """Grouped expert GEMM, `[T, top_k, N]`; same contract as `reference.w4a16_moe_ref`."""
    check_device(x)
    num_tokens, top_k = topk_ids.shape
    num_slots = num_tokens * top_k
    num_experts, n, _ = weight_packed.shape
    k = x.shape[1]
    if x.shape[0] not in (num_tokens, num_slots):
        raise ValueError(f"x has {x.shape[0]} rows; expected T={num_tokens} or T*top_k={num_slots}")
    rows_div = top_k if x.shape[0] == num_tokens else 1
    cfg = config or pick_moe_config(num_slots, n, k, group_size, x.device)
    sorted_slots, block_expert, num_padded = moe_align(topk_ids, num_experts, cfg.block_m)
    x = x if x.stride(-1) == 1 else x.contiguous()
    weight_packed, weight_scale = weight_packed.contiguous(), weight_scale.contiguous()
    topk_weights = topk_weights.reshape(-1).contiguous()
    out_dtype = torch.float32 if cfg.split_k > 1 else x.dtype
    out = torch.zeros((num_slots, n), dtype=out_dtype, device=x.device)
    grid = (sorted_slots.numel() // cfg.block_m, triton.cdiv(n, cfg.block_n), cfg.split_k)
    _w4a16_moe_kernel[grid](
        x, weight_packed, weight_scale, out, topk_weights, sorted_slots, block_expert, num_padded,
        n, k, num_slots, rows_div,
        x.stride(0), weight_packed.stride(0), weight_packed.stride(1),
        weight_scale.stride(0), weight_scale.stride(1), out.stride(0),
        GROUP=group_size, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        SUB=sub_block(cfg.block_k, group_size, cfg.block_m, cfg.block_n), SPLIT_K=cfg.split_k,
        MUL_ROUTED_WEIGHT=mul_routed_weight, DOT_DTYPE=dot_dtype_for(x), PRECISION=dot_precision_for(x),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out.to(x.dtype).reshape(num_tokens, top_k, n)
