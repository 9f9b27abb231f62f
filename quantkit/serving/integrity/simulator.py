"""A small serving simulator that shows what page-reuse bugs do, with and without the tag tracker.

Modelled: a paged KV pool with a free list, a radix-style prefix cache (one node per full prompt page,
LRU eviction of unreferenced nodes), continuous batching (admit while pages and slots allow), preemption
when a decode step cannot get a page, and a live block table that the "attention" step reads.

Ground truth: every KV slot holds a content stamp, the rolling hash of the tokens up to that position,
so two requests sharing a prompt prefix legitimately share identical pages. A decode step writes the
new token's stamp through the block table and then reads every position through it; a request whose
reads differ from its expected stamps *would serve wrong data*. Aborted requests are read too (without
writing), which is how the simulator knows that an abort prevented wrong data rather than guessing.

Injected faults (one per step with probability ``fault_rate``):
- ``realloc_while_referenced``: a referenced page is freed and goes to the front of the free list;
- ``stale_block_table``: a block-table entry points to another (freed or foreign) page;
- ``double_free``: a free page is freed again, so two later allocations receive it;
- ``swapped_page_index``: two block-table entries (of one request or of two) are swapped.

Step order: inject -> admit (prefill) -> allocate decode slots -> tracker.check -> forward -> finish.
Only decode steps return tokens, so a check that runs before the forward gates everything served.
"""

from __future__ import annotations

import random
from collections import OrderedDict, deque

import numpy as np
import torch

from quantkit.serving.integrity.simulator_faults import FAULT_KINDS, FaultInjector
from quantkit.serving.integrity.simulator_state import SimConfig, SimResult, _Node, _Request
from quantkit.serving.integrity.tracker import DecodeBatch, IntegrityConfig, make_tracker

__all__ = ["FAULT_KINDS", "SimConfig", "SimResult", "simulate"]

_MASK = (1 << 61) - 1


class _Sim(FaultInjector):
    def __init__(self, cfg: SimConfig) -> None:
        self.cfg = cfg
        self.rng = random.Random(cfg.seed)
        self.tracker = make_tracker(IntegrityConfig(tracker=cfg.tracker, backend="torch"), cfg.num_pages)
        ps = cfg.page_size
        width = (cfg.max_prefix_pages * ps + cfg.max_suffix + cfg.max_new_tokens) // ps + 2
        self.content = np.zeros((cfg.num_pages, ps), dtype=np.int64)
        self.block_table = np.zeros((cfg.max_running, width), dtype=np.int32)
        self.table_view = torch.from_numpy(self.block_table)  # shares memory: the "live" table
        self.free: deque[int] = deque(range(cfg.num_pages))
        self.free_rows = list(range(cfg.max_running))
        self.cache: OrderedDict[int, _Node] = OrderedDict()  # LRU order: oldest first
        self.running: list[_Request] = []
        self.waiting: deque[_Request] = deque()
        self.page_faults: dict[int, set[int]] = {}
        self.corrupt_faults: set[int] = set()
        self.caught_faults: set[int] = set()
        self.res = SimResult(tracker=cfg.tracker, seed=cfg.seed, faults_by_kind=dict.fromkeys(FAULT_KINDS, 0))
        self.prefix_tokens = [
            [self.rng.randrange(cfg.vocab) for _ in range(ps * self.rng.randint(1, cfg.max_prefix_pages))]
            for _ in range(cfg.prefixes)
        ]
        self.next_rid = 0
        self.now = 0

    # ---- pool -------------------------------------------------------------------------------------
    def alloc(self, req: _Request, n: int) -> list[int] | None:
        if len(self.free) < n:
            self.evict(n - len(self.free))
        if len(self.free) < n:
            return None
        pages = [self.free.popleft() for _ in range(n)]
        tags = self.tracker.on_alloc(req.rid, torch.tensor(pages, dtype=torch.int64))
        for p in pages:
            req.faults |= self.page_faults.get(p, set())
        req.own += pages
        req.pages += pages
        return tags.tolist() if tags is not None else [None] * n

    def free_pages(self, pages: list[int], front: bool = False) -> None:
        if not pages:
            return
        self.tracker.on_free(torch.tensor(pages, dtype=torch.int64))
        if front:
            self.free.extendleft(pages)
        else:
            self.free.extend(pages)

    def evict(self, need: int) -> None:
        """Free the least recently used unreferenced prefix pages."""
        keys = []
        for key, node in self.cache.items():
            if node.refs == 0:
                keys.append(key)
                if len(keys) == need:
                    break
        self.free_pages([self.cache.pop(key).page for key in keys])
        self.res.evictions += len(keys)

    # ---- requests ---------------------------------------------------------------------------------
    def new_request(self) -> _Request:
        cfg = self.cfg
        prefix = self.prefix_tokens[self.rng.randrange(cfg.prefixes)]
        suffix = [self.rng.randrange(cfg.vocab) for _ in range(self.rng.randint(1, cfg.max_suffix))]
        out = [self.rng.randrange(cfg.vocab) for _ in range(self.rng.randint(1, cfg.max_new_tokens))]
        stamps, h = [], 1469598103934665603 & _MASK
        for tok in prefix + suffix + out:
            h = (h * 1099511628211 + tok + 1) & _MASK
            stamps.append(h)
        self.next_rid += 1
        return _Request(self.next_rid, np.array(stamps, dtype=np.int64), len(prefix) + len(suffix))

    def admit(self, req: _Request) -> bool:
        """Prefill: attach cached prefix pages, allocate the rest, write the prompt's KV."""
        ps = self.cfg.page_size
        if not self.free_rows:
            return False
        keys = []
        for i in range(req.prompt_len // ps):
            key = int(req.stamps[(i + 1) * ps - 1])
            if key not in self.cache:
                break
            keys.append(key)
        n_pages = -(-req.prompt_len // ps)
        req.row = self.free_rows.pop()
        nodes = [self.cache[k] for k in keys]
        for key, node in zip(keys, nodes, strict=True):
            node.refs += 1
            self.cache.move_to_end(key)
        req.nodes, req.pages = keys, [n.page for n in nodes]
        for node in nodes:
            req.faults |= self.page_faults.get(node.page, set())
        if nodes:
            tags = None if nodes[0].tag is None else torch.tensor([n.tag for n in nodes])
            self.tracker.on_attach(req.rid, torch.tensor(req.pages, dtype=torch.int64), tags)
        tags = self.alloc(req, n_pages - len(keys))
        if tags is None:
            self.release(req)
            return False
        self.block_table[req.row, : len(req.pages)] = req.pages
        self.write(req, len(keys) * ps, req.prompt_len)
        req.length = req.prompt_len
        self.insert_prompt_pages(req, len(keys), tags)
        self.running.append(req)
        return True

    def insert_prompt_pages(self, req: _Request, first: int, tags: list) -> None:
        """Hand the request's full prompt pages to the prefix cache (it keeps one reference)."""
        ps = self.cfg.page_size
        for i in range(first, req.prompt_len // ps):
            key = int(req.stamps[(i + 1) * ps - 1])
            if key in self.cache:
                continue
            page = req.pages[i]
            self.cache[key] = _Node(page, tags[i - first], 1)
            req.own.remove(page)
            req.nodes.append(key)

    def write(self, req: _Request, lo: int, hi: int) -> None:
        """Write stamps of positions [lo, hi) through the live block table, as a kernel would."""
        ps = self.cfg.page_size
        pos = np.arange(lo, hi)
        pages = self.block_table[req.row, pos // ps]
        self.content[pages, pos % ps] = req.stamps[lo:hi]

    def reads_wrong(self, req: _Request, n: int) -> bool:
        ps = self.cfg.page_size
        pages = self.block_table[req.row, : -(-n // ps)]
        return not np.array_equal(self.content[pages].reshape(-1)[:n], req.stamps[:n])

    def release(self, req: _Request, aborted: bool = False) -> None:
        """Give back everything the request holds; after an abort only pages whose tag still matches."""
        own = req.own
        if aborted and self.tracker.enabled:
            safe = set(self.tracker.owned_pages(req.rid).tolist())
            own = [p for p in own if p in safe]
        for key in req.nodes:
            node = self.cache.get(key)
            if node is not None:
                node.refs -= 1
        if aborted and self.tracker.enabled:
            self.drop_stale_nodes(req.nodes)
        self.free_pages(own)
        self.tracker.on_release(req.rid)
        if req.row >= 0:
            self.free_rows.append(req.row)
        req.row, req.own, req.pages, req.nodes, req.length = -1, [], [], [], 0

    def drop_stale_nodes(self, keys: list[int]) -> None:
        """A cache node whose page was reused is dropped without freeing the page (not ours any more)."""
        live = self.tracker.table.tags
        for key in keys:
            node = self.cache.get(key)
            if node is not None and node.tag is not None and int(live[node.page]) != node.tag:
                del self.cache[key]

    # ---- one step ---------------------------------------------------------------------------------
    def step(self) -> None:
        self.now += 1
        if self.rng.random() < self.cfg.fault_rate:
            self.inject()
        if self.rng.random() < self.cfg.arrival_rate:
            self.waiting.append(self.new_request())
        while self.waiting and len(self.running) < self.cfg.max_running and self.admit(self.waiting[0]):
            self.waiting.popleft()
        self.allocate_decode_slots()
        if not self.running:
            return
        batch = DecodeBatch(
            [r.rid for r in self.running], [r.row for r in self.running], self.table_view
        )
        aborted = set(self.tracker.check(batch).abort)
        self.forward(aborted)

    def allocate_decode_slots(self) -> None:
        """One page for every request whose next token starts a page, in one batched allocation."""
        ps = self.cfg.page_size
        while True:
            needing = [r for r in self.running if r.length % ps == 0]
            if len(self.free) < len(needing):
                self.evict(len(needing) - len(self.free))
            if len(self.free) >= len(needing):
                break
            self.preempt(self.running[-1])  # newest first, as SGLang retracts decode requests
        if not needing:
            return
        pages = [self.free.popleft() for _ in needing]
        self.tracker.on_alloc_many([r.rid for r in needing], torch.tensor(pages, dtype=torch.int64))
        for req, page in zip(needing, pages, strict=True):
            req.faults |= self.page_faults.get(page, set())
            req.own.append(page)
            req.pages.append(page)
            self.block_table[req.row, len(req.pages) - 1] = page

    def preempt(self, req: _Request) -> None:
        self.running.remove(req)
        self.release(req)
        self.waiting.appendleft(req)
        self.res.preemptions += 1

    def forward(self, aborted: set[int]) -> None:
        for req in self.running:
            if req.rid not in aborted:
                self.write(req, req.length, req.length + 1)
        for req in list(self.running):
            # An aborted request wrote nothing this step, so only its earlier positions are read.
            wrong = self.reads_wrong(req, req.length + (req.rid not in aborted))
            if wrong:
                self.corrupt_faults |= req.faults
            if req.rid in aborted:
                self.abort(req)
                continue
            self.res.decode_tokens += 1
            if wrong and not req.served_wrong:
                req.served_wrong = True
                self.res.wrong_data_served += 1
            req.length += 1
            if req.length >= len(req.stamps):
                self.running.remove(req)
                self.release(req)
                self.res.finished += 1

    def abort(self, req: _Request) -> None:
        self.running.remove(req)
        self.res.aborts += 1
        if req.faults:
            self.caught_faults |= req.faults
        else:
            self.res.false_aborts += 1
        self.release(req, aborted=True)

    def result(self) -> SimResult:
        self.res.faults_that_would_corrupt = len(self.corrupt_faults)
        self.res.faults_caught = len(self.caught_faults)
        self.res.uncaught_corrupting_faults = len(self.corrupt_faults - self.caught_faults)
        return self.res


def simulate(cfg: SimConfig) -> SimResult:
    """Run ``cfg.steps`` steps and return the counts (deterministic for a given config and seed)."""
    if cfg.tracker not in ("tags", "noop"):
        raise ValueError(f"tracker must be 'tags' or 'noop', got {cfg.tracker!r}")
    if not 0.0 <= cfg.fault_rate <= 1.0:
        raise ValueError(f"fault_rate must be in [0, 1], got {cfg.fault_rate}")
    sim = _Sim(cfg)
    for _ in range(cfg.steps):
        sim.step()
    sim.res.steps = cfg.steps
    return sim.result()
