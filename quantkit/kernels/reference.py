"""Torch reference implementations of every serving kernel: the oracle the fast kernels are tested against.

All math runs in fp32 and is written for clarity, not speed. The weight layout is compressed-tensors'
`pack-quantized` W4A16 form, read as stored:

- `weight_packed` int32 `[N, ceil(K/8)]`: word `w` holds input columns `8w..8w+7`, column `8w+i` in bits
  `[4i, 4i+4)` (lowest nibble first), stored as `q + 8` (offset binary, 0..15 for q in -8..7).
- `weight_scale` (bf16) `[N, ceil(K/group_size)]`: group `g` covers input columns `[g*gs, (g+1)*gs)`.
- dequantised weight `W[n, k] = q[n, k] * scale[n, k // gs]`; a linear layer computes `x @ W.T`.

MoE weights are the per-expert tensors stacked along a leading expert dim: `[E, N, K/8]` and `[E, N, K/g]`.
"""

from __future__ import annotations

import torch

__all__ = [
    "FP8_E4M3_MAX",
    "unpack_int4",
    "dequantize_w4",
    "w4a16_linear_ref",
    "moe_align",
    "w4a16_moe_ref",
    "fp8_kv_quant_ref",
    "fp8_kv_dequant_ref",
]

FP8_E4M3_MAX = 448.0  # largest finite float8_e4m3fn value; engines clamp to it before the cast


def unpack_int4(weight_packed: torch.Tensor, k: int) -> torch.Tensor:
    """Unpack `[..., ceil(k/8)]` int32 words into signed int8 values `[..., k]` in -8..7.

    Shifts and masks on int32 (an arithmetic shift is harmless because the mask keeps 4 bits),
    so this works on any device and never depends on compressed-tensors at runtime.
    """
    if weight_packed.dtype != torch.int32:
        raise ValueError(f"weight_packed must be int32, got {weight_packed.dtype}")
    if weight_packed.shape[-1] * 8 < k:
        raise ValueError(f"weight_packed holds {weight_packed.shape[-1] * 8} columns, fewer than K={k}")
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=weight_packed.device)
    nibbles = (weight_packed.unsqueeze(-1) >> shifts) & 0xF
    q = nibbles.reshape(*weight_packed.shape[:-1], -1)[..., :k]
    return (q - 8).to(torch.int8)


def dequantize_w4(
    weight_packed: torch.Tensor, weight_scale: torch.Tensor, group_size: int, k: int
) -> torch.Tensor:
    """Dequantise packed W4 weights to fp32 `[..., N, k]` (the `q * scale` of compressed-tensors)."""
    q = unpack_int4(weight_packed, k).to(torch.float32)
    scale = weight_scale.to(torch.float32).repeat_interleave(group_size, dim=-1)[..., :k]
    if scale.shape[-1] != k:
        raise ValueError(f"weight_scale covers {scale.shape[-1]} columns, need K={k} (group {group_size})")
    return q * scale


def w4a16_linear_ref(
    x: torch.Tensor, weight_packed: torch.Tensor, weight_scale: torch.Tensor, group_size: int
) -> torch.Tensor:
    """`x @ dequant(W).T` in fp32, returned in x's dtype: `[M, K] -> [M, N]`."""
    w = dequantize_w4(weight_packed, weight_scale, group_size, x.shape[-1])
    return (x.to(torch.float32) @ w.T).to(x.dtype)


def moe_align(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort routed slots by expert and pad each expert's run to a multiple of `block_m`.

    A slot is one (token, choice) pair, numbered `t * top_k + j`. Returns
    - `sorted_slots` int32 `[P]`: slot ids grouped by expert; padding entries hold `T * top_k` (a sentinel),
    - `block_expert` int32 `[P / block_m]`: the expert every block of `block_m` sorted slots belongs to,
    - `num_padded` int32 `[1]`: P, the number of valid sorted entries.
    This is the layout SGLang's fused MoE consumes: one kernel program handles one block, so it reads
    exactly one expert's weights.
    """
    flat = topk_ids.reshape(-1).to(torch.int64)
    sentinel = flat.numel()
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    order = torch.argsort(flat, stable=True)
    starts = torch.cumsum(padded, 0) - padded
    total = int(padded.sum())
    sorted_slots = torch.full((total,), sentinel, dtype=torch.int32, device=topk_ids.device)
    first_of_expert = torch.cumsum(counts, 0) - counts
    rank_in_expert = torch.arange(flat.numel(), device=flat.device) - first_of_expert[flat[order]]
    sorted_slots[starts[flat[order]] + rank_in_expert] = order.to(torch.int32)
    block_expert = torch.repeat_interleave(
        torch.arange(num_experts, device=flat.device, dtype=torch.int32), padded // block_m
    )
    num_padded = torch.tensor([total], dtype=torch.int32, device=topk_ids.device)
    return sorted_slots, block_expert, num_padded


def w4a16_moe_ref(
    x: torch.Tensor,
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    group_size: int,
    mul_routed_weight: bool = True,
) -> torch.Tensor:
    """Per-slot expert GEMM: `out[t, j] = w[t, j] * x_row @ dequant(W[ids[t, j]]).T`, shape `[T, top_k, N]`.

    `x` is `[T, K]` (every choice of token t reads row t, the gate/up projection) or `[T * top_k, K]`
    (one row per slot, the down projection). The caller sums over `top_k` after the down projection.
    """
    num_tokens, top_k = topk_ids.shape
    rows = _slot_rows(x, num_tokens, top_k)
    n = weight_packed.shape[1]
    out = torch.zeros(num_tokens * top_k, n, dtype=torch.float32, device=x.device)
    flat_ids = topk_ids.reshape(-1)
    for expert in torch.unique(flat_ids).tolist():
        slots = (flat_ids == expert).nonzero().squeeze(1)
        w = dequantize_w4(weight_packed[expert], weight_scale[expert], group_size, x.shape[-1])
        out[slots] = x[rows[slots]].to(torch.float32) @ w.T
    if mul_routed_weight:
        out *= topk_weights.reshape(-1, 1).to(torch.float32)
    return out.to(x.dtype).reshape(num_tokens, top_k, n)


def _slot_rows(x: torch.Tensor, num_tokens: int, top_k: int) -> torch.Tensor:
    """Row of x each slot reads: `slot // top_k` for `[T, K]` input, `slot` for `[T * top_k, K]` input."""
    slots = torch.arange(num_tokens * top_k, device=x.device)
    if x.shape[0] == num_tokens:
        return slots // top_k
    if x.shape[0] == num_tokens * top_k:
        return slots
    raise ValueError(f"x has {x.shape[0]} rows; expected T={num_tokens} or T*top_k={num_tokens * top_k}")


def fp8_kv_quant_ref(x: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """`fp8_e4m3fn(clamp(x * (1/scale), -448, 448))` with round-to-nearest-even (torch's cast)."""
    inv = 1.0 / torch.as_tensor(scale, dtype=torch.float32, device=x.device).reshape(())
    y = torch.clamp(x.to(torch.float32) * inv, -FP8_E4M3_MAX, FP8_E4M3_MAX)
    return y.to(torch.float8_e4m3fn)


def fp8_kv_dequant_ref(
    q: torch.Tensor, scale: torch.Tensor | float, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """What the engine reads back: `fp8 * scale`, in `dtype`."""
    s = torch.as_tensor(scale, dtype=torch.float32, device=q.device).reshape(())
    return (q.to(torch.float32) * s).to(dtype)
