"""Serving-side kernels for compressed-tensors W4A16 weights and FP8 KV caches.

`w4a16_linear` / `w4a16_moe` multiply activations by INT4 weights read in the checkpoint's own packed
layout; `fp8_kv_quant` / `fp8_kv_dequant` convert KV-cache rows. Each runs on CUDA C++, Triton or
torch (see `dispatch` for the rules); `reference` holds the torch oracles the tests compare against.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["w4a16_linear", "w4a16_moe", "fp8_kv_quant", "fp8_kv_dequant"]


def __getattr__(name: str) -> Callable[..., torch.Tensor]:
    """Import torch (via `dispatch`) only when a kernel is used, not when the CLI starts."""
    if name in __all__:
        from quantkit.kernels import dispatch

        return getattr(dispatch, name)
    raise AttributeError(f"module 'quantkit.kernels' has no attribute {name!r}")
