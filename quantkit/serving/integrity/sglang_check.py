"""The plugin's batched check before each decode forward, the TP agreement, and the abort of one request.

See ``sglang_integrity.py`` for the hooks; SGLang is imported only inside the functions.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from quantkit.serving.integrity.sglang_hooks import (
    ABORT_MESSAGE,
    AbortRecord,
    SGLangObject,
    _PoolTracker,
    _row_pages,
    logger,
    state,
    tracker_of,
)
from quantkit.serving.integrity.tracker import DecodeBatch

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["agree_flags", "screen_batch"]

_SCHEDULER: contextvars.ContextVar[SGLangObject | None] = contextvars.ContextVar("quantkit_scheduler", default=None)
_STATE = state()


def agree_flags(flags: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """MAX all-reduce of per-request abort flags over a (gloo) group; unchanged without a group or alone."""
    import torch.distributed as dist

    if not _multi_rank(group):
        return flags
    flags = flags.to(torch.int32).cpu().contiguous()
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    return flags


def _multi_rank(group: ProcessGroup | None) -> bool:
    import torch.distributed as dist

    return group is not None and dist.is_initialized() and dist.get_world_size(group) > 1


def _tp_group(batch: SGLangObject) -> ProcessGroup | None:
    scheduler = _SCHEDULER.get()
    if scheduler is not None and getattr(scheduler, "attn_tp_cpu_group", None) is not None:
        return scheduler.attn_tp_cpu_group
    return getattr(batch.tree_cache, "attn_tp_group", None)


def screen_batch(batch: SGLangObject) -> list[int]:
    """The batched check for a decode batch: abort and filter out every request whose row no longer matches its
    records (on any TP rank); returns the batch indices aborted."""
    tracker = tracker_of(batch.tree_cache.token_to_kv_pool_allocator)
    if tracker is None or not batch.reqs:
        return []
    _STATE.checks += 1
    rows = [int(r) for r in batch.req_pool_indices_cpu.tolist()]
    ps = tracker.page_size
    result = tracker.check(DecodeBatch(rows, rows, batch.req_to_token_pool.req_to_token, ps, ps))
    group = _tp_group(batch)
    if result.clean and not _multi_rank(group):
        return []
    bad_rows = set(result.abort)
    flags = agree_flags(torch.tensor([row in bad_rows for row in rows], dtype=torch.int32), group)
    if not bool(flags.any()):
        return []
    aborted = [i for i, f in enumerate(flags.tolist()) if f]
    for i in aborted:
        _abort(batch, batch.reqs[i], rows[i], tracker)
    keep = [i for i in range(len(rows)) if not flags[i]]
    out_cache_loc = batch.out_cache_loc
    batch.filter_batch(keep_indices=keep)
    if keep and out_cache_loc is not None and out_cache_loc.numel() == len(rows):  # filter_batch drops it
        batch.out_cache_loc = out_cache_loc[torch.tensor(keep, device=out_cache_loc.device)]
    return aborted


Mismatch = tuple[tuple[int, int, int, int], torch.Tensor, torch.Tensor]


def _mismatch(tracker: _PoolTracker, pool: SGLangObject, row: int, protected: int) -> Mismatch:
    """(first bad: row page, recorded page, recorded tag, live tag), the row's pages at bad positions (not to be
    freed), and recorded pages the row lost that the request still owns (freed so they do not leak)."""
    led_pages, led_tags = tracker.ledger.entries(row)
    led_pages = led_pages.long()
    now = _row_pages(tracker, pool, row, 0, led_pages.numel())
    valid = (now >= 0) & (now < tracker.table.num_pages)
    live = tracker.table.lookup(now.clamp(0, tracker.table.num_pages - 1))
    bad = ~valid | (now != led_pages) | (live != led_tags)
    idx = bad.nonzero().flatten()
    if idx.numel() == 0:  # flagged by a peer rank only
        return (-1, -1, -1, -1), now[:0], now[:0]
    j = int(idx[0])
    lost = bad & (now != led_pages) & (tracker.table.lookup(led_pages) == led_tags)
    lost[: protected // tracker.page_size] = False  # the tree's prefix is not the request's to free
    first = (int(now[j]), int(led_pages[j]), int(led_tags[j]), int(live[j]))
    return first, now[bad & valid], led_pages[lost]


def _abort(batch: SGLangObject, req: SGLangObject, row: int, tracker: _PoolTracker) -> None:
    from sglang.srt.managers.schedule_batch import FINISH_ABORT
    from sglang.srt.mem_cache.common import release_kv_cache

    pool, allocator = batch.req_to_token_pool, batch.tree_cache.token_to_kv_pool_allocator
    first, bad_pages, lost = _mismatch(tracker, pool, row, int(req.kv.cache_protected_len))
    page, expected_page, expected_tag, actual_tag = first
    logger.error(
        "KV page integrity: aborting request %s (row %d): page %d, expected page %d tag %d, live tag %d "
        "(%d mismatching page(s))", req.rid, row, page, expected_page, expected_tag, actual_tag, bad_pages.numel(),
    )  # fmt: skip
    row_pages = tuple(_row_pages(tracker, pool, row, 0, tracker.ledger.length(row)).tolist())
    _STATE.aborts.append(AbortRecord(str(req.rid), row, page, expected_page, expected_tag, actual_tag, row_pages))
    req.finished_reason = FINISH_ABORT(ABORT_MESSAGE, 500)
    scheduler = _SCHEDULER.get()
    if scheduler is not None:
        scheduler.output_streamer.stream_output([req], req.return_logprob)
    # someone else's now (or already free): never free them again -- except a page handed to two holders at once,
    # which is on no free list: the first of its holders to be aborted gives it back
    back = [p for p in set(bad_pages.tolist()) if p in tracker.handed_twice]
    tracker.handed_twice.difference_update(back)
    _STATE.skip = bad_pages[~torch.isin(bad_pages, torch.tensor(back, dtype=torch.int64))]
    try:
        release_kv_cache(req, batch.tree_cache, checkpoint=False)
    finally:
        _STATE.skip = None
    if lost.numel():
        allocator.free_page_ids(lost)


def _prepare_for_decode(original: Callable[..., Any], self: SGLangObject, *args: Any, **kwargs: Any) -> Any:
    """The check runs after this step's decode allocation (which may hand a page freed twice to a second holder)
    and before the forward; aborted requests leave the batch with their decode slot."""
    out = original(self, *args, **kwargs)
    screen_batch(self)
    return out


def _update_running_batch(original: Callable[..., Any], self: SGLangObject, *args: Any, **kwargs: Any) -> Any:
    token = _SCHEDULER.set(self)
    try:
        return original(self, *args, **kwargs)
    finally:
        _SCHEDULER.reset(token)
