"""The integrity plugin's device state for one KV pool, and the step functions over it (no SGLang here).

State, all on the pool's device:

- ``stamp[num_pages + 1]`` int64, the live stamp of each physical page: ``page << 32 | tag``. The tag part moves
  by one on every free and every hand-out, so a stamp taken when a request was given a page stops matching the
  moment the page is reused behind its back; the page part makes a row entry pointing at another page differ too.
  The last entry is a sentinel no record equals: the check clamps an out-of-range row entry onto it.
- ``sig[rows, pages_per_row + 1]`` int64, parallel to SGLang's ``req_to_token``: the stamp row ``r``'s ``j``-th
  page must still carry (:data:`NEVER` never matches; the last column is a write-off slot for masked scatters).
- on the host only, ``nrec_host[rows]`` (numpy): pages recorded per row. The check's extent is SGLang's own
  ``seq_lens`` (device) and ``seq_lens_cpu`` (host); every decode record verifies ``nrec_host`` against
  ``seq_lens_cpu`` and records any page a path escaped, so the two agree without reading the device.
- ``row_bad[rows]`` int32: ``-1`` once a check found row ``r`` wrong, else ``0`` (monotone until the row is
  recorded again from its first page by its next request).
- ``tree_stamp`` / ``tree_keys`` ``[num_pages + 1]``: the stamp the radix tree adopted a page with and the key of
  the token prefix it held then (slot ``num_pages`` is a write-off slot).

Host-sync convention (``tests/engines/sync_count.py`` counts against it): nothing on the decode path reads a
device tensor, builds a data-dependent shape, or indexes a device tensor with a host tensor. Host data reaches the
device only through :meth:`PoolState.upload` (pinned memory, ``non_blocking``); device tensors are created with
``device=self.device``; host tensors never pass ``device=``. Only :meth:`PoolState.explain` (after a failed check)
and :meth:`PoolState.rebuild_start` (pool clear) read the device.

A tag wraps into the page bits after 2**32 bumps of one page while a record of it is alive; a stale record could
then match again. :data:`NEVER_TAG` (all ones) is never a live tag before that either.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

__all__ = ["NEVER", "NEVER_TAG", "TAG_MASK", "Explanation", "PoolState", "mark"]

TAG_BITS = 32
TAG_MASK = (1 << TAG_BITS) - 1
NEVER_TAG = TAG_MASK  # the tag part of a record that never matches its page's live stamp
NEVER = -1  # a record with no valid page (never matches: live stamps are >= 0)
Backend = Literal["torch", "triton"]
_CHUNK = 1 << 22  # check cells per torch launch group (bounds the temporaries to a few tens of MB)
_SENTINEL = -2  # stamp of the check's out-of-range slot: no record equals it


@dataclass(frozen=True)
class Explanation:
    """Why a row failed, read back after the fact (host syncs allowed): the first bad position, what was recorded
    there and what is live, the row's pages at bad positions (someone else's: never freed again), recorded pages
    the row lost that the request still owns (freed so they do not leak), and pages handed to this row and another
    live row in one allocation (on no free list: the first holder to be aborted gives them back)."""

    position: int
    page: int
    expected_page: int
    expected_tag: int
    actual_tag: int
    bad_pages: tuple[int, ...]
    lost_pages: tuple[int, ...]
    twin_pages: tuple[int, ...]
    row_pages: tuple[int, ...]


def mark(ids: torch.Tensor, verdict: torch.Tensor) -> torch.Tensor:
    """Sampled ids with every flagged row's id turned negative (``~id == -1 - id``); out of place, one launch.

    ``verdict`` is ``row_bad`` gathered for the batch: 0 keeps an id, -1 flips it."""
    return torch.bitwise_xor(ids, verdict)


class PoolState:
    """The device tables of one pool and the plugin's step functions.

    :param num_pages: pages in the pool (SGLang: ``size // page_size + 1``, page 0 is its padding page).
    :param page_size: tokens per page.
    :param device: the pool's device.
    :param start: first tag (after a pool clear: above every tag of the old table).
    :param backend: ``"triton"`` (CUDA, or CPU under ``TRITON_INTERPRET=1``) or ``"torch"``; default by device.
    """

    def __init__(self, num_pages: int, page_size: int, device: torch.device | str, start: int = 0,
                 backend: Backend | None = None) -> None:  # fmt: skip
        if num_pages <= 0 or page_size <= 0:
            raise ValueError(f"num_pages and page_size must be positive, got {num_pages}, {page_size}")
        self.num_pages, self.page_size = num_pages, page_size
        self.device = torch.device(device)
        self.backend: Backend = backend or ("triton" if self.device.type == "cuda" else "torch")
        self.stamp = (torch.arange(num_pages + 1, dtype=torch.int64, device=self.device) << TAG_BITS) + start
        self.stamp[num_pages] = _SENTINEL
        self.tree_stamp = torch.full((num_pages + 1,), NEVER, dtype=torch.int64, device=self.device)
        self.tree_keys = torch.zeros(num_pages + 1, dtype=torch.int64, device=self.device)
        self._hand = torch.zeros(num_pages, dtype=torch.int64, device=self.device)
        self._ones, self._ones_n = torch.ones(1024, dtype=torch.int64, device=self.device), 1024
        self._never = torch.tensor(NEVER, dtype=torch.int64, device=self.device)
        self._starts, self._starts_n = self._page_starts(1024), 1024  # first token of each page of a row
        self.bound = False
        self.write_off = 0
        self.next_seq: tuple[object, np.ndarray] | None = None  # (batch, lengths after its decode token), for check
        self.sig = torch.full((0, 1), NEVER, dtype=torch.int64, device=self.device)
        self.row_bad = torch.zeros(0, dtype=torch.int32, device=self.device)
        self.nrec_host = np.zeros(0, dtype=np.int64)
        # (slots, stamps before the hand-out, which slots opened a page) of the last decode allocation, for its record
        self.pending: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None

    # ---- shape ---------------------------------------------------------------------------------------------------
    def bind(self, rows: int, row_tokens: int) -> None:
        """Size the row tables for a ``req_to_token`` of ``rows x row_tokens`` (once; a new pool gets a new state)."""
        if self.bound:
            return
        cols = -(-row_tokens // self.page_size)
        self.sig = torch.full((rows, cols + 1), NEVER, dtype=torch.int64, device=self.device)
        self.row_bad = torch.zeros(rows, dtype=torch.int32, device=self.device)
        self.nrec_host = np.zeros(rows, dtype=np.int64)
        self.write_off = cols  # the sig column masked scatters write into
        self.bound = True

    def upload(self, values: np.ndarray) -> torch.Tensor:
        """Host int64 values on the device without blocking the host (pinned staging off the CPU)."""
        host = torch.from_numpy(np.ascontiguousarray(values, dtype=np.int64))
        if self.device.type == "cuda":
            host = host.pin_memory()
        return host.to(self.device, non_blocking=True)

    def _ones_like(self, n: int) -> torch.Tensor:
        if n > self._ones_n:
            self._ones_n = max(n, 2 * self._ones_n)
            self._ones = torch.ones(self._ones_n, dtype=torch.int64, device=self.device)
        return self._ones[:n]

    def _page_starts(self, n: int) -> torch.Tensor:
        return torch.arange(n, dtype=torch.int64, device=self.device) * self.page_size

    def _starts_upto(self, n: int) -> torch.Tensor:
        if n > self._starts_n:
            self._starts_n = max(n, 2 * self._starts_n)
            self._starts = self._page_starts(self._starts_n)
        return self._starts[:n]

    # ---- memory events -------------------------------------------------------------------------------------------
    def freed(self, pages: torch.Tensor) -> None:
        """Pages returned to the pool (a page listed k times moves by k) and dropped by the tree."""
        self.stamp.index_add_(0, pages, self._ones_like(pages.numel()))
        self.tree_stamp.index_put_((pages,), self._never)

    def handed(self, slots: torch.Tensor) -> None:
        """An allocation's token slots: bump every page it opened (the slot at a page's start)."""
        if self.page_size == 1:
            self.stamp.index_add_(0, slots, self._ones_like(slots.numel()))
            return
        opened = (slots % self.page_size == 0).long()
        self.stamp.index_add_(0, slots // self.page_size, opened)

    def handed_decode(self, slots: torch.Tensor, n: int) -> None:
        """A decode allocation of ``n`` slots, one per row (``n = 0``: the host knows no row opens a page): bump the
        opened pages and keep their stamps from before the bump for :meth:`record_decode` (a page handed to two rows
        in this one call then matches neither)."""
        self.pending = None
        if not n:
            return
        if self.page_size == 1:
            before = self.stamp.index_select(0, slots)
            self.stamp.index_add_(0, slots, self._ones_like(n))
            self.pending = (slots, before, None)
            return
        pages, opened = slots // self.page_size, slots % self.page_size == 0
        before = self.stamp.index_select(0, pages)
        self.stamp.index_add_(0, pages, opened.long())
        self.pending = (slots, before, opened)

    # ---- records -------------------------------------------------------------------------------------------------
    def record_decode(self, table: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor, seq_lens: torch.Tensor,
                      rows_host: np.ndarray, seq_host: np.ndarray) -> None:  # fmt: skip
        """Record the page each row's decode token opened (``seq_lens``: lengths before the token).

        Device work only (``rows`` / ``seq_lens`` / ``slots`` are SGLang's device tensors, already written into
        ``table``); the host keeps its mirror from SGLang's host copies. A row whose earlier pages were never
        recorded (a path that escaped the hooks) is recorded from ``table`` with :meth:`record_spans`."""
        ps = self.page_size
        pending, self.pending = self.pending, None
        have = self.nrec_host[rows_host]
        gaps = np.flatnonzero(have != -(-seq_host // ps))
        opens = seq_host % ps == 0
        if opens.any():
            if pending is not None and pending[0] is slots:
                expected, opened = pending[1] + 1, pending[2]
            else:  # the allocation was not seen (another allocator entry point): the live stamp after it
                expected = self.stamp.index_select(0, slots if ps == 1 else slots // ps)
                opened = None if ps == 1 else slots % ps == 0
            if opened is None:
                self.sig.index_put_((rows, seq_lens), expected)
            else:  # rows that did not open a page write into the write-off column
                self.sig.index_put_((rows, torch.where(opened, seq_lens // ps, self.write_off)), expected)
            self.nrec_host[rows_host[opens]] = seq_host[opens] // ps + 1
        if len(gaps):
            ends = -(-(seq_host[gaps] + 1) // ps)
            self.record_spans(table, rows_host[gaps], have[gaps], ends, np.zeros(len(gaps), dtype=np.int64))

    def record_spans(self, table: torch.Tensor, rows: Sequence[int], firsts: Sequence[int], ends: Sequence[int],
                     tree_pages: Sequence[int], keys: np.ndarray | None = None) -> None:  # fmt: skip
        """Record pages ``[firsts[i], ends[i])`` of each row as the row holds them now in ``table``
        (``req_to_token``). The first ``tree_pages[i]`` pages of a row recorded from page 0 came from the radix
        tree and get the stamp the tree adopted them with if ``keys`` (one int64 per tree page, rows in order)
        matches the tree's key, else :data:`NEVER_TAG`; the rest were just handed out and get their stamp from
        before this hand-out plus one (a page handed to two holders in one allocation matches neither).

        One upload of host-built indices; no device read."""
        counts = np.asarray(ends, dtype=np.int64) - np.asarray(firsts, dtype=np.int64)
        keep = counts > 0
        if not keep.any():
            return
        rows_a = np.asarray(rows, dtype=np.int64)[keep]
        firsts_a = np.asarray(firsts, dtype=np.int64)[keep]
        ends_a, counts = np.asarray(ends, dtype=np.int64)[keep], counts[keep]
        tree_a = np.asarray(tree_pages, dtype=np.int64)[keep]
        n = int(counts.sum())
        offsets = np.repeat(np.cumsum(counts) - counts, counts)
        cols = np.arange(n, dtype=np.int64) - offsets + np.repeat(firsts_a, counts)
        from_tree = cols < np.repeat(np.where(firsts_a == 0, tree_a, 0), counts)
        entry_keys = np.zeros(n, dtype=np.int64)
        if keys is not None and from_tree.any():
            entry_keys[from_tree] = keys[: int(from_tree.sum())]
        restart = rows_a[firsts_a == 0]
        packed = self.upload(np.concatenate([np.repeat(rows_a, counts), cols, from_tree.astype(np.int64),
                                             entry_keys, restart]))  # fmt: skip
        r, c, t, k = packed[:n], packed[n : 2 * n], packed[2 * n : 3 * n].bool(), packed[3 * n : 4 * n]
        self._record_entries(table, r, c, t, k)
        if len(restart):  # a row's next request starts with a clean verdict
            self.row_bad.index_fill_(0, packed[4 * n :], 0)
        self.nrec_host[rows_a] = ends_a

    def _record_entries(self, table: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, from_tree: torch.Tensor,
                        keys: torch.Tensor) -> None:  # fmt: skip
        ps = self.page_size
        page = table[rows, cols * ps].long()
        if ps > 1:
            page = page // ps
        pc = page.clamp(0, self.num_pages - 1)
        fresh = (~from_tree).long()
        self._hand.index_add_(0, pc, fresh)
        times = self._hand.index_select(0, pc)  # how often this hand-out gave the page
        self._hand.index_add_(0, pc, -fresh)
        fresh_val = self.stamp.index_select(0, pc) - (times - 1)
        tree_val = torch.where(self.tree_keys.index_select(0, pc) == keys, self.tree_stamp.index_select(0, pc),
                               (pc << TAG_BITS) | NEVER_TAG)  # fmt: skip
        val = torch.where(from_tree, tree_val, fresh_val)
        self.sig.index_put_((rows, cols), torch.where(pc == page, val, NEVER))

    def adopt(self, table: torch.Tensor, row: int, first: int, end: int, keys: np.ndarray) -> None:
        """The radix tree took row ``row``'s pages ``[first, end)`` (``keys``: their prefix keys) and may have
        rewritten some entries with pages it already held: where the row still holds the recorded page the tree
        adopts it with the recorded stamp; rewritten entries are re-recorded with the tree's stamp (masked
        scatters through the write-off slot; no device read)."""
        if end <= first:
            return
        ps = self.page_size
        page = table[row, first * ps : end * ps : ps].long()
        if ps > 1:
            page = page // ps
        pc = page.clamp(0, self.num_pages - 1)
        rec = self.sig[row, first:end]
        same = (rec >> TAG_BITS) == page
        target = torch.where(same, pc, self.num_pages)
        k = self.upload(keys)
        self.tree_stamp.index_put_((target,), rec)
        self.tree_keys.index_put_((target,), k)
        tree_val = torch.where(self.tree_keys.index_select(0, pc) == k, self.tree_stamp.index_select(0, pc),
                               (pc << TAG_BITS) | NEVER_TAG)  # fmt: skip
        rewritten = torch.where(pc == page, tree_val, NEVER)
        self.sig[row, first:end] = torch.where(same, rec, rewritten)

    # ---- the check -----------------------------------------------------------------------------------------------
    def check(self, table: torch.Tensor, rows: torch.Tensor, seq_lens: torch.Tensor, seq_host: np.ndarray,
              slots: torch.Tensor | None) -> torch.Tensor | None:  # fmt: skip
        """One fused gather-compare over every page the step's attention reads (``ceil(seq_lens / page_size)`` per
        row, SGLang's device lengths; ``seq_host`` its host copy, for the launch size): ORs ``-1`` into ``row_bad``
        of each row with a page whose live stamp differs from its record, and points such a row's decode write
        (``slots``, SGLang's ``out_cache_loc``) at slot 0, SGLang's padding slot: a flagged request still runs its
        forward (nothing is read back to take it out of the batch), but cannot write into a page that is someone
        else's now. Returns the slots the forward must use (``slots`` itself, updated in place, on Triton;
        ``slots=None``: no redirect). Enqueued only: nothing is read back."""
        if not len(seq_host):
            return slots
        ps = self.page_size
        max_n = -(-int(seq_host.max()) // ps)
        if max_n == 0:
            return slots
        if self.backend == "triton":
            from quantkit.serving.integrity.triton_check import row_check_triton

            row_check_triton(rows, seq_lens, table, self.sig, self.stamp, self.row_bad, slots, ps, max_n)
            return slots
        if slots is None:
            slots = torch.zeros(len(seq_host), dtype=torch.int64, device=self.device)
        step = max(1, _CHUNK // max_n)
        if step >= len(seq_host):
            return self._check_torch(table, rows, seq_lens, max_n, slots)
        parts = [self._check_torch(table, rows[lo : lo + step], seq_lens[lo : lo + step], max_n, slots[lo : lo + step])
                 for lo in range(0, len(seq_host), step)]  # fmt: skip
        return torch.cat(parts)

    def _check_torch(self, table: torch.Tensor, rows: torch.Tensor, seq_lens: torch.Tensor, max_n: int,
                     slots: torch.Tensor) -> torch.Tensor:  # fmt: skip
        ps = self.page_size
        page = table[:, : max_n * ps : ps].index_select(0, rows).long()
        if ps > 1:
            page = page // ps
        now = self.stamp.take(page.clamp_(0, self.num_pages))  # out of range -> the sentinel
        bad = ((now != self.sig[:, :max_n].index_select(0, rows)) & (self._starts_upto(max_n) < seq_lens[:, None]))
        flags = torch.where(bad.any(1), -1, self.row_bad.index_select(0, rows))
        self.row_bad.index_copy_(0, rows, flags)
        return torch.bitwise_and(slots, ~flags)

    def verdict(self, rows: torch.Tensor) -> torch.Tensor:
        """``row_bad`` of ``rows`` (0 clean, -1 failed): what :func:`mark` applies to the sampled ids."""
        return self.row_bad.index_select(0, rows)

    # ---- after a failed check (host reads allowed) ---------------------------------------------------------------
    def explain(self, table: torch.Tensor, row: int, protected_pages: int) -> Explanation:
        """Read back why ``row`` failed (see :class:`Explanation`); ``protected_pages``: the tree's prefix, not the
        request's to free."""
        ps, n = self.page_size, int(self.nrec_host[row])
        page = table[row, : n * ps : ps].long() // ps
        valid = (page >= 0) & (page < self.num_pages)
        pc = page.clamp(0, self.num_pages - 1)
        rec = self.sig[row, :n]
        now = self.stamp.index_select(0, pc)
        bad = ~valid | (now != rec)
        rec_page = rec >> TAG_BITS
        idx = bad.nonzero().flatten().tolist()
        if not idx:  # flagged, but the row has been recorded again since
            return Explanation(-1, -1, -1, -1, -1, (), (), (), tuple(page.tolist()))
        j = idx[0]
        owned = (rec_page >= 0) & (rec_page < self.num_pages)
        still_ours = owned & (self.stamp.index_select(0, rec_page.clamp(0, self.num_pages - 1)) == rec)
        lost = bad & (page != rec_page) & still_ours
        lost[:protected_pages] = False
        same_page = bad & valid & (page == rec_page) & ((rec & TAG_MASK) != NEVER_TAG)
        twins = [int(p) for p, s in zip(page[same_page].tolist(), rec[same_page].tolist(), strict=True)
                 if self._held_elsewhere(row, s)]  # fmt: skip
        return Explanation(
            j, int(page[j]), int(rec_page[j]), _tag(int(rec[j])), _tag(int(now[j])) if bool(valid[j]) else -1,
            tuple(sorted(set(page[bad & valid].tolist()))), tuple(rec_page[lost].tolist()), tuple(twins),
            tuple(page.tolist()),
        )  # fmt: skip

    def _held_elsewhere(self, row: int, stamp: int) -> bool:
        """Another live row recorded exactly this stamp: the page went to both in one hand-out."""
        live = np.flatnonzero(self.nrec_host > 0)
        live = live[live != row]
        if not len(live):
            return False
        width = int(self.nrec_host[live].max())
        return bool((self.sig[torch.from_numpy(live).to(self.device), :width] == stamp).any())

    def rebuild_start(self) -> int:
        """The first tag of a table that replaces this one (above every live tag): read at pool clear only."""
        return int((self.stamp[: self.num_pages] & TAG_MASK).max()) + 1


def _tag(stamp: int) -> int:
    tag = stamp & TAG_MASK
    return -1 if stamp < 0 or tag == NEVER_TAG else tag
