"""What the W4A16 kernels are measured against in `quantkit.kernels.bench`: the same routed expert GEMM with
BF16 weights (a grouped GEMM, checked against a per-expert loop), and SGLang's own Triton int4 MoE kernel
where SGLang is importable (on a GPU)."""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["BASELINE_MODULES", "bf16_moe_fn", "sglang_moe_baseline"]

# baseline name -> the package that provides it (the GPU check reports which are importable)
BASELINE_MODULES = {"sglang": "sglang", "vllm-marlin": "vllm"}


def bf16_moe_fn(x: torch.Tensor, w: torch.Tensor, weights: torch.Tensor,
                ids: torch.Tensor) -> tuple[Callable[[], torch.Tensor], str]:
    """The same routed expert GEMM with BF16 weights `w [E, N, K]`, and how it is computed.

    Slots are sorted by expert and their rows gathered (timed, as the W4A16 kernel's alignment is), then
    one `torch._grouped_mm` over the expert runs; if that op is missing or disagrees with a loop of one
    `torch.matmul` per touched expert, that loop is the baseline. Routing weights multiply the rows.
    """
    e, top_k = w.shape[0], ids.shape[1]
    flat = ids.reshape(-1).to(torch.int64)
    route = weights.reshape(-1, 1).to(x.dtype)

    def rows() -> tuple[torch.Tensor, torch.Tensor]:
        order = torch.argsort(flat, stable=True)
        return x[order // top_k] * route[order], order

    def grouped() -> torch.Tensor:
        a, order = rows()
        offs = torch.cumsum(torch.bincount(flat, minlength=e), 0).to(torch.int32)
        return torch._grouped_mm(a, w.transpose(-2, -1), offs=offs)

    def loop() -> torch.Tensor:
        a, order = rows()
        out = torch.empty(a.shape[0], w.shape[1], device=x.device, dtype=x.dtype)
        start = 0
        for expert, count in enumerate(torch.bincount(flat, minlength=e).tolist()):
            if count:
                out[start : start + count] = a[start : start + count] @ w[expert].T
                start += count
        return out

    reference_out = loop().float()
    try:
        got = grouped().float()
    except Exception as exc:  # missing op or unsupported GPU/layout: the loop is the baseline
        return loop, f"per-expert torch.matmul loop (torch._grouped_mm: {type(exc).__name__})"
    err = float((got - reference_out).norm() / reference_out.norm().clamp_min(1e-12))
    if not err < 1e-2:
        return loop, f"per-expert torch.matmul loop (torch._grouped_mm off by {err:.1e})"
    return grouped, "torch._grouped_mm"


def sglang_moe_baseline(x: torch.Tensor, wp: torch.Tensor, ws: torch.Tensor, weights: torch.Tensor,
                        ids: torch.Tensor, g: int) -> tuple[str, Callable[[], object]] | str | None:
    """SGLang's Triton int4_w4a16 MoE GEMM on the same problem; None off-GPU, a reason string if it fails.

    SGLang keeps int4 experts as uint8 `[E, N, K/2]` (two nibbles per byte, low first, offset 8), which is
    the same nibble order as the int32 words, so a byte view of our weights is its layout.
    """
    if not x.is_cuda:
        return None
    try:
        from sglang.srt.layers.moe.fused_moe_triton.fused_moe import invoke_fused_moe_kernel, moe_align_block_size
    except Exception as exc:
        return f"sglang baseline not importable: {type(exc).__name__}"
    e, n, _ = wp.shape
    k = x.shape[1]
    b_u8 = wp.view(torch.uint8).reshape(e, n, k // 2)
    config = {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 64, "GROUP_SIZE_M": 1}
    out = torch.empty(x.shape[0], ids.shape[1], n, device=x.device, dtype=x.dtype)
    sorted_ids, expert_ids, num_post = moe_align_block_size(ids, config["BLOCK_SIZE_M"], e)

    def run() -> None:
        invoke_fused_moe_kernel(x, b_u8, None, out, None, ws, None, weights, ids, sorted_ids, expert_ids,
                                num_post, True, ids.shape[1], config, compute_type=_tl_bf16(),
                                use_fp8_w8a8=False, use_int8_w8a8=False, use_int8_w8a16=False,
                                use_int4_w4a16=True, per_channel_quant=False, block_shape=[0, g])

    try:  # the private kernel entry changes between SGLang releases: best effort, reason recorded
        run()
    except Exception as exc:
        return f"sglang baseline failed: {type(exc).__name__}: {exc}"[:200]
    return "sglang-triton-int4", run


def _tl_bf16():
    import triton.language as tl

    return tl.bfloat16
