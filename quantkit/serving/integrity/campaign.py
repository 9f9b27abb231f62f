"""Fault-injection campaign against SGLang's own scheduler bookkeeping, with the integrity plugin loaded.

What runs is SGLang's code: its allocator (``PagedTokenToKVPoolAllocator``, or ``TokenToKVPoolAllocator`` at page
size 1; ``need_sort`` staged reuse as on PD servers, or immediate reuse), ``ReqToTokenPool``, ``UnifiedRadixCache``,
``Req`` (``init_next_round_input``: prefix match), ``ScheduleBatch`` (``prepare_for_extend`` -> ``alloc_for_extend``,
``merge_batch``, ``check_decode_mem`` / ``retract_decode``, ``prepare_for_decode`` -> ``alloc_for_decode``,
``filter_batch``), ``checkpoint_kv_cache`` and ``release_kv_cache`` inside free groups, eviction on allocation, and
the plugin loaded by SGLang's ``load_plugins()``. Only the model is absent: the "forward" is a content oracle.
The allocator runs SGLang's torch path (``use_triton_kernels = False``, what it does where Triton is unsupported).

Oracle: every KV slot written gets a stamp, the hash of the token prefix ending at that position (so legitimately
shared prefix pages hold identical stamps). Before each decode forward every surviving request's row is read back
through ``req_to_token``; a stamp that differs from the request's own prefix hash is wrong data served.

Faults (one per step with probability ``fault_rate``, kinds in turn), each on a designated victim in the batch
about to decode: ``premature_free`` (one of its pages freed while held, then reused by later allocations),
``double_free`` (freed twice: on the free list twice, later handed to two requests), ``stale_radix_node`` (a page
of a radix node freed while the node stays in the tree and is matched again), ``wrong_page_in_row`` (a row entry
overwritten with another page), ``pd_transfer_free`` (a page of a request still in its PD transfer window, i.e.
admitted but not yet decoded, freed). Detected = the victim is aborted by the check at that decode step. A
false positive is an abort of a request that is neither a victim nor holds a page a fault touched.
"""

from __future__ import annotations

import os
import random
import types
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal

import torch

from quantkit.serving.integrity import sglang as plugin

__all__ = ["FAULT_KINDS", "CampaignConfig", "CampaignResult", "run_campaign", "load_plugin"]

FAULT_KINDS = ("premature_free", "double_free", "stale_radix_node", "wrong_page_in_row", "pd_transfer_free")
_MASK = (1 << 61) - 1
VOCAB = 32000
Req = Any  # sglang.srt.managers.schedule_batch.Req (importable only once SGLang is loaded)


@dataclass(frozen=True)
class CampaignConfig:
    steps: int = 2000
    seed: int = 0
    page_size: int = 16
    reuse: Literal["immediate", "staged"] = "immediate"
    fault_rate: float = 0.05
    pool_pages: int = 24  # in units of max(page_size, 16) tokens, as are the prompt and output lengths
    max_running: int = 10
    prefixes: int = 4
    max_prefix_pages: int = 3
    max_suffix_pages: int = 2
    arrival_rate: float = 0.6
    abort_rate: float = 0.01
    guarded: bool = True  # False: the allocator gets no tracker (control run: what the faults do unguarded)


@dataclass
class CampaignResult:
    sglang_version: str = ""
    page_size: int = 0
    reuse: str = ""
    steps: int = 0
    injected: int = 0
    detected: int = 0
    false_positives: int = 0
    wrong_data_served: int = 0
    prefill_exposed: int = 0
    check_aborts: int = 0
    finished: int = 0
    retracted: int = 0
    client_aborts: int = 0
    by_kind: dict[str, dict[str, int]] = field(default_factory=lambda: {k: {"injected": 0, "detected": 0}
                                                                        for k in FAULT_KINDS})  # fmt: skip

    def to_dict(self) -> dict:
        return asdict(self)


def load_plugin() -> None:
    """Load the plugin through SGLang's ``load_plugins()`` with ``QUANTKIT_KV_INTEGRITY=tags``."""
    import sglang.srt.plugins as plugins

    os.environ[plugin.ENV] = plugin.ENABLE_VALUE
    os.environ.setdefault("SGLANG_PLUGINS", "quantkit_kv_integrity")  # SGLang's own whitelist: only this plugin
    plugins.load_plugins()
    if not plugin.state().registered:
        raise RuntimeError("load_plugins() did not register the quantkit KV integrity plugin (entry point missing?)")


class _Engine:
    """SGLang's memory-side objects for one campaign, and the oracle."""

    def __init__(self, cfg: CampaignConfig) -> None:
        from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
        from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
        from sglang.srt.mem_cache.unified_cache.components import ComponentType
        from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

        ps, unit = cfg.page_size, _unit(cfg)
        size, staged = cfg.pool_pages * unit, cfg.reuse == "staged"
        if ps == 1:
            self.alloc = TokenToKVPoolAllocator(size, torch.bfloat16, "cpu", None, staged)
        else:
            self.alloc = PagedTokenToKVPoolAllocator(size, ps, torch.bfloat16, "cpu", None, staged)
            self.alloc.use_triton_kernels = False
        max_ctx = (cfg.max_prefix_pages + cfg.max_suffix_pages + 12) * unit + 8
        self.pool = ReqToTokenPool(cfg.max_running + 4, max_ctx, "cpu", False)
        params = CacheInitParams(disable=False, req_to_token_pool=self.pool, token_to_kv_pool_allocator=self.alloc,
                                 page_size=ps, tree_components=(ComponentType.FULL,))  # fmt: skip
        self.tree = UnifiedRadixCache(params)
        if not cfg.guarded:
            self.alloc.__dict__.pop("_quantkit_tracker", None)
        self.model = types.SimpleNamespace(vocab_size=VOCAB, is_encoder_decoder=False)  # what ScheduleBatch reads
        self.stamps = torch.zeros(size + ps, dtype=torch.int64)
        self.hashes: dict[str, list[int]] = {}

    def expected(self, req: Req, n: int) -> torch.Tensor:
        h = self.hashes.setdefault(req.rid, [])
        tokens = req.origin_input_ids + req.output_ids
        key = h[-1] if h else 0
        while len(h) < n:
            key = hash((key, tokens[len(h)])) & _MASK
            h.append(key)
        return torch.tensor(h[:n], dtype=torch.int64)

    def write(self, req: Req, start: int, end: int) -> None:
        slots = self.pool.req_to_token[req.kv.req_pool_idx, start:end].long()
        self.stamps[slots] = self.expected(req, end)[start:end]

    def reads_wrong(self, req: Req, n: int) -> bool:
        slots = self.pool.req_to_token[req.kv.req_pool_idx, :n].long()
        return not torch.equal(self.stamps[slots], self.expected(req, n))


class _Campaign:
    def __init__(self, cfg: CampaignConfig, version: str) -> None:
        from sglang.srt.managers.schedule_batch import FINISH_ABORT, FINISH_LENGTH, ScheduleBatch
        from sglang.srt.mem_cache.common import checkpoint_kv_cache, release_kv_cache

        self.sg = types.SimpleNamespace(ScheduleBatch=ScheduleBatch, FINISH_ABORT=FINISH_ABORT,
                                        FINISH_LENGTH=FINISH_LENGTH, checkpoint=checkpoint_kv_cache,
                                        release=release_kv_cache)  # fmt: skip
        self.cfg, self.rng = cfg, random.Random(cfg.seed)
        self.e = _Engine(cfg)
        self.res = CampaignResult(sglang_version=version, page_size=cfg.page_size, reuse=cfg.reuse)
        unit = _unit(cfg)
        self.prefixes = [[self.rng.randrange(VOCAB) for _ in range(self.rng.randint(1, cfg.max_prefix_pages) * unit)]
                         for _ in range(cfg.prefixes)]  # fmt: skip
        self.waiting: list[Req] = []
        self.running: Any = None  # ScheduleBatch
        self.max_new: dict[str, int] = {}
        self.poisoned: set[int] = set()
        self.admitted_prefix: dict[str, int] = {}
        self.missed: list[tuple[int, str, str]] = []
        self.n_req = 0
        self.kind = 0

    # ---- workload --------------------------------------------------------------------------------------------------
    def request(self, prompt: list[int], max_new: int) -> Req:
        """A SGLang ``Req`` for ``prompt`` that finishes after ``max_new`` tokens."""
        from array import array

        from sglang.srt.managers.schedule_batch import Req as SGReq
        from sglang.srt.sampling.sampling_params import SamplingParams

        params = SamplingParams(max_new_tokens=max_new)
        params.normalize(None)
        self.n_req += 1
        req = SGReq(f"q{self.n_req}", "", array("q", prompt), params, vocab_size=VOCAB)
        self.max_new[req.rid] = max_new
        return req

    def _new_request(self) -> Req:
        cfg, rng, unit = self.cfg, self.rng, _unit(self.cfg)
        prompt = list(rng.choice(self.prefixes)) if rng.random() < 0.8 else []
        prompt += [rng.randrange(VOCAB) for _ in range(rng.randint(1, cfg.max_suffix_pages * unit))]
        long = rng.random() < 0.35
        return self.request(prompt, rng.randint(2, 12 * unit if long else 2 * unit))

    def _admit(self) -> list[Req]:
        cfg = self.cfg
        if cfg.arrival_rate and self.rng.random() < cfg.arrival_rate:
            self.waiting.append(self._new_request())
        running = len(self.running.reqs) if self.running is not None else 0
        ps = cfg.page_size
        # what SGLang's PrefillAdder budgets: free + evictable tokens, less a decode page per running request
        budget = self.e.alloc.available_size() + self.e.tree.evictable_size() - (running + 1) * ps
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
            req.output_ids.append(self.rng.randrange(VOCAB))
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
        for req in to_abort:
            self.hashes_forget(req)

    def hashes_forget(self, req: Req) -> None:
        self.e.hashes.pop(req.rid, None)

    def _finish(self) -> None:
        batch, alloc = self.running, self.e.alloc
        alloc.free_group_begin()
        try:
            for req in batch.reqs:
                req.output_ids.append(self.rng.randrange(VOCAB))
                if len(req.output_ids) >= self.max_new[req.rid]:
                    req.finished_reason = self.sg.FINISH_LENGTH(len(req.output_ids))
                    self.sg.release(req, self.e.tree, checkpoint=True)
                    self.res.finished += 1
                    self.hashes_forget(req)
                elif self.rng.random() < self.cfg.abort_rate:
                    req.finished_reason = self.sg.FINISH_ABORT("client abort")
                    self.sg.release(req, self.e.tree, checkpoint=False)
                    self.res.client_aborts += 1
                    self.hashes_forget(req)
        finally:
            alloc.free_group_end()
        batch.filter_batch()

    # ---- faults ----------------------------------------------------------------------------------------------------
    def _pages(self, req: Req) -> list[int]:
        ps, n = self.cfg.page_size, req.kv.kv_committed_len
        return (self.e.pool.req_to_token[req.kv.req_pool_idx, : n : ps].long() // ps).tolist()

    def _free(self, page: int) -> None:
        self.e.alloc.free_page_ids(torch.tensor([page], dtype=torch.int64))

    def _inject(self, fresh: list[Req]) -> tuple[str, Req] | None:
        kind = FAULT_KINDS[self.kind % len(FAULT_KINDS)]
        self.kind += 1
        ps, rng = self.cfg.page_size, self.rng
        reqs = fresh if kind == "pd_transfer_free" else self.running.reqs
        candidates = []
        for req in reqs:
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
        return kind, req

    # ---- one step --------------------------------------------------------------------------------------------------
    def step(self) -> None:
        fresh = self._admit()
        if self.running is None or not self.running.reqs:
            return
        self._retract()
        if not self.running.reqs:
            return
        fault = self._inject(fresh) if self.rng.random() < self.cfg.fault_rate else None
        before = len(plugin.state().aborts)
        reqs = list(self.running.reqs)
        seq_before = {req.rid: req.kv.kv_committed_len for req in reqs}
        self.running.prepare_for_decode()
        records = plugin.state().aborts[before:]
        aborted = {a.rid for a in records}
        tainted = {a.rid for a in records if self.poisoned.intersection(a.row_pages)}
        self.res.steps += 1
        self.res.check_aborts += len(aborted)
        if fault is not None:
            kind, victim = fault
            self.res.injected += 1
            self.res.by_kind[kind]["injected"] += 1
            if victim.rid in aborted:
                self.res.detected += 1
                self.res.by_kind[kind]["detected"] += 1
        victim_rid = fault[1].rid if fault else None
        self.res.false_positives += len({rid for rid in aborted if rid != victim_rid and rid not in tainted})
        if fault is not None and victim_rid not in aborted and victim_rid in self.e.hashes:
            self.missed.append((self.res.steps, fault[0], victim_rid))
        for req in reqs:
            if req.rid in aborted:
                self.hashes_forget(req)
        for req in self.running.reqs:
            self.e.write(req, seq_before[req.rid], seq_before[req.rid] + 1)
            if self.e.reads_wrong(req, seq_before[req.rid] + 1):
                self.res.wrong_data_served += 1
        self._finish()


def _unit(cfg: CampaignConfig) -> int:
    """Tokens per workload "page": the page size, at least 16 (so page size 1 sees the same token lengths)."""
    return max(cfg.page_size, 16)


def _spec_none() -> Any:
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    return SpeculativeAlgorithm.NONE


def run_campaign(cfg: CampaignConfig, version: str, episode: int = 1000) -> CampaignResult:
    """Run ``cfg.steps`` decode steps in episodes of ``episode`` steps, each on fresh SGLang objects (a restart:
    pages lost to detected corruption, e.g. a stale radix node's, do not pile up). SGLang must be loaded and the
    plugin registered (:func:`load_plugin`)."""
    total = CampaignResult(sglang_version=version, page_size=cfg.page_size, reuse=cfg.reuse)
    done, n = 0, 0
    while done < cfg.steps:
        steps = min(episode, cfg.steps - done)
        res = _episode(replace(cfg, steps=steps, seed=cfg.seed * 1_000_003 + n), version)
        for key in ("steps", "injected", "detected", "false_positives", "wrong_data_served", "prefill_exposed",
                    "check_aborts", "finished", "retracted", "client_aborts"):
            setattr(total, key, getattr(total, key) + getattr(res, key))
        for kind in FAULT_KINDS:
            for key in ("injected", "detected"):
                total.by_kind[kind][key] += res.by_kind[kind][key]
        done, n = done + steps, n + 1
    return total


def _episode(cfg: CampaignConfig, version: str) -> CampaignResult:
    campaign = _Campaign(cfg, version)
    guard = 0
    while campaign.res.steps < cfg.steps:
        campaign.step()
        guard += 1
        if guard > 20 * cfg.steps + 1000:
            raise RuntimeError("the workload stopped decoding (admission stalled)")
    return campaign.res
