"""The KV integrity plugin executed inside SGLang 0.5.23's own allocator, radix cache and scheduler batch code.

SGLang runs in one child interpreter per module (tests/engines/run_sglang_integrity.py: the engine stubs change
torch process-wide, so they stay out of the pytest process); the tests assert on its report. The TP agreement runs
here with two gloo ranks (torch only).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from quantkit.serving.integrity.campaign import FAULT_KINDS
from quantkit.serving.integrity.sglang_check import agree_flags

ROOT = Path(__file__).resolve().parent.parent
RUNNER = ROOT / "tests" / "engines" / "run_sglang_integrity.py"
SGLANG = ROOT / ".cache" / "engines" / "src" / "sglang" / "sglang"


def _run(tmp: Path, steps: int) -> dict:
    if not SGLANG.is_dir():
        pytest.fail(f"{SGLANG} is missing: run `make engines` first")
    out = tmp / "report.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    env.pop("QUANTKIT_KV_INTEGRITY", None)
    proc = subprocess.run([sys.executable, str(RUNNER), str(out), str(steps)], capture_output=True, text=True,
                          env=env, timeout=900)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return _run(tmp_path_factory.mktemp("sglang-integrity"), 100)


def test_unset_installs_nothing_and_tags_installs_the_hooks(report):
    assert report["version"] == "0.5.23"
    off, on = report["plugin"]["off"], report["plugin"]["on"]
    assert off == {"registered": False, "targets": [], "wrapped": False}
    assert on["registered"] and on["wrapped"]
    for target in ("PagedTokenToKVPoolAllocator._release_page_ids", "TokenToKVPoolAllocator.free",
                   "allocation.alloc_for_extend", "allocation.alloc_for_decode",
                   "UnifiedRadixCache.checkpoint_into_tree", "ScheduleBatch.prepare_for_decode",
                   "GenerationBatchResult.copy_to_cpu", "SchedulerBatchResultProcessor._normalize_decode_outputs",
                   "common.release_kv_cache"):  # fmt: skip
        assert any(t.endswith(target) for t in on["targets"]), target


def test_premature_free_aborts_only_that_request_logs_it_and_frees_nothing_twice(report):
    r = report["premature_free"]
    assert r["clean_aborts"] == 0
    [abort] = r["aborts"]
    assert abort["rid"] == r["rid"] and abort["page"] == r["page"] == abort["expected_page"]
    assert abort["actual_tag"] != abort["expected_tag"]
    assert r["finished_reason"] == "KV page integrity check failed (quantkit)"
    assert r["running"] == 0
    assert r["page_on_free_list"] == 1  # freed once by the fault, not again by the abort's release
    [line] = r["log"]
    assert r["rid"] in line and f"page {r['page']}" in line and f"tag {abort['expected_tag']}" in line
    assert f"live tag {abort['actual_tag']}" in line
    # the client got the abort through SGLang's own output streamer, and no token of the faulty step
    assert r["streamed_reason"]["message"] == r["finished_reason"] and r["streamed_reason"]["status_code"] == 500
    assert r["tokens_after_fault"] == 0


def test_checkpoint_rewrite_of_a_row_is_not_a_mismatch(report):
    r = report["shared_prompt_rewrite"]
    assert r["rows_share_prefix"] and r["aborts"] == 0 and r["wrong"] == 0


def test_mixed_batch_aborts_the_flagged_decode_request_without_its_token(report):
    r = report["mixed"]
    assert r["mode_mixed"] and r["aborted"] == [r["victim"]] and r["kv_released"]
    assert r["victim_tokens"] == 0 and r["other_tokens"] == 1 and r["prefill_tokens"] == 1
    assert r["streamed"]["message"] == "KV page integrity check failed (quantkit)"
    assert r["streamed"]["status_code"] == 500


def test_clear_makes_every_old_record_stale(report):
    r = report["clear"]
    assert r["replaced"] and r["min_new"] > r["max_old"]


def test_campaign_every_fault_detected_no_false_positive_no_wrong_data(report):
    runs = [r for r in report["campaigns"] if not r.get("control")]
    assert sorted((r["page_size"], r["reuse"]) for r in runs) == sorted(
        (p, m) for p in (1, 16, 64) for m in ("immediate", "staged"))
    for r in runs:
        assert r["steps"] == 100 and r["injected"] > 0, r
        assert r["detected"] == r["injected"] and r["false_positives"] == 0 and r["wrong_data_served"] == 0, r
        assert r["ordering"] == "non_overlap+overlap" and r["moot"] == 0, r
        # nothing computed from a page that failed the check reached a client; every abort reached its client
        assert r["wrong_tokens_streamed"] == 0 and r["tokens_streamed"] > 0, r
        assert r["aborts_streamed"] == r["check_aborts"] > 0, r
    for kind in FAULT_KINDS:
        assert sum(r["by_kind"][kind]["injected"] for r in runs) > 0, kind


def test_unguarded_control_serves_wrong_data(report):
    controls = [r for r in report["campaigns"] if r.get("control")]
    assert sorted(r["ordering"] for r in controls) == ["non_overlap", "overlap"]
    for control in controls:
        assert control["injected"] > 0 and control["detected"] == 0 and control["wrong_data_served"] > 0
        assert control["wrong_tokens_streamed"] > 0  # the metric can fail: without the check, wrong tokens stream


def _rank(rank: int, port: int, out: dict) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        local = torch.tensor([1, 0, 0, 0], dtype=torch.int32) if rank == 0 else torch.tensor([0, 0, 1, 0])
        out[rank] = agree_flags(local, dist.group.WORLD).tolist()
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_two_gloo_ranks_agree_on_the_abort_set():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with mp.Manager() as manager:
        out = manager.dict()
        mp.start_processes(_rank, args=(port, out), nprocs=2, join=True, start_method="spawn")
        assert out[0] == out[1] == [1, 0, 1, 0]


def test_agree_flags_without_a_group_is_identity():
    flags = torch.tensor([0, 1], dtype=torch.int32)
    assert agree_flags(flags, None) is flags


@pytest.mark.slow
def test_campaign_longer(tmp_path: Path):
    report = _run(tmp_path, 3000)
    for r in report["campaigns"]:
        if r.get("control"):
            continue
        assert r["detected"] == r["injected"] > 0 and r["false_positives"] == 0 and r["wrong_data_served"] == 0, r
        assert r["wrong_tokens_streamed"] == 0, r


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    return subprocess.run([sys.executable, "-m", "quantkit", "simulate", "integrity", "--engine", "sglang", *args],
                          capture_output=True, text=True, env=env, timeout=900)  # fmt: skip


def test_cli_engine_sglang_prints_the_promised_figures():
    proc = _cli("--page-size", "16", "--steps", "60", "--fault-rate", "0.3", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["sglang_version"] == "0.5.23" and result["steps"] == 60
    assert result["injected"] > 0 and result["detected"] == result["injected"] and result["false_positives"] == 0
    assert set(result["by_kind"]) == set(FAULT_KINDS)
    assert [(r["page_size"], r["reuse"]) for r in result["runs"]] == [(16, "immediate"), (16, "staged")]


def test_cli_engine_sglang_without_a_source_tree_is_a_one_line_error(tmp_path: Path):
    proc = _cli("--sglang-src", str(tmp_path), "--steps", "1")
    assert proc.returncode == 2
    assert str(tmp_path) in proc.stderr and "Traceback" not in proc.stderr
