"""The SGLang plugin's device state (``state.py``): the check against a plain-Python reference, Triton against torch,
the decode record, and the structural proof that a clean step's functions never read the device (they run on
``meta`` tensors, where any read raises)."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from quantkit.serving.integrity.state import NEVER, NEVER_TAG, TAG_BITS, PoolState, mark  # noqa: E402

ROWS, WIDTH = 9, 96


def _state(seed: int, ps: int, batch: int, corrupt: int, backend: str) -> tuple[PoolState, torch.Tensor, list[int]]:
    """Rows recorded through ``record_spans`` from a random table, then ``corrupt`` random faults."""
    gen = torch.Generator().manual_seed(seed)
    num_pages = 40
    s = PoolState(num_pages, ps, "cpu", backend=backend)  # type: ignore[arg-type]
    s.bind(ROWS, WIDTH)
    table = torch.zeros(ROWS, WIDTH, dtype=torch.int32)
    s.stamp[:num_pages] += torch.randint(0, 5, (num_pages,), generator=gen)
    rows = torch.randperm(ROWS - 1, generator=gen)[:batch].add(1).tolist()
    for row in rows:
        n = int(torch.randint(1, WIDTH // ps + 1, (1,), generator=gen))
        pages = torch.randint(1, num_pages, (n,), generator=gen)
        table[row, : n * ps] = (pages[:, None] * ps + torch.arange(ps)).reshape(-1).to(torch.int32)
        s.record_spans(table, [row], [0], [n], [0])
    for _ in range(corrupt):
        kind = int(torch.randint(0, 4, (1,), generator=gen))
        row = rows[int(torch.randint(0, batch, (1,), generator=gen))]
        if kind == 0:
            s.freed(torch.randint(0, num_pages, (1,), generator=gen))
        elif kind == 1:
            table[row, int(torch.randint(0, WIDTH, (1,), generator=gen))] = int(torch.randint(0, 60 * ps, (1,)))
        elif kind == 2:
            s.sig[row, int(torch.randint(0, int(s.nrec_host[row]), (1,), generator=gen))] += 1
        else:
            s.row_bad[row] = -1  # flagged by an earlier check
    return s, table, rows


def _seq(s: PoolState, rows: list[int], seed: int) -> list[int]:
    """Lengths whose last page is partly filled (the check covers ``ceil(len / page_size)`` pages)."""
    return [int(s.nrec_host[r]) * s.page_size - (seed + r) % s.page_size for r in rows]


def _reference(s: PoolState, table: torch.Tensor, rows: list[int], seq: list[int]) -> list[bool]:
    out = []
    for row, n in zip(rows, seq, strict=True):
        bad = bool(s.row_bad[row] < 0)
        for j in range(-(-n // s.page_size)):
            page = int(table[row, j * s.page_size]) // s.page_size
            live = int(s.stamp[page]) if 0 <= page < s.num_pages else None
            bad |= live != int(s.sig[row, j])
        out.append(bad)
    return out


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), ps=st.sampled_from([1, 4, 16]), batch=st.integers(1, 8),
       corrupt=st.integers(0, 3), backend=st.sampled_from(["torch", "triton"]))  # fmt: skip
def test_check_flags_exactly_the_reference_rows_and_redirects_their_writes(seed, ps, batch, corrupt, backend):
    s, table, rows = _state(seed, ps, batch, corrupt, backend)
    seq = _seq(s, rows, seed)
    expected = _reference(s, table, rows, seq)
    slots = torch.arange(100, 100 + batch, dtype=torch.int64)
    out = s.check(table, torch.tensor(rows), torch.tensor(seq), np.array(seq), slots)
    assert [bool(s.row_bad[r] < 0) for r in rows] == expected
    assert out.tolist() == [0 if b else 100 + i for i, b in enumerate(expected)]  # 0: SGLang's padding slot
    assert s.verdict(torch.tensor(rows)).tolist() == [-1 if b else 0 for b in expected]


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("ps", [1, 16])
def test_decode_record_then_reuse_and_a_page_handed_out_twice(ps, backend):
    s = PoolState(50, ps, "cpu", backend=backend)
    s.bind(6, 8 * ps)
    table = torch.zeros(6, 8 * ps, dtype=torch.int32)
    for row, page in ((1, 10), (2, 11), (3, 12)):
        table[row, :ps] = torch.arange(page * ps, page * ps + ps, dtype=torch.int32)
        s.handed(table[row, :ps].long())
        s.record_spans(table, [row], [0], [1], [0])
    rows, rows_h, seq = torch.tensor([1, 2, 3]), np.array([1, 2, 3]), np.array([ps, ps, ps])
    slots = torch.tensor([20 * ps, 21 * ps, 21 * ps])  # rows 2 and 3 both get page 21 (it was freed twice)
    table[rows, ps] = slots.to(torch.int32)
    s.handed_decode(slots, len(slots))
    s.record_decode(table, slots, rows, torch.from_numpy(seq), rows_h, seq)
    assert s.nrec_host[rows_h].tolist() == [2, 2, 2]
    seq_after = torch.from_numpy(seq + 1)
    s.check(table, rows, seq_after, seq + 1, slots.clone())
    assert s.row_bad[rows].tolist() == [0, -1, -1]
    assert s.explain(table, 2, 0).twin_pages == (21,) and s.explain(table, 1, 0).position == -1
    s.freed(torch.tensor([10]))  # row 1's first page reused behind its back
    s.check(table, rows[:1], seq_after[:1], seq[:1] + 1, slots[:1].clone())
    e = s.explain(table, 1, 0)
    assert s.row_bad[1] == -1 and (e.page, e.expected_page, e.expected_tag + 1) == (10, 10, e.actual_tag)


def test_mark_flips_flagged_ids_out_of_place():
    ids = torch.tensor([5, 6, 7])
    marked = mark(ids, torch.tensor([0, -1, 0], dtype=torch.int32))
    assert marked.tolist() == [5, -7, 7] and ids.tolist() == [5, 6, 7]


def test_tree_pages_vouch_only_under_their_own_prefix_key():
    s = PoolState(20, 4, "cpu")
    s.bind(4, 32)
    table = torch.zeros(4, 32, dtype=torch.int32)
    table[1, :8] = torch.arange(12, 20, dtype=torch.int32)  # pages 3, 4
    s.handed(table[1, :8].long())
    s.record_spans(table, [1], [0], [2], [0])
    s.adopt(table, 1, 0, 2, np.array([111, 222], dtype=np.int64))  # the tree takes both pages
    table[2, :8] = table[1, :8]
    s.record_spans(table, [2], [0], [2], [2], np.array([111, 999], dtype=np.int64))  # page 4 under another prefix
    assert s.sig[2, 0] == s.sig[1, 0] and s.sig[2, 1] == (4 << TAG_BITS) | NEVER_TAG
    s.check(table, torch.tensor([1, 2]), torch.tensor([8, 8]), np.array([8, 8]), torch.zeros(2, dtype=torch.int64))
    assert s.row_bad[1:3].tolist() == [0, -1]
    table[3, 0] = 999 * 4  # an entry outside the pool
    s.record_spans(table, [3], [0], [1], [0])
    assert s.sig[3, 0] == NEVER


@pytest.mark.parametrize("ps", [1, 16])
def test_a_clean_steps_functions_run_on_meta_tensors_the_abort_path_does_not(ps):
    """On ``meta`` any host read, boolean mask or data-dependent shape raises: what runs here enqueues only."""
    s = PoolState(64, ps, "meta")
    s.bind(8, 16 * ps)
    table = torch.zeros(8, 16 * ps, dtype=torch.int32, device="meta")
    s.record_spans(table, [1, 2], [0, 0], [3, 2], [1, 0], np.array([5], dtype=np.int64))
    rows, seq = torch.tensor([1, 2], device="meta"), torch.tensor([3 * ps, 2 * ps], device="meta")
    slots = torch.zeros(2, dtype=torch.int64, device="meta")
    s.handed(torch.zeros(3 * ps, dtype=torch.int64, device="meta"))
    s.handed_decode(slots, len(slots))
    s.record_decode(table, slots, rows, seq, np.array([1, 2]), np.array([3 * ps, 2 * ps]))
    out = s.check(table, rows, seq + 1, np.array([3 * ps + 1, 2 * ps + 1]), slots)
    marked = mark(torch.zeros(2, dtype=torch.int64, device="meta"), s.verdict(rows))
    s.freed(torch.tensor([3, 4], device="meta"))
    s.adopt(table, 1, 0, 2, np.array([1, 2], dtype=np.int64))
    assert out.device.type == marked.device.type == "meta" and s.nrec_host[[1, 2]].tolist() == [4, 3]
    with pytest.raises(NotImplementedError):
        s.explain(table, 1, 0)
