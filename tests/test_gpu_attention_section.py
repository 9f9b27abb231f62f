"""bench/gpu_sections/attention.py (issue 28) runs its CPU smoke path: the pool upcast and SGLang's Triton MLA decode
kernel (under the Triton interpreter) at tiny sizes, each row carrying the planner's prediction."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_attention_section_smoke(tmp_path: Path) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_sections" / "attention.py"), "--smoke", "--out",
                           str(tmp_path)], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads((tmp_path / "attention.json").read_text())
    assert data["status"] == "ok", data
    pool = data["figures"]["pool_upcast"]
    assert pool and all(r["upcast_us"] > 0 and r["predicted_us"] > 0 for r in pool)
    rows = data["figures"]["triton_mla"]
    assert {(r["kv"], r["batch"]) for r in rows} == {("bf16", 1), ("bf16", 2), ("fp8", 1), ("fp8", 2)}
    assert all(r["us"] > 0 and r["predicted_us"] > 0 and r["splits"] >= 1 for r in rows)
    assert "measured / model" in proc.stdout
