"""Opt-in SGLang plugin for the production PD split: BF16 prefill KV pages into the decode's FP8 page layout.

Entry point `quantkit_pd_kv` (group `sglang.srt.plugins`): SGLang's `load_plugins()` calls `register()` in every
server process of an environment where quantkit is installed, so `register()` does nothing unless
`QUANTKIT_PD_KV=bf16-to-fp8` is set.

What exists: the page conversion itself, `mla_pages_to_fp8` (the decode's per-layer calibrated scale, the byte
layout SGLang's triton MLA backend writes: latent / k_scale cast to FP8) and `dsa_pages_to_fp8` (the 656 B DSA
row: FP8 latent + one fp32 scale per 128 values + BF16 rope, quantized by SGLang's own
`quantize_k_cache_separate`), byte-equal to what the decode server writes from the same latent
(tests/engines/test_sglang_pd_pages.py executes SGLang's pools and write paths on the CPU).

What does not exist yet: the hooks that would run the conversion on the prefill's send path and make both sides
advertise the decode's dtype string and row layout. Until they do, enabling the switch stops the server with
an error naming the plain pair to run instead (docs/serving.md), rather than letting SGLang refuse the pair on
the first request or copy BF16 pages into an FP8 pool.
"""

from __future__ import annotations

import os
from typing import Literal

import torch

__all__ = ["ENV", "MODE", "PluginNotReady", "dsa_pages_to_fp8", "enabled", "mla_pages_to_fp8", "register"]

ENV = "QUANTKIT_PD_KV"
MODE = "bf16-to-fp8"
PageLayout = Literal["mla", "dsa-656"]
_FP8 = torch.float8_e4m3fn


class PluginNotReady(RuntimeError):
    """The switch is on but the in-transit conversion is not wired into SGLang's send path."""


def enabled() -> bool:
    """Whether the plugin is switched on for this process."""
    value = os.environ.get(ENV, "")
    if value and value != MODE:
        raise PluginNotReady(f"{ENV}={value!r}: the only mode is {MODE!r} (unset it to run without the plugin)")
    return value == MODE


def mla_pages_to_fp8(pages: torch.Tensor, k_scale: float) -> torch.Tensor:
    """BF16 MLA pages [n_pages, page_size, kv_lora_rank + rope] -> the decode's FP8 bytes (same shape, uint8):
    the latent divided by the decode layer's calibrated k_scale in the latent's dtype, then cast, as the decode's
    triton backend writes its own tokens (`k.div_(layer.k_scale)` before `MLATokenToKVPool.set_kv_buffer`)."""
    if pages.dtype != torch.bfloat16:
        raise ValueError(f"expected BF16 prefill pages, got {pages.dtype}")
    return pages.clone().div_(torch.tensor(k_scale, dtype=torch.float32)).to(_FP8).view(torch.uint8)


def dsa_pages_to_fp8(pages: torch.Tensor, kv_lora_rank: int = 512) -> torch.Tensor:
    """BF16 DSA pages [n_pages, page_size, kv_lora_rank + rope] -> the decode's 656 B rows [n, page, 656] uint8,
    quantized by SGLang's own `quantize_k_cache_separate` (per-tile dynamic scales: no checkpoint scale).
    Runs inside an SGLang process (imports SGLang)."""
    from sglang.kernels.ops.quantization.dsa_quant_k_cache import quantize_k_cache_separate

    n, page, width = pages.shape
    flat = pages.reshape(n * page, width)
    nope, rope = quantize_k_cache_separate(flat[:, :kv_lora_rank].contiguous(), flat[:, kv_lora_rank:].contiguous())
    rows = torch.cat([nope.reshape(n * page, -1).view(torch.uint8), rope.reshape(n * page, -1).view(torch.uint8)], -1)
    return rows.reshape(n, page, -1)


def register() -> None:
    """SGLang plugin hook: a no-op unless QUANTKIT_PD_KV=bf16-to-fp8; then it refuses to start (not wired yet)."""
    if not enabled():
        return
    raise PluginNotReady(f"{ENV}={MODE}: quantkit converts BF16 pages to the decode's FP8 layout "
                         "(quantkit.serving.sglang_pd), but the hooks that run it on the prefill's send path are not "
                         f"built in this version; unset {ENV} and run the FP8/FP8 pair of `quantkit plan --pd`")
