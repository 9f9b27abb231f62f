"""The prefill side of the BF16 -> FP8 KV hand-off: a bounded staging area laid out as the decode's pool.

SGLang's transfer engines copy pages as raw bytes, computing source *and* destination addresses with the
prefill's bytes per page (`mooncake/conn.py: _send_kvcache_generic`). So the prefill must hand the engine
pages that already have the decode's bytes: :class:`PageStaging` holds, per transferred layer, `slots` pages in
the decode's row layout (FP8 MLA rows of 576 B, or DSA rows of 656 B), registered with the transfer engine
in place of the BF16 pool. A send converts the request's BF16 pages into free slots, moves the slots
with SGLang's own send, and frees them; a request with more pages than slots is sent in several rounds.
Memory: `slots x page_size x row bytes x layers` on the prefill's device, whatever the traffic.

SGLang-free (plain torch): the hooks that put this on SGLang's send path are in `sglang_pd.py`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

__all__ = ["DecodeRow", "PageStaging", "StagedLayer", "dsa_pages_to_fp8", "mla_pages_to_fp8", "row_bytes"]

DecodeRow = Literal["mla", "dsa-656"]
_FP8 = torch.float8_e4m3fn
_TILE = 128  # DSA: one fp32 scale per 128 FP8 latent values (DSATokenToKVPool.quant_block_size)


def row_bytes(row: DecodeRow, kv_lora_rank: int, rope: int) -> int:
    """Bytes of one token's row in one layer of the decode's FP8 pool."""
    return kv_lora_rank + rope if row == "mla" else kv_lora_rank + kv_lora_rank // _TILE * 4 + rope * 2


def mla_pages_to_fp8(pages: torch.Tensor, k_scale: float | torch.Tensor) -> torch.Tensor:
    """BF16 MLA pages [n_pages, page_size, kv_lora_rank + rope] -> the decode's FP8 bytes (same shape, uint8):
    the latent divided by the decode layer's calibrated k_scale in the latent's dtype, then cast, as the decode's
    triton backend writes its own tokens (`k.div_(layer.k_scale)` before `MLATokenToKVPool.set_kv_buffer`)."""
    if pages.dtype != torch.bfloat16:
        raise ValueError(f"expected BF16 prefill pages, got {pages.dtype}")
    if not isinstance(k_scale, torch.Tensor):
        if k_scale == 1.0:
            return pages.to(_FP8).view(torch.uint8)
        k_scale = torch.tensor(k_scale, dtype=torch.float32, device=pages.device)
    return pages.div(k_scale).to(_FP8).view(torch.uint8)


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


@dataclass(frozen=True)
class StagedLayer:
    """One transferred layer: the prefill's BF16 buffer (SGLang's `kv_buffer[i]`, [tokens, 1, width]) and the
    k_scale the decode's attention applies to that layer (MLA; DSA rows carry their own per-tile scales)."""

    source: torch.Tensor
    k_scale: float = 1.0


SendFn = Callable[[np.ndarray, np.ndarray], int]  # (staging slot indices, decode page indices) -> 0 or error


class PageStaging:
    """`slots` pages per layer in the decode's layout; thread-safe slot allocation (SGLang sends from several
    transfer threads at once)."""

    def __init__(self, layers: Sequence[StagedLayer], page_size: int, row: DecodeRow, kv_lora_rank: int,
                 rope: int, slots: int) -> None:
        if not layers:
            raise ValueError("no KV layers to stage")
        if slots < 1:
            raise ValueError(f"staging needs at least one page per layer, got {slots}")
        width = kv_lora_rank + rope
        for i, layer in enumerate(layers):
            if layer.source.dtype != torch.bfloat16 or layer.source.shape[-1] != width:
                raise ValueError(f"KV layer {i}: expected a BF16 buffer of rows {width} wide, got "
                                 f"{layer.source.dtype} {tuple(layer.source.shape)}")
        self.layers = list(layers)
        self.page_size, self.row, self.kv_lora_rank, self.slots = page_size, row, kv_lora_rank, slots
        self.row_bytes = row_bytes(row, kv_lora_rank, rope)
        device = layers[0].source.device
        self.buffers = [torch.zeros((slots, page_size, self.row_bytes), dtype=torch.uint8, device=device)
                        for _ in layers]
        # 0-dim fp32 scales on the pool's device, made once (a host-to-device copy per layer per send otherwise)
        self._scales: list[float | torch.Tensor] = [
            layer.k_scale if layer.k_scale == 1.0 else torch.tensor(layer.k_scale, dtype=torch.float32, device=device)
            for layer in layers]
        self._free = list(range(slots))
        self._cond = threading.Condition()

    @property
    def item_len(self) -> int:
        """Bytes of one page of one layer as the decode stores it (what the transfer engine moves per page)."""
        return self.page_size * self.row_bytes

    def buf_infos(self) -> tuple[list[int], list[int], list[int]]:
        """(data pointers, data lengths, item lengths) as SGLang's `get_contiguous_buf_infos` returns them."""
        return ([b.data_ptr() for b in self.buffers], [b.nbytes for b in self.buffers],
                [self.item_len] * len(self.buffers))

    def _acquire(self, n: int) -> list[int]:
        with self._cond:
            self._cond.wait_for(lambda: len(self._free) >= n)
            self._free.sort()
            taken, self._free = self._free[:n], self._free[n:]
            return taken

    def _release(self, slots: list[int]) -> None:
        with self._cond:
            self._free.extend(slots)
            self._cond.notify_all()

    def convert(self, pages: np.ndarray, slots: Sequence[int]) -> None:
        """Convert the prefill's pages `pages` of every layer into staging `slots` (same order)."""
        src_idx = torch.as_tensor(np.asarray(pages, dtype=np.int64), device=self.buffers[0].device)
        dst_idx = torch.as_tensor(list(slots), dtype=torch.int64, device=self.buffers[0].device)
        for layer, staged, scale in zip(self.layers, self.buffers, self._scales, strict=True):
            flat = layer.source.reshape(-1, layer.source.shape[-1])
            whole = flat.shape[0] // self.page_size * self.page_size  # SGLang pads the pool by one page
            bf16 = flat[:whole].view(-1, self.page_size, flat.shape[-1]).index_select(0, src_idx)
            fp8 = (mla_pages_to_fp8(bf16, scale) if self.row == "mla"
                   else dsa_pages_to_fp8(bf16, self.kv_lora_rank))
            staged.index_copy_(0, dst_idx, fp8)
        if staged.is_cuda:  # the transfer engine reads the staging memory directly: the casts must be done
            torch.cuda.current_stream(staged.device).synchronize()

    def send(self, pages: np.ndarray, dst_pages: np.ndarray, send: SendFn) -> int:
        """Convert and send `pages` (the prefill pool's page indices) to `dst_pages` (the decode's), at most
        `slots` pages per round; returns the first non-zero status of `send` (SGLang's), else 0."""
        pages, dst_pages = np.asarray(pages), np.asarray(dst_pages)
        if len(pages) != len(dst_pages):
            raise ValueError(f"{len(pages)} prefill pages for {len(dst_pages)} decode pages")
        for start in range(0, len(pages), self.slots):
            chunk = pages[start:start + self.slots]
            slots = self._acquire(len(chunk))
            try:
                self.convert(chunk, slots)
                ret = send(np.asarray(slots, dtype=pages.dtype), dst_pages[start:start + self.slots])
            finally:
                self._release(slots)
            if ret != 0:
                return ret
        return 0
