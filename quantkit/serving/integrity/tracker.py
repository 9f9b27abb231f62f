"""KV-page integrity trackers: the tag tracker and a no-op tracker with the same interface.

The serving engine calls these hooks (``sglang_integrity.py`` is the SGLang plugin that drives them):

- ``on_alloc(rid, pages)``   pages newly allocated to a request: bump their tags, record the new ones
  (``on_alloc_many(rids, pages)``: one page per request, a decode step's allocation in one call);
- ``on_attach(rid, pages, tags)`` shared prefix pages attached from the prefix cache: record the tags the
  cache stored when it took the pages (not the live ones, or a cache entry whose page was reused would
  be trusted);
- ``on_free(pages)``         pages returned to the pool (free or eviction): bump their tags;
- ``on_release(rid)``        the request is done with its pages (finish, abort, preemption);
- ``check(batch)``           before decode, one batched gather + compare for every page of every request;
  returns the requests to abort with the offending pages.

Which tracker runs is configuration (``IntegrityConfig.tracker``); ``NoOpTracker`` is the default, as in
the production design, and does nothing at all on every hook.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Protocol

import torch

from quantkit.serving.integrity.ledger import Ledger
from quantkit.serving.integrity.tags import PageTagTable

__all__ = [
    "CheckResult",
    "DecodeBatch",
    "IntegrityConfig",
    "NoOpTracker",
    "TagTracker",
    "Tracker",
    "check_counts_torch",
    "make_tracker",
]


@dataclass(frozen=True)
class DecodeBatch:
    """What the attention kernel is about to read: requests and their rows in the live block table.

    :param rids: request ids in batch order.
    :param rows: the block-table row of each request (SGLang: ``req_pool_idx``).
    :param table: the live block table, row-major 2-D (SGLang: ``req_to_token``).
    :param col_stride: columns between two pages of a row (the page size for a per-token table).
    :param page_div: divisor that turns an entry into a page index (the page size for token slots).
    """

    rids: list[int]
    rows: list[int]
    table: torch.Tensor
    col_stride: int = 1
    page_div: int = 1


@dataclass(frozen=True)
class CheckResult:
    """Requests to abort before decode, and for each the block-table pages that failed the check."""

    abort: list[int] = field(default_factory=list)
    offending: dict[int, list[int]] = field(default_factory=dict)

    @property
    def clean(self) -> bool:
        return not self.abort


CLEAN = CheckResult()


class Tracker(Protocol):
    """The hook interface both trackers implement."""

    enabled: bool

    def on_alloc(self, rid: int, pages: torch.Tensor) -> torch.Tensor | None: ...
    def on_alloc_many(self, rids: list[int], pages: torch.Tensor) -> torch.Tensor | None: ...
    def on_attach(self, rid: int, pages: torch.Tensor, tags: torch.Tensor | None = None) -> None: ...
    def on_free(self, pages: torch.Tensor) -> None: ...
    def on_release(self, rid: int) -> None: ...
    def owned_pages(self, rid: int) -> torch.Tensor | None: ...
    def check(self, batch: DecodeBatch) -> CheckResult: ...


class NoOpTracker:
    """Same interface, no state, no work: every hook returns at once."""

    enabled = False

    def on_alloc(self, rid: int, pages: torch.Tensor) -> None:
        return None

    def on_alloc_many(self, rids: list[int], pages: torch.Tensor) -> None:
        return None

    def on_attach(self, rid: int, pages: torch.Tensor, tags: torch.Tensor | None = None) -> None:
        return None

    def on_free(self, pages: torch.Tensor) -> None:
        return None

    def on_release(self, rid: int) -> None:
        return None

    def owned_pages(self, rid: int) -> None:
        return None

    def check(self, batch: DecodeBatch) -> CheckResult:
        return CLEAN


class TagTracker:
    """Generation tags per page + a per-request (page, tag) ledger + the batched pre-decode check.

    :param num_pages: pages in the pool.
    :param device: the pool's device; tags and ledger live there.
    :param backend: ``"triton"``, ``"torch"`` or ``"auto"`` (Triton on CUDA, torch elsewhere).
    """

    enabled = True

    def __init__(self, num_pages: int, device: torch.device | str = "cpu",
                 backend: Literal["auto", "torch", "triton"] = "auto") -> None:  # fmt: skip
        if backend not in ("auto", "torch", "triton"):
            raise ValueError(f"backend must be auto, torch or triton, got {backend!r}")
        self.device = torch.device(device)
        self.table = PageTagTable(num_pages, self.device)
        self.ledger = Ledger(device=self.device)
        self.backend = ("triton" if self.device.type == "cuda" else "torch") if backend == "auto" else backend
        self._counts = torch.zeros(256, dtype=torch.int32, device=self.device)

    def on_alloc(self, rid: int, pages: torch.Tensor) -> torch.Tensor:
        """Pages newly allocated to ``rid``; returns the recorded tags (for the prefix cache to keep)."""
        tags = self.table.bump_for_alloc(pages)
        self.ledger.append(rid, pages, tags)
        return tags

    def on_alloc_many(self, rids: list[int], pages: torch.Tensor) -> torch.Tensor:
        """One page each for ``rids`` (a decode step's allocation), bumped and recorded in one go."""
        tags = self.table.bump_for_alloc(pages)
        self.ledger.append_many(rids, pages, tags)
        return tags

    def on_attach(self, rid: int, pages: torch.Tensor, tags: torch.Tensor | None = None) -> None:
        """Shared pages attached to ``rid``; ``tags`` are those the prefix cache stored with them."""
        self.ledger.append(rid, pages, self.table.lookup(pages) if tags is None else tags)

    def on_free(self, pages: torch.Tensor) -> None:
        self.table.bump(pages)

    def on_release(self, rid: int) -> None:
        self.ledger.release(rid)

    def owned_pages(self, rid: int) -> torch.Tensor:
        """Recorded pages of ``rid`` whose tag still matches: the only ones safe to free on abort."""
        if rid not in self.ledger:
            return torch.zeros(0, dtype=torch.int64, device=self.device)
        pages, tags = self.ledger.entries(rid)
        pages = pages.long()
        return pages[self.table.lookup(pages) == tags]

    def check(self, batch: DecodeBatch) -> CheckResult:
        """One batched gather + compare; a host sync only for the one 'anything wrong?' flag."""
        counts = self.counts(batch)
        if counts is None or not bool(counts.any()):
            return CLEAN
        return self._explain(batch, counts)

    def counts(self, batch: DecodeBatch) -> torch.Tensor | None:
        """Mismatching entries per batch request (device tensor), or None for an empty batch."""
        starts, lengths = self.ledger.segments(batch.rids)
        max_len = max(lengths, default=0)
        if max_len == 0:
            return None
        args = self._batch_tensors(starts, lengths, batch.rows)
        if self.backend == "triton":
            from quantkit.serving.integrity.triton_check import check_counts_triton

            if self._counts.numel() < len(lengths):
                self._counts = torch.zeros(2 * len(lengths), dtype=torch.int32, device=self.device)
            out = self._counts[: len(lengths)]
            return check_counts_triton(
                self.ledger.pages, self.ledger.tags, *args, batch.table, self.table.tags, out,
                batch.col_stride, batch.page_div, max_len,
            )  # fmt: skip
        return check_counts_torch(
            self.ledger.pages, self.ledger.tags, *args, batch.table, self.table.tags,
            batch.col_stride, batch.page_div, max_len,
        )  # fmt: skip

    def _batch_tensors(self, starts: list[int], lengths: list[int], rows: list[int]) -> tuple[torch.Tensor, ...]:
        packed = torch.tensor([starts, lengths, rows], dtype=torch.int64)
        packed = packed.to(self.device, non_blocking=True)
        return packed[0], packed[1], packed[2]

    def _explain(self, batch: DecodeBatch, counts: torch.Tensor) -> CheckResult:
        """Slow path, only after a mismatch: which pages of which requests failed."""
        abort, offending = [], {}
        for i in torch.nonzero(counts).flatten().tolist():
            rid = batch.rids[i]
            led_pages, led_tags = self.ledger.entries(rid)
            n = led_pages.numel()
            row = batch.table[batch.rows[i]]
            pages = (row[: n * batch.col_stride : batch.col_stride].long() // batch.page_div).to(self.device)
            valid = (pages >= 0) & (pages < self.table.num_pages)
            live = self.table.tags[pages.clamp(0, self.table.num_pages - 1)]
            bad = ~valid | (pages != led_pages.long()) | (live != led_tags)
            abort.append(rid)
            offending[rid] = pages[bad].tolist()
        return CheckResult(abort, offending)


def check_counts_torch(
    led_pages: torch.Tensor,
    led_tags: torch.Tensor,
    starts: torch.Tensor,
    lengths: torch.Tensor,
    rows: torch.Tensor,
    table: torch.Tensor,
    live_tags: torch.Tensor,
    col_stride: int = 1,
    page_div: int = 1,
    max_len: int | None = None,
) -> torch.Tensor:
    """Reference/CPU path of the check: mismatching entries per request, as int32.

    Works on a (requests x longest segment) grid, like the Triton kernel: no per-entry index built by
    ``repeat_interleave`` (which stalls on contended CPUs), at the price of padding when lengths differ.
    """
    if table.dim() != 2 or not table.is_contiguous():
        raise ValueError("the block table must be a contiguous 2-D tensor")
    if max_len is None:
        max_len = int(lengths.max()) if lengths.numel() else 0
    j = torch.arange(max_len, device=lengths.device)
    step = max(1, _CHUNK_ENTRIES // max(max_len, 1))  # bound the temporaries to a few MB
    parts = [
        _grid_counts(led_pages, led_tags, starts[i : i + step], lengths[i : i + step], rows[i : i + step],
                     table, live_tags, col_stride, page_div, j)
        for i in range(0, lengths.numel(), step)
    ]  # fmt: skip
    return torch.cat(parts) if len(parts) != 1 else parts[0]


_CHUNK_ENTRIES = 1 << 20


def _grid_counts(
    led_pages: torch.Tensor,
    led_tags: torch.Tensor,
    starts: torch.Tensor,
    lengths: torch.Tensor,
    rows: torch.Tensor,
    table: torch.Tensor,
    live_tags: torch.Tensor,
    col_stride: int,
    page_div: int,
    j: torch.Tensor,
) -> torch.Tensor:
    inside = j < lengths[:, None]
    led = (starts[:, None] + j).clamp_(max=led_pages.numel() - 1).view(-1)
    cell = (rows[:, None] * table.stride(0) + j * col_stride).clamp_(max=table.numel() - 1).view(-1)
    # index_select on flat indices: advanced indexing is several times slower on CPU.
    page = table.view(-1).index_select(0, cell)
    if page_div != 1:
        page = page // page_div
    # Recorded pages are always valid, so an out-of-range table entry already differs from its record;
    # clamping only keeps the tag gather in bounds.
    live = live_tags.index_select(0, page.clamp(0, live_tags.numel() - 1))
    bad = (page != led_pages.index_select(0, led)) | (live != led_tags.index_select(0, led))
    return (bad.view(inside.shape) & inside).sum(1, dtype=torch.int32)


@dataclass(frozen=True)
class IntegrityConfig:
    """Serving-side choice of tracker; ``noop`` is the default where integrity checking is not wanted."""

    tracker: Literal["tags", "noop"] = "noop"
    backend: Literal["auto", "torch", "triton"] = "auto"


def make_tracker(
    config: IntegrityConfig, num_pages: int, device: torch.device | str = "cpu"
) -> TagTracker | NoOpTracker:
    """Build the tracker the configuration asks for."""
    if config.tracker == "noop":
        return NoOpTracker()
    if config.tracker == "tags":
        return TagTracker(num_pages, device, config.backend)
    raise ValueError(f"unknown tracker {config.tracker!r}: use 'tags' or 'noop'")
