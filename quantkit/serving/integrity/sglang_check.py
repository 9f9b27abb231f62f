"""The check before each decode forward, the verdict riding the sampled ids, and the abort of one request.

Where each piece sits in SGLang 0.5.23's step (hooks registered by ``sglang.py``):

1. ``ScheduleBatch.prepare_for_decode`` (AROUND, after SGLang's own work): enqueue the fused gather-compare on the
   scheduler's stream; it ORs ``-1`` into ``row_bad`` of a row whose pages changed and points that row's decode
   write (``out_cache_loc``) at SGLang's padding slot. Nothing is read back, nothing is aborted, the batch keeps its
   shape: the flagged request runs its forward but writes nowhere that matters.
2. ``TpModelWorker.forward_batch_generation`` (AFTER; the forward stream waited for the scheduler's): gather
   ``row_bad`` for the batch's rows onto the result (``_qk_bad``).
3. ``GenerationBatchResult.copy_to_cpu`` (AROUND; overlap scheduler, before SGLang's own device->host copy of the
   ids): ``ids ^ verdict`` out of place: a flagged row's id becomes negative in the copy SGLang makes anyway, while
   the ids already relayed to the next step's input stay real.
4. ``SchedulerBatchResultProcessor._normalize_decode_outputs`` (AROUND; after SGLang waited for that copy, before
   any of the step's tokens is appended or streamed): without overlap the ids are marked here, before SGLang's own
   ``tolist``; then an O(batch) host scan. A negative id aborts its request: ``to_finish = FINISH_ABORT(.., 500)``,
   no radix insert, an empty token list; SGLang's loop then finishes it, releases it (5) and streams the abort.
5. ``release_kv_cache`` (AROUND): an aborted request's release skips pages that are someone else's now and frees
   pages the row lost that the request still owned.

A speculative-decoding batch keeps a synchronous path: the verdict is read in ``prepare_for_decode`` (a host sync)
and the flagged requests' tokens of that step are dropped in 4; so does a mixed batch (``--enable-mixed-chunk``),
whose decoding requests are finished through SGLang's ``discard_output_reason`` (no token committed).

TP ranks need no collective: the verdict is a function of the scheduler's replicated bookkeeping;
``QUANTKIT_KV_INTEGRITY_TP_SYNC=1`` (read at registration) adds a device-side all-reduce of it on the forward
stream.
"""

from __future__ import annotations

from http import HTTPStatus
from typing import TYPE_CHECKING

import torch

from quantkit.serving.integrity.sglang_hooks import (
    ABORT_MESSAGE,
    AbortPlan,
    AbortRecord,
    Original,
    logger,
    state,
    tracker_of,
)
from quantkit.serving.integrity.state import PoolState, mark

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
    from sglang.srt.managers.scheduler_components.batch_result_processor import SchedulerBatchResultProcessor
    from sglang.srt.managers.tp_worker import TpModelWorker
    from sglang.srt.managers.utils import GenerationBatchResult
    from sglang.srt.mem_cache.base_prefix_cache import BasePrefixCache
    from torch.distributed import ProcessGroup

__all__ = ["TP_SYNC_ENV", "agree_flags", "flagged_rows"]

TP_SYNC_ENV = "QUANTKIT_KV_INTEGRITY_TP_SYNC"
_STATE = state()
_BAD = "_qk_bad"  # GenerationBatchResult.__dict__ key: the batch's verdict (device tensor)
_MARKED = "_qk_marked"  # ... the ids already carry it
_PLAN = "_qk_abort"  # Req.__dict__ key: the AbortPlan for its release
_DROP = "_qk_drop"  # ... its tokens of the step being processed are not committed (speculative path)


def agree_flags(flags: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """MAX all-reduce of per-request flags over ``group`` on the flags' own device (no host copy; on CUDA with the
    NCCL group it is enqueued on the current stream); unchanged without a group or alone."""
    import torch.distributed as dist

    if group is None or not dist.is_initialized() or dist.get_world_size(group) <= 1:
        return flags
    flags = flags.to(torch.int32)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    return flags


def _tracker(batch: ScheduleBatch) -> PoolState | None:
    tracker = tracker_of(batch.tree_cache.token_to_kv_pool_allocator)
    return tracker if tracker is not None and tracker.bound else None


# ---- 1. the check ----------------------------------------------------------------------------------------------------


def _prepare_for_decode(original: Original, self: ScheduleBatch, *args: object, **kwargs: object) -> object:
    out = original(self, *args, **kwargs)
    tracker = _tracker(self)
    if tracker is None or not self.reqs:
        return out
    _STATE.checks += 1
    stash, tracker.next_seq = tracker.next_seq, None
    seq_host = stash[1] if stash is not None and stash[0] is self else self.seq_lens_cpu.numpy()
    table = self.req_to_token_pool.req_to_token
    if not self.spec_algorithm.is_none():  # no per-step out_cache_loc on a speculative batch: nothing to redirect
        tracker.check(table, self.req_pool_indices, self.seq_lens, seq_host, None)
        _screen_now(self, tracker)
        return out
    self.out_cache_loc = tracker.check(table, self.req_pool_indices, self.seq_lens, seq_host, self.out_cache_loc)
    return out


def _screen_now(batch: ScheduleBatch, tracker: PoolState) -> None:
    """Speculative decoding (its outputs are verified runs, not one id per row): read the verdict now (a host sync)
    and set flagged requests to abort; :func:`_normalize_decode_outputs` drops their tokens of this step."""
    bad = tracker.verdict(batch.req_pool_indices).tolist()
    for i, req in enumerate(batch.reqs):
        if bad[i] and _PLAN not in req.__dict__ and not req.finished():
            _plan_abort(batch, req, tracker)
            req.__dict__[_DROP] = True
            _STATE.drops += 1


# ---- 2. the verdict onto the result ----------------------------------------------------------------------------------


def _after_forward(result: GenerationBatchResult | None, self: TpModelWorker, batch: ScheduleBatch | None = None,
                   *args: object, **kwargs: object) -> None:  # fmt: skip
    if result is None or batch is None or not batch.spec_algorithm.is_none():
        return
    mode = batch.forward_mode
    mixed = mode.is_mixed()
    if not (mixed or mode.is_decode()):
        return
    tracker = _tracker(batch)
    if tracker is None:
        return
    verdict = tracker.verdict(batch.req_pool_indices)
    if _STATE.tp_sync:
        verdict = -agree_flags(-verdict, _tp_device_group())
    if mixed:
        _screen_mixed(batch, tracker, verdict)
    else:
        result.__dict__[_BAD] = verdict


def _screen_mixed(batch: ScheduleBatch, tracker: PoolState, verdict: torch.Tensor) -> None:
    """A mixed batch (``--enable-mixed-chunk``: decode requests ride a prefill) is processed by SGLang's prefill
    path, which finishes a request without committing the forward's token when ``discard_output_reason`` is set:
    read the verdict now (a host sync, mixed batches only) and set it for the flagged decoding requests."""
    bad = verdict.tolist()
    decoding = set(map(id, batch.decoding_reqs or ()))
    for i, req in enumerate(batch.reqs):
        if bad[i] and id(req) in decoding and _PLAN not in req.__dict__ and not req.finished():
            _plan_abort(batch, req, tracker)
            req.discard_output_reason = req.to_finish


def _tp_device_group() -> ProcessGroup:
    """The group SGLang's sampler makes its request-abort decisions agree over (attention TP under DP attention)."""
    from sglang.srt.layers.dp_attention import is_dp_attention_enabled
    from sglang.srt.runtime_context import get_parallel

    parallel = get_parallel()
    return (parallel.attn_tp_group if is_dp_attention_enabled() else parallel.tp_group).device_group


# ---- 3. the verdict into SGLang's own copy of the ids -------------------------------------------------------------


def _mark_result(result: GenerationBatchResult, ids: object) -> object:
    """``ids`` with the verdict in them, once (one id per row: :func:`_after_forward` attaches a verdict only to a
    non-speculative decode or mixed batch, whose sampler gives one id per row)."""
    verdict = result.__dict__.get(_BAD)
    if verdict is None or result.__dict__.get(_MARKED) or not isinstance(ids, torch.Tensor):
        return ids
    result.__dict__[_MARKED] = True
    return mark(ids, verdict)


def _copy_to_cpu(original: Original, self: GenerationBatchResult, *args: object, **kwargs: object) -> object:
    self.next_token_ids = _mark_result(self, self.next_token_ids)
    return original(self, *args, **kwargs)


# ---- 4. the abort, before anything of the step is appended or streamed ------------------------------------------


def flagged_rows(ids: list[list[int]]) -> list[int]:
    """Batch indices whose (marked) sampled id is negative; O(batch) host work, no tensor touched."""
    if not ids or min(t[0] if t else 0 for t in ids) >= 0:
        return []
    return [i for i, t in enumerate(ids) if t and t[0] < 0]


def _normalize_decode_outputs(original: Original, self: SchedulerBatchResultProcessor, *, batch: ScheduleBatch,
                              result: GenerationBatchResult, **kwargs: object) -> object:  # fmt: skip
    marked = _BAD in result.__dict__
    if not marked and not _STATE.drops:
        return original(self, batch=batch, result=result, **kwargs)
    if marked:
        kwargs["next_token_ids"] = _mark_result(result, kwargs.get("next_token_ids"))
    ids, logprobs = original(self, batch=batch, result=result, **kwargs)
    reqs = batch.reqs
    flagged = flagged_rows(ids[: len(reqs)]) if marked else []
    if flagged:
        tracker = tracker_of(self.token_to_kv_pool_allocator)  # (the overlap path's batch copy has no tree cache)
        for i in flagged:
            ids[i] = []
            req = reqs[i]
            if tracker is not None and tracker.bound and not (req.finished() or req.is_retracted) \
                    and _PLAN not in req.__dict__:
                _plan_abort(batch, req, tracker)
    if _STATE.drops:
        for i, req in enumerate(reqs):
            if req.__dict__.get(_DROP):
                ids[i] = []
    return ids, logprobs


def _plan_abort(batch: ScheduleBatch, req: Req, tracker: PoolState) -> None:
    """Log, record, and set the request to finish with the integrity abort; its release follows SGLang's path."""
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    row = int(req.kv.req_pool_idx)
    e = tracker.explain(batch.req_to_token_pool.req_to_token, row, req.kv.cache_protected_len // tracker.page_size)
    logger.error(
        "KV page integrity: aborting request %s (row %d): page %d, expected page %d tag %d, live tag %d "
        "(%d mismatching page(s))", req.rid, row, e.page, e.expected_page, e.expected_tag, e.actual_tag,
        len(e.bad_pages),
    )  # fmt: skip
    _STATE.aborts.append(AbortRecord(str(req.rid), row, e.page, e.expected_page, e.expected_tag, e.actual_tag,
                                     e.row_pages))  # fmt: skip
    # pages now someone else's (or already free) are never freed again -- except a page handed to this row and
    # another in one allocation (on no free list): the first of its holders to be aborted gives it back
    give_back = {p for p in e.twin_pages if _claim(tracker, p)}
    skip = [p for p in e.bad_pages if p not in give_back]
    req.to_finish = FINISH_ABORT(ABORT_MESSAGE, HTTPStatus.INTERNAL_SERVER_ERROR, "InternalServerError")
    req.skip_radix_cache_insert = True
    req.return_logprob = False
    req.return_hidden_states = False
    req.__dict__[_PLAN] = AbortPlan(torch.tensor(skip, dtype=torch.int64, device=tracker.device), e.lost_pages)


def _claim(tracker: PoolState, page: int) -> bool:
    stamp = int(tracker.stamp[page])
    if stamp in _STATE.returned:
        return False
    _STATE.returned.add(stamp)
    return True


# ---- 5. the release of an aborted request --------------------------------------------------------------------------


def _release_kv_cache(original: Original, req: Req, tree_cache: BasePrefixCache, *args: object,
                      **kwargs: object) -> object:  # fmt: skip
    plan: AbortPlan | None = req.__dict__.pop(_PLAN, None)
    if req.__dict__.pop(_DROP, False):
        _STATE.drops -= 1
    if plan is None:
        return original(req, tree_cache, *args, **kwargs)
    _STATE.skip = plan.skip
    try:
        out = original(req, tree_cache, checkpoint=False)
    finally:
        _STATE.skip = None
    if plan.lost:
        allocator = tree_cache.token_to_kv_pool_allocator
        allocator.free_page_ids(torch.tensor(plan.lost, dtype=torch.int64, device=plan.skip.device))
    return out
