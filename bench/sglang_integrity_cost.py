"""Cost of the KV integrity plugin per decode step, against SGLang's own step bookkeeping, on the CPU; before/after.

    OMP_NUM_THREADS=1 python bench/sglang_integrity_cost.py [--before TREE] [--batches 1,16,64,256]
        [--contexts 8192,32768,131072] [--page-sizes 64,1] [--repeats 32] [--json]

For each (page size, batch, context): SGLang 0.5.23's allocator, ReqToTokenPool and UnifiedRadixCache (loaded as for
``quantkit simulate integrity --engine sglang``), ``batch`` requests of about ``context`` prompt tokens (staggered by
one token each, so at page size > 1 page openings spread over steps as in a real batch) prefilled through
``ScheduleBatch.prepare_for_extend``; then ``repeats`` decode steps, process CPU time per step (torch on one thread):

- ``bookkeeping``: SGLang's ``prepare_for_decode`` (``alloc_for_decode``, the row write, lengths) and the step's
  ``GenerationBatchResult``, without the plugin's state on the allocator (its hooks find none and return);
- ``guarded``: the same with the plugin's state, plus what the plugin adds after the forward: the verdict gathered
  onto the result, the mark of the ids, the host scan (``added`` = guarded - bookkeeping: everything on the CPU,
  the check's gather-compare included, executed by torch on the CPU);
- ``host`` (new plugin only): the guarded step again with the check's extent cut to one page per row: every hook
  and every launch the plugin issues, but a negligible gather-compare, i.e. what a GPU server's host pays (there
  the gather runs on the device); ``host_added`` = host - bookkeeping. The check is issued as the torch path's ~20
  small launches (on CUDA it is one Triton launch, whose host cost needs a GPU to measure): an upper bound.
  It must not grow with the context;
- ``check``: the check alone on the clean batch (executed on the CPU), ``check_dispatch`` the same cut to one page.

The three steps run interleaved on two engines (plain and guarded) built first, so a shared machine's drift hits
them alike; medians of ``--repeats`` samples.

``--before TREE`` first runs this script against another checkout (e.g. a worktree of main) in a subprocess, then
the current one, and prints both side by side: same workload, same machine, one command. With the old plugin
"guarded" is ``prepare_for_decode`` alone (its check, and aborts, lived there). Configurations beyond
``--max-tokens`` (batch x context; default 4M, 1M at page size 1) are skipped: a node's KV pool holds ~1.2-1.4M
tokens, so those batches cannot be resident at once.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

NEW = importlib.util.find_spec("quantkit.serving.integrity.state") is not None
Row = dict[str, float | int | str]


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def _engine(ps: int, batch: int, context: int, repeats: int, guarded: bool, version: str):  # noqa: ANN202
    """SGLang's memory objects holding ``batch`` prefilled requests (no oracle, no radix insert: setup only)."""
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    from quantkit.serving.integrity.campaign import CampaignConfig, _Campaign

    unit = max(ps, 16)
    pages = -(-(batch * (context + (repeats + 4) * ps + ps)) // unit) + 4
    cfg = CampaignConfig(page_size=ps, fault_rate=0.0, arrival_rate=0.0, abort_rate=0.0, pool_pages=pages,
                         max_running=batch, guarded=guarded, max_prefix_pages=1,
                         max_suffix_pages=-(-context // unit) + repeats + 4)  # fmt: skip
    camp = _Campaign(cfg, version)
    e, reqs = camp.e, []
    for i in range(batch):
        req = camp.request([(i * 7919 + t) % 30000 for t in range(context - i % ps)], max_new=1 << 30)
        req.init_next_round_input(e.tree)
        req.extend_end = len(req.full_untruncated_fill_ids)
        req.lock = e.tree.lock(req.last_node)
        reqs.append(req)
    camp.running = ScheduleBatch.init_new(reqs, e.pool, e.alloc, e.tree, e.model, False, SpeculativeAlgorithm.NONE)
    camp.running.prepare_for_extend()
    for req in reqs:
        req.output_ids.append(1)
    return camp


def _cpu_us(fn: Callable[[], object], repeats: int) -> tuple[float, float]:  # the check alone
    """(median, mean) process CPU time of one call in µs: CPU time, not wall, so a shared machine's descheduling
    does not land in the figure."""
    samples = []
    for _ in range(repeats):
        t0 = time.process_time()
        fn()
        samples.append(time.process_time() - t0)
    return statistics.median(samples) * 1e6, statistics.fmean(samples) * 1e6


def _step(batch: object, guarded: bool) -> Callable[[], None]:
    from sglang.srt.managers.utils import GenerationBatchResult

    ids = [7] * len(batch.reqs)
    if NEW:
        from quantkit.serving.integrity.sglang_check import _after_forward, _mark_result, flagged_rows

    def step() -> None:
        for req in batch.reqs:
            req.output_ids.append(1)
        batch.prepare_for_decode()
        result = GenerationBatchResult(next_token_ids=torch.tensor(ids))
        if guarded and NEW:
            _after_forward(result, None, batch)
            result.next_token_ids = _mark_result(result, result.next_token_ids)
            flagged_rows([[t] for t in ids])

    return step


def _check_us(camp: object, repeats: int) -> tuple[float, float]:
    """The check alone on the clean batch: (at this context, with every row cut to one page). The second is the
    check's dispatch cost (its gather-compare over batch x 1 pages is negligible): what the check costs the host
    when its gather runs on a GPU."""
    b = camp.running
    if not NEW:
        from quantkit.serving.integrity.sglang_check import screen_batch

        return _cpu_us(lambda: screen_batch(b), repeats)[0], float("nan")
    from quantkit.serving.integrity import sglang as plugin

    tracker, table, rows, loc = (plugin.tracker_of(camp.e.alloc), b.req_to_token_pool.req_to_token,
                                 b.req_pool_indices, b.out_cache_loc.clone())  # fmt: skip
    one, one_host = torch.ones_like(b.seq_lens), np.ones(len(b.reqs), dtype=np.int64)
    full = _cpu_us(lambda: tracker.check(table, rows, b.seq_lens, b.seq_lens_cpu.numpy(), loc), repeats)[0]
    return full, _cpu_us(lambda: tracker.check(table, rows, one, one_host, loc), repeats)[0]


def _host_mode(step: Callable[[], None]) -> Callable[[], None]:
    """``step`` with the check's extent cut to one page per row: the same host work (every hook, every launch), a
    negligible gather-compare (what a GPU server's host pays when that gather runs on the device)."""
    from quantkit.serving.integrity.state import PoolState

    check = PoolState.check

    def one_page(self: PoolState, table: torch.Tensor, rows: torch.Tensor, seq_lens: torch.Tensor,
                 seq_host: np.ndarray, slots: torch.Tensor) -> torch.Tensor:  # fmt: skip
        return check(self, table, rows, torch.ones_like(seq_lens), np.ones_like(seq_host), slots)

    def run() -> None:
        PoolState.check = one_page
        try:
            step()
        finally:
            PoolState.check = check

    return run


def measure(ps: int, batch: int, context: int, repeats: int, version: str) -> Row:
    """Both engines built first, their steps interleaved (so drifts of a shared machine hit both alike), medians of
    process CPU time; the garbage collector is off while timing."""
    row: Row = {"page_size": ps, "batch": batch, "context": context}
    plain = _engine(ps, batch, context, 3 * repeats, False, version)
    guarded = _engine(ps, batch, context, 3 * repeats, True, version)
    assert len(plain.running.reqs) == len(guarded.running.reqs) == batch, "the pool did not admit the whole batch"
    steps = {"bookkeeping": _step(plain.running, False), "guarded": _step(guarded.running, True)}
    if NEW:
        steps["host"] = _host_mode(_step(guarded.running, True))
    for step in steps.values():
        step()  # warm
    samples: dict[str, list[float]] = {key: [] for key in steps}
    gc.collect()
    gc.disable()
    try:
        for _ in range(repeats):
            for key, step in steps.items():
                t0 = time.process_time()
                step()
                samples[key].append((time.process_time() - t0) * 1e6)
        row["check_us"], row["check_dispatch_us"] = _check_us(guarded, max(5, repeats // 2))
    finally:
        gc.enable()
    for key, values in samples.items():
        row[f"{key}_us"], row[f"{key}_mean_us"] = statistics.median(values), statistics.fmean(values)
    row["added_us"] = row["guarded_us"] - row["bookkeeping_us"]
    row["added_mean_us"] = row["guarded_mean_us"] - row["bookkeeping_mean_us"]
    if NEW:  # the plugin's host work per step, the check's gather-compare over the context taken out
        row["host_added_us"] = row["host_us"] - row["bookkeeping_us"]
        row["host_added_mean_us"] = row["host_mean_us"] - row["bookkeeping_mean_us"]
    del plain, guarded, steps
    gc.collect()
    return row


def _grid(args: argparse.Namespace) -> list[tuple[int, int, int]]:
    return [(ps, b, ctx) for ps in _ints(args.page_sizes) for ctx in _ints(args.contexts) for b in _ints(args.batches)
            if b * ctx <= (args.max_tokens if ps > 1 else args.max_tokens // 4)]  # fmt: skip


def _before(args: argparse.Namespace) -> list[Row]:
    tree = Path(args.before).resolve()
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--json", "--batches", args.batches, "--contexts",
           args.contexts, "--page-sizes", args.page_sizes, "--repeats", str(args.repeats), "--max-tokens",
           str(args.max_tokens)]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=tree)
    if proc.returncode != 0:
        raise SystemExit(f"the --before run failed: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])["rows"]


def _print(rows: list[Row], before: dict[tuple, Row]) -> None:
    print("page batch context | bookkeeping µs | before: added µs (x bk) | after: added µs (x bk) | "
          "after: host added µs (x bk) | check µs before / after (dispatch)")
    for r in rows:
        key = (r["page_size"], r["batch"], r["context"])
        bk, old = r["bookkeeping_us"], before.get(key)
        old_added = old["guarded_us"] - old["bookkeeping_us"] if old else float("nan")
        old_bk = old["bookkeeping_us"] if old else float("nan")
        host = r.get("host_added_us", float("nan"))
        print(f"{key[0]:>4} {key[1]:>5} {key[2]:>7} | {bk:6.0f} | {old_added:7.0f} ({old_added / old_bk:5.1f}x) | "
              f"{r['added_us']:7.0f} ({r['added_us'] / bk:5.1f}x) | {host:6.0f} ({host / bk:4.2f}x) | "
              f"{old['check_us'] if old else float('nan'):7.0f} / {r['check_us']:7.0f} "
              f"({r.get('check_dispatch_us', float('nan')):4.0f})", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,16,64,256")
    ap.add_argument("--contexts", default="8192,32768,131072")
    ap.add_argument("--page-sizes", default="64,1")
    ap.add_argument("--repeats", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=4_000_000, help="largest batch x context (page size 1: 1/4)")
    ap.add_argument("--before", default="", help="a checkout to measure first (e.g. a worktree of main)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    before = _before(args) if args.before else []
    sys.path.insert(0, str(Path.cwd()))
    from quantkit.serving.integrity.campaign import load_plugin
    from quantkit.serving.integrity.sglang_env import load_sglang

    version = load_sglang()
    load_plugin()
    import logging

    logging.getLogger("quantkit.kv_integrity").setLevel(logging.CRITICAL)
    np.seterr(all="ignore")
    rows = [measure(ps, b, ctx, args.repeats, version) for ps, b, ctx in _grid(args)]
    if args.json:
        print(json.dumps({"sglang_version": version, "new_plugin": NEW, "rows": rows, "before": before}))
        return
    _print(rows, {(r["page_size"], r["batch"], r["context"]): r for r in before})


if __name__ == "__main__":
    main()
