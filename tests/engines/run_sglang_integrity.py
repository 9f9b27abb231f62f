"""Run the KV integrity plugin against SGLang 0.5.23's own memory/scheduler code and write a JSON report.

    python tests/engines/run_sglang_integrity.py OUT.json [STEPS]

A fresh interpreter (the stubs enter a process-wide torch mode and answer torch.cuda as an H200, so they must not
leak into the pytest process): installs `stubs.install_sglang_stubs`, loads SGLang through
`quantkit.serving.integrity.sglang_env.load_sglang`, calls SGLang's `load_plugins()` first with `QUANTKIT_KV_INTEGRITY`
unset (nothing may be registered), then with it set, and runs targeted scenarios plus the fault campaign at page
sizes 1, 16 and 64 with immediate and staged reuse, each in SGLang's normal and overlap orderings (half the steps
each), and one unguarded control campaign.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
SRC = HERE.parent.parent / ".cache" / "engines" / "src" / "sglang"
DEPS = SRC.parent.parent / "deps-sglang"


def _hooked_targets() -> list[str]:
    from sglang.srt.plugins.hook_registry import HookRegistry

    from quantkit.serving.integrity import sglang as plugin
    ours = {id(hook) for _, hook, _ in plugin.hook_table()}
    return sorted(t for t, hooks in HookRegistry._hooks.items() if any(id(h) in ours for _, h, _ in hooks))


def _wrapped(dotted: str) -> bool:
    import pkgutil

    owner, attr = dotted.rsplit(".", 1)
    return hasattr(pkgutil.resolve_name(owner).__dict__[attr], "__wrapped__")


def noop_then_enable() -> dict:
    import sglang.srt.plugins as plugins

    from quantkit.serving.integrity import sglang as plugin
    from quantkit.serving.integrity.campaign import load_plugin

    release = "sglang.srt.mem_cache.allocator.paged.PagedTokenToKVPoolAllocator._release_page_ids"
    os.environ.pop(plugin.ENV, None)
    os.environ["SGLANG_PLUGINS"] = "quantkit_kv_integrity"
    plugins.load_plugins()
    off = {"registered": plugin.state().registered, "targets": _hooked_targets(), "wrapped": _wrapped(release)}
    plugins._plugins_loaded = False  # SGLang's once-per-process guard; load again with the variable set
    load_plugin()
    on = {"registered": plugin.state().registered, "targets": _hooked_targets(), "wrapped": _wrapped(release)}
    return {"off": off, "on": on}


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def premature_free(version: str) -> dict:
    """One request decodes; one of its pages is freed behind its back; the next decode step must abort it,
    log it, and leave the page on the free list exactly once."""
    from quantkit.serving.integrity import sglang as plugin
    from quantkit.serving.integrity.campaign import CampaignConfig, _Campaign

    camp = _Campaign(CampaignConfig(page_size=16, fault_rate=0.0, arrival_rate=0.0, abort_rate=0.0), version)
    camp.waiting.append(camp.request(list(range(100, 140)), max_new=40))
    camp.step()
    req = camp.running.reqs[0]
    clean_steps = camp.res.check_aborts
    page = camp._pages(req)[-1]
    tokens_before = len(req.output_ids)
    camp._free(page)
    lines = _Lines()
    logging.getLogger("quantkit.kv_integrity").addHandler(lines)
    before = len(plugin.state().aborts)
    camp.step()
    logging.getLogger("quantkit.kv_integrity").removeHandler(lines)
    rec = plugin.state().aborts[before:]
    free = camp.e.alloc.get_all_free_pages()
    sent = camp.out.sink.finished.get(req.rid, {})
    return {"clean_aborts": clean_steps, "aborts": [r.__dict__ for r in rec], "rid": req.rid, "page": page,
            "finished_reason": str(getattr(req.finished_reason, "message", None)), "log": lines.lines,
            "page_on_free_list": int((free == page).sum()),
            "running": len([r for r in camp.running.reqs if not r.finished()]),
            "streamed_reason": sent, "tokens_after_fault": len(req.output_ids) - tokens_before}


def shared_prompt_rewrite(version: str) -> dict:
    """Two requests with one prompt in one prefill batch: checkpoint_into_tree rewrites the second row with the
    first's pages (freeing its own); decoding on must not abort either."""
    from quantkit.serving.integrity import sglang as plugin
    from quantkit.serving.integrity.campaign import CampaignConfig, _Campaign

    camp = _Campaign(CampaignConfig(page_size=16, fault_rate=0.0, arrival_rate=0.0, abort_rate=0.0), version)
    prompt = list(range(500, 548))
    camp.waiting += [camp.request(prompt, max_new=30), camp.request(prompt, max_new=30)]
    before = len(plugin.state().aborts)
    camp.step()
    a, b = camp.running.reqs
    pool = camp.e.pool.req_to_token
    shared = bool(torch.equal(pool[a.kv.req_pool_idx, :48], pool[b.kv.req_pool_idx, :48]))
    for _ in range(20):
        camp.step()
    return {"rows_share_prefix": shared, "aborts": len(plugin.state().aborts) - before,
            "wrong": camp.res.wrong_data_served}


def mixed_batch(version: str) -> dict:
    """``--enable-mixed-chunk``: two decoding requests ride a prefill (SGLang's ``mix_with_running``), one of them
    lost a page; SGLang's prefill-path result processing must finish it with the integrity abort and no token."""
    import torch
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.managers.utils import GenerationBatchResult

    from quantkit.serving.integrity import sglang as plugin
    from quantkit.serving.integrity.campaign import CampaignConfig, _Campaign, _spec_none
    from quantkit.serving.integrity.sglang_check import _after_forward

    camp = _Campaign(CampaignConfig(page_size=16, fault_rate=0.0, arrival_rate=0.0, abort_rate=0.0), version)
    victim, other = (camp.request(list(range(b, b + 40)), max_new=40, stream=True) for b in (100, 200))
    camp.waiting += [victim, other]
    while camp.running is None or len(camp.running.reqs) < 2:
        camp.step()
    camp.step()
    camp._free(camp._pages(victim)[-1])
    before = {r.rid: len(r.output_ids) for r in (victim, other)}
    new_req = camp.request(list(range(300, 330)), max_new=40, stream=True)
    new_req.init_next_round_input(camp.e.tree)
    new_req.extend_end = len(new_req.full_untruncated_fill_ids)
    new_req.lock = camp.e.tree.lock(new_req.last_node)
    batch = ScheduleBatch.init_new([new_req], camp.e.pool, camp.e.alloc, camp.e.tree, camp.e.model, False,
                                   _spec_none())  # fmt: skip
    batch.prepare_for_extend()
    camp.running.prepare_for_decode()  # what get_new_batch_prefill does under --enable-mixed-chunk
    batch.mix_with_running(camp.running)
    batch.decoding_reqs = camp.running.reqs
    aborts = len(plugin.state().aborts)
    result = GenerationBatchResult(next_token_ids=torch.tensor([5, 6, 7]))
    _after_forward(result, None, batch)
    camp.out.processor.process_batch_result_prefill(batch, result)
    return {"mode_mixed": bool(batch.forward_mode.is_mixed()), "victim": victim.rid,
            "aborted": [a.rid for a in plugin.state().aborts[aborts:]],
            "victim_tokens": len(victim.output_ids) - before[victim.rid],
            "other_tokens": len(other.output_ids) - before[other.rid], "prefill_tokens": len(new_req.output_ids),
            "streamed": camp.out.sink.finished.get(victim.rid, {}), "kv_released": victim.kv.is_kv_released}


def clear_makes_stale(version: str) -> dict:
    from quantkit.serving.integrity import sglang as plugin
    from quantkit.serving.integrity.campaign import CampaignConfig, _Campaign

    camp = _Campaign(CampaignConfig(page_size=16, fault_rate=0.0, arrival_rate=0.0), version)
    old = plugin.tracker_of(camp.e.alloc)
    camp.e.alloc.clear()
    new = plugin.tracker_of(camp.e.alloc)
    from quantkit.serving.integrity.state import TAG_MASK

    return {"replaced": new is not old, "min_new": int((new.stamp[: new.num_pages] & TAG_MASK).min()),
            "max_old": int((old.stamp[: old.num_pages] & TAG_MASK).max())}


def campaigns(version: str, steps: int) -> list[dict]:
    from quantkit.serving.integrity.campaign import ORDERINGS, CampaignConfig, merge_results, run_campaign

    out = []
    for i, (ps, reuse) in enumerate([(p, r) for p in (1, 16, 64) for r in ("immediate", "staged")]):
        parts = [run_campaign(CampaignConfig(steps=n, seed=100 + i, page_size=ps, reuse=reuse, ordering=order,
                                             fault_rate=0.25), version)
                 for order, n in zip(ORDERINGS, (steps // 2, steps - steps // 2), strict=True)]  # fmt: skip
        out.append(merge_results(parts).to_dict())
    for order in ORDERINGS:
        control = CampaignConfig(steps=steps, seed=7, page_size=16, fault_rate=0.25, guarded=False, ordering=order)
        out.append({"control": True, **run_campaign(control, version).to_dict()})
    return out


def main() -> None:
    out, steps = Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 120
    sys.path[:0] = [str(SRC), str(DEPS), str(HERE)]
    from stubs import install_sglang_stubs

    install_sglang_stubs(str(SRC))
    from quantkit.serving.integrity.sglang_env import load_sglang

    version = load_sglang()
    report = {"version": version, "plugin": noop_then_enable()}
    report["premature_free"] = premature_free(version)
    report["shared_prompt_rewrite"] = shared_prompt_rewrite(version)
    report["clear"] = clear_makes_stale(version)
    report["mixed"] = mixed_batch(version)
    report["campaigns"] = campaigns(version, steps)
    out.write_text(json.dumps(report))


if __name__ == "__main__":
    main()
