"""Count the host synchronisations of clean decode steps through SGLang 0.5.23's own code, plugin on or off.

    python tests/engines/run_sglang_integrity_syncs.py OUT.json on|off [STEPS]

A fresh interpreter (the stubs change torch process-wide). Each clean decode step runs what the campaign runs
(``quantkit.serving.integrity.campaign``): SGLang's ``ScheduleBatch.prepare_for_decode`` (with the plugin: its
allocation and record hooks and the check), the forward's result with the plugin's forward hook, SGLang's
``GenerationBatchResult.copy_to_cpu`` under the overlap ordering, and SGLang's ``process_batch_result_decode``
(with the plugin: the verdict scan) streaming to a sink; one request finishes inside the counted window (release,
``checkpoint_into_tree``, the free hooks). Page sizes 1, 16, 64, both orderings. ``tests/engines/sync_count.py``
counts, per bucket (plugin / sglang / harness), every operation that would make the host wait for a GPU.

With ``on`` it also runs negative controls (the counter must see a host read, a boolean mask and a host index a
test adds to the plugin's step) and a step with a real fault (the abort path reads the device: counted).
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SRC = HERE.parent.parent / ".cache" / "engines" / "src" / "sglang"
DEPS = SRC.parent.parent / "deps-sglang"
WARMUP = 3


def _campaign(version: str, ps: int, ordering: str, steps: int):  # noqa: ANN202 - SGLang-typed harness object
    """Four decoding requests sharing a prompt prefix; the first finishes inside the counted window."""
    from quantkit.serving.integrity.campaign import CampaignConfig, _Campaign

    cfg = CampaignConfig(page_size=ps, ordering=ordering, fault_rate=0.0, arrival_rate=0.0, abort_rate=0.0,
                         stream_rate=1.0, max_running=6, pool_pages=64)  # fmt: skip
    camp = _Campaign(cfg, version)
    unit = max(ps, 16)
    prefix = list(range(1000, 1000 + 2 * unit))
    for i in range(4):
        max_new = WARMUP + steps // 2 if i == 0 else 10_000
        camp.waiting.append(camp.request(prefix + list(range(2000 + 40 * i, 2010 + 40 * i)), max_new, stream=True))
    while camp.running is None or len(camp.running.reqs) < 4:
        camp.step()
    for _ in range(WARMUP):
        camp.step()
    return camp


def _roots(counter, camp) -> None:  # noqa: ANN001 - harness objects
    """What lives on the GPU in a real server: SGLang's pool tensors, the batch's device tensors, the plugin's state."""
    from quantkit.serving.integrity import sglang as plugin

    e, b = camp.e, camp.running
    counter.tag(e.pool.req_to_token, e.alloc.free_pages, getattr(e.alloc, "release_pages", None))
    for name in ("seq_lens", "req_pool_indices", "out_cache_loc", "orig_seq_lens", "input_ids"):
        value = getattr(b, name, None)
        if value is not None:
            counter.tag(value)
    tracker = plugin.tracker_of(e.alloc)
    if tracker is not None:
        counter.tag(tracker.stamp, tracker.sig, tracker.row_bad, tracker.tree_stamp, tracker.tree_keys,
                    tracker._hand, tracker._ones, tracker._starts, tracker._never)  # fmt: skip


def _window(counter, camp, steps: int) -> dict:  # noqa: ANN001
    from quantkit.serving.integrity import sglang as plugin

    checks, finished = plugin.state().checks, camp.res.finished
    for _ in range(steps):
        _roots(counter, camp)
        counter.active = True
        try:
            camp.step()
        finally:
            counter.active = False
    return {"checks": plugin.state().checks - checks, "finished": camp.res.finished - finished,
            "aborts": camp.res.check_aborts}


def clean(version: str, counter, steps: int) -> list[dict]:  # noqa: ANN001
    out = []
    for ps in (1, 16, 64):
        for ordering in ("non_overlap", "overlap"):
            camp = _campaign(version, ps, ordering, steps)
            counter.events.clear()
            info = _window(counter, camp, steps)
            out.append({"page_size": ps, "ordering": ordering, **info, "plugin": counter.totals("plugin"),
                        "sglang": counter.totals("sglang"), "plugin_events": counter.lines("plugin"),
                        "sglang_events": counter.lines("sglang")})  # fmt: skip
    return out


def controls(version: str, counter, steps: int) -> dict:  # noqa: ANN001
    """The counter is live on the plugin's path: what a test adds there is counted, once per step."""
    import torch

    from quantkit.serving.integrity.state import PoolState

    check, verdict = PoolState.check, PoolState.verdict

    def check_reading(self, *args):  # noqa: ANN001, ANN202
        slots = check(self, *args)
        bool(self.row_bad.any())  # a host read of a device flag
        self.stamp.index_select(0, torch.tensor([0, 1]))  # a host index into a device tensor
        return slots

    def verdict_masked(self, rows):  # noqa: ANN001, ANN202
        v = verdict(self, rows)
        v[v < 0]  # noqa: B018 - a boolean mask: data-dependent shape
        return v

    out = {}
    PoolState.check, PoolState.verdict = check_reading, verdict_masked
    try:
        camp = _campaign(version, 16, "non_overlap", steps)
        counter.events.clear()
        _window(counter, camp, steps)
        out["injected"] = {"events": counter.lines("plugin"), "steps": steps}
    finally:
        PoolState.check, PoolState.verdict = check, verdict
    # a real fault: the abort path explains the mismatch (reads the device), which is allowed and must show
    camp = _campaign(version, 16, "non_overlap", steps)
    victim = camp.running.reqs[1]
    camp._free(camp._pages(victim)[-1])
    counter.events.clear()
    info = _window(counter, camp, 1)
    out["fault"] = {"plugin": counter.totals("plugin"), "aborts": info["aborts"], "victim": victim.rid,
                    "victim_finished": victim.finished(), "events": counter.lines("plugin")}  # fmt: skip
    return out


def main() -> None:
    out, mode = Path(sys.argv[1]), sys.argv[2]
    steps = int(sys.argv[3]) if len(sys.argv) > 3 else 24
    sys.path[:0] = [str(SRC), str(DEPS), str(HERE)]
    from stubs import install_sglang_stubs

    install_sglang_stubs(str(SRC))
    from sync_count import SyncCounter

    from quantkit.serving.integrity.sglang_env import load_sglang

    version = load_sglang()
    if mode == "on":
        from quantkit.serving.integrity.campaign import load_plugin

        load_plugin()
    else:
        os.environ.pop("QUANTKIT_KV_INTEGRITY", None)
    logging.getLogger("quantkit.kv_integrity").setLevel(logging.CRITICAL)
    from quantkit.serving.integrity.campaign_engine import OutputPath

    make_result = OutputPath.result

    def tagged_result(batch, ids):  # noqa: ANN001, ANN202 - the sampled ids live on the GPU
        result = make_result(batch, ids)
        SyncCounter.tag(result.next_token_ids)
        return result

    OutputPath.result = staticmethod(tagged_result)
    report: dict = {"version": version, "mode": mode, "steps": steps}
    with SyncCounter(str(SRC / "sglang")) as counter:
        report["clean"] = clean(version, counter, steps)
        if mode == "on":
            report["controls"] = controls(version, counter, steps)
    out.write_text(json.dumps(report))


if __name__ == "__main__":
    main()
