"""Cost of the KV integrity plugin per decode step, against SGLang's own step bookkeeping, on the CPU.

    OMP_NUM_THREADS=1 python bench/sglang_integrity_cost.py [--batches 1,16,64,256] [--contexts 8192,32768,131072]
        [--page-sizes 64,1] [--repeats 10] [--json]

For each (page size, batch, context): SGLang 0.5.23's allocator, ReqToTokenPool and UnifiedRadixCache (loaded as
for ``quantkit simulate integrity --engine sglang``), ``batch`` requests of ``context`` prompt tokens prefilled
through ``ScheduleBatch.prepare_for_extend``; then ``repeats`` decode steps of ``ScheduleBatch.prepare_for_decode``
(SGLang's step bookkeeping: ``alloc_for_decode``, the row write, sequence lengths) are timed twice, once with the
plugin's tracker on the allocator (record + batched check + the hook wrappers) and once without (the hooks find no
tracker and return). Also timed alone: the check (``screen_batch``) on the clean batch. Median CPU time per step
(process CPU time; run with ``OMP_NUM_THREADS=1``: torch on one thread, so CPU time is the step's work).
Configurations beyond ``--max-tokens`` (batch x context; default 4M, 1M at page size 1) are skipped: a node's
KV pool holds ~1.2-1.4M tokens, so those batches cannot be resident at once.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time

from quantkit.serving.integrity import sglang as plugin
from quantkit.serving.integrity.campaign import CampaignConfig, _Campaign, load_plugin
from quantkit.serving.integrity.sglang_check import screen_batch
from quantkit.serving.integrity.sglang_env import load_sglang


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def _engine(page_size: int, batch: int, context: int, repeats: int, guarded: bool, version: str) -> _Campaign:
    """SGLang's memory objects holding ``batch`` prefilled requests (no oracle, no radix insert: setup only)."""
    from sglang.srt.managers.schedule_batch import ScheduleBatch

    from quantkit.serving.integrity.campaign import _spec_none

    unit = max(page_size, 16)
    pages = -(-(batch * (context + (repeats + 4) * page_size + page_size)) // unit) + 4
    cfg = CampaignConfig(page_size=page_size, fault_rate=0.0, arrival_rate=0.0, abort_rate=0.0, pool_pages=pages,
                         max_running=batch, guarded=guarded, max_prefix_pages=1,
                         max_suffix_pages=-(-context // unit) + repeats + 4)  # fmt: skip
    camp = _Campaign(cfg, version)
    e = camp.e
    reqs = []
    for i in range(batch):
        req = camp.request([(i * 7919 + t) % 30000 for t in range(context)], max_new=1 << 30)
        req.init_next_round_input(e.tree)
        req.extend_end = len(req.full_untruncated_fill_ids)
        req.lock = e.tree.lock(req.last_node)
        reqs.append(req)
    camp.running = ScheduleBatch.init_new(reqs, e.pool, e.alloc, e.tree, e.model, False, _spec_none())
    camp.running.prepare_for_extend()
    for req in reqs:
        req.output_ids.append(1)
    return camp


def _time(fn: object, repeats: int) -> float:
    """Median CPU time of one call in µs: process CPU time, not wall, so that a shared machine's descheduling
    (time slices of other processes, ~10-30 ms each) does not land in the figure; torch runs one thread."""
    samples = []
    for _ in range(repeats):
        t0 = time.process_time()
        fn()
        samples.append(time.process_time() - t0)
    return statistics.median(samples) * 1e6


def _stepper(running: object) -> object:
    def step() -> None:
        for req in running.reqs:
            req.output_ids.append(1)
        running.prepare_for_decode()

    return step


def _checker(running: object) -> object:
    return lambda: screen_batch(running)


def measure(page_size: int, batch: int, context: int, repeats: int, version: str) -> dict:
    row: dict = {"page_size": page_size, "batch": batch, "context": context}
    for guarded in (False, True):
        camp = _engine(page_size, batch, context, repeats, guarded, version)
        assert len(camp.running.reqs) == batch, "the pool did not admit the whole batch"
        step = _stepper(camp.running)
        step()  # warm
        row["guarded_us" if guarded else "bookkeeping_us"] = _time(step, repeats)
        if guarded:
            aborts = len(plugin.state().aborts)
            row["check_us"] = _time(_checker(camp.running), repeats)
            row["aborts"] = len(plugin.state().aborts) - aborts
        del camp, step
        gc.collect()
    row["overhead_pct"] = 100 * (row["guarded_us"] - row["bookkeeping_us"]) / row["bookkeeping_us"]
    row["check_pct"] = 100 * row["check_us"] / row["bookkeeping_us"]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,16,64,256")
    ap.add_argument("--contexts", default="8192,32768,131072")
    ap.add_argument("--page-sizes", default="64,1")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--max-tokens", type=int, default=4_000_000, help="largest batch x context (page size 1: 1/4)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    version = load_sglang()
    load_plugin()
    rows = []
    for ps in _ints(args.page_sizes):
        for ctx in _ints(args.contexts):
            for b in _ints(args.batches):
                if b * ctx > (args.max_tokens if ps > 1 else args.max_tokens // 4):
                    continue
                rows.append(measure(ps, b, ctx, args.repeats, version))
                if not args.json:
                    r = rows[-1]
                    print(f"page {ps:>2} batch {b:>3} context {ctx:>6}: bookkeeping {r['bookkeeping_us']:>9.0f} us"
                          f"  guarded {r['guarded_us']:>9.0f} us  check {r['check_us']:>8.0f} us"
                          f"  overhead {r['overhead_pct']:6.1f}%  check {r['check_pct']:6.1f}%", flush=True)
    if args.json:
        print(json.dumps({"sglang_version": version, "rows": rows}))


if __name__ == "__main__":
    main()
