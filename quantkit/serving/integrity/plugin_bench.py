"""The SGLang plugin's per-decode-step work on a device, without SGLang: for the GPU check's ``sglang_plugin``
section (``bench/gpu_check.py``) and anyone timing ``state.py`` on a card.

One step is what the hooks issue on a clean decode step (``sglang.py``): the allocation's bump
(:meth:`PoolState.handed_decode`), the decode record (:meth:`PoolState.record_decode`), the check with the write
redirect (:meth:`PoolState.check`; Triton on CUDA), the verdict gathered for the batch and the mark of the sampled
ids. ``batch`` rows of ``context`` tokens (staggered by one token per row, so page openings spread over steps) on
shuffled pages of an SGLang-shaped ``req_to_token``. Reported: ``step_us``, the median wall time of a step with the
device synchronised after it (device work included), and ``host_us``, the median time to issue it (what the host
pays; nothing in it waits for the device).
"""

from __future__ import annotations

import statistics
import time

import numpy as np
import torch

from quantkit.serving.integrity.state import Backend, PoolState, mark

__all__ = ["plugin_step"]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def plugin_step(batch: int, context: int, page_size: int, device: torch.device | str, repeats: int = 5,
                backend: Backend | None = None) -> dict[str, float]:  # fmt: skip
    """Time the plugin's per-step work for one (batch, context, page size); see the module docstring."""
    device = torch.device(device)
    ps = page_size
    per_row = -(-(context + repeats + 2) // ps) + 1
    num_pages = batch * per_row + 1  # page 0: SGLang's padding page
    state = PoolState(num_pages, ps, device, backend=backend)
    width = per_row * ps
    state.bind(batch + 1, width)
    gen = torch.Generator().manual_seed(0)
    pages = (torch.randperm(num_pages - 1, generator=gen) + 1)[: batch * per_row].view(batch, per_row)
    table = torch.zeros(batch + 1, width, dtype=torch.int32)
    table[1:] = (pages[:, :, None] * ps + torch.arange(ps)).view(batch, width).to(torch.int32)
    table = table.to(device)
    rows_h = np.arange(1, batch + 1, dtype=np.int64)
    seq_h = np.array([context - i % ps for i in range(batch)], dtype=np.int64)
    state.record_spans(table, rows_h, np.zeros(batch, dtype=np.int64), -(-seq_h // ps), np.zeros(batch, np.int64))
    rows = torch.from_numpy(rows_h).to(device)
    ids = torch.full((batch,), 7, dtype=torch.int64, device=device)
    host, total = [], []
    for _ in range(repeats + 1):
        seq = torch.from_numpy(seq_h).to(device)
        slots, seq_next = table[rows, seq].long(), seq + 1  # SGLang's: the allocation and the length update
        _sync(device)
        t0 = time.perf_counter()
        state.handed_decode(slots, batch if (seq_h % ps == 0).any() else 0)
        state.record_decode(table, slots, rows, seq, rows_h, seq_h)
        state.check(table, rows, seq_next, seq_h + 1, slots)
        mark(ids, state.verdict(rows))
        t1 = time.perf_counter()
        _sync(device)
        host.append(t1 - t0)
        total.append(time.perf_counter() - t0)
        seq_h = seq_h + 1
    if bool((state.row_bad != 0).any()):
        raise AssertionError("a clean state failed the check")
    return {"step_us": statistics.median(total[1:]) * 1e6, "host_us": statistics.median(host[1:]) * 1e6}
