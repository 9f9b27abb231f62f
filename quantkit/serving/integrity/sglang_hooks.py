"""The KV-integrity plugin's process state and its memory hooks (frees, allocations, row records); the entry point,
its hook table and the overview are in ``sglang.py``, the check, the verdict and the abort in ``sglang_check.py``.

Nothing here reads the device on the decode path (see ``state.py`` for the convention); SGLang is imported only
for type names.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from quantkit.serving.integrity.state import PoolState

if TYPE_CHECKING:
    from sglang.srt.disaggregation.decode import DecodePreallocQueue
    from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
    from sglang.srt.mem_cache.allocator.base import BaseTokenToKVPoolAllocator
    from sglang.srt.mem_cache.base_prefix_cache import BasePrefixCache
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

__all__ = ["ENV", "ENABLE_VALUE", "AbortPlan", "AbortRecord", "enabled", "record_rows", "state", "tracker_of"]

ENV = "QUANTKIT_KV_INTEGRITY"
ENABLE_VALUE = "tags"
ABORT_MESSAGE = "KV page integrity check failed (quantkit)"
logger = logging.getLogger("quantkit.kv_integrity")
Original = Callable[..., object]  # the SGLang function an AROUND hook wraps


@dataclass(frozen=True)
class AbortRecord:
    """One request aborted by the check (kept for observation and tests)."""

    rid: str
    row: int
    page: int
    expected_page: int
    expected_tag: int
    actual_tag: int
    row_pages: tuple[int, ...] = ()


@dataclass(frozen=True)
class AbortPlan:
    """What SGLang's own release of an aborted request must not free (pages now someone else's) and what it must
    free besides (pages the row lost but the request still owns)."""

    skip: torch.Tensor
    lost: tuple[int, ...]


@dataclass
class _State:
    registered: bool = False
    aborts: list[AbortRecord] = field(default_factory=list)
    checks: int = 0
    skip: torch.Tensor | None = None  # pages not to free while an aborted request is released
    returned: set[int] = field(default_factory=set)  # stamps of pages handed out twice that an abort gave back
    drops: int = 0  # requests whose tokens of the step in processing are dropped (speculative path)
    tp_sync: bool = False  # QUANTKIT_KV_INTEGRITY_TP_SYNC=1: all-reduce the verdict over the TP group


_STATE = _State()


def state() -> _State:
    """The plugin's process-wide state (aborts so far, checks run)."""
    return _STATE


def enabled() -> bool:
    return os.environ.get(ENV, "").strip().lower() == ENABLE_VALUE


def tracker_of(allocator: BaseTokenToKVPoolAllocator) -> PoolState | None:
    """The allocator's integrity state (None: not tracked, e.g. the plugin is off or the allocator unsupported)."""
    return allocator.__dict__.get("_quantkit_tracker")


# ---- free / alloc / clear hooks ------------------------------------------------------------------------------------


def _unskipped(index: torch.Tensor, page_size: int) -> torch.Tensor:
    """``index`` (slots, or pages with ``page_size`` 1) less the pages an abort must not free. Abort path only."""
    skip = _STATE.skip
    if skip is None or index.numel() == 0:
        return index
    pages = index.long() // page_size if page_size > 1 else index.long()
    return index[~torch.isin(pages, skip)]


def _release_page_ids(original: Original, self: BaseTokenToKVPoolAllocator, *page_ids: torch.Tensor) -> object:
    """Every paged free ends here (also a free group's, at its end): bump the pages."""
    tracker = tracker_of(self)
    if tracker is not None:
        for ids in page_ids:
            if ids.numel():
                tracker.freed(ids)
    return original(self, *page_ids)


def _paged_free(original: Original, self: BaseTokenToKVPoolAllocator, free_index: torch.Tensor) -> object:
    return original(self, _unskipped(free_index, self.page_size))


def _paged_free_page_ids(original: Original, self: BaseTokenToKVPoolAllocator, page_ids: torch.Tensor) -> object:
    return original(self, _unskipped(page_ids, 1))


def _token_free(original: Original, self: BaseTokenToKVPoolAllocator, free_index: torch.Tensor) -> object:
    free_index = _unskipped(free_index, 1)
    tracker = tracker_of(self)
    if tracker is not None and self.free_group is None and free_index.numel():
        tracker.freed(free_index)
    return original(self, free_index)


def _after_alloc(result: torch.Tensor | None, self: BaseTokenToKVPoolAllocator, *args: object,
                 **kwargs: object) -> None:  # fmt: skip
    """Paged ``alloc`` / ``alloc_extend``: bump the pages they opened."""
    tracker = tracker_of(self)
    if tracker is not None and isinstance(result, torch.Tensor) and result.numel():
        tracker.handed(result)


def _after_token_alloc(result: torch.Tensor | None, self: BaseTokenToKVPoolAllocator, need_size: int) -> None:
    """Page size 1 (every allocation, a decode step's included): bump, and keep the stamps for the decode record."""
    tracker = tracker_of(self)
    if tracker is not None and isinstance(result, torch.Tensor):
        tracker.handed_decode(result, need_size)


def _after_alloc_decode(result: torch.Tensor | None, self: BaseTokenToKVPoolAllocator, seq_lens: torch.Tensor,
                        seq_lens_cpu: torch.Tensor, last_loc: torch.Tensor) -> None:  # fmt: skip
    """Paged decode allocation (``seq_lens_cpu``: lengths with the new token): the host knows which rows open a page,
    so a step that opens none costs nothing."""
    tracker = tracker_of(self)
    if tracker is not None and isinstance(result, torch.Tensor):
        seq = seq_lens_cpu.numpy()
        tracker.handed_decode(result, len(seq) if ((seq - 1) % self.page_size == 0).any() else 0)


def _after_clear(result: None, self: BaseTokenToKVPoolAllocator) -> None:
    old = tracker_of(self)
    start = old.rebuild_start() if old is not None else 0
    num_pages = self.size // self.page_size + 1  # page 0 is SGLang's padding page
    self.__dict__["_quantkit_tracker"] = PoolState(num_pages, self.page_size, self.device, start)


def _before_free_rows(self: ReqToTokenPool, indices: list[int]) -> None:
    tracker: PoolState | None = self.__dict__.get("_quantkit_tracker")
    if tracker is not None and tracker.bound and len(indices):
        tracker.nrec_host[np.asarray(indices, dtype=np.int64)] = 0


def _after_pool_clear(result: None, self: ReqToTokenPool) -> None:
    tracker: PoolState | None = self.__dict__.get("_quantkit_tracker")
    if tracker is not None and tracker.bound:
        tracker.nrec_host[:] = 0


# ---- recording row writes ------------------------------------------------------------------------------------------


def _bind(pool: ReqToTokenPool, allocator: BaseTokenToKVPoolAllocator) -> PoolState | None:
    tracker = tracker_of(allocator)
    if tracker is not None and pool.__dict__.get("_quantkit_tracker") is not tracker:
        pool.__dict__["_quantkit_tracker"] = tracker
        tracker.bind(*pool.req_to_token.shape)
    return tracker


_KEY_MASK = (1 << 62) - 1


def chain_keys(owner: object, tokens: Sequence[int], first: int, end: int, page_size: int) -> np.ndarray:
    """Chained key of the token prefix ending with each page in ``[first, end)`` (deterministic across processes).

    The chain's state is kept on ``owner`` (the request), so keys already computed are never hashed again: a
    request's pages are hashed once over its life, not at every checkpoint."""
    cache: dict[str, tuple[int, int]] = owner.__dict__
    done, key = cache.get("_qk_chain", (0, 0))
    if done > first:
        done, key = 0, 0
    keys = np.empty(max(end - first, 0), dtype=np.int64)
    for j in range(done, end):
        key = hash((key, tuple(tokens[j * page_size : (j + 1) * page_size]))) & _KEY_MASK
        if j >= first:
            keys[j - first] = key
    cache["_qk_chain"] = (max(done, end), key)
    return keys


def record_rows(pool: ReqToTokenPool, allocator: BaseTokenToKVPoolAllocator, rows: Sequence[int],
                seq_lens: Sequence[int], tree_prefix_lens: Sequence[int],
                reqs: Sequence[Req | None] | None = None,
                tokens: Sequence[Sequence[int]] | None = None) -> None:  # fmt: skip
    """Record the not-yet-recorded pages of each row up to ``seq_lens`` (tokens); the first ``tree_prefix_lens``
    tokens of a row that had no record came from the radix tree (whose token ids are ``tokens``, or the requests'
    ``full_untruncated_fill_ids``) and get the tree's adoption stamps."""
    tracker = _bind(pool, allocator)
    if tracker is None or not len(rows):
        return
    ps = tracker.page_size
    rows_a = np.asarray(rows, dtype=np.int64)
    firsts = tracker.nrec_host[rows_a].copy()
    ends = -(-np.asarray(seq_lens, dtype=np.int64) // ps)
    tree = np.where(firsts == 0, np.asarray(tree_prefix_lens, dtype=np.int64) // ps, 0)
    keys = []
    for i in np.flatnonzero((tree > 0) & (ends > firsts)):
        req = reqs[i] if reqs is not None else None
        toks = tokens[i] if tokens is not None else (req.full_untruncated_fill_ids if req is not None else None)
        if toks is None:
            tree[i] = 0
            continue
        n = min(int(tree[i]), int(ends[i]))
        keys.append(chain_keys(req if req is not None else _Scratch(), toks, 0, n, ps))
    tracker.record_spans(pool.req_to_token, rows_a, firsts, ends, tree, np.concatenate(keys) if keys else None)


class _Scratch:
    """A throw-away owner for :func:`chain_keys` when there is no request object to keep the chain on."""


def _after_alloc_for_extend(result: tuple[torch.Tensor, torch.Tensor, torch.Tensor], batch: ScheduleBatch) -> None:
    _, _, rows_cpu = result
    record_rows(batch.req_to_token_pool, batch.tree_cache.token_to_kv_pool_allocator, rows_cpu.tolist(),
                batch.seq_lens_cpu.tolist(), list(batch.prefix_lens), batch.reqs)  # fmt: skip


def _after_alloc_for_decode(result: torch.Tensor, batch: ScheduleBatch, token_per_req: int) -> None:
    pool = batch.req_to_token_pool
    tracker = _bind(pool, batch.tree_cache.token_to_kv_pool_allocator)
    if tracker is None or not len(batch.reqs):
        return
    if token_per_req != 1:
        ends = (batch.seq_lens_cpu + token_per_req).tolist()
        record_rows(pool, batch.tree_cache.token_to_kv_pool_allocator, batch.req_pool_indices_cpu.tolist(), ends,
                    [0] * len(ends))  # fmt: skip
        return
    seq = batch.seq_lens_cpu.numpy()
    tracker.record_decode(pool.req_to_token, result, batch.req_pool_indices, batch.seq_lens,
                          batch.req_pool_indices_cpu.numpy(), seq)  # fmt: skip
    tracker.next_seq = (batch, seq + 1)  # the lengths prepare_for_decode is about to set: the check's extent


def _after_alloc_for_spec_decode(result: None, tree_cache: BasePrefixCache, req_to_token_pool: ReqToTokenPool, *,
                                 reqs: list[Req], nxt_kv_lens_cpu: torch.Tensor, **kwargs: object) -> None:  # fmt: skip
    rows = [int(r.kv.req_pool_idx) for r in reqs]
    record_rows(req_to_token_pool, tree_cache.token_to_kv_pool_allocator, rows, nxt_kv_lens_cpu.tolist(),
                [0] * len(rows))  # fmt: skip


def _after_pre_alloc(result: torch.Tensor, self: DecodePreallocQueue, req: Req,
                     prefix_indices: torch.Tensor | None = None, prefix_len: int | None = None,
                     total_prefix_len: int | None = None) -> None:  # fmt: skip
    end = (total_prefix_len or prefix_len or 0) + len(result)
    record_rows(self.req_to_token_pool, self.token_to_kv_pool_allocator, [int(req.kv.req_pool_idx)], [end],
                [prefix_len or 0], [req], [req.origin_input_ids])  # fmt: skip


def _after_restore(result: None, req: Req, tree_cache: BasePrefixCache, req_to_token_pool: ReqToTokenPool,
                   token_to_kv_pool_allocator: BaseTokenToKVPoolAllocator, backend: str) -> None:  # fmt: skip
    if req.kv.req_pool_idx is not None:
        record_rows(req_to_token_pool, token_to_kv_pool_allocator, [int(req.kv.req_pool_idx)],
                    [int(req.kv.kv_allocated_len)], [0])  # fmt: skip


def _checkpoint_into_tree(original: Original, self: UnifiedRadixCache, req: Req, *args: object,
                          **kwargs: object) -> object:  # fmt: skip
    """The tree adopts the row's pages with the stamps the request recorded, and may rewrite part of the row
    ([cache_protected_len, new path length)) with pages it already held: those get the tree's stamps. Only the
    pages past the old protected prefix are touched (and hashed, once per request: :func:`chain_keys`)."""
    tracker = tracker_of(self.token_to_kv_pool_allocator)
    row = req.kv.req_pool_idx
    if tracker is None or row is None or not tracker.bound or tracker.nrec_host[int(row)] == 0:
        return original(self, req, *args, **kwargs)
    row = int(row)
    ps = tracker.page_size
    before = req.kv.cache_protected_len // ps
    out = original(self, req, *args, **kwargs)
    after = min(req.kv.cache_protected_len // ps, int(tracker.nrec_host[row]))
    if after > before:
        keys = chain_keys(req, req.full_untruncated_fill_ids, before, after, ps)
        tracker.adopt(self.req_to_token_pool.req_to_token, row, before, after, keys)
    return out
