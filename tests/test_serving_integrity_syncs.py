"""Counted, not assumed: host synchronisations of clean decode steps through SGLang's own code, plugin on vs off.

`tests/engines/run_sglang_integrity_syncs.py` runs SGLang 0.5.23's `prepare_for_decode`, the forward's result,
`copy_to_cpu` (overlap ordering) and `process_batch_result_decode` + streaming, at page sizes 1, 16 and 64, once
with the plugin loaded by SGLang's `load_plugins()` and once in a process where it is not; the counter
(`tests/engines/sync_count.py`) sees every operation that would make the host wait for a GPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RUNNER = ROOT / "tests" / "engines" / "run_sglang_integrity_syncs.py"
SGLANG = ROOT / ".cache" / "engines" / "src" / "sglang" / "sglang"
STEPS = 24


def _run(tmp: Path, mode: str) -> dict:
    if not SGLANG.is_dir():
        pytest.fail(f"{SGLANG} is missing: run `make engines` first")
    out = tmp / f"syncs-{mode}.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    env.pop("QUANTKIT_KV_INTEGRITY", None)
    proc = subprocess.run([sys.executable, str(RUNNER), str(out), mode, str(STEPS)], capture_output=True, text=True,
                          env=env, timeout=900)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def counts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    tmp = tmp_path_factory.mktemp("integrity-syncs")
    return {mode: _run(tmp, mode) for mode in ("on", "off")}


def test_clean_decode_steps_add_no_host_sync(counts):
    on, off = counts["on"], counts["off"]
    assert [(c["page_size"], c["ordering"]) for c in on["clean"]] == [
        (ps, o) for ps in (1, 16, 64) for o in ("non_overlap", "overlap")]
    for c_on, c_off in zip(on["clean"], off["clean"], strict=True):
        # the plugin ran (one check per step) and a request finished inside the window (release, tree, frees)
        assert c_on["checks"] == STEPS and c_on["finished"] >= 1 and c_on["aborts"] == 0, c_on
        assert c_off["checks"] == 0 and c_off["finished"] == c_on["finished"], c_off
        # zero in the plugin's frames, and SGLang itself does not synchronise more because the plugin is there
        assert c_on["plugin"] == 0, c_on["plugin_events"]
        assert c_on["sglang"] == c_off["sglang"] > 0, (c_on["sglang_events"], c_off["sglang_events"])
        assert c_on["sglang_events"] == c_off["sglang_events"]


def test_the_counter_sees_what_a_test_adds_to_the_plugins_step(counts):
    injected = counts["on"]["controls"]["injected"]
    kinds = {line.split(" ", 2)[2].split(" @ ")[0]: int(line.split(" ")[1]) for line in injected["events"]}
    assert kinds == {"host read: __bool__": STEPS, "host tensor indexes a device tensor (blocking upload)": STEPS,
                     "boolean-mask indexing (nonzero)": STEPS}, injected["events"]


def test_the_abort_path_reads_the_device_and_is_counted(counts):
    fault = counts["on"]["controls"]["fault"]
    assert fault["aborts"] == 1 and fault["victim_finished"], fault
    assert fault["plugin"] > 0 and any("explain" in line for line in fault["events"]), fault["events"]
