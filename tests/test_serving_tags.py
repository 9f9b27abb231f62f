"""Tag table and ledger: the two pieces of state the integrity check compares."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from quantkit.serving.integrity.ledger import Ledger
from quantkit.serving.integrity.tags import PageTagTable, _occurrence_rank


def test_bump_changes_only_named_pages_and_counts_duplicates():
    table = PageTagTable(8)
    table.bump(torch.tensor([1, 3, 3]))
    assert table.tags.tolist() == [0, 1, 0, 2, 0, 0, 0, 0]
    assert table.tags.dtype == torch.int64


def test_bump_larger_than_preallocated_ones_buffer():
    table = PageTagTable(5000)
    table.bump(torch.arange(5000))
    table.bump(torch.arange(5000))
    assert bool((table.tags == 2).all())


def test_alloc_of_a_page_twice_in_one_call_leaves_only_the_last_holder_valid():
    table = PageTagTable(4)
    recorded = table.bump_for_alloc(torch.tensor([2, 0, 2]))
    live = table.lookup(torch.tensor([2, 0, 2]))
    assert (recorded == live).tolist() == [False, True, True]


@settings(max_examples=40, deadline=None, derandomize=True)
@given(st.lists(st.integers(0, 6), min_size=0, max_size=30))
def test_occurrence_rank_counts_earlier_equal_values(values):
    ranks = _occurrence_rank(torch.tensor(values, dtype=torch.int64)).tolist()
    assert ranks == [values[:i].count(v) for i, v in enumerate(values)]


@settings(max_examples=30, deadline=None, derandomize=True)
@given(
    st.lists(
        st.tuples(st.sampled_from(["append", "release", "many"]), st.integers(0, 5), st.integers(1, 20)),
        max_size=60,
    )
)
def test_ledger_matches_a_plain_dict_through_growth_and_compaction(ops):
    ledger = Ledger(capacity=16, min_segment=2)
    model: dict[int, list[tuple[int, int]]] = {}
    counter = 0
    for op, rid, n in ops:
        if op == "release":
            ledger.release(rid)
            model.pop(rid, None)
            continue
        if op == "many":  # one page each for several requests, as a decode step allocates
            rids = [(rid + k) % 6 for k in range(n)]
            pages = torch.arange(counter, counter + n)
            counter += n
            ledger.append_many(rids, pages, pages * 7 + 1)
            for r, p in zip(rids, pages.tolist(), strict=True):
                model.setdefault(r, []).append((p, p * 7 + 1))
            continue
        pages = torch.arange(counter, counter + n)
        tags = pages * 7 + 1
        counter += n
        ledger.append(rid, pages, tags)
        model.setdefault(rid, []).extend(zip(pages.tolist(), tags.tolist(), strict=True))
    for rid, pairs in model.items():
        pages, tags = ledger.entries(rid)
        assert list(zip(pages.tolist(), tags.tolist(), strict=True)) == pairs
    starts, lengths = ledger.segments(sorted(model) + [99])
    assert lengths == [len(model[r]) for r in sorted(model)] + [0]
    assert len(ledger) == len(model)


def test_ledger_rejects_mismatched_pages_and_tags():
    ledger = Ledger(capacity=4)
    try:
        ledger.append(1, torch.tensor([1, 2]), torch.tensor([0]))
    except ValueError as exc:
        assert "2 pages but 1 tags" in str(exc)
    else:
        raise AssertionError("expected ValueError")
