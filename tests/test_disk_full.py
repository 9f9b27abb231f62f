"""Full disks on a real (small) tmpfs: the preflight refuses up front; ENOSPC mid-way is exit 2 naming the
path and the bytes still needed, the partial stays resumable, and after freeing space the rerun completes
byte-identical. Also: a second run on the same OUT refuses while the first holds the lock, and a stale
lock from a killed run is taken over."""

from __future__ import annotations

import errno
import hashlib
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

import quantkit.convert.pipeline as convert_module
from quantkit.checkpoint.synth import make_checkpoint
from quantkit.convert.pipeline import convert
from quantkit.quant.recipe import load_recipe

REPO = Path(__file__).resolve().parent.parent
RECIPE = ["--max-shard-size", "64KB"]


def digest_tree(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@contextmanager
def tmpfs(path: Path, size: str, *options: str) -> Iterator[Path]:
    """A real size-limited file system; skipped where mounting is not permitted (not root, no CAP_SYS_ADMIN)."""
    path.mkdir(parents=True, exist_ok=True)
    opts = ",".join([f"size={size}", *options])
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({proc.stderr.strip() or proc.returncode}); run as root to test")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def fill(directory: Path) -> Path:
    """Write a ballast file until the file system is full; returns it (delete it to free the space)."""
    ballast = directory / "ballast"
    with open(ballast, "wb") as fh:
        chunk = b"\0" * 65536
        try:
            while True:
                fh.write(chunk)
                fh.flush()
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
        try:
            fh.write(b"\0" * 4096)
            fh.flush()
        except OSError:
            pass
    return ballast


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("full") / "src", "glm_moe_dsa", "fp8", shards=3)


@pytest.fixture(scope="module")
def reference(source, tmp_path_factory) -> dict[str, str]:
    out = tmp_path_factory.mktemp("ref") / "out"
    convert(source, out, load_recipe(None, {"model_type": "glm_moe_dsa"}, {"max_shard_size": "64KB"}))
    return digest_tree(out)


def test_preflight_refuses_before_writing(source, tmp_path, cli):
    with tmpfs(tmp_path / "small", "128k") as disk:
        code, _, err = cli("convert", str(source), str(disk / "out"), "--quiet", *RECIPE)
        assert code == 2, err
        line = err.strip()
        assert line.startswith("error: ") and "\n" not in line and "not enough free space" in line
        needed, free = (int(x) for x in re.search(r"needs (\d+) more bytes .* but (\d+) are free", line).groups())
        assert needed > free > 0
        assert sorted(p.name for p in disk.iterdir()) == []  # no OUT, no OUT.partial


def _fill_after_shards(monkeypatch, disk: Path, after: int) -> None:
    real = convert_module.convert_shard
    calls = []

    def then_fill(src, job, *args, **kwargs):
        calls.append(job.index)
        if len(calls) == after + 1:
            fill(disk)
        return real(src, job, *args, **kwargs)

    monkeypatch.setattr(convert_module, "convert_shard", then_fill)


def _fill_before_finalize(monkeypatch, disk: Path) -> None:
    real = convert_module.finalize_shards

    def then_fill(partial, journal):
        weight_map = real(partial, journal)  # the renames need no space; the metadata after them does
        fill(disk)
        return weight_map

    monkeypatch.setattr(convert_module, "finalize_shards", then_fill)


@pytest.mark.parametrize("when", ["mid-shards", "after finalize"])
def test_enospc_is_exit_2_and_resumes_byte_identical(source, reference, tmp_path, cli, monkeypatch, when):
    with tmpfs(tmp_path / "disk", "16m") as disk:
        out = disk / "out"
        if when == "mid-shards":
            _fill_after_shards(monkeypatch, disk, after=1)
        else:
            _fill_before_finalize(monkeypatch, disk)
        code, _, err = cli("convert", str(source), str(out), "--quiet", *RECIPE)
        assert code == 2, err
        line = err.strip()
        assert "\n" not in line and "Traceback" not in line
        assert "no space left on device" in line and str(disk / "out.partial") in line
        assert int(re.search(r"about (\d+) more bytes", line).group(1)) > 0
        assert not out.exists() and (disk / "out.partial" / "journal").is_dir()
        assert not list((disk / "out.partial").rglob("*.tmp"))  # nothing torn left behind
        monkeypatch.undo()
        (disk / "ballast").unlink()
        code, _, err = cli("convert", str(source), str(out), "--quiet", *RECIPE)
        assert code == 0, err
        assert digest_tree(out) == reference
        assert sorted(p.name for p in disk.iterdir()) == ["out"]


def test_read_only_parent_is_exit_2(source, tmp_path, cli):
    with tmpfs(tmp_path / "ro", "1m", "ro") as disk:
        code, _, err = cli("convert", str(source), str(disk / "out"), "--quiet")
        assert code == 2 and "not writable" in err and str(disk) in err


# ---- concurrent runs ------------------------------------------------------------------------------
_HOLDER = """
import sys, time
from pathlib import Path
from quantkit.core.durable import RunLock
RunLock(Path(sys.argv[1])).acquire()
print("locked", flush=True)
time.sleep(600)
"""


def _hold_lock(partial: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER, str(partial)], stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout.readline().strip() == "locked"
    return proc


class Notes:
    def __init__(self) -> None:
        self.notes: list[str] = []

    def stage(self, name: str, total: int | None = None) -> None:
        pass

    def advance(self, n: int) -> None:
        pass

    def note(self, message: str) -> None:
        self.notes.append(message)


def test_second_run_refuses_while_the_first_holds_the_lock_then_takes_over_a_stale_one(
        source, reference, tmp_path, cli):
    out, partial = tmp_path / "out", tmp_path / "out.partial"
    holder = _hold_lock(partial)
    try:
        code, _, err = cli("convert", str(source), str(out), "--quiet", *RECIPE)
        assert code == 2 and "another quantkit run" in err and f"pid {holder.pid}" in err, err
        assert not out.exists()
    finally:
        os.kill(holder.pid, signal.SIGKILL)  # a killed run: its lock file stays, its flock is gone
        holder.wait()
    assert (partial / ".quantkit.lock").exists()
    notes = Notes()
    convert(source, out, load_recipe(None, {"model_type": "glm_moe_dsa"}, {"max_shard_size": "64KB"}), reporter=notes)
    assert any(f"taking over out.partial from a run that stopped (pid {holder.pid}" in n for n in notes.notes)
    assert digest_tree(out) == reference and not partial.exists()


def test_two_real_runs_at_once_give_one_output(source, reference, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "quantkit", "convert", str(source), str(tmp_path / "out"), "--quiet", *RECIPE]
    procs = [subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    results = [(p.wait(timeout=300), p.stderr.read()) for p in procs]
    codes = sorted(code for code, _ in results)
    assert codes == [0, 2], results
    loser = next(err for code, err in results if code == 2)
    assert "another quantkit run" in loser or "already converted" in loser, loser
    assert digest_tree(tmp_path / "out") == reference
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
