"""kill -9 at any instant of `convert`: the rerun resumes and the output is byte-identical; a kill never
leaves OUT, only OUT.partial. Driven by tests/kill9_driver.py (real SIGKILLs of forked children)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from quantkit.checkpoint.synth import make_checkpoint

REPO = Path(__file__).resolve().parent.parent
DRIVER = REPO / "tests" / "kill9_driver.py"


def drive(src: Path, work: Path, *args: str, timeout: int = 600) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, str(DRIVER), str(src), str(work), *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def two_shards(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("k9") / "src", "glm_moe_dsa", "fp8", shards=2)


def test_kill_at_every_other_mutation_resumes_to_identical_bytes(two_shards, tmp_path):
    """Every second filesystem mutation, and each of the last 12 (finalize, metadata, publish), is a kill point."""
    result = drive(two_shards, tmp_path, "--every", "2", "--override", "max_shard_size=64KB")
    assert result["events"] > 40  # parts, journal entries, renames, metadata, publish: many distinct instants
    assert len(result["killed_at"]) >= result["events"] // 2
    assert result["failures"] == []
    assert set(result["states"]) <= {"out", "out.partial", ""}  # never a torn OUT next to a partial


@pytest.mark.slow
def test_kill_at_every_mutation_resumes_to_identical_bytes(two_shards, tmp_path):
    result = drive(two_shards, tmp_path, "--every", "1", "--override", "max_shard_size=64KB")
    assert len(result["killed_at"]) == result["events"] and result["failures"] == []


@pytest.mark.slow
def test_kill_with_two_workers(two_shards, tmp_path):
    """The parent dies at its own mutations while spawned workers are mid-shard; workers die with it."""
    result = drive(two_shards, tmp_path, "--every", "3", "--workers", "2", "--override", "max_shard_size=64KB")
    assert result["failures"] == []


@pytest.mark.slow
def test_kill_during_gptq_calibration_resumes_to_identical_bytes(tmp_path):
    from quantkit.calibrate.tiny import build_tiny

    src = build_tiny("deepseek_v3")
    result = drive(src, tmp_path, "--every", "9", "--override", "method=gptq", "calibration.samples=4",
                   "calibration.seq_len=32", timeout=1800)
    assert result["events"] > 20 and result["failures"] == []


def test_workers_die_with_a_killed_parent(tmp_path):
    """SIGKILL of the converter takes its busy shard workers with it: an orphan would finish its shard and
    write into OUT.partial underneath the rerun. The workers are threads of the one process (no child
    process exists to orphan). MSE scale search makes each shard take a second or two."""
    src = make_checkpoint(tmp_path / "src", "glm_moe_dsa", "bf16", size="small", shards=2)
    out = tmp_path / "out"
    script = (
        "import sys; from quantkit.convert.pipeline import convert; from quantkit.quant.recipe import load_recipe\n"
        "convert(sys.argv[1], sys.argv[2], load_recipe('glm5-w4a16-g32', {}, {'scale_search': 'mse'}), workers=2)\n"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-c", script, str(src), str(out)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    parts = tmp_path / "out.partial" / "parts"
    deadline = time.time() + 120
    while time.time() < deadline and not list(parts.glob("*.tmp")):  # a worker is writing its first part
        time.sleep(0.02)
    workers = _children(proc.pid)
    threads = os.listdir(f"/proc/{proc.pid}/task")
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert workers == [], "shard workers are threads: no child process may exist"
    assert len(threads) >= 3, "the converter never had two worker threads next to its main thread"
    journal = sorted(p.name for p in (tmp_path / "out.partial" / "journal").glob("shard-*"))
    time.sleep(4)  # longer than a shard takes: an orphan would have finished and journaled it
    assert sorted(p.name for p in (tmp_path / "out.partial" / "journal").glob("shard-*")) == journal
    assert not out.exists()


def _children(pid: int) -> list[int]:
    try:
        kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return []
    out = []
    for k in kids:
        try:
            if b"spawn_main" in Path(f"/proc/{k}/cmdline").read_bytes():
                out.append(int(k))
        except OSError:
            pass
    return out

