"""Per-request ledger of the (page, tag) pairs each request was given, in one flat arena.

Layout (CSR-like): two preallocated flat tensors ``pages`` (int32) and ``tags`` (int64) on the pool's
device; request ``rid`` owns the contiguous segment ``[start, start + length)`` with room for ``capacity``
entries. A decode batch is then described by two small vectors (starts, lengths) and the check reads
contiguous memory with no per-step gather index to build.

Appending is amortised O(1): a full segment moves to the end of the arena with twice the room, and a
full arena is compacted (or grown) in one copy. Releasing a request only forgets its segment; the hole is
reclaimed at the next compaction. Nothing here allocates on the decode hot path except when a segment
outgrows its room, i.e. O(log n) times per request.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Ledger"]


@dataclass
class _Segment:
    start: int
    length: int
    capacity: int


class Ledger:
    """Flat (page, tag) records per request.

    :param capacity: initial arena size in entries (grows by doubling when needed).
    :param device: the device holding the KV pool and the tag table.
    :param min_segment: room a new request starts with (entries).
    """

    def __init__(self, capacity: int = 1 << 14, device: torch.device | str = "cpu", min_segment: int = 8):
        if capacity <= 0 or min_segment <= 0:
            raise ValueError("capacity and min_segment must be positive")
        self.device = torch.device(device)
        self.pages = torch.zeros(capacity, dtype=torch.int32, device=self.device)
        self.tags = torch.zeros(capacity, dtype=torch.int64, device=self.device)
        self.min_segment = min_segment
        self._segments: dict[int, _Segment] = {}
        self._top = 0

    @property
    def capacity(self) -> int:
        return self.pages.numel()

    def __contains__(self, rid: int) -> bool:
        return rid in self._segments

    def __len__(self) -> int:
        return len(self._segments)

    def length(self, rid: int) -> int:
        """Entries recorded for ``rid`` (0 when unknown)."""
        seg = self._segments.get(rid)
        return seg.length if seg else 0

    def append(self, rid: int, pages: torch.Tensor, tags: torch.Tensor) -> None:
        """Record that ``rid`` now uses ``pages`` with ``tags`` (in block-table order)."""
        n = pages.numel()
        if n != tags.numel():
            raise ValueError(f"{n} pages but {tags.numel()} tags")
        seg = self._reserve(rid, n)
        end = seg.start + seg.length
        self.pages[end : end + n] = pages.to(self.device, torch.int32)
        self.tags[end : end + n] = tags.to(self.device, torch.int64)
        seg.length += n

    def append_many(self, rids: list[int], pages: torch.Tensor, tags: torch.Tensor) -> None:
        """Record ``pages[i]``/``tags[i]`` for ``rids[i]`` (one decode step's new pages) in one scatter."""
        if not (len(rids) == pages.numel() == tags.numel()):
            raise ValueError(f"{len(rids)} requests, {pages.numel()} pages, {tags.numel()} tags")
        counts: dict[int, int] = {}
        for rid in rids:
            counts[rid] = counts.get(rid, 0) + 1
        for rid, n in counts.items():
            self._reserve(rid, n)
        # Positions only after every reservation: a later one may compact and move earlier segments.
        positions = []
        for rid in rids:
            seg = self._segments[rid]
            positions.append(seg.start + seg.length)
            seg.length += 1
        index = torch.tensor(positions, dtype=torch.int64, device=self.device)
        self.pages.index_copy_(0, index, pages.to(self.device, torch.int32))
        self.tags.index_copy_(0, index, tags.to(self.device, torch.int64))

    def entries(self, rid: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of the (pages, tags) recorded for ``rid``."""
        seg = self._segments[rid]
        return self.pages[seg.start : seg.start + seg.length], self.tags[seg.start : seg.start + seg.length]

    def release(self, rid: int) -> None:
        """Forget ``rid`` (finished, aborted or preempted); unknown ids are ignored."""
        self._segments.pop(rid, None)

    def segments(self, rids: list[int]) -> tuple[list[int], list[int]]:
        """(starts, lengths) of ``rids`` in order; unknown requests have length 0."""
        starts, lengths = [], []
        for rid in rids:
            seg = self._segments.get(rid)
            starts.append(seg.start if seg else 0)
            lengths.append(seg.length if seg else 0)
        return starts, lengths

    def _reserve(self, rid: int, n: int) -> _Segment:
        seg = self._segments.get(rid)
        if seg is None:
            seg = _Segment(0, 0, 0)
            self._segments[rid] = seg
        if seg.length + n <= seg.capacity:
            return seg
        room = max(self.min_segment, 2 * seg.capacity, seg.length + n)
        if self._top + room > self.capacity:
            self._compact(extra=room)
        start = self._top
        if seg.length:
            self.pages[start : start + seg.length] = self.pages[seg.start : seg.start + seg.length]
            self.tags[start : start + seg.length] = self.tags[seg.start : seg.start + seg.length]
        seg.start, seg.capacity = start, room
        self._top = start + room
        return seg

    def _compact(self, extra: int) -> None:
        """Pack live segments to the front (growing the arena if needed), leaving ``extra`` free entries.

        Segments keep their reserved room, so a reservation made just before a compaction still holds.
        """
        reserved = sum(s.capacity for s in self._segments.values())
        capacity = self.capacity
        while reserved + extra > capacity // 2:
            capacity *= 2
        pages = torch.zeros(capacity, dtype=torch.int32, device=self.device)
        tags = torch.zeros(capacity, dtype=torch.int64, device=self.device)
        top = 0
        for seg in self._segments.values():
            pages[top : top + seg.length] = self.pages[seg.start : seg.start + seg.length]
            tags[top : top + seg.length] = self.tags[seg.start : seg.start + seg.length]
            seg.start = top
            top += seg.capacity
        self.pages, self.tags, self._top = pages, tags, top
