"""The GPU check section for issue 27 (`bench/gpu_sections/integrity_server.py`) in its CPU smoke mode: the toy
model and the command line are built, and SGLang's own `load_plugins()` registers the plugin with the environment
the "on" server gets (no server runs on a CPU; throughput figures are GPU-only)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SECTION = ROOT / "bench" / "gpu_sections" / "integrity_server.py"


def test_smoke_path_registers_the_plugin_through_sglangs_loader(tmp_path: Path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("QUANTKIT_KV_INTEGRITY", None)
    proc = subprocess.run([sys.executable, str(SECTION), "--smoke", "--out", str(tmp_path)], capture_output=True,
                          text=True, env=env, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads((tmp_path / "integrity_server.json").read_text())
    assert data["status"] == "ok" and data["figures"]["plugin_registered"] is True
    assert "hooks registered" in data["figures"]["registration_line"]
    command = data["figures"]["command"]
    assert command[1:3] == ["-m", "sglang.launch_server"] and "--load-format" in command
    assert "rows" not in data["figures"]  # no throughput figure from a CPU
