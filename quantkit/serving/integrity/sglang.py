"""KV-page integrity inside SGLang 0.5.23: the tag tracker as an SGLang plugin (no fork).

Enable with ``QUANTKIT_KV_INTEGRITY=tags`` in the server's environment. SGLang's ``load_plugins()`` (entry point
``quantkit_kv_integrity`` in group ``sglang.srt.plugins``) calls :func:`register`; unset (or any other value) it
registers no hook at all, so SGLang runs unchanged and pays nothing.

Hooks, all through ``sglang.srt.plugins.hook_registry.HookRegistry`` (it patches class attributes and re-exported
bindings):

===========================================================  ========================================================
SGLang target                                                what the plugin does
===========================================================  ========================================================
``PagedTokenToKVPoolAllocator._release_page_ids`` (AROUND)   every paged free ends here: bump the pages' tags
``TokenToKVPoolAllocator.free`` (AROUND)                     page size 1 (ungrouped frees; a free group ends here too)
``*.alloc`` / ``alloc_extend`` / ``alloc_decode`` (AFTER)    bump the newly handed-out pages (a page freed twice and
                                                             handed out twice leaves only its last holder matching)
``*.clear`` (AFTER; ``resize`` calls it)                     new tag table, every old record stale
``ReqToTokenPool.free_rows`` / ``clear`` (BEFORE / AFTER)    forget the rows' records
``mem_cache.allocation.alloc_for_extend`` (AFTER)            record (page, tag) of each row's new pages; pages
                                                             attached from the radix tree get the tag the tree took
                                                             them with, not the live one
``mem_cache.allocation.alloc_for_decode`` (AFTER)            record the page a decode step opened
``mem_cache.allocation.alloc_for_spec_decode`` (AFTER)       record speculative-decode pages
``UnifiedRadixCache.checkpoint_into_tree`` (AROUND)          the tree adopts the row's pages (keeps their tags) and
                                                             rewrites the row with its own pages (re-recorded)
``disaggregation.decode.DecodePreallocQueue._pre_alloc``     PD decode pre-allocation: record the row
``mem_cache.common.restore_kv_cache`` (AFTER)                retraction restore (host pool / CPU tensor backup)
``ScheduleBatch.prepare_for_decode`` (AROUND)                the batched check after the step's allocation, before its
                                                             forward; mismatching requests are aborted and filtered
                                                             out of the batch
``Scheduler.update_running_batch`` (AROUND)                  makes the scheduler known to the check (to stream aborts)
===========================================================  ========================================================

The tag table and the per-row ledger are the project's :class:`~quantkit.serving.integrity.tracker.TagTracker` (one per
allocator, keyed by ``req_pool_idx``). The check aborts a request with ``FINISH_ABORT`` (HTTP 500), streams it,
releases its row without freeing the pages whose tag no longer matches (they belong to someone else now), and logs
one line naming request, row, page, expected and actual tag. The TP ranks of the attention group all-reduce the
abort flags (MAX) first, as SGLang's PD checksum does, or the ranks would run different batches and hang.

The state and the memory hooks are in ``sglang_hooks.py``, the check and the abort in ``sglang_check.py``. SGLang
is imported only inside the hooks and :func:`register`: the modules import without SGLang.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from quantkit.serving.integrity.sglang_check import _prepare_for_decode, _update_running_batch
from quantkit.serving.integrity.sglang_hooks import (
    _STATE,
    ENABLE_VALUE,
    ENV,
    AbortRecord,
    _after_alloc,
    _after_alloc_for_decode,
    _after_alloc_for_extend,
    _after_alloc_for_spec_decode,
    _after_clear,
    _after_pool_clear,
    _after_pre_alloc,
    _after_restore,
    _before_free_rows,
    _checkpoint_into_tree,
    _release_page_ids,
    _token_free,
    enabled,
    logger,
    record_rows,
    state,
    tracker_of,
)

__all__ = ["ENV", "ENABLE_VALUE", "AbortRecord", "enabled", "hook_table", "record_rows", "register", "state",
           "tracker_of"]


# ---- registration --------------------------------------------------------------------------------------------------

_MC = "sglang.srt.mem_cache"
_ALLOCATORS = (f"{_MC}.allocator.paged.PagedTokenToKVPoolAllocator", f"{_MC}.allocator.token.TokenToKVPoolAllocator")


def hook_table() -> list[tuple[str, Callable[..., Any], str]]:
    """(target, hook, hook type name) for every hook the plugin registers."""
    paged, token = _ALLOCATORS
    table: list[tuple[str, Callable[..., Any], str]] = [
        (f"{paged}._release_page_ids", _release_page_ids, "AROUND"),
        (f"{token}.free", _token_free, "AROUND"),
        (f"{_MC}.memory_pool.ReqToTokenPool.free_rows", _before_free_rows, "BEFORE"),
        (f"{_MC}.memory_pool.ReqToTokenPool.clear", _after_pool_clear, "AFTER"),
        (f"{_MC}.allocation.alloc_for_extend", _after_alloc_for_extend, "AFTER"),
        (f"{_MC}.allocation.alloc_for_decode", _after_alloc_for_decode, "AFTER"),
        (f"{_MC}.allocation.alloc_for_spec_decode", _after_alloc_for_spec_decode, "AFTER"),
        (f"{_MC}.common.restore_kv_cache", _after_restore, "AFTER"),
        (f"{_MC}.unified_radix_cache.UnifiedRadixCache.checkpoint_into_tree", _checkpoint_into_tree, "AROUND"),
        ("sglang.srt.disaggregation.decode.DecodePreallocQueue._pre_alloc", _after_pre_alloc, "AFTER"),
        ("sglang.srt.managers.schedule_batch.ScheduleBatch.prepare_for_decode", _prepare_for_decode, "AROUND"),
        ("sglang.srt.managers.scheduler.Scheduler.update_running_batch", _update_running_batch, "AROUND"),
    ]
    for cls in _ALLOCATORS:
        table.append((f"{cls}.clear", _after_clear, "AFTER"))
    table.append((f"{paged}.alloc", _after_alloc, "AFTER"))
    table.append((f"{paged}.alloc_extend", _after_alloc, "AFTER"))
    table.append((f"{paged}.alloc_decode", _after_alloc, "AFTER"))
    table.append((f"{token}.alloc", _after_alloc, "AFTER"))
    return table


# Scheduler-side modules: imported in the scheduler process before it calls load_plugins(); elsewhere (the
# engine's main process, the detokenizer, a test driving the memory code alone) they are not hooked.
_SCHEDULER_MODULES = ("sglang.srt.disaggregation.decode", "sglang.srt.managers.scheduler")


def register() -> None:
    """SGLang plugin entry point: register the hooks when ``QUANTKIT_KV_INTEGRITY=tags``, else nothing."""
    if not enabled() or _STATE.registered:
        return
    import sys

    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    count = 0
    for target, hook, kind in hook_table():
        if target.startswith(_SCHEDULER_MODULES) and target.rsplit(".", 2)[0] not in sys.modules:
            continue
        HookRegistry.register(target, hook, HookType[kind])
        count += 1
    _STATE.registered = True
    logger.info("quantkit KV page integrity: %d hooks registered", count)
