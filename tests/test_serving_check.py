"""The batched pre-decode check: torch path vs a plain-Python reference, Triton vs torch, fault cases."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import inspect  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from quantkit.serving.integrity.tracker import (  # noqa: E402
    DecodeBatch,
    IntegrityConfig,
    NoOpTracker,
    TagTracker,
    check_counts_torch,
    make_tracker,
)


def _state(seed: int, batch: int, max_len: int, num_pages: int, corrupt: int, page_size: int = 1):
    """A random tracker state with ``corrupt`` random corruptions of the table, the tags or the ledger."""
    gen = torch.Generator().manual_seed(seed)
    tracker = TagTracker(num_pages)
    tracker.table.tags.copy_(torch.randint(0, 5, (num_pages,), generator=gen))
    lengths = torch.randint(0, max_len + 1, (batch,), generator=gen).tolist()
    table = torch.zeros(batch + 1, max(max_len, 1) * page_size, dtype=torch.int32)
    rows = list(range(batch, 0, -1))  # rows differ from batch order on purpose
    for rid, (row, n) in enumerate(zip(rows, lengths, strict=True)):
        pages = torch.randint(0, num_pages, (n,), generator=gen)
        tracker.on_attach(rid, pages)
        slots = pages[:, None] * page_size + torch.arange(page_size)
        table[row, : n * page_size] = slots.reshape(-1).to(torch.int32)
    for _ in range(corrupt):
        kind = int(torch.randint(0, 3, (1,), generator=gen))
        if kind == 0:
            tracker.table.bump(torch.randint(0, num_pages, (1,), generator=gen))
        elif kind == 1:
            r = int(torch.randint(1, batch + 1, (1,), generator=gen))
            c = int(torch.randint(0, table.shape[1], (1,), generator=gen))
            table[r, c] = int(torch.randint(0, num_pages * page_size, (1,), generator=gen))
        else:
            tracker.ledger.tags[int(torch.randint(0, max(tracker.ledger._top, 1), (1,), generator=gen))] += 1
    return tracker, DecodeBatch(list(range(batch)), rows, table, page_size, page_size), lengths


def _reference(tracker: TagTracker, batch: DecodeBatch) -> list[int]:
    out = []
    for rid, row in zip(batch.rids, batch.rows, strict=True):
        bad = 0
        if rid in tracker.ledger:
            pages, tags = tracker.ledger.entries(rid)
            for j, (p, t) in enumerate(zip(pages.tolist(), tags.tolist(), strict=True)):
                live_page = int(batch.table[row, j * batch.col_stride]) // batch.page_div
                bad += live_page != p or int(tracker.table.tags[live_page]) != t
        out.append(bad)
    return out


@settings(max_examples=40, deadline=None, derandomize=True)
@given(st.integers(0, 10_000), st.integers(1, 6), st.integers(0, 40), st.integers(0, 4), st.sampled_from([1, 4]))
def test_torch_check_matches_reference(seed, batch, max_len, corrupt, page_size):
    tracker, dbatch, _ = _state(seed, batch, max_len, 64, corrupt, page_size)
    counts = tracker.counts(dbatch)
    expected = _reference(tracker, dbatch)
    assert (counts.tolist() if counts is not None else [0] * batch) == expected
    result = tracker.check(dbatch)
    assert result.abort == [rid for rid, n in zip(dbatch.rids, expected, strict=True) if n]
    assert all(len(result.offending[rid]) == expected[rid] for rid in result.abort)


def test_torch_check_chunks_large_batches_consistently(monkeypatch):
    import quantkit.serving.integrity.tracker as tr

    tracker, dbatch, _ = _state(7, 6, 50, 128, 5)
    whole = tracker.counts(dbatch).tolist()
    monkeypatch.setattr(tr, "_CHUNK_ENTRIES", 60)
    assert tracker.counts(dbatch).tolist() == whole == _reference(tracker, dbatch)


@pytest.mark.parametrize("seed,page_size", [(1, 1), (2, 4), (3, 1)])
def test_triton_kernel_matches_torch_path(seed, page_size):
    pytest.importorskip("triton")
    from quantkit.serving.integrity.triton_check import check_counts_triton

    tracker, dbatch, lengths = _state(seed, 3, 300, 256, 6, page_size)
    starts, lens = tracker.ledger.segments(dbatch.rids)
    vecs = [torch.tensor(v, dtype=torch.int64) for v in (starts, lens, dbatch.rows)]
    args = (tracker.ledger.pages, tracker.ledger.tags, *vecs, dbatch.table, tracker.table.tags)
    expected = check_counts_torch(*args, page_size, page_size)
    got = check_counts_triton(*args, torch.zeros(3, dtype=torch.int32), page_size, page_size, max(lengths))
    assert got.tolist() == expected.tolist() == _reference(tracker, dbatch)
    assert sum(expected.tolist()) > 0  # the case exercises mismatches, not only clean pages


def test_triton_backend_through_the_tracker_flags_a_reallocated_page():
    pytest.importorskip("triton")
    tracker = TagTracker(32, backend="triton")
    table = torch.zeros(2, 8, dtype=torch.int32)
    for rid, pages in ((0, [3, 4, 5]), (1, [6, 7])):
        tracker.on_alloc(rid, torch.tensor(pages))
        table[rid, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
    batch = DecodeBatch([0, 1], [0, 1], table)
    assert tracker.check(batch).clean
    tracker.on_free(torch.tensor([7]))
    tracker.on_alloc(9, torch.tensor([7]))
    result = tracker.check(batch)
    assert result.abort == [1] and result.offending == {1: [7]}


def _two_requests() -> tuple[TagTracker, torch.Tensor]:
    tracker = TagTracker(16)
    table = torch.zeros(2, 4, dtype=torch.int32)
    for rid, pages in ((0, [1, 2]), (1, [3, 4])):
        tracker.on_alloc(rid, torch.tensor(pages))
        table[rid, :2] = torch.tensor(pages, dtype=torch.int32)
    return tracker, table


def test_each_fault_kind_is_caught():
    tracker, table = _two_requests()
    batch = DecodeBatch([0, 1], [0, 1], table)
    assert tracker.check(batch).clean
    tracker.on_free(torch.tensor([2]))  # freed while referenced
    tracker.on_alloc(5, torch.tensor([2]))  # ... and reallocated
    assert tracker.check(batch).abort == [0]

    tracker, table = _two_requests()
    table[1, 0] = 9  # stale block-table entry
    assert tracker.check(DecodeBatch([0, 1], [0, 1], table)).offending == {1: [9]}

    tracker, table = _two_requests()
    table[0, 0], table[1, 1] = 4, 1  # page indices swapped between requests
    assert tracker.check(DecodeBatch([0, 1], [0, 1], table)).abort == [0, 1]

    tracker, table = _two_requests()
    tracker.on_free(torch.tensor([7, 7]))  # double free, then both copies handed out
    tracker.on_alloc(0, torch.tensor([7]))
    table[0, 2] = 7
    tracker.on_alloc(1, torch.tensor([7]))
    table[1, 2] = 7
    assert tracker.check(DecodeBatch([0, 1], [0, 1], table)).offending == {0: [7]}


def test_prefix_pages_are_checked_against_the_cache_tags_not_the_live_ones():
    tracker = TagTracker(8)
    cache_tags = tracker.on_alloc(0, torch.tensor([5]))  # the request that filled the prefix
    tracker.on_free(torch.tensor([5]))  # bug: the prefix page is reused while cached
    tracker.on_alloc(1, torch.tensor([5]))
    tracker.on_attach(2, torch.tensor([5]), cache_tags)  # a new request attaches the cached prefix
    table = torch.tensor([[5], [5], [5]], dtype=torch.int32)
    assert tracker.check(DecodeBatch([1, 2], [1, 2], table)).abort == [2]
    assert tracker.owned_pages(1).tolist() == [5] and tracker.owned_pages(0).tolist() == []


def test_noop_tracker_has_the_same_interface_and_does_nothing():
    public = {n for n in dir(TagTracker) if not n.startswith("_") and callable(getattr(TagTracker, n))}
    assert {"on_alloc", "on_attach", "on_free", "on_release", "owned_pages", "check"} <= public
    for name in ("on_alloc", "on_attach", "on_free", "on_release", "owned_pages", "check"):
        assert list(inspect.signature(getattr(NoOpTracker, name)).parameters) == list(
            inspect.signature(getattr(TagTracker, name)).parameters
        )
    noop = NoOpTracker()
    assert noop.on_alloc(1, torch.tensor([1])) is None
    assert noop.check(DecodeBatch([1], [0], torch.full((1, 1), 99, dtype=torch.int32))).clean


def test_config_selects_the_tracker():
    assert isinstance(make_tracker(IntegrityConfig(), 4), NoOpTracker)
    assert isinstance(make_tracker(IntegrityConfig(tracker="tags"), 4), TagTracker)
    with pytest.raises(ValueError, match="unknown tracker"):
        make_tracker(IntegrityConfig(tracker="bogus"), 4)  # type: ignore[arg-type]


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_out_of_range_block_table_entries_are_flagged_not_read(backend):
    if backend == "triton":
        pytest.importorskip("triton")
    tracker = TagTracker(8, backend=backend)
    tracker.on_alloc(0, torch.tensor([1, 2, 3]))
    table = torch.tensor([[1, 10_000, -5]], dtype=torch.int32)
    result = tracker.check(DecodeBatch([0], [0], table))
    assert result.offending == {0: [10_000, -5]}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_triton_on_cuda_matches_torch_on_cpu():
    tracker, dbatch, _ = _state(5, 16, 2000, 4096, 20, 4)
    expected = tracker.counts(dbatch).tolist()
    gpu = TagTracker(4096, "cuda")
    gpu.table.tags.copy_(tracker.table.tags)
    for rid in dbatch.rids:
        if rid in tracker.ledger:
            pages, tags = tracker.ledger.entries(rid)
            gpu.ledger.append(rid, pages, tags)
    cuda_batch = DecodeBatch(dbatch.rids, dbatch.rows, dbatch.table.cuda(), dbatch.col_stride, dbatch.page_div)
    assert gpu.backend == "triton"
    assert gpu.counts(cuda_batch).cpu().tolist() == expected
