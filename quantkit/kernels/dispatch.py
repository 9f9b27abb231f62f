"""One entry point per operation; picks the CUDA, Triton or torch implementation by device and shape.

Rules (`backend=None`):
- CPU tensors: the torch reference (Triton on CPU only runs under `TRITON_INTERPRET=1`, and only when
  asked for with `backend="triton"`: it is a test vehicle, not a fast path).
- CUDA, `w4a16_linear`: the CUDA C++ GEMV for M <= `CUDA_GEMV_MAX_ROWS` (bf16/fp16, K and group multiples
  of 32) when the extension builds; otherwise Triton (GEMV/split-K body for M <= 16, tiles above).
  If Triton is missing, torch.
- CUDA, `w4a16_moe` and the FP8 KV kernels: Triton, else torch.
`backend` forces "torch", "triton" or "cuda". Triton and the CUDA extension are imported lazily, so
importing `quantkit.kernels` stays cheap and never fixes the Triton interpreter mode too early.
"""

from __future__ import annotations

import functools
import importlib.util
import logging

import torch

from quantkit.kernels import reference

__all__ = ["BACKENDS", "CUDA_GEMV_MAX_ROWS", "w4a16_linear", "w4a16_moe", "fp8_kv_quant", "fp8_kv_dequant"]

BACKENDS = ("torch", "triton", "cuda")
CUDA_GEMV_MAX_ROWS = 4  # above this the Triton split-K dot path reuses each weight load across rows
log = logging.getLogger(__name__)


@functools.lru_cache(maxsize=1)
def _triton_importable() -> bool:
    return importlib.util.find_spec("triton") is not None


@functools.lru_cache(maxsize=1)
def _cuda_extension_ready() -> bool:
    """Build the extension once; a failed build (no nvcc, no compiler) falls back to Triton with a log line."""
    from quantkit.kernels import cuda_ext

    try:
        cuda_ext.load_extension()
    except Exception as exc:  # build toolchains fail in many ways; all mean "not available"
        log.warning("CUDA W4A16 GEMV unavailable, using Triton: %s", exc)
        return False
    return True


def _check_backend(backend: str | None, allowed: tuple[str, ...]) -> None:
    if backend is not None and backend not in allowed:
        raise ValueError(f"backend must be one of {allowed} or None, got {backend!r}")


def _default_backend(x: torch.Tensor) -> str:
    return "triton" if x.is_cuda and _triton_importable() else "torch"


def check_w4_operands(x: torch.Tensor, weight_packed: torch.Tensor, weight_scale: torch.Tensor,
                      group_size: int) -> None:
    """Validate the compressed-tensors shapes up front so a kernel never reads out of bounds."""
    if group_size < 8 or group_size & (group_size - 1):
        raise ValueError(f"group_size must be a power of two >= 8 (32, 64 or 128 in practice), got {group_size}")
    k = x.shape[-1]
    lead = weight_packed.shape[:-2]
    n = weight_packed.shape[-2]
    if weight_packed.dtype != torch.int32:
        raise ValueError(f"weight_packed must be int32, got {weight_packed.dtype}")
    if weight_packed.shape[-1] != -(-k // 8):
        raise ValueError(f"weight_packed {tuple(weight_packed.shape)} does not pack K={k} (need K/8 columns)")
    if tuple(weight_scale.shape) != (*lead, n, -(-k // group_size)):
        raise ValueError(f"weight_scale {tuple(weight_scale.shape)} != {(*lead, n, -(-k // group_size))}")
    if x.device != weight_packed.device or x.device != weight_scale.device:
        raise ValueError("x, weight_packed and weight_scale must be on one device")


def w4a16_linear(
    x: torch.Tensor,
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    group_size: int,
    backend: str | None = None,
) -> torch.Tensor:
    """`x @ dequant(W).T` for a compressed-tensors W4A16 layer: x `[M, K]` (or `[..., K]`) -> `[M, N]`.

    `weight_packed` int32 `[N, K/8]`, `weight_scale` `[N, K/group_size]`, exactly as in the checkpoint.
    """
    _check_backend(backend, BACKENDS)
    if weight_packed.dim() != 2:
        raise ValueError(f"weight_packed must be [N, K/8], got {tuple(weight_packed.shape)} (experts: w4a16_moe)")
    check_w4_operands(x, weight_packed, weight_scale, group_size)
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    chosen = backend or _pick_linear_backend(x2, group_size)
    if x2.shape[0] == 0:  # an empty batch: nothing to launch
        return x.new_empty(*lead, weight_packed.shape[0])
    if chosen == "torch":
        out = reference.w4a16_linear_ref(x2, weight_packed, weight_scale, group_size)
    elif chosen == "cuda":
        from quantkit.kernels.cuda_ext import cuda_w4a16_linear

        out = cuda_w4a16_linear(x2, weight_packed, weight_scale, group_size)
    else:
        from quantkit.kernels.triton_w4a16 import triton_w4a16_linear

        out = triton_w4a16_linear(x2, weight_packed, weight_scale, group_size)
    return out.reshape(*lead, weight_packed.shape[0])


def _pick_linear_backend(x: torch.Tensor, group_size: int) -> str:
    if not x.is_cuda:
        return "torch"
    from quantkit.kernels.cuda_ext import cuda_gemv_supported

    if (x.shape[0] <= CUDA_GEMV_MAX_ROWS and cuda_gemv_supported(x, x.shape[1], group_size)
            and _cuda_extension_ready()):
        return "cuda"
    return _default_backend(x)


def w4a16_moe(
    x: torch.Tensor,
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    group_size: int,
    mul_routed_weight: bool = True,
    backend: str | None = None,
) -> torch.Tensor:
    """Grouped expert GEMM over routed slots -> `[T, top_k, N]` (sum over top_k after the down projection).

    `x` `[T, K]` (gate/up: each choice reads its token's row) or `[T * top_k, K]` (down: one row per slot);
    `weight_packed` `[E, N, K/8]` and `weight_scale` `[E, N, K/g]` are the per-expert checkpoint tensors
    stacked once at load; `topk_ids` / `topk_weights` `[T, top_k]` come from the router.
    """
    _check_backend(backend, ("torch", "triton"))
    check_w4_operands(x, weight_packed, weight_scale, group_size)
    if weight_packed.dim() != 3 or topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2:
        raise ValueError("need 3-D expert weights [E, N, K/8] and [T, top_k] topk_ids / topk_weights")
    if topk_ids.numel() and (int(topk_ids.min()) < 0 or int(topk_ids.max()) >= weight_packed.shape[0]):
        raise ValueError(f"topk_ids must lie in [0, {weight_packed.shape[0]})")
    chosen = backend or _default_backend(x)
    if chosen == "torch":
        return reference.w4a16_moe_ref(x, weight_packed, weight_scale, topk_weights, topk_ids, group_size,
                                       mul_routed_weight)
    from quantkit.kernels.triton_moe import triton_w4a16_moe

    return triton_w4a16_moe(x, weight_packed, weight_scale, topk_weights, topk_ids, group_size,
                            mul_routed_weight)


def fp8_kv_quant(
    x: torch.Tensor,
    scale: torch.Tensor | float,
    out: torch.Tensor | None = None,
    slot_mapping: torch.Tensor | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """Quantize KV rows `[..., D]` (MLA: D = 576) to float8_e4m3fn with one per-tensor scale.

    Stores `fp8(clamp(x / scale, -448, 448))`, round to nearest even. With `out` (a cache) and
    `slot_mapping` (`[rows]`), row i is written to `out[slot_mapping[i]]`; returns `out`.
    """
    _check_backend(backend, ("torch", "triton"))
    if (backend or _default_backend(x)) == "triton":
        from quantkit.kernels.triton_fp8kv import triton_fp8_kv_quant

        return triton_fp8_kv_quant(x, scale, out, slot_mapping)
    q = reference.fp8_kv_quant_ref(x, scale)
    if out is None and slot_mapping is None:
        return q
    if out is None:
        raise ValueError("slot_mapping needs the cache tensor to write into (out=)")
    if out.dtype != torch.float8_e4m3fn or out.shape[-1] != x.shape[-1]:
        raise ValueError(f"out must be float8_e4m3fn with last dim {x.shape[-1]}, got {out.dtype} {tuple(out.shape)}")
    rows = out.view(-1, x.shape[-1])
    if slot_mapping is None:
        rows.copy_(q.reshape(-1, x.shape[-1]))
    else:
        rows[slot_mapping.reshape(-1).long()] = q.reshape(-1, x.shape[-1])
    return out


def fp8_kv_dequant(
    q: torch.Tensor,
    scale: torch.Tensor | float,
    dtype: torch.dtype = torch.bfloat16,
    backend: str | None = None,
) -> torch.Tensor:
    """Read FP8 KV rows back the way the engine does: `fp8 * scale`, in `dtype`."""
    _check_backend(backend, ("torch", "triton"))
    if q.dtype != torch.float8_e4m3fn:
        raise ValueError(f"q must be float8_e4m3fn, got {q.dtype}")
    if (backend or _default_backend(q)) == "triton":
        from quantkit.kernels.triton_fp8kv import triton_fp8_kv_dequant

        return triton_fp8_kv_dequant(q, scale, dtype)
    return reference.fp8_kv_dequant_ref(q, scale, dtype)
