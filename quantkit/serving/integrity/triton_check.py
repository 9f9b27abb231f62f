"""Triton kernel for the pre-decode integrity check: one launch for every page of every request.

Grid ``(requests, ceil(max_pages / BLOCK))``; each program loads a block of one request's ledger entries
and the matching block-table entries (the pages the attention kernel is about to read), gathers the live
tags and counts entries where the page or the tag differs. Counts go to one int32 per request with a
single atomic add per block, so the host reads B integers, never per-page flags.

It runs as its own launch before attention, never inside it: inside, it would race with the writes
of the same step and could only poison output, not abort the request.

``row_check_triton`` is the SGLang plugin's check (``state.py``): the expected stamps sit in a table parallel to
``req_to_token`` and a failing row gets ``-1`` in ``row_bad`` directly, so nothing is read back by the host.

Import this module only where triton is installed; ``available()`` says whether a launch can run.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

__all__ = ["BLOCK", "available", "check_counts_triton", "row_check_triton"]

BLOCK = 256


def available(device: torch.device) -> bool:
    """A launch works on CUDA devices, and on CPU tensors under ``TRITON_INTERPRET=1``."""
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _check_kernel(
    led_pages_ptr,
    led_tags_ptr,
    starts_ptr,
    lengths_ptr,
    rows_ptr,
    table_ptr,
    live_tags_ptr,
    counts_ptr,
    row_stride,
    col_stride,
    page_div,
    num_pages,
    BLOCK: tl.constexpr,
):
    req = tl.program_id(0)
    blk = tl.program_id(1)
    n = tl.load(lengths_ptr + req)
    if blk * BLOCK < n:
        offs = blk * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        start = tl.load(starts_ptr + req)
        row = tl.load(rows_ptr + req)
        offs64 = offs.to(tl.int64)
        page = tl.load(table_ptr + row * row_stride + offs64 * col_stride, mask=mask, other=0).to(tl.int64)
        page = page // page_div
        valid = mask & (page >= 0) & (page < num_pages)
        led_page = tl.load(led_pages_ptr + start + offs64, mask=mask, other=0).to(tl.int64)
        led_tag = tl.load(led_tags_ptr + start + offs64, mask=mask, other=0)
        live = tl.load(live_tags_ptr + page, mask=valid, other=-1)
        bad = mask & ((~valid) | (page != led_page) | (live != led_tag))
        nbad = tl.sum(bad.to(tl.int32), axis=0)
        if nbad > 0:
            tl.atomic_add(counts_ptr + req, nbad)


def check_counts_triton(
    led_pages: torch.Tensor,
    led_tags: torch.Tensor,
    starts: torch.Tensor,
    lengths: torch.Tensor,
    rows: torch.Tensor,
    table: torch.Tensor,
    live_tags: torch.Tensor,
    counts: torch.Tensor,
    col_stride: int,
    page_div: int,
    max_len: int,
) -> torch.Tensor:
    """Fill ``counts[i]`` (int32, zeroed here) with the mismatching entries of batch request ``i``.

    :param table: the live block table (2-D, row-major), e.g. SGLang's ``req_to_token``.
    :param col_stride: table columns between two pages of a row (page size for a per-token table).
    :param page_div: divisor turning a table entry into a page index (page size for token slots).
    :param max_len: the longest segment in the batch (host-side, so no device sync is needed).
    """
    if table.dim() != 2 or table.stride(1) != 1:
        raise ValueError("the block table must be a row-major 2-D tensor")
    counts.zero_()
    if max_len == 0 or lengths.numel() == 0:
        return counts
    grid = (lengths.numel(), triton.cdiv(max_len, BLOCK))
    _check_kernel[grid](
        led_pages,
        led_tags,
        starts,
        lengths,
        rows,
        table,
        live_tags,
        counts,
        table.stride(0),
        col_stride,
        page_div,
        live_tags.numel(),
        BLOCK=BLOCK,
    )
    return counts


@triton.jit
def _row_check_kernel(
    rows_ptr,
    seq_lens_ptr,
    table_ptr,
    sig_ptr,
    stamp_ptr,
    row_bad_ptr,
    slots_ptr,
    table_stride,
    sig_stride,
    page_size,
    num_pages,
    BLOCK: tl.constexpr,
):
    b = tl.program_id(0)
    blk = tl.program_id(1)
    row = tl.load(rows_ptr + b).to(tl.int64)
    n = (tl.load(seq_lens_ptr + b).to(tl.int64) + page_size - 1) // page_size
    if blk == 0:
        if tl.load(row_bad_ptr + row) < 0:  # flagged by an earlier check: keep its write off the pool
            tl.store(slots_ptr + b, 0)
    if blk * BLOCK < n:
        offs = (blk * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
        mask = offs < n
        page = tl.load(table_ptr + row * table_stride + offs * page_size, mask=mask, other=0).to(tl.int64)
        page = page // page_size
        valid = mask & (page >= 0) & (page < num_pages)
        now = tl.load(stamp_ptr + page, mask=valid, other=-3)  # -3: no record equals it
        expected = tl.load(sig_ptr + row * sig_stride + offs, mask=mask, other=0)
        nbad = tl.sum((mask & (now != expected)).to(tl.int32), axis=0)
        if nbad > 0:
            tl.atomic_min(row_bad_ptr + row, -1)
            tl.store(slots_ptr + b, 0)  # its decode write goes to SGLang's padding slot


def row_check_triton(
    rows: torch.Tensor,
    seq_lens: torch.Tensor,
    table: torch.Tensor,
    sig: torch.Tensor,
    stamp: torch.Tensor,
    row_bad: torch.Tensor,
    slots: torch.Tensor | None,
    page_size: int,
    max_n: int,
) -> None:
    """One launch over ``rows`` x ``max_n`` pages: ``row_bad[row] = -1`` where a page's live ``stamp`` differs from
    ``sig[row, j]`` (``j < ceil(seq_lens[b] / page_size)``: the pages the step reads), and ``slots[b] = 0``
    (SGLang's padding slot) for a flagged row ``b``; ``max_n`` comes from the host, so nothing is read back.

    :param table: ``req_to_token`` (row-major 2-D int32 token slots; every ``page_size``-th column is read).
    """
    if table.dim() != 2 or table.stride(1) != 1 or sig.stride(1) != 1:
        raise ValueError("req_to_token and the record table must be row-major 2-D tensors")
    if max_n <= 0 or rows.numel() == 0:
        return
    if slots is None:  # no write to redirect (a speculative batch): a scratch target
        slots = torch.empty(rows.numel(), dtype=torch.int64, device=rows.device)
    grid = (rows.numel(), triton.cdiv(max_n, BLOCK))
    _row_check_kernel[grid](rows, seq_lens, table, sig, stamp, row_bad, slots, table.stride(0), sig.stride(0),
                            page_size, stamp.numel(), BLOCK=BLOCK)  # fmt: skip
