"""The KV-integrity plugin's state and its memory hooks (frees, allocations, row records); the entry point,
its hook table and the overview are in ``sglang.py``, the check and the abort in ``sglang_check.py``."""


from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from quantkit.serving.integrity.tags import _occurrence_rank
from quantkit.serving.integrity.tracker import TagTracker

__all__ = ["ENV", "ENABLE_VALUE", "AbortRecord", "enabled", "record_rows", "state", "tracker_of"]

ENV = "QUANTKIT_KV_INTEGRITY"
ENABLE_VALUE = "tags"
ABORT_MESSAGE = "KV page integrity check failed (quantkit)"
NEVER = -3  # a recorded tag that never matches (live tags start at 0 and only grow)
logger = logging.getLogger("quantkit.kv_integrity")
SGLangObject = Any  # allocator / pool / batch / request / tree: SGLang's classes, importable only with SGLang


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


@dataclass
class _State:
    registered: bool = False
    aborts: list[AbortRecord] = field(default_factory=list)
    checks: int = 0
    skip: torch.Tensor | None = None  # pages not to free while an aborted request is released


_STATE = _State()


def state() -> _State:
    """The plugin's process-wide state (aborts so far, checks run)."""
    return _STATE


def enabled() -> bool:
    return os.environ.get(ENV, "").strip().lower() == ENABLE_VALUE


# ---- per-allocator tracker -----------------------------------------------------------------------------------------


class _PoolTracker(TagTracker):
    """TagTracker plus, per page, the tag the radix tree took it with (-1: not the tree's) and the key of the token
    prefix it held then (a freed page re-adopted under another prefix does not vouch for a stale node)."""

    def __init__(self, num_pages: int, page_size: int, device: torch.device | str, start: int = 0) -> None:
        super().__init__(num_pages, device)
        self.page_size = page_size
        if start:
            self.table.tags.fill_(start)
        self.tree_tags = torch.full((num_pages,), -1, dtype=torch.int64, device=self.device)
        self.tree_keys = torch.zeros(num_pages, dtype=torch.int64, device=self.device)
        self.handed_twice: set[int] = set()  # pages given to two holders at once: the first abort frees them

    def freed(self, pages: torch.Tensor) -> None:
        self.table.bump(pages)
        self.tree_tags[pages] = -1

    def tree_tag(self, pages: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """The tag a page attached from the tree must carry: the adoption tag if the tree adopted it under this
        prefix, else NEVER."""
        tags = self.tree_tags[pages]
        return torch.where(self.tree_keys[pages] == keys, tags, torch.full_like(tags, NEVER))


_KEY_MASK = (1 << 62) - 1


def page_keys(tokens: Sequence[int], first: int, end: int, page_size: int) -> torch.Tensor:
    """Chained key of the token prefix ending with each page in [first, end) (deterministic across processes)."""
    key, keys = 0, []
    for j in range(end):
        key = hash((key, tuple(tokens[j * page_size : (j + 1) * page_size]))) & _KEY_MASK
        if j >= first:
            keys.append(key)
    return torch.tensor(keys, dtype=torch.int64)


def tracker_of(allocator: SGLangObject) -> _PoolTracker | None:
    return allocator.__dict__.get("_quantkit_tracker")


def _pages_of_slots(slots: torch.Tensor, page_size: int) -> torch.Tensor:
    """Pages whose first slot is in ``slots``: the pages an allocation handed out anew."""
    slots = slots.long()
    if page_size > 1:
        slots = slots[slots % page_size == 0]
    return slots // page_size


def _unskipped(pages: torch.Tensor) -> torch.Tensor:
    skip = _STATE.skip
    if skip is None or pages.numel() == 0:
        return pages
    return pages[~torch.isin(pages.long(), skip)]


# ---- free / alloc / clear hooks ------------------------------------------------------------------------------------


def _release_page_ids(original: Callable[..., Any], self: SGLangObject, *page_ids: torch.Tensor) -> Any:
    kept = tuple(_unskipped(ids) for ids in page_ids)
    tracker = tracker_of(self)
    if tracker is not None:
        for ids in kept:
            tracker.freed(ids.long())
    return original(self, *kept)


def _token_free(original: Callable[..., Any], self: SGLangObject, free_index: torch.Tensor) -> Any:
    free_index = _unskipped(free_index)
    tracker = tracker_of(self)
    if tracker is not None and self.free_group is None and free_index.numel():
        tracker.freed(free_index.long())
    return original(self, free_index)


def _after_alloc(result: torch.Tensor | None, self: SGLangObject, *args: Any, **kwargs: Any) -> None:
    tracker = tracker_of(self)
    if tracker is not None and isinstance(result, torch.Tensor) and result.numel():
        tracker.table.bump(_pages_of_slots(result, self.page_size))


def _after_clear(result: None, self: SGLangObject) -> None:
    old = tracker_of(self)
    start = int(old.table.tags.max()) + 1 if old is not None else 0
    num_pages = self.size // self.page_size + 1  # page 0 is SGLang's padding page
    self.__dict__["_quantkit_tracker"] = _PoolTracker(num_pages, self.page_size, self.device, start)


def _before_free_rows(self: SGLangObject, indices: list[int]) -> None:
    tracker = self.__dict__.get("_quantkit_tracker")
    if tracker is not None:
        for row in indices:
            tracker.on_release(int(row))


def _after_pool_clear(result: None, self: SGLangObject) -> None:
    tracker = self.__dict__.get("_quantkit_tracker")
    if tracker is not None:
        for row in list(tracker.ledger._segments):
            tracker.on_release(row)


# ---- recording row writes ------------------------------------------------------------------------------------------


def _bind(pool: SGLangObject, allocator: SGLangObject) -> _PoolTracker | None:
    tracker = tracker_of(allocator)
    if tracker is not None:
        pool.__dict__["_quantkit_tracker"] = tracker
    return tracker


def _row_pages(tracker: _PoolTracker, pool: SGLangObject, row: int, first: int, end: int) -> torch.Tensor:
    ps = tracker.page_size
    return pool.req_to_token[row, first * ps : end * ps : ps].long() // ps


def record_rows(pool: SGLangObject, allocator: SGLangObject, rows: list[int], seq_lens: list[int],
                tree_prefix_lens: list[int], tokens: Sequence[Sequence[int] | None] | None = None) -> None:  # fmt: skip
    """Record the not-yet-recorded pages of each row up to ``seq_lens``; the first ``tree_prefix_lens`` tokens
    of a row that had no record came from the radix tree (whose token ids are ``tokens``) and get the tree's
    adoption tags."""
    tracker = _bind(pool, allocator)
    if tracker is None:
        return
    ps = tracker.page_size
    spans, pages, from_tree, keys = [], [], [], []
    for i, (row, seq_len, tree_len) in enumerate(zip(rows, seq_lens, tree_prefix_lens, strict=True)):
        have = tracker.ledger.length(row)
        end = -(-seq_len // ps)
        if end <= have:
            continue
        p = _row_pages(tracker, pool, row, have, end)
        tree_pages = tree_len // ps if have == 0 else 0
        mask = torch.zeros(end - have, dtype=torch.bool)
        mask[:tree_pages] = True
        k = torch.zeros(end - have, dtype=torch.int64)
        if tree_pages and tokens is not None and tokens[i] is not None:
            k[:tree_pages] = page_keys(tokens[i], 0, tree_pages, ps)
        spans.append((row, p.numel()))
        pages.append(p)
        from_tree.append(mask)
        keys.append(k)
    if not spans:
        return
    pages_t, tree_t = torch.cat(pages), torch.cat(from_tree)
    tags = torch.where(tree_t, tracker.tree_tag(pages_t, torch.cat(keys)), _fresh_tags(tracker, pages_t, ~tree_t))
    start = 0
    for row, n in spans:
        tracker.ledger.append(row, pages_t[start : start + n], tags[start : start + n])
        start += n


def _fresh_tags(tracker: _PoolTracker, pages: torch.Tensor, fresh: torch.Tensor) -> torch.Tensor:
    """Live tags of newly handed-out pages. A page handed out twice in one call (it was freed twice) is written by
    two prefills in one forward: no holder's data is intact, so every occurrence records a tag that never matches."""
    live = tracker.table.lookup(pages)
    sel = pages[fresh]
    if sel.numel() > 1 and torch.unique(sel).numel() != sel.numel():
        dup = torch.zeros_like(fresh)
        dup[fresh] = (_occurrence_rank(sel) > 0) | (_occurrence_rank(sel.flip(0)).flip(0) > 0)
        tracker.handed_twice.update(pages[dup].tolist())
        return torch.where(dup, torch.full_like(live, NEVER), live)
    return live


def _after_alloc_for_extend(result: tuple, batch: SGLangObject) -> None:
    _, _, rows_cpu = result
    rows = [int(r) for r in rows_cpu.tolist()]
    record_rows(batch.req_to_token_pool, batch.tree_cache.token_to_kv_pool_allocator, rows,
                [int(s) for s in batch.seq_lens_cpu.tolist()], list(batch.prefix_lens),
                [r.full_untruncated_fill_ids for r in batch.reqs])  # fmt: skip


def _after_alloc_for_decode(result: torch.Tensor, batch: SGLangObject, token_per_req: int) -> None:
    allocator = batch.tree_cache.token_to_kv_pool_allocator
    tracker = _bind(batch.req_to_token_pool, allocator)
    if tracker is None or not len(batch.reqs):
        return
    ps = tracker.page_size
    rows = batch.req_pool_indices_cpu.long()
    seq = batch.seq_lens_cpu.long()
    if token_per_req == 1:
        new = (seq % ps == 0).nonzero().flatten()
        rows_new = rows[new].tolist()
        if all(tracker.ledger.length(r) == s // ps for r, s in zip(rows_new, seq[new].tolist(), strict=True)):
            pages = result.long()[new] // ps
            fresh = torch.ones_like(pages, dtype=torch.bool)
            tracker.ledger.append_many(rows_new, pages, _fresh_tags(tracker, pages, fresh))
            return
    ends = (seq + token_per_req).tolist()
    record_rows(batch.req_to_token_pool, allocator, rows.tolist(), ends, [0] * len(ends))


def _after_alloc_for_spec_decode(result: None, tree_cache: SGLangObject, req_to_token_pool: SGLangObject,
                                 **kwargs: Any) -> None:  # fmt: skip
    rows = [int(r.kv.req_pool_idx) for r in kwargs["reqs"]]
    ends = [int(n) for n in kwargs["nxt_kv_lens_cpu"].tolist()]
    record_rows(req_to_token_pool, tree_cache.token_to_kv_pool_allocator, rows, ends, [0] * len(rows))


def _after_pre_alloc(result: torch.Tensor, self: SGLangObject, req: SGLangObject,
                     prefix_indices: torch.Tensor | None = None, prefix_len: int | None = None,
                     total_prefix_len: int | None = None) -> None:  # fmt: skip
    end = (total_prefix_len or prefix_len or 0) + len(result)
    record_rows(self.req_to_token_pool, self.token_to_kv_pool_allocator, [int(req.kv.req_pool_idx)], [end],
                [prefix_len or 0], [req.origin_input_ids])  # fmt: skip


def _after_restore(result: None, req: SGLangObject, tree_cache: SGLangObject, req_to_token_pool: SGLangObject,
                   token_to_kv_pool_allocator: SGLangObject, backend: str) -> None:  # fmt: skip
    if req.kv.req_pool_idx is not None:
        record_rows(req_to_token_pool, token_to_kv_pool_allocator, [int(req.kv.req_pool_idx)],
                    [int(req.kv.kv_allocated_len)], [0])  # fmt: skip


def _checkpoint_into_tree(original: Callable[..., Any], self: SGLangObject, req: SGLangObject, *args: Any,
                          **kwargs: Any) -> Any:  # fmt: skip
    """The tree adopts the row's pages with the tags the request recorded, and may rewrite part of the row
    ([cache_protected_len, new path length)) with pages it already held: those get the tree's tags."""
    tracker = tracker_of(self.token_to_kv_pool_allocator)
    row = req.kv.req_pool_idx
    if tracker is None or row is None or int(row) not in tracker.ledger:
        return original(self, req, *args, **kwargs)
    row = int(row)
    ps = tracker.page_size
    before = req.kv.cache_protected_len // ps
    out = original(self, req, *args, **kwargs)
    after = min(req.kv.cache_protected_len // ps, tracker.ledger.length(row))
    if after <= 0:
        return out
    led_pages, led_tags = tracker.ledger.entries(row)
    now = _row_pages(tracker, self.req_to_token_pool, row, 0, after)
    same = now == led_pages[:after].long()
    rewritten = ~same
    rewritten[:before] = False  # the tree writes only past the old protected prefix; other changes stay suspect
    adopt = same.clone()
    adopt[:before] = False
    keys = page_keys(req.full_untruncated_fill_ids, 0, after, ps)
    tracker.tree_tags[now[adopt]] = led_tags[:after][adopt]
    tracker.tree_keys[now[adopt]] = keys[adopt]
    if bool(rewritten.any()):
        idx = rewritten.nonzero().flatten()
        led_pages[idx] = now[idx].to(led_pages.dtype)
        led_tags[idx] = tracker.tree_tag(now[idx], keys[idx])
    return out
