"""KV-page integrity inside SGLang 0.5.23: the tag tracker as an SGLang plugin (no fork).

Enable with ``QUANTKIT_KV_INTEGRITY=tags`` in the server's environment. SGLang's ``load_plugins()`` (entry point
``quantkit_kv_integrity`` in group ``sglang.srt.plugins``) calls :func:`register`; unset (or any other value) it
registers no hook at all, so SGLang runs unchanged and pays nothing.

Hooks, all through ``sglang.srt.plugins.hook_registry.HookRegistry`` (it patches class attributes and re-exported
bindings). None of them reads the device on a clean decode step (``state.py``; counted in
``tests/engines/run_sglang_integrity_syncs.py``):

==============================================================  =====================================================
SGLang target                                                   what the plugin does
==============================================================  =====================================================
``PagedTokenToKVPoolAllocator._release_page_ids`` (AROUND)      every paged free ends here: bump the pages' stamps
``PagedTokenToKVPoolAllocator.free`` / ``free_page_ids``        (AROUND) an aborted request's release skips pages
                                                                that are someone else's now
``TokenToKVPoolAllocator.free`` (AROUND)                        page size 1: both of the above
``PagedTokenToKVPoolAllocator.alloc`` / ``alloc_extend``        (AFTER) bump the pages they opened
``PagedTokenToKVPoolAllocator.alloc_decode``,                   (AFTER) bump, keeping the stamps from before for the
``TokenToKVPoolAllocator.alloc``                                decode record (a page handed out twice in one call
                                                                matches neither holder)
``*.clear`` (AFTER; ``resize`` calls it)                        new stamp table, every old record stale
``ReqToTokenPool.free_rows`` / ``clear`` (BEFORE / AFTER)       forget the rows' records (host mirror only)
``mem_cache.allocation.alloc_for_extend`` (AFTER)               record each row's new pages; pages attached from the
                                                                radix tree get the stamp the tree took them with
``mem_cache.allocation.alloc_for_decode`` (AFTER)               record the page a decode step opened (device only)
``mem_cache.allocation.alloc_for_spec_decode`` (AFTER)          record speculative-decode pages
``UnifiedRadixCache.checkpoint_into_tree`` (AROUND)             the tree adopts the row's pages (keeps their stamps);
                                                                rows it rewrites are re-recorded
``disaggregation.decode.DecodePreallocQueue._pre_alloc``        PD decode pre-allocation: record the row
``mem_cache.common.restore_kv_cache`` (AFTER)                   retraction restore (host pool / CPU tensor backup)
``ScheduleBatch.prepare_for_decode`` (AROUND)                   enqueue the batched check (no read back, no abort)
``TpModelWorker.forward_batch_generation`` (AFTER)              the batch's verdict onto the result (device)
``GenerationBatchResult.copy_to_cpu`` (AROUND)                  the verdict into the ids SGLang copies to the host
``SchedulerBatchResultProcessor._normalize_decode_outputs``     (AROUND) a negative id aborts its request before any
                                                                of the step's tokens is appended or streamed
``mem_cache.common.release_kv_cache`` (AROUND)                  an aborted request's release: skip / free pages
==============================================================  =====================================================

The state is the project's :class:`~quantkit.serving.integrity.state.PoolState` (one per allocator, rows keyed by
``req_pool_idx``). An aborted request gets ``FINISH_ABORT`` (HTTP 500) through SGLang's own finish path and stream,
is released without freeing the pages whose stamp no longer matches (they belong to someone else now), and one line
is logged naming request, row, page, expected and live tag. TP ranks agree without a collective (the verdict is a
function of the scheduler's replicated bookkeeping); ``QUANTKIT_KV_INTEGRITY_TP_SYNC=1`` adds a device all-reduce.

The state and the memory hooks are in ``sglang_hooks.py``, the check, the verdict and the abort in
``sglang_check.py``. SGLang is imported only inside the hooks and :func:`register`: the modules import without it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Literal

from quantkit.serving.integrity import sglang_check as check
from quantkit.serving.integrity import sglang_hooks as hooks
from quantkit.serving.integrity.sglang_hooks import (
    _STATE,
    ABORT_MESSAGE,
    ENABLE_VALUE,
    ENV,
    AbortRecord,
    enabled,
    logger,
    record_rows,
    state,
    tracker_of,
)

__all__ = ["ABORT_MESSAGE", "ENV", "ENABLE_VALUE", "AbortRecord", "enabled", "hook_table", "record_rows", "register",
           "state", "tracker_of"]

HookKind = Literal["BEFORE", "AFTER", "AROUND"]

# ---- registration --------------------------------------------------------------------------------------------------

_MC = "sglang.srt.mem_cache"
_MGR = "sglang.srt.managers"
_PAGED = f"{_MC}.allocator.paged.PagedTokenToKVPoolAllocator"
_TOKEN = f"{_MC}.allocator.token.TokenToKVPoolAllocator"


def hook_table() -> list[tuple[str, Callable[..., object], HookKind]]:
    """(target, hook, hook type) for every hook the plugin registers."""
    return [
        (f"{_PAGED}._release_page_ids", hooks._release_page_ids, "AROUND"),
        (f"{_PAGED}.free", hooks._paged_free, "AROUND"),
        (f"{_PAGED}.free_page_ids", hooks._paged_free_page_ids, "AROUND"),
        (f"{_TOKEN}.free", hooks._token_free, "AROUND"),
        (f"{_MC}.memory_pool.ReqToTokenPool.free_rows", hooks._before_free_rows, "BEFORE"),
        (f"{_MC}.memory_pool.ReqToTokenPool.clear", hooks._after_pool_clear, "AFTER"),
        (f"{_MC}.allocation.alloc_for_extend", hooks._after_alloc_for_extend, "AFTER"),
        (f"{_MC}.allocation.alloc_for_decode", hooks._after_alloc_for_decode, "AFTER"),
        (f"{_MC}.allocation.alloc_for_spec_decode", hooks._after_alloc_for_spec_decode, "AFTER"),
        (f"{_MC}.common.restore_kv_cache", hooks._after_restore, "AFTER"),
        (f"{_MC}.common.release_kv_cache", check._release_kv_cache, "AROUND"),
        (f"{_MC}.unified_radix_cache.UnifiedRadixCache.checkpoint_into_tree", hooks._checkpoint_into_tree, "AROUND"),
        ("sglang.srt.disaggregation.decode.DecodePreallocQueue._pre_alloc", hooks._after_pre_alloc, "AFTER"),
        (f"{_MGR}.schedule_batch.ScheduleBatch.prepare_for_decode", check._prepare_for_decode, "AROUND"),
        (f"{_MGR}.tp_worker.TpModelWorker.forward_batch_generation", check._after_forward, "AFTER"),
        (f"{_MGR}.utils.GenerationBatchResult.copy_to_cpu", check._copy_to_cpu, "AROUND"),
        (f"{_MGR}.scheduler_components.batch_result_processor.SchedulerBatchResultProcessor._normalize_decode_outputs",
         check._normalize_decode_outputs, "AROUND"),
        (f"{_PAGED}.clear", hooks._after_clear, "AFTER"),
        (f"{_TOKEN}.clear", hooks._after_clear, "AFTER"),
        (f"{_PAGED}.alloc", hooks._after_alloc, "AFTER"),
        (f"{_PAGED}.alloc_extend", hooks._after_alloc, "AFTER"),
        (f"{_PAGED}.alloc_decode", hooks._after_alloc_decode, "AFTER"),
        (f"{_TOKEN}.alloc", hooks._after_token_alloc, "AFTER"),
    ]


# Modules of the scheduler's side (forward, result processing, PD decode): hooked in the scheduler process (which
# imports sglang.srt.managers.scheduler before it calls load_plugins()) or where they are already imported (a test
# driving them); elsewhere (the engine's main process, the detokenizer) registering them would import the model
# runner for nothing.
_SCHEDULER_SIDE = ("sglang.srt.disaggregation.decode", f"{_MGR}.scheduler", f"{_MGR}.tp_worker",
                   f"{_MGR}.scheduler_components.batch_result_processor")  # fmt: skip


def register() -> None:
    """SGLang plugin entry point: register the hooks when ``QUANTKIT_KV_INTEGRITY=tags``, else nothing."""
    if not enabled() or _STATE.registered:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    in_scheduler = f"{_MGR}.scheduler" in sys.modules
    count = 0
    for target, hook, kind in hook_table():
        side = next((m for m in _SCHEDULER_SIDE if target.startswith(m + ".")), None)
        if side is not None and not in_scheduler and side not in sys.modules:
            continue
        HookRegistry.register(target, hook, HookType[kind])
        count += 1
    _STATE.registered = True
    _STATE.tp_sync = os.environ.get(check.TP_SYNC_ENV, "").strip() == "1"
    logger.info("quantkit KV page integrity: %d hooks registered", count)
