"""The sensitivity pass on the tiny trained MLA-MoE: every unit scored, the errors ordered as the formats' bits,
the sensitive layer found, resumable, the same table expert-parallel; and `convert --max-size` around it."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from quantkit.core.errors import QuantkitError

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny() -> Path:
    from quantkit.calibrate.tiny import build_tiny

    return build_tiny("deepseek_v3")


def _table(src: Path, work: Path, **kw):  # type: ignore[no-untyped-def]
    from quantkit.calibrate.sensitivity_run import sensitivity_of
    from quantkit.calibrate.tiny import CORPUS

    return sensitivity_of(src, CORPUS, work, samples=8, seq_len=64, batch_size=4, **kw)


@pytest.fixture(scope="module")
def table(tiny: Path, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    return _table(tiny, tmp_path_factory.mktemp("sens") / "work")


def test_every_unit_scored_and_formats_ordered(tiny: Path, table) -> None:  # type: ignore[no-untyped-def]
    from quantkit.checkpoint.source import open_source
    from quantkit.quant.units import list_units

    units = {u.name for u in list_units(open_source(tiny).adapter) if not u.mtp}
    assert set(table.units) == units
    for name, s in table.units.items():
        assert s.kl["int4-g32"] < s.kl["int4-g64"], name
        if s.kind != "attention":  # attention's q_b_proj has 64 inputs: no group of 128 there (INT8 is g128)
            assert s.kl["int8-g128"] < s.kl["int4-g32"] and s.kl["int4-g64"] < s.kl["int4-g128"], name
        assert all(v > 0 for v in s.kl_fisher.values())
    assert set(table.units["layers.0.attention"].kl) == {"int4-g32", "int4-g64"}
    experts = {n: s.kl["int4-g32"] for n, s in table.units.items() if s.kind == "experts"}
    assert max(experts, key=experts.get) == "layers.0.experts"  # measured: ~97% of uniform INT4's KL


def test_resumes_where_it_stopped(tiny: Path, table, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Stopped after the top two layers were scored: the rerun neither forwards again nor rescores them, and
    the table is the uninterrupted run's."""
    work = tmp_path / "work"
    said: list[str] = []

    def stop(message: str) -> None:
        said.append(message)
        if "layer 3/4 scored" in message:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        _table(tiny, work, progress=stop)
    said.clear()
    again = _table(tiny, work, progress=said.append)
    assert not any("forward pass" in m for m in said)
    assert [m.split(" scored")[0] for m in said] == ["sensitivity: layer 2/4", "sensitivity: layer 1/4"]
    for name, s in table.units.items():
        assert again.units[name].kl == pytest.approx(s.kl, rel=1e-9), name


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_expert_parallel_gives_the_same_table(tiny: Path, table, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Two gloo ranks (experts and batches dealt round-robin, MoE forward and backward collectives) score the
    same as one process."""
    port = _port()
    procs = []
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "QUANTKIT_DIST_TIMEOUT": "300",
               "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
        cmd = [sys.executable, "-m", "quantkit", "sensitivity", str(tiny), "--out", str(tmp_path / "S.json"),
               "--samples", "8", "--seq-len", "64", "--batch-size", "4", "--device", "cpu", "--quiet"]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=900) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    data = json.loads((tmp_path / "S.json").read_text())
    for name, s in table.units.items():
        got = data["units"][name]
        for fmt, kl in s.kl_fisher.items():
            assert got["kl_fisher"][fmt] == pytest.approx(kl, rel=1e-4), (name, fmt)
        for fmt, e in s.energy.items():
            assert got["energy"][fmt] == pytest.approx(e, rel=1e-4), (name, fmt)


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "2", "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "quantkit", *args], capture_output=True, text=True, env=env)


def test_budget_below_the_smallest_plan_exits_2_before_anything(tiny: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = _run("convert", str(tiny), str(out), "--max-size", "1MB")
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "below the smallest loadable plan" in lines[0] and "checkpoint size" in lines[0]
    assert not out.exists() and not out.with_name("out.partial").exists()
    assert not out.with_name("out.sensitivity").exists()


def test_max_size_plan_is_within_budget(tiny: Path, table, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """RTN under a budget of the uniform INT4 size: the output's shards fit, precision was moved (some unit above
    INT4 g32, some kept unit quantized), the recipe records the plan."""
    import yaml

    from quantkit.calibrate.sensitivity import write_table

    write_table(table, tmp_path / "S.json")
    uniform = tmp_path / "uniform"
    assert _run("convert", str(tiny), str(uniform), "--method", "rtn", "--quiet").returncode == 0
    size = sum(p.stat().st_size for p in uniform.glob("*.safetensors"))
    out = tmp_path / "mixed"
    proc = _run("convert", str(tiny), str(out), "--method", "rtn", "--max-size", str(size), "--sensitivity",
                str(tmp_path / "S.json"), "--json", "--quiet")
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert sum(p.stat().st_size for p in out.glob("*.safetensors")) <= size
    units = yaml.safe_load((out / "quantkit_recipe.yaml").read_text())["units"]
    assert units == summary["budget"]["units"]
    assert units["layers.0.experts"] == "int8-g128"
    assert any(f not in ("bf16",) for u, f in units.items() if u.endswith(".shared_experts"))
    # quantkit.json lists each unit's format with its predicted KL; the table travels with the output
    from quantkit.checkpoint.manifest import verify_manifest

    record = json.loads((out / "quantkit.json").read_text())
    rows = {r["unit"]: r for r in record["precision"]["units"]}
    assert rows["layers.0.experts"]["format"] == "int8-g128"
    predicted = summary["budget"]["predicted_kl"]["layers.0.experts"]
    assert rows["layers.0.experts"]["predicted_kl"] == pytest.approx(predicted)
    assert record["budget"]["limit_bytes"] == size and record["budget"]["sensitivity"] == "quantkit_sensitivity.json"
    assert json.loads((out / "quantkit_sensitivity.json").read_text())["schema"] == "quantkit-sensitivity/1"
    assert verify_manifest(out).ok


def test_table_of_another_model_is_refused(table, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from quantkit.plan.catalog import get_gpu
    from quantkit.plan.frontier import frontier_report
    from quantkit.plan.models import resolve_model
    from quantkit.plan.planner import Deployment

    with pytest.raises(QuantkitError, match="measure it on this model"):
        frontier_report(resolve_model("glm-5.2"), Deployment(get_gpu("h200"), 8), "bf16", table)


def test_fewer_checkpoints_same_table(tiny: Path, table, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Keeping every other layer boundary (the rest recomputed from the checkpoint below) changes nothing."""
    sparse = _table(tiny, tmp_path / "work", checkpoint_every=2)
    for name, s in table.units.items():
        assert sparse.units[name].kl == pytest.approx(s.kl, rel=1e-9), name
