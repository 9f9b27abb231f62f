"""Launch an engine runner (`run_sglang.py` / `run_vllm.py`) on a checkpoint in a fresh interpreter; its report.

Each runner imports the engine's unpacked wheel (`make engines` fetches them into `.cache/engines`), installs
the stubs of `stubs.py`, executes the engine's own config parsing, model construction and `load_weights`
for the given server args, and writes a JSON report (keys: engine, version, args, error, architecture,
methods, skipped_tensors, unloaded_params, kv, kv_cache_dtype, notes, draft).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Literal

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
ENGINES_DIR = REPO / ".cache" / "engines"
CT017 = ENGINES_DIR / "ct017"  # compressed-tensors 0.17.0, vLLM's pin (only on the vLLM runner's sys.path)
EngineName = Literal["sglang", "vllm"]
SOURCES: dict[EngineName, Path] = {"sglang": ENGINES_DIR / "src" / "sglang" / "sglang",
                                   "vllm": ENGINES_DIR / "src" / "vllm" / "vllm"}


class EngineRunError(RuntimeError):
    """The runner itself failed (not the engine: an engine error is reported in the JSON)."""


Run = tuple[str | os.PathLike[str], list[str] | tuple[str, ...]]  # (checkpoint, server args)


def _runner(engine: EngineName, runner_args: list[str], cwd: str, timeout: float) -> None:
    if not SOURCES[engine].is_dir():
        raise EngineRunError(f"{SOURCES[engine]} is missing: run `make engines` first")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    cmd = [sys.executable, str(HERE / f"run_{engine}.py"), *runner_args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)
    if proc.returncode != 0:
        raise EngineRunError(f"{engine} runner exited {proc.returncode}: {proc.stderr[-3000:]}")


def run_engine(engine: EngineName, ckpt: str | os.PathLike[str], args: list[str] | tuple[str, ...] = (),
               timeout: float = 600.0) -> dict[str, Any]:
    """Run `engine`'s loader on `ckpt` with server `args` in a new process; the parsed report."""
    with tempfile.TemporaryDirectory(prefix=f"{engine}-report-") as tmp:
        out = Path(tmp) / "report.json"
        _runner(engine, [str(ckpt), *args, "--out", str(out)], tmp, timeout)
        return json.loads(out.read_text())


def run_engine_batch(engine: EngineName, runs: list[Run], timeout: float = 1200.0) -> list[dict[str, Any]]:
    """Several runs in one runner process (`--batch`: the engine is imported once, each run is a forked
    child starting from that state); the reports, in order."""
    with tempfile.TemporaryDirectory(prefix=f"{engine}-batch-") as tmp:
        jobs = [{"ckpt": str(ckpt), "args": list(args), "out": str(Path(tmp) / f"{i}.json")}
                for i, (ckpt, args) in enumerate(runs)]
        (Path(tmp) / "jobs.json").write_text(json.dumps(jobs))
        _runner(engine, ["--batch", str(Path(tmp) / "jobs.json")], tmp, timeout)
        return [json.loads(Path(job["out"]).read_text()) for job in jobs]
