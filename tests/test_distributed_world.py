"""quantkit.core.distributed.World: partitioning, and one rank's failure reaching every rank (gloo, 2 processes)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from quantkit.core.distributed import SINGLE, World

DRIVER = Path(__file__).with_name("dist_world_driver.py")


def test_partitions_cover_every_item_once_and_balance_bytes() -> None:
    sizes = [9, 1, 5, 5, 3, 3, 2, 8]
    for n in (1, 2, 3, 5):
        owned = [World(rank=r, size=n).balanced(sizes) for r in range(n)]
        assert sorted(i for part in owned for i in part) == list(range(len(sizes)))
        loads = [sum(sizes[i] for i in part) for part in owned]
        assert max(loads) - min(loads) <= max(sizes)
        mine = [World(rank=r, size=n).mine(list(range(10))) for r in range(n)]
        assert sorted(i for part in mine for i in part) == list(range(10))
        assert all(World(rank=r, size=n).owner(i) == r for r in range(n) for i in mine[r])
    # the same world size always gives the same partition (every rank computes it alone)
    assert World(rank=1, size=3).balanced(sizes) == World(rank=1, size=3).balanced(list(sizes))


def test_one_process_is_a_world_of_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert World.from_env() is SINGLE
    import torch

    t = torch.ones(3)
    assert SINGLE.all_reduce(t) is t and SINGLE.agree(False) is False and SINGLE.all_gather_object(7) == [7]
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    with pytest.raises(Exception, match="torchrun"):
        World.from_env()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(tmp_path: Path, mode: str) -> tuple[int, dict[int, str]]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).parents[1]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
           str(_free_port()), str(DRIVER), str(tmp_path / "dist"), mode]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)
    results = {int(p.suffix[1:]): p.read_text() for p in tmp_path.glob("result.*")}
    return proc.returncode, results


def test_collectives_across_two_ranks(tmp_path: Path) -> None:
    code, results = _run(tmp_path, "ok")
    assert code == 0
    assert results == {0: "ok sum=3 agree=True", 1: "ok sum=3 agree=True"}


def test_one_rank_failing_fails_every_rank_with_its_message(tmp_path: Path) -> None:
    code, results = _run(tmp_path, "fail")
    assert code != 0
    assert "up_proj.weight is corrupt" in results[1]
    assert results[0].startswith("rank 1 of 2 failed: ") and "up_proj.weight is corrupt" in results[0]


def test_a_killed_rank_is_reported_by_the_survivor(tmp_path: Path) -> None:
    code, results = _run(tmp_path, "kill")
    assert code != 0
    assert 1 not in results  # killed: it printed nothing
    assert "stopped" in results[0] and "rerun" in results[0]
