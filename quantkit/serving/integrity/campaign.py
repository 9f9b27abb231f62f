"""Fault-injection campaign against SGLang's own scheduler bookkeeping and output path, with the plugin loaded.

What runs is SGLang's code: its allocator (``PagedTokenToKVPoolAllocator``, or ``TokenToKVPoolAllocator`` at page
size 1; ``need_sort`` staged reuse as on PD servers, or immediate reuse), ``ReqToTokenPool``, ``UnifiedRadixCache``,
``Req`` (``init_next_round_input``: prefix match), ``ScheduleBatch`` (``prepare_for_extend`` -> ``alloc_for_extend``,
``merge_batch``, ``check_decode_mem`` / ``retract_decode``, ``prepare_for_decode`` -> ``alloc_for_decode``,
``filter_batch``, ``copy``), ``GenerationBatchResult.copy_to_cpu``, and ``SchedulerBatchResultProcessor.
process_batch_result_decode`` (append, finish by length, ``release_kv_cache`` with checkpoint, abort handling)
streaming through ``SchedulerOutputStreamer`` into a sink in place of the detokenizer; the plugin is loaded by
SGLang's ``load_plugins()``. Only the model is absent: the "forward" is a content oracle (``campaign_engine.py``).

Two orderings: ``non_overlap`` (a step's result is processed right after its forward, SGLang's normal loop) and
``overlap`` (step N+1 is prepared and launched before step N's result is processed, on a ``batch.copy()``, SGLang's
overlap loop: a request flagged at N is in N+1 already).

Faults (one per step with probability ``fault_rate``, kinds in turn), each on a designated victim in the batch
about to decode: ``premature_free`` (one of its pages freed while held, then reused by later allocations),
``double_free`` (freed twice: on the free list twice, later handed to two requests), ``stale_radix_node`` (a page
of a radix node freed while the node stays in the tree and is matched again), ``wrong_page_in_row`` (a row entry
overwritten with another page), ``pd_transfer_free`` (a page of a request still in its PD transfer window, i.e.
admitted but not yet decoded, freed). Detected = the victim is aborted (``FINISH_ABORT`` from the plugin) when the
result of the first decode step after the fault is processed. A false positive is an abort of a request that is
neither a victim nor holds a page a fault touched. ``wrong_tokens_streamed`` counts tokens that reached the sink
from a forward that read another request's KV (must be 0); ``wrong_data_served`` counts forwards that read wrong
KV while the check passed them (must be 0).
"""

from __future__ import annotations

import random
import types
from collections import deque
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Literal

import torch

from quantkit.serving.integrity import sglang as plugin
from quantkit.serving.integrity.campaign_engine import CLEAN_VOCAB, VOCAB, Engine, OutputPath, load_plugin

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
    from sglang.srt.managers.utils import GenerationBatchResult
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

__all__ = ["FAULT_KINDS", "ORDERINGS", "CampaignConfig", "CampaignResult", "load_plugin", "merge_results",
           "run_campaign"]

FaultKind = Literal["premature_free", "double_free", "stale_radix_node", "wrong_page_in_row", "pd_transfer_free"]
FAULT_KINDS: tuple[FaultKind, ...] = ("premature_free", "double_free", "stale_radix_node", "wrong_page_in_row",
                                      "pd_transfer_free")  # fmt: skip
Ordering = Literal["non_overlap", "overlap"]
ORDERINGS: tuple[Ordering, ...] = ("non_overlap", "overlap")
_COUNTS = ("steps", "injected", "detected", "moot", "false_positives", "wrong_data_served", "wrong_tokens_streamed",
           "tokens_streamed", "aborts_streamed", "prefill_exposed", "check_aborts", "finished", "retracted",
           "client_aborts")  # fmt: skip


@dataclass(frozen=True)
class CampaignConfig:
    steps: int = 2000
    seed: int = 0
    page_size: int = 16
    reuse: Literal["immediate", "staged"] = "immediate"
    ordering: Ordering = "non_overlap"
    fault_rate: float = 0.05
    pool_pages: int = 24  # in units of max(page_size, 16) tokens, as are the prompt and output lengths
    max_running: int = 10
    prefixes: int = 4
    max_prefix_pages: int = 3
    max_suffix_pages: int = 2
    arrival_rate: float = 0.6
    abort_rate: float = 0.01
    stream_rate: float = 0.5  # share of requests that stream every token (the rest get their output at the end)
    guarded: bool = True  # False: the allocator gets no tracker (control run: what the faults do unguarded)


@dataclass
class CampaignResult:
    sglang_version: str = ""
    page_size: int = 0
    reuse: str = ""
    ordering: str = ""
    steps: int = 0
    injected: int = 0
    detected: int = 0
    moot: int = 0  # victim finished (its last token) or was retracted before the faulty step's result: not counted
    false_positives: int = 0
    wrong_data_served: int = 0
    wrong_tokens_streamed: int = 0
    tokens_streamed: int = 0
    aborts_streamed: int = 0
    prefill_exposed: int = 0
    check_aborts: int = 0
    finished: int = 0
    retracted: int = 0
    client_aborts: int = 0
    by_kind: dict[str, dict[str, int]] = field(default_factory=lambda: {k: {"injected": 0, "detected": 0}
                                                                        for k in FAULT_KINDS})  # fmt: skip

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


@dataclass
class _Launched:
    """One decode forward whose result is not processed yet."""

    batch: ScheduleBatch
    result: GenerationBatchResult
    faults: list[tuple[FaultKind, str]]


class _Campaign:
    def __init__(self, cfg: CampaignConfig, version: str) -> None:
        from sglang.srt.managers.schedule_batch import FINISH_ABORT, ScheduleBatch
        from sglang.srt.mem_cache.common import checkpoint_kv_cache

        self.sg = types.SimpleNamespace(ScheduleBatch=ScheduleBatch, FINISH_ABORT=FINISH_ABORT,
                                        checkpoint=checkpoint_kv_cache)  # fmt: skip
        self.cfg, self.rng = cfg, random.Random(cfg.seed)
        unit = _unit(cfg)
        row_tokens = (cfg.max_prefix_pages + cfg.max_suffix_pages + 12) * unit + 8
        self.e = Engine(cfg.page_size, cfg.pool_pages * unit, cfg.reuse, cfg.max_running + 4, row_tokens, cfg.guarded)
        self.out = OutputPath(self.e, cfg.ordering == "overlap")
        self.res = CampaignResult(sglang_version=version, page_size=cfg.page_size, reuse=cfg.reuse,
                                  ordering=cfg.ordering)  # fmt: skip
        self.prefixes = [[self.rng.randrange(VOCAB) for _ in range(self.rng.randint(1, cfg.max_prefix_pages) * unit)]
                         for _ in range(cfg.prefixes)]  # fmt: skip
        self.waiting: list[Req] = []
        self.running: ScheduleBatch | None = None
        self.launched: deque[_Launched] = deque()
        self.poisoned: set[int] = set()
        self.victims: set[str] = set()
        self.admitted_prefix: dict[str, int] = {}
        self.missed: list[tuple[int, str, str]] = []
        self.n_req = 0
        self.kind = 0

    # ---- workload --------------------------------------------------------------------------------------------------
    def request(self, prompt: list[int], max_new: int, stream: bool = False) -> Req:
        """A SGLang ``Req`` for ``prompt`` that finishes after ``max_new`` tokens."""
        from array import array

        from sglang.srt.managers.schedule_batch import Req as SGReq
        from sglang.srt.sampling.sampling_params import SamplingParams

        params = SamplingParams(max_new_tokens=max_new)
        params.normalize(None)
        self.n_req += 1
        return SGReq(f"q{self.n_req}", "", array("q", prompt), params, vocab_size=VOCAB, stream=stream)

    def _new_request(self) -> Req:
        cfg, rng, unit = self.cfg, self.rng, _unit(self.cfg)
        prompt = list(rng.choice(self.prefixes)) if rng.random() < 0.8 else []
        prompt += [rng.randrange(VOCAB) for _ in range(rng.randint(1, cfg.max_suffix_pages * unit))]
        long = rng.random() < 0.35
        return self.request(prompt, rng.randint(2, 12 * unit if long else 2 * unit), rng.random() < cfg.stream_rate)

    def _admit(self) -> list[Req]:
        cfg = self.cfg
        if cfg.arrival_rate and self.rng.random() < cfg.arrival_rate:
            self.waiting.append(self._new_request())
        running = len(self.running.reqs) if self.running is not None else 0
        ps = cfg.page_size
        # what SGLang's PrefillAdder budgets: free + evictable tokens, less a decode page per running request (two
        # under overlap: one more is in flight)
        decode = (running + 1) * ps * (2 if cfg.ordering == "overlap" else 1)
        budget = self.e.alloc.available_size() + self.e.tree.evictable_size() - decode
        new = []
        while self.waiting and running + len(new) < cfg.max_running and self.e.pool.available_size() > len(new):
            req = self.waiting[0]
            req.init_next_round_input(self.e.tree)
            # the extension, alloc_extend's page over-estimate, and the matched prefix leaving the evictable set
            need = len(req.full_untruncated_fill_ids) + 2 * ps
            if need > budget:
                break
            budget -= need
            self.waiting.pop(0)
            req.extend_end = len(req.full_untruncated_fill_ids)
            req.lock = self.e.tree.lock(req.last_node)
            new.append(req)
        if not new:
            return []
        batch = self.sg.ScheduleBatch.init_new(new, self.e.pool, self.e.alloc, self.e.tree, self.e.model, False,
                                               _spec_none())  # fmt: skip
        batch.prepare_for_extend()
        for req in new:
            self.admitted_prefix[req.rid] = req.prefix_len
            if self.e.reads_wrong(req, req.prefix_len):
                self.res.prefill_exposed += 1
            self.e.write(req, req.prefix_len, req.extend_end)
            req.output_ids.append(self.rng.randrange(CLEAN_VOCAB))  # the prefill's token (prefill is not gated)
            self.sg.checkpoint(req, self.e.tree)
        if self.running is None or not self.running.reqs:
            self.running = batch
        else:
            self.running.merge_batch(batch)
        return new

    def _retract(self) -> None:
        if self.running.check_decode_mem():
            return
        retracted, _, to_abort = self.running.retract_decode()
        self.res.retracted += len(retracted)
        self.waiting[:0] = retracted
        for req in [*retracted, *to_abort]:
            self.e.forget(req.rid)  # re-prefilled from its committed tokens: the in-flight ones are dropped

    def _client_aborts(self) -> None:
        """SGLang's "abort method 3": a client abort sets ``to_finish``; the next processed result finishes it."""
        for req in self.running.reqs:
            if req.rid not in self.victims and not req.finished() and self.rng.random() < self.cfg.abort_rate:
                req.to_finish = self.sg.FINISH_ABORT("client abort")
                self.res.client_aborts += 1

    # ---- faults ----------------------------------------------------------------------------------------------------
    def _pages(self, req: Req) -> list[int]:
        ps, n = self.cfg.page_size, req.kv.kv_committed_len
        return (self.e.pool.req_to_token[req.kv.req_pool_idx, : n : ps].long() // ps).tolist()

    def _free(self, page: int) -> None:
        self.e.alloc.free_page_ids(torch.tensor([page], dtype=torch.int64))

    def _victim_ok(self, req: Req) -> bool:
        """Not about to finish before its faulty step's result is processed (that would make the fault moot): not
        near its last token, not client-aborted, not already flagged by a check whose result is still in flight."""
        left = req.sampling_params.max_new_tokens - len(req.output_ids) - len(self.e.inflight.get(req.rid, ()))
        if left < 2 or req.to_finish is not None or req.rid in self.victims:
            return False
        tracker = plugin.tracker_of(self.e.alloc)
        return tracker is None or not tracker.bound or int(tracker.row_bad[req.kv.req_pool_idx]) == 0

    def _inject(self, fresh: list[Req]) -> tuple[FaultKind, str] | None:
        kind = FAULT_KINDS[self.kind % len(FAULT_KINDS)]
        self.kind += 1
        ps, rng = self.cfg.page_size, self.rng
        reqs = fresh if kind == "pd_transfer_free" else self.running.reqs
        candidates = []
        for req in reqs:
            if not self._victim_ok(req):
                continue
            pages, prot = self._pages(req), req.kv.cache_protected_len // ps
            span = {"stale_radix_node": range(0, prot), "wrong_page_in_row": range(len(pages)),
                    "pd_transfer_free": range(-(-self.admitted_prefix.get(req.rid, 0) // ps), len(pages))
                    }.get(kind, range(prot, len(pages)))  # fmt: skip
            if len(span):
                candidates.append((req, pages, span))
        if not candidates:
            self.kind -= 1  # try this kind again next time (a PD window needs a step that admits requests)
            return None
        req, pages, span = rng.choice(candidates)
        j = rng.choice(list(span))
        page = pages[j]
        if kind == "wrong_page_in_row":
            num_pages = self.e.alloc.size // ps
            other = rng.choice([p for p in range(1, num_pages + 1) if p != page])
            row = req.kv.req_pool_idx
            self.e.pool.req_to_token[row, j * ps : (j + 1) * ps] = other * ps + torch.arange(ps, dtype=torch.int32)
        else:
            self._free(page)
            if kind == "double_free":
                self._free(page)
            self.poisoned.add(page)
        self.victims.add(req.rid)
        return kind, req.rid

    # ---- one step --------------------------------------------------------------------------------------------------
    def step(self) -> None:
        if self.running is not None:
            self._client_aborts()
            self.running.filter_batch()  # what get_next_batch_to_run does first: drop finished requests
        fresh = self._admit()
        if self.running is None or not self.running.reqs:
            self._drain()
            return
        self._retract()
        if not self.running.reqs:
            self._drain()
            return
        fault = self._inject(fresh) if self.rng.random() < self.cfg.fault_rate else None
        self.running.prepare_for_decode()
        launched = _Launched(self.running.copy(), self._forward(self.running), [fault] if fault else [])
        self.res.steps += 1
        if self.cfg.ordering == "overlap":
            self.out.copy_to_cpu(self.running, launched.result)
            self.launched.append(launched)
            if len(self.launched) > 1:
                self._process(self.launched.popleft())
        else:
            self._process(launched)

    def _drain(self) -> None:
        while self.launched:
            self._process(self.launched.popleft())

    def _forward(self, batch: ScheduleBatch) -> GenerationBatchResult:
        """The oracle's forward: write each request's new slot, read its whole row back, "sample" a poison id for a
        request that read another request's KV; then SGLang's result with the plugin's verdict on it."""
        ids = []
        for req, slot in zip(batch.reqs, batch.out_cache_loc.tolist(), strict=True):
            n = req.kv.kv_committed_len
            self.e.write_decode(req, slot)
            wrong = self.e.reads_wrong(req, n)
            token = self.rng.randrange(CLEAN_VOCAB, VOCAB) if wrong else self.rng.randrange(CLEAN_VOCAB)
            self.e.inflight.setdefault(req.rid, []).append(token)
            ids.append(token)
        result = self.out.result(batch, ids)
        verdict = result.__dict__.get("_qk_bad")
        flags = verdict.tolist() if verdict is not None else [0] * len(ids)
        for token, flag in zip(ids, flags, strict=True):
            if token >= CLEAN_VOCAB and not flag:
                self.res.wrong_data_served += 1  # a wrong read the check let through
        return result

    def _process(self, launched: _Launched) -> None:
        batch, sink = launched.batch, self.out.sink
        before, tokens, poison = len(plugin.state().aborts), sink.tokens, sink.poison
        done = {req.rid for req in batch.reqs if req.finished() or req.is_retracted}
        self.out.process(batch, launched.result)
        for req in batch.reqs:
            pending = self.e.inflight.get(req.rid)
            if pending:
                pending.pop(0)
        records = plugin.state().aborts[before:]
        aborted = {a.rid for a in records}
        tainted = {a.rid for a in records if self.poisoned.intersection(a.row_pages)}
        self.res.check_aborts += len(aborted)
        self.res.tokens_streamed += sink.tokens - tokens
        self.res.wrong_tokens_streamed += sink.poison - poison
        for kind, victim in launched.faults:
            if victim in done:
                self.res.moot += 1
                continue
            self.res.injected += 1
            self.res.by_kind[kind]["injected"] += 1
            if victim in aborted:
                self.res.detected += 1
                self.res.by_kind[kind]["detected"] += 1
            else:
                self.missed.append((self.res.steps, kind, victim))
        self.res.false_positives += len(aborted - self.victims - tainted)
        for req in batch.reqs:
            if req.finished() and req.rid not in done:
                reason = sink.finished.get(req.rid, {})
                self.res.finished += reason.get("type") == "length"
                self.res.aborts_streamed += reason.get("message") == plugin.ABORT_MESSAGE
                self.e.forget(req.rid)
                self.victims.discard(req.rid)


def _unit(cfg: CampaignConfig) -> int:
    """Tokens per workload "page": the page size, at least 16 (so page size 1 sees the same token lengths)."""
    return max(cfg.page_size, 16)


def _spec_none() -> SpeculativeAlgorithm:
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    return SpeculativeAlgorithm.NONE


def merge_results(parts: list[CampaignResult]) -> CampaignResult:
    """The figures of several runs of one page size and reuse mode added up (orderings joined with ``+``)."""
    orderings = "+".join(dict.fromkeys(p.ordering for p in parts))
    total = CampaignResult(sglang_version=parts[0].sglang_version, page_size=parts[0].page_size,
                           reuse=parts[0].reuse, ordering=orderings)  # fmt: skip
    for part in parts:
        for key in _COUNTS:
            setattr(total, key, getattr(total, key) + getattr(part, key))
        for kind in FAULT_KINDS:
            for key in ("injected", "detected"):
                total.by_kind[kind][key] += part.by_kind[kind][key]
    return total


def run_campaign(cfg: CampaignConfig, version: str, episode: int = 1000) -> CampaignResult:
    """Run ``cfg.steps`` decode steps in episodes of ``episode`` steps, each on fresh SGLang objects (a restart:
    pages lost to detected corruption, e.g. a stale radix node's, do not pile up). SGLang must be loaded and the
    plugin registered (:func:`load_plugin`)."""
    parts, done, n = [], 0, 0
    while done < cfg.steps:
        steps = min(episode, cfg.steps - done)
        parts.append(_episode(replace(cfg, steps=steps, seed=cfg.seed * 1_000_003 + n), version))
        done, n = done + steps, n + 1
    return merge_results(parts) if parts else CampaignResult(version, cfg.page_size, cfg.reuse, cfg.ordering)


def _episode(cfg: CampaignConfig, version: str) -> CampaignResult:
    campaign = _Campaign(cfg, version)
    guard = 0
    while campaign.res.steps < cfg.steps:
        campaign.step()
        guard += 1
        if guard > 20 * cfg.steps + 1000:
            raise RuntimeError("the workload stopped decoding (admission stalled)")
    campaign._drain()
    return campaign.res
