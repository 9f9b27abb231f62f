"""Fault injection of the serving simulator (``simulator.py``): the four page-reuse bugs it models."""

from __future__ import annotations

import random
from collections import deque
from typing import Literal

import numpy as np

from quantkit.serving.integrity.simulator_state import SimConfig, SimResult, _Request

__all__ = ["FAULT_KINDS", "FaultInjector"]

FaultKind = Literal["realloc_while_referenced", "stale_block_table", "double_free", "swapped_page_index"]
FAULT_KINDS: tuple[FaultKind, ...] = ("realloc_while_referenced", "stale_block_table", "double_free",
                                      "swapped_page_index")  # fmt: skip


class FaultInjector:
    """Mixin of the simulator: one fault per :meth:`inject`, recorded against the pages and requests it touches."""

    cfg: SimConfig
    rng: random.Random
    res: SimResult
    running: list[_Request]
    free: deque[int]
    block_table: np.ndarray
    page_faults: dict[int, set[int]]

    def free_pages(self, pages: list[int], front: bool = False) -> None:
        raise NotImplementedError

    def inject(self) -> None:
        kind = FAULT_KINDS[self.rng.randrange(len(FAULT_KINDS))]
        holders = [r for r in self.running if r.pages]
        fid = self.res.faults_injected + 1
        pages = getattr(self, f"_fault_{kind}")(holders, fid)
        if pages is None:
            return
        self.res.faults_injected += 1
        self.res.faults_by_kind[kind] += 1
        for p in pages:
            self.page_faults.setdefault(p, set()).add(fid)
        for req in self.running:
            if any(p in pages for p in self.block_table[req.row, : len(req.pages)].tolist()):
                req.faults.add(fid)

    def _fault_realloc_while_referenced(self, holders: list[_Request], fid: int) -> list[int] | None:
        if not holders:
            return None
        req = self.rng.choice(holders)
        page = self.rng.choice(req.pages)
        self.free_pages([page], front=True)  # refcount bug: freed while still referenced
        return [page]

    def _fault_stale_block_table(self, holders: list[_Request], fid: int) -> list[int] | None:
        if not holders:
            return None
        req = self.rng.choice(holders)
        i = self.rng.randrange(len(req.pages))
        old = int(self.block_table[req.row, i])
        pool = list(self.free) if self.free else range(self.cfg.num_pages)
        stale = self.rng.choice([p for p in pool if p != old] or [(old + 1) % self.cfg.num_pages])
        self.block_table[req.row, i] = stale
        req.faults.add(fid)
        return [old, stale]

    def _fault_double_free(self, holders: list[_Request], fid: int) -> list[int] | None:
        if not self.free:
            return None
        page = self.rng.choice(list(self.free))
        self.free_pages([page], front=True)  # now on the free list twice
        return [page]

    def _fault_swapped_page_index(self, holders: list[_Request], fid: int) -> list[int] | None:
        slots = [(r, i) for r in holders for i in range(len(r.pages))]
        if len(slots) < 2:
            return None
        (a, i), (b, j) = self.rng.sample(slots, 2)
        pa, pb = int(self.block_table[a.row, i]), int(self.block_table[b.row, j])
        if pa == pb:
            return None
        self.block_table[a.row, i], self.block_table[b.row, j] = pb, pa
        a.faults.add(fid)
        b.faults.add(fid)
        return [pa, pb]

