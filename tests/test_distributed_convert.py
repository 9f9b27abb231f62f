"""`quantkit convert` under torchrun (gloo, CPU): the shards are split across ranks, the bytes are those of
one process whatever the world size, a failure on one rank stops every rank with its message, and a run
killed on one rank resumes with another world size to identical bytes.

Every case starts the real launcher (`python -m torch.distributed.run`) on a free port; each rank's stdout
and stderr are read from torchrun's --log-dir, each rank's exit status from its failure summary.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from quantkit.checkpoint.synth import make_checkpoint
from quantkit.convert.pipeline import convert
from quantkit.quant.recipe import load_recipe

REPO = Path(__file__).resolve().parent.parent
DRIVER = REPO / "tests" / "rank_driver.py"
SHARD_CAP = ["--max-shard-size", "1MB"]  # several parts per source shard


@dataclass
class Launch:
    returncode: int  # torchrun's
    exit_codes: dict[int, int]  # each failed rank's exit status, from torchrun's summary
    stdout: dict[int, str]
    stderr: dict[int, str]
    agent: str  # torchrun's own output


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(ranks: int, args: list[str], work: Path, driver: list[str] | None = None, timeout: int = 180) -> Launch:
    logs = work / f"logs-{free_port()}"
    target = [str(DRIVER), *(driver or []), "--"] if driver is not None else ["-m", "quantkit"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--master-addr",
           "127.0.0.1", "--master-port", str(free_port()), "--redirects", "3", "--log-dir", str(logs), *target, *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "QUANTKIT_DIST_TIMEOUT": "120"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)
    agent = proc.stdout + proc.stderr

    def per_rank(name: str) -> dict[int, str]:
        return {int(p.parent.name): p.read_text() for p in logs.rglob(name)}

    codes = {int(r): int(c) for r, c in re.findall(r"rank\s+: (\d+) \(local_rank: \d+\)\s+exitcode\s+: (-?\d+)", agent)}
    return Launch(proc.returncode, codes, per_rank("stdout.log"), per_rank("stderr.log"), agent)


def digest_tree(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("dist") / "src", "glm_moe_dsa", "fp8", size="small", shards=5)


@pytest.fixture(scope="module")
def one_process(source, tmp_path_factory) -> dict[str, str]:
    """Every output file's sha256 from a plain single-process conversion (the recipe the CLI resolves)."""
    out = tmp_path_factory.mktemp("single") / "out"
    config = json.loads((source / "config.json").read_text())
    convert(source, out, load_recipe(None, config, {"max_shard_size": "1MB"}))
    return digest_tree(out)


@pytest.mark.parametrize("ranks", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_ranks_write_the_bytes_of_one_process(source, one_process, tmp_path, ranks):
    out = tmp_path / "out"
    launch = torchrun(ranks, ["convert", str(source), str(out), *SHARD_CAP], tmp_path)
    assert launch.returncode == 0, launch.agent[-3000:]
    assert digest_tree(out) == one_process  # every file, byte for byte
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("out")) == ["out"]
    expected = {2: "rank 0 converts 2 of the 5 shards left", 3: "rank 0 converts 1 of the 5 shards left"}[ranks]
    assert expected in launch.stderr[0]  # the work was split (balanced by source bytes)
    assert "done" in launch.stderr[0]
    for rank in range(1, ranks):  # only rank 0 reports
        assert launch.stdout[rank].strip() == "" and launch.stderr[rank].strip() == ""


def _nan_in_last_shard(src: Path) -> tuple[Path, str]:
    """An FP8 NaN byte in one routed expert of the last shard: found only by the rank that converts it."""
    shard = sorted(src.glob("model-*.safetensors"))[-1]
    tensors = load_file(shard)
    name = next(n for n in sorted(tensors) if ".experts." in n and tensors[n].dtype == torch.float8_e4m3fn)
    raw = tensors[name].view(torch.uint8).clone()
    raw[0, 0] = 0x7F  # NaN in float8_e4m3fn
    tensors[name] = raw.view(torch.float8_e4m3fn)
    save_file(tensors, shard, metadata={"format": "pt"})
    return shard, name


def test_one_rank_failing_stops_every_rank_with_its_message(source, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(source, src)
    shard, tensor = _nan_in_last_shard(src)
    out = tmp_path / "out"
    launch = torchrun(2, ["convert", str(src), str(out), "--quiet"], tmp_path)
    assert launch.returncode != 0
    assert launch.exit_codes == {0: 2, 1: 2}, launch.agent[-3000:]
    message = f"{shard}: tensor {tensor} contains NaN or Inf values"
    got = {rank: lines(err) for rank, err in launch.stderr.items()}
    assert all(len(v) == 1 for v in got.values()), got  # one line each, no traceback
    failing = [r for r, v in got.items() if v[0].startswith(f"error: {message}; ")]  # + what OUT.partial keeps
    assert len(failing) == 1, got
    other = 1 - failing[0]
    said = got[failing[0]][0].removeprefix("error: ")
    assert got[other] == [f"error: rank {failing[0]} of 2 failed: {said}"]
    assert not out.exists()


def _truncate_a_shard(src: Path, out: Path) -> str:
    shard = sorted(src.glob("model-*.safetensors"))[2]
    shard.write_bytes(shard.read_bytes()[:1000])
    return f"error: {shard}: "


def _out_exists(src: Path, out: Path) -> str:
    out.mkdir()
    return f"error: {out}: already exists (use --force to replace it)"


@pytest.mark.slow
@pytest.mark.parametrize("fault", [_truncate_a_shard, _out_exists], ids=["truncated shard", "OUT exists"])
def test_bad_input_is_the_same_one_line_error_on_every_rank(source, tmp_path, fault):
    """A bad source fails on every rank (each validates it); a decision of rank 0 reaches the others."""
    src = tmp_path / "src"
    shutil.copytree(source, src)
    out = tmp_path / "out"
    expected = fault(src, out)
    launch = torchrun(2, ["convert", str(src), str(out), "--quiet"], tmp_path)
    assert launch.exit_codes == {0: 2, 1: 2}, launch.agent[-3000:]
    got = {rank: lines(err) for rank, err in launch.stderr.items()}
    assert all(len(v) == 1 for v in got.values()), got
    if fault is _out_exists:  # rank 0 decides; rank 1 learns it through the collective
        assert got == {0: [expected], 1: [expected.replace("error: ", "error: rank 0 of 2 failed: ", 1)]}
    else:
        assert got[0] == got[1] and got[0][0].startswith(expected), got
    assert not (tmp_path / "out.partial").exists()


def test_kill9_of_one_rank_then_resume_with_another_world_size(source, one_process, tmp_path):
    out = tmp_path / "out"
    args = ["convert", str(source), str(out), *SHARD_CAP, "--quiet"]
    killed = torchrun(2, args, tmp_path, driver=["--kill-rank", "1", "--before-journal", "2"])
    assert killed.returncode != 0
    assert killed.exit_codes[1] == -9 and killed.exit_codes[0] == 2, killed.agent[-3000:]
    rank0 = lines(killed.stderr[0])
    assert len(rank0) == 1 and rank0[0].startswith("error: another rank of 2 "), rank0
    assert rank0[0].endswith("rerun the same command to resume")
    assert not out.exists()
    journaled = len(list((tmp_path / "out.partial" / "journal").glob("shard-*.json")))
    assert 1 <= journaled < 5  # rank 1 journaled one shard before it died; the run did not finish

    resumed = torchrun(3, [*args, "--json"], tmp_path)
    assert resumed.returncode == 0, resumed.agent[-3000:]
    assert json.loads(resumed.stdout[0])["resumed_shards"] == journaled
    assert digest_tree(out) == one_process
    assert not (tmp_path / "out.partial").exists()


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root and unshare(1)")
def test_output_not_shared_between_ranks_is_refused(source, tmp_path):
    """Rank 1 sees its own empty file system where OUT's parent is, as a node without the shared mount would."""
    parent = tmp_path / "outputs"
    parent.mkdir()
    out = parent / "out"
    launch = torchrun(2, ["convert", str(source), str(out), "--quiet"], tmp_path,
                      driver=["--private-dir", str(parent)])
    assert launch.exit_codes == {0: 2, 1: 2}, launch.agent[-3000:]
    got = {rank: lines(err) for rank, err in launch.stderr.items()}
    assert len(got[1]) == 1 and got[1][0].startswith(f"error: {out}.partial/dist/nonce: rank 1 on "), got
    assert "must be on a file system every node shares" in got[1][0]
    assert got[0] == [got[1][0].replace("error: ", "error: rank 1 of 2 failed: ", 1)]
    assert not out.exists()


@pytest.mark.slow
def test_a_rank_with_another_recipe_is_refused(source, tmp_path):
    """Ranks that would write parts of two different runs into one OUT.partial stop before any work."""
    out = tmp_path / "out"
    launch = torchrun(2, ["convert", str(source), str(out), "--quiet"], tmp_path,
                      driver=["--rank-args", "1", "--group-size 64"])
    assert launch.exit_codes == {0: 2, 1: 2}, launch.agent[-3000:]
    got = {rank: lines(err) for rank, err in launch.stderr.items()}
    assert len(got[1]) == 1 and got[1][0].startswith(f"error: {source}: rank 1 on "), got
    assert "sees another source, recipe or tool version than rank 0" in got[1][0]
    assert got[0] == [got[1][0].replace("error: ", "error: rank 1 of 2 failed: ", 1)]
    assert not out.exists() and not (tmp_path / "out.partial").exists()


@pytest.mark.parametrize("runs", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_gptq_under_torchrun_end_to_end(tmp_path, runs):
    """`torchrun -m quantkit convert --method gptq`: calibration across 2 ranks (expert-parallel), then the
    write phase across them; the checkpoint validates, its experts are GPTQ's (better than RTN on every
    module), and (slow) a second 2-rank run writes the same bytes."""
    from quantkit.calibrate.tiny import build_tiny

    src = build_tiny("deepseek_v3")
    calib = REPO / "calibration_data" / "default.jsonl"
    args = ["--method", "gptq", "--calib", str(calib), "--samples", "8", "--seq-len", "64", "--kv-cache", "fp8",
            "--quiet"]
    sums = []
    for name in ("a", "b")[:runs]:
        out = tmp_path / name
        launch = torchrun(2, ["convert", str(src), str(out), *args], tmp_path)
        assert launch.returncode == 0, launch.agent[-3000:]
        sums.append((out / "SHA256SUMS").read_text())
        report = json.loads((out / "calibration_coverage.json").read_text())
        assert report["summary"]["gptq_better_than_rtn"] == report["summary"]["modules"] > 0
        config = json.loads((src / "config.json").read_text())
        moe_layers = range(config.get("first_k_dense_replace", 0), config["num_hidden_layers"])
        # every expert of every MoE layer recorded once, whichever rank solved it
        assert sorted((r["layer"], r["expert"]) for r in report["experts"]) == [
            (layer, e) for layer in moe_layers for e in range(config["n_routed_experts"])]
    assert len(set(sums)) == 1  # GPTQ across ranks is deterministic for a given world size
    check = subprocess.run([sys.executable, "-m", "quantkit", "validate", str(tmp_path / "a"), "--engine", "vllm"],
                           capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=REPO)
    assert check.returncode == 0, check.stdout + check.stderr
