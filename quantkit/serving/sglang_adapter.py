"""Where the integrity hooks go in SGLang, as code that runs without SGLang installed.

SGLang keeps three structures (``sglang.srt.mem_cache``): ``ReqToTokenPool.req_to_token`` — one row of KV
slot indices per running request (the block table the attention backends read); the token-to-KV pool
allocator (``TokenToKVPoolAllocator`` / ``PagedTokenToKVPoolAllocator``: ``alloc``/``alloc_extend``/
``alloc_decode`` hand out slots, ``free`` returns them); and the ``RadixCache`` whose ``TreeNode.value``
holds the slots of cached prefixes. The hooks, with their call sites:

=====================  ========================================================================
hook                   SGLang call site
=====================  ========================================================================
``wrap_allocator``     model runner, where the allocator is built: every ``free`` (request finish,
                       ``RadixCache.evict``, abort) then bumps the tags of the freed pages
``after_alloc``        ``ScheduleBatch.prepare_for_extend`` / ``prepare_for_decode``, after
                       ``out_cache_loc`` is split per request and written to ``req_to_token``
``after_prefix_match`` ``prepare_for_extend``, where ``req.prefix_indices`` (from
                       ``RadixCache.match_prefix``) are written to ``req_to_token``; pass the tags
                       stored on the matched ``TreeNode``\\s
``tags_for_insert``    ``RadixCache.cache_finished_req`` / ``cache_unfinished_req``: store the returned
                       tags on the new ``TreeNode`` next to ``value``
``on_release``         ``ReqToTokenPool.free(req_pool_idx)``
``pre_decode``         ``Scheduler.run_batch``, after ``prepare_for_decode`` and before
                       ``forward_batch_generation``: abort the returned rows
                       (``req.to_finish = FINISH_ABORT(...)``, ``batch.filter_batch``)
=====================  ========================================================================

The ledger key is the request's ``req_pool_idx``: it identifies the request for as long as it holds a row.
With ``page_size > 1`` the table holds token slots, so the check reads every ``page_size``-th column and
divides by the page size (``col_stride = page_div = page_size``); nothing is copied.
"""

from __future__ import annotations

from typing import Any

import torch

from quantkit.serving.tracker import CLEAN, CheckResult, DecodeBatch, NoOpTracker, TagTracker

__all__ = ["SGLangIntegrityHooks"]


class SGLangIntegrityHooks:
    """Translate SGLang's slot-level events into tracker calls.

    :param tracker: a ``TagTracker`` or ``NoOpTracker`` (from ``make_tracker``).
    :param req_to_token: ``ReqToTokenPool.req_to_token`` (rows x max context, int32, on the pool device).
    :param page_size: the server's ``--page-size``.
    """

    def __init__(self, tracker: TagTracker | NoOpTracker, req_to_token: torch.Tensor, page_size: int = 1):
        if page_size <= 0:
            raise ValueError(f"page_size must be positive, got {page_size}")
        self.tracker = tracker
        self.req_to_token = req_to_token
        self.page_size = page_size

    def _pages(self, slots: torch.Tensor, first_of_page_only: bool) -> torch.Tensor:
        slots = slots.long()
        if first_of_page_only and self.page_size > 1:
            slots = slots[slots % self.page_size == 0]
        return slots // self.page_size

    def wrap_allocator(self, allocator: Any) -> Any:
        """A proxy of ``allocator`` whose ``free`` also bumps the freed pages' tags."""
        return _FreeHookedAllocator(allocator, self)

    def on_free_slots(self, slots: torch.Tensor) -> None:
        """Slots returned to the pool; each page is bumped once per free call that names it."""
        if self.tracker.enabled and slots.numel():
            self.tracker.on_free(torch.unique(slots.long() // self.page_size))

    def after_alloc(self, req_pool_idx: int, slots: torch.Tensor) -> torch.Tensor | None:
        """New slots of one request (extend or decode); pages starting in ``slots`` are recorded."""
        if not self.tracker.enabled:
            return None
        return self.tracker.on_alloc(req_pool_idx, self._pages(slots, first_of_page_only=True))

    def after_prefix_match(self, req_pool_idx: int, prefix_slots: torch.Tensor, tags: torch.Tensor) -> None:
        """Prefix slots attached from the radix cache, with the tags stored on the matched nodes."""
        if self.tracker.enabled and prefix_slots.numel():
            self.tracker.on_attach(req_pool_idx, self._pages(prefix_slots, first_of_page_only=True), tags)

    def tags_for_insert(self, req_pool_idx: int, first_page: int, num_pages: int) -> torch.Tensor | None:
        """Tags the radix cache must keep for pages [first_page, first_page + num_pages) of a request."""
        if not self.tracker.enabled:
            return None
        _, tags = self.tracker.ledger.entries(req_pool_idx)
        return tags[first_page : first_page + num_pages].clone()

    def on_release(self, req_pool_idx: int) -> None:
        self.tracker.on_release(req_pool_idx)

    def pre_decode(self, req_pool_indices: list[int]) -> CheckResult:
        """The batched check for a decode batch; ``abort`` lists the ``req_pool_idx`` to abort."""
        if not self.tracker.enabled:
            return CLEAN
        batch = DecodeBatch(
            list(req_pool_indices), list(req_pool_indices), self.req_to_token, self.page_size, self.page_size
        )
        return self.tracker.check(batch)


class _FreeHookedAllocator:
    """Forwards everything to the wrapped allocator; ``free`` bumps tags first."""

    def __init__(self, inner: Any, hooks: SGLangIntegrityHooks) -> None:
        self._inner = inner
        self._hooks = hooks

    def free(self, free_index: torch.Tensor) -> Any:
        self._hooks.on_free_slots(free_index)
        return self._inner.free(free_index)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)
