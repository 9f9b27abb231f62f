"""Cost of the pre-decode integrity check per decode step, and its share of a modelled decode step.

For each (batch, context, page size) the bench builds a real tracker state — a tag table sized to the
batch's pages, a ledger holding every request's (page, tag) pairs, an SGLang-style per-token block table
(``req_to_token``) — and times ``TagTracker.check`` end to end: batch vectors to the device, the gather +
compare (Triton on CUDA, torch on CPU), and the one host sync that decides whether to abort.

The decode step comes from the planner (``quantkit.plan.throughput.decode_step_seconds``) when it is
importable and knows the model. Otherwise a documented fallback is used and labelled as such: the measured GLM-5.2 INT4
single-request step (92 tok/s -> 1/92 s) plus reading the batch's FP8 KV at the H200's 4.8 TB/s peak
(a lower bound on the step, so the fraction is an upper bound).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from quantkit.core.errors import QuantkitError
from quantkit.serving.integrity.tracker import DecodeBatch, NoOpTracker, TagTracker

__all__ = ["BenchRow", "MODELS", "bench_config", "decode_step", "run_bench"]

# FP8 KV bytes per token per GPU (MLA/DSA caches are replicated on every TP rank) and the node's pool
# capacity in tokens after INT4 + FP8 KV, from the production report (see docs/integrity.md).
MODELS = {
    "kimi-k2.6": {"kv_bytes": 35_136, "pool_tokens": 1_370_000},
    "glm-5.2": {"kv_bytes": 61_464, "pool_tokens": 1_180_000},
}
FALLBACK_FIXED_S = 1 / 92  # GLM-5.2 INT4, 1 concurrent request, 92 tok/s (mission figures)
H200_BW = 4.8e12


@dataclass
class BenchRow:
    """One configuration: check cost and its share of each model's decode step."""

    device: str
    backend: str
    batch: int
    context: int
    page_size: int
    entries: int
    check_us: float
    noop_us: float
    bare_us: float
    fractions: dict[str, float]
    fits_pool: dict[str, bool]
    step_source: str


def decode_step(model: str, batch: int, context: int) -> tuple[float, str]:
    """Modelled H200 TP8 decode step (INT4 weights, FP8 KV) in seconds, and where the figure came from."""
    try:
        from quantkit.plan.throughput import decode_step_seconds

        seconds = decode_step_seconds(
            model, gpu="h200", tp=8, batch=batch, context=context, weights="int4", kv="fp8"
        )
        return float(seconds), "planner"
    except (ImportError, AttributeError, QuantkitError):
        kv_read = batch * context * MODELS[model]["kv_bytes"] / H200_BW
        return FALLBACK_FIXED_S + kv_read, "fallback: 1/92 s measured (GLM-5.2 INT4) + FP8 KV read at 4.8 TB/s"


def _build(batch: int, context: int, page_size: int, device: torch.device) -> tuple[TagTracker, DecodeBatch]:
    """A tracker holding ``batch`` requests of ``context`` tokens on shuffled pages, clean state."""
    pages_per_req = -(-context // page_size)
    num_pages = batch * pages_per_req
    tracker = TagTracker(num_pages, device)
    gen = torch.Generator().manual_seed(0)
    perm = torch.randperm(num_pages, generator=gen).to(device)
    tracker.table.tags.copy_(torch.randint(0, 1 << 20, (num_pages,), generator=gen).to(device))
    offsets = torch.arange(page_size, device=device, dtype=torch.int32)
    table = torch.empty(batch, pages_per_req * page_size, dtype=torch.int32, device=device)
    for r in range(batch):
        pages = perm[r * pages_per_req : (r + 1) * pages_per_req]
        tracker.on_attach(r, pages)
        table[r] = (pages.to(torch.int32)[:, None] * page_size + offsets).reshape(-1)
    return tracker, DecodeBatch(list(range(batch)), list(range(batch)), table, page_size, page_size)


def _time_us(fn: Callable[[], object], device: torch.device, repeats: int, min_s: float = 0.02) -> float:
    """Median microseconds per call; each sample loops long enough to beat timer resolution."""
    fn()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    fn()
    sync()
    once = max(time.perf_counter() - start, 1e-7)
    inner = max(1, min(1000, int(min_s / once)))
    samples = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        sync()
        samples.append((time.perf_counter() - start) / inner * 1e6)
    return statistics.median(samples)


def bench_config(batch: int, context: int, page_size: int, device: torch.device, repeats: int = 5) -> BenchRow:
    """Time the tag check, the no-op tracker's check and a bare call for one configuration."""
    tracker, dbatch = _build(batch, context, page_size, device)
    result = tracker.check(dbatch)
    if not result.clean:
        raise AssertionError(f"clean state reported mismatches: {result.abort[:5]}")
    noop = NoOpTracker()
    check_us = _time_us(lambda: tracker.check(dbatch), device, repeats)
    noop_us = _time_us(lambda: noop.check(dbatch), device, repeats)
    bare_us = _time_us(lambda: None, device, repeats)
    fractions, fits, source = {}, {}, ""
    for model, facts in MODELS.items():
        step_s, source = decode_step(model, batch, context)
        fractions[model] = check_us * 1e-6 / step_s
        fits[model] = batch * context <= facts["pool_tokens"]
    return BenchRow(
        str(device), tracker.backend, batch, context, page_size, dbatch.table.shape[1] // page_size * batch,
        check_us, noop_us, bare_us, fractions, fits, source,
    )  # fmt: skip


def run_bench(
    batches: list[int],
    contexts: list[int],
    page_sizes: list[int],
    device: str = "auto",
    repeats: int = 5,
) -> list[dict[str, object]]:
    """All configurations on one device (``auto``: CUDA when available, else CPU)."""
    dev = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else
                       ("cpu" if device == "auto" else device))  # fmt: skip
    rows = []
    for page_size in page_sizes:
        for context in contexts:
            for batch in batches:
                rows.append(asdict(bench_config(batch, context, page_size, dev, repeats)))
    return rows
