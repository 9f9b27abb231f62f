"""One generation tag per physical KV page: the live half of the integrity check.

Every time a page is freed or handed out again its tag changes, so a (page, tag) pair that a request
recorded when it was given the page stops matching the moment the page is reused behind its back.

Why int64 and not a wrapping uint32:
- torch has no full uint32 arithmetic on every device (``index_add_``/comparisons on ``torch.uint32`` are
  missing on several backends), and emulating the wrap in int32 would need a mask on every bump;
- an int64 tag cannot wrap in practice (2**63 bumps of one page), so a stale pair can never match again
  by wrap-around, which a 32-bit tag only makes unlikely (4e9 reallocations of one page);
- the cost is small: 8 bytes per page, i.e. 11 MB for a 1.37M-token pool at page size 1 next to ~48 GB
  of KV, and the check reads 8 bytes per page, not per token, at page size 64.

Tags live on the device that holds the pool, so the batched check never copies them.
"""

from __future__ import annotations

import torch

__all__ = ["PageTagTable"]


class PageTagTable:
    """Vectorised generation tags for ``num_pages`` physical pages.

    :param num_pages: pages in the KV pool (SGLang: ``size // page_size`` plus its padding page).
    :param device: the device holding the KV pool.
    """

    def __init__(self, num_pages: int, device: torch.device | str = "cpu") -> None:
        if num_pages <= 0:
            raise ValueError(f"num_pages must be positive, got {num_pages}")
        self.num_pages = num_pages
        self.tags = torch.zeros(num_pages, dtype=torch.int64, device=device)
        # Preallocated so bumping never allocates a source tensor on the hot path.
        self._ones = torch.ones(1024, dtype=torch.int64, device=device)

    @property
    def device(self) -> torch.device:
        return self.tags.device

    def lookup(self, pages: torch.Tensor) -> torch.Tensor:
        """Current tags of ``pages`` (any integer dtype)."""
        return self.tags.index_select(0, pages.to(self.device))

    def bump(self, pages: torch.Tensor) -> None:
        """Change the tag of every page in ``pages``; a page listed k times moves by k (double free)."""
        pages = pages.to(self.device)
        n = pages.numel()
        if n == 0:
            return
        if n > self._ones.numel():
            self._ones = torch.ones(max(n, 2 * self._ones.numel()), dtype=torch.int64, device=self.device)
        self.tags.index_add_(0, pages, self._ones[:n])

    def bump_for_alloc(self, pages: torch.Tensor) -> torch.Tensor:
        """Bump ``pages`` for a new allocation and return the tag each occurrence must record.

        A page that occurs twice in one allocation (a double free put it twice on the free list) gets
        distinct tags per occurrence, and only the last one matches the live tag: every earlier holder
        is caught, even inside one batched allocation.
        """
        pages = pages.to(self.device).long()
        old = self.lookup(pages)
        self.bump(pages)
        if _surely_unique(pages):
            return old + 1
        return old + _occurrence_rank(pages) + 1


def _surely_unique(pages: torch.Tensor) -> bool:
    """Cheap host-side duplicate test for small CPU allocations (the common case); False = don't know."""
    n = pages.numel()
    if n <= 1:
        return True
    return pages.device.type == "cpu" and n <= 4096 and len(set(pages.tolist())) == n


def _occurrence_rank(pages: torch.Tensor) -> torch.Tensor:
    """For each element, how many earlier elements hold the same value (0 for unique pages)."""
    n = pages.numel()
    if n <= 1:
        return torch.zeros_like(pages)
    sorted_pages, order = torch.sort(pages, stable=True)
    positions = torch.arange(n, device=pages.device)
    run_start = torch.ones(n, dtype=torch.bool, device=pages.device)
    run_start[1:] = sorted_pages[1:] != sorted_pages[:-1]
    first = torch.where(run_start, positions, torch.zeros_like(positions)).cummax(0).values
    rank = torch.empty_like(pages)
    rank[order] = positions - first
    return rank
