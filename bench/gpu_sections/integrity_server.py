"""GPU check section (issue 27): decode throughput of a real SGLang server with the KV integrity plugin off and on.

    run(ctx, rep)     # from the GPU check's driver (bench/gpu_check.py style: ctx.smoke, ctx.work, ctx.budget;
                      # rep.figures / rep.notes / rep.device / rep.save())
    python bench/gpu_sections/integrity_server.py --smoke --out DIR     # the CPU smoke path, standalone

What it runs: ``python -m sglang.launch_server`` on a toy Llama (a ~1B config written here, ``--load-format dummy``,
no tokenizer: ``--skip-tokenizer-init``), the overlap scheduler and CUDA graphs on (SGLang's defaults), twice: once
plain, once with ``QUANTKIT_KV_INTEGRITY=tags`` and ``SGLANG_PLUGINS=quantkit_kv_integrity`` (quantkit from this
checkout via ``PYTHONPATH``; its ``sglang.srt.plugins`` entry point from a scratch ``.dist-info`` when quantkit is
not installed there). For batch 1, 32 and 128: ``batch`` concurrent ``/generate`` requests of 32 prompt tokens and
256 new tokens (``ignore_eos``), three rounds; decode tokens per second = new tokens / wall time of a round.
Reported per batch: median tok/s off and on and the loss in percent (target < 1%, the production report's
0.38-0.79%), plus the plugin's registration line from the server's log (proof that the "on" server ran it).

``--smoke`` (no GPU, no server): writes the toy model and the entry point, builds both command lines, and checks in
a subprocess that SGLang's own ``load_plugins()`` registers the plugin's hooks with that environment (SGLang's
source tree and the engine stubs, as the tests run it); no throughput figure (they would not be measurements).
"""

from __future__ import annotations

import concurrent.futures
import importlib.util
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Protocol

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "bench")]
BATCHES = (1, 32, 128)
ROUNDS, PROMPT, NEW_TOKENS = 3, 32, 256
TARGET_PCT = 1.0
TOY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048, "intermediate_size": 5632,
       "num_attention_heads": 16, "num_key_value_heads": 16, "num_hidden_layers": 16, "vocab_size": 32000,
       "max_position_embeddings": 4096, "torch_dtype": "bfloat16", "rms_norm_eps": 1e-5, "rope_theta": 10000.0}
PLUGIN_LINE = "quantkit KV page integrity:"

from gpu_sections.common import SectionData, Skip  # noqa: E402  (a section that cannot run here is "skipped")


class Ctx(Protocol):
    smoke: bool
    work: Path

    def remaining(self, margin: float = 0.0) -> float: ...


class Rep(Protocol):
    device: str
    notes: list[str]
    figures: dict[str, object]

    def save(self) -> None: ...


def _toy_model(work: Path) -> Path:
    model = work / "toy-llama-1b"
    model.mkdir(parents=True, exist_ok=True)
    (model / "config.json").write_text(json.dumps(TOY))
    return model


def _entry_point(work: Path) -> Path | None:
    """A scratch distribution carrying quantkit's plugin entry point, unless quantkit is installed (then None)."""
    from importlib.metadata import entry_points

    if any(ep.name == "quantkit_kv_integrity" for ep in entry_points(group="sglang.srt.plugins")):
        return None
    dist = work / "plugin-dist" / "quantkit_gpu_check-0.0.dist-info"
    dist.mkdir(parents=True, exist_ok=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: quantkit-gpu-check\nVersion: 0.0\n")
    (dist / "entry_points.txt").write_text(
        "[sglang.srt.plugins]\nquantkit_kv_integrity = quantkit.serving.integrity.sglang:register\n")
    return dist.parent


def _env(plugin: bool, dist: Path | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("QUANTKIT_KV_INTEGRITY", "SGLANG_PLUGINS")}
    paths = [str(REPO), *([str(dist)] if dist else []), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    if plugin:
        env["QUANTKIT_KV_INTEGRITY"] = "tags"
        env["SGLANG_PLUGINS"] = "quantkit_kv_integrity"
    return env


def _command(model: Path, port: int) -> list[str]:
    return [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model), "--load-format", "dummy",
            "--skip-tokenizer-init", "--port", str(port), "--host", "127.0.0.1", "--mem-fraction-static", "0.6",
            "--max-running-requests", str(max(BATCHES)), "--log-level", "info"]  # fmt: skip


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _post(port: int, body: dict[str, object], timeout: float) -> dict[str, object]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/generate", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def _wait_ready(proc: subprocess.Popen[bytes], port: int, deadline: float) -> None:
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before it was ready")
        try:
            _post(port, {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1}}, 10)
            return
        except OSError:
            time.sleep(2)
    raise TimeoutError("the server was not ready in time")


def _rounds(port: int, batch: int) -> list[float]:
    """Decode tokens per second of ``ROUNDS`` rounds of ``batch`` concurrent requests."""
    body = {"input_ids": list(range(100, 100 + PROMPT)),
            "sampling_params": {"max_new_tokens": NEW_TOKENS, "ignore_eos": True, "temperature": 0.0}}
    out = []
    with concurrent.futures.ThreadPoolExecutor(batch) as pool:
        for _ in range(ROUNDS):
            t0 = time.perf_counter()
            done = list(pool.map(lambda _: _post(port, body, 600), range(batch)))
            elapsed = time.perf_counter() - t0
            tokens = sum(len(r.get("output_ids") or []) for r in done)
            out.append(tokens / elapsed)
    return out


def _serve(model: Path, plugin: bool, dist: Path | None, ctx: Ctx, log: Path) -> dict[str, object]:
    port = _free_port()
    with open(log, "wb") as sink:
        proc = subprocess.Popen(_command(model, port), env=_env(plugin, dist), stdout=sink, stderr=subprocess.STDOUT)
        try:
            _wait_ready(proc, port, time.monotonic() + min(300.0, ctx.remaining(30)))
            _rounds(port, 1)  # warm-up
            return {str(b): statistics.median(_rounds(port, b)) for b in BATCHES}
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()


def _registered(log: Path) -> str | None:
    lines = [line for line in log.read_text(errors="replace").splitlines() if PLUGIN_LINE in line]
    return lines[-1].strip() if lines else None


def _smoke(ctx: Ctx, rep: Rep, model: Path, dist: Path | None) -> None:
    """No server on a CPU: the commands, and SGLang's own ``load_plugins()`` with the "on" environment."""
    rep.figures["command"] = _command(model, 0)  # the same for off and on; only the environment differs
    probe = ("import logging, sys; logging.basicConfig(level=logging.INFO, stream=sys.stdout)\n"
             "from quantkit.serving.integrity.sglang_env import load_sglang; load_sglang()\n"
             "import sglang.srt.plugins as p; p.load_plugins()\n"
             "from quantkit.serving.integrity import sglang as q; print('REGISTERED', q.state().registered)\n")
    proc = subprocess.run([sys.executable, "-c", probe], env=_env(True, dist), capture_output=True, text=True,
                          timeout=max(30.0, ctx.remaining(5)), cwd=REPO)  # fmt: skip
    text = proc.stdout + proc.stderr
    rep.figures["plugin_registered"] = "REGISTERED True" in text
    rep.figures["registration_line"] = next((ln.strip() for ln in text.splitlines() if PLUGIN_LINE in ln), None)
    rep.notes.append("smoke: no SGLang server on a CPU; decode throughput figures are pending a GPU")
    if not rep.figures["plugin_registered"]:
        raise RuntimeError(f"load_plugins() did not register the plugin: {text[-800:]}")


def run(ctx: Ctx, rep: Rep) -> None:
    work = Path(ctx.work)
    model, dist = _toy_model(work), _entry_point(work)
    if ctx.smoke:
        rep.device = "cpu"
        _smoke(ctx, rep, model, dist)
        rep.save()
        return
    import torch

    if not torch.cuda.is_available():
        raise Skip("no CUDA device visible to torch (use --smoke on a CPU machine)")
    missing = [m for m in ("sglang", "sgl_kernel") if importlib.util.find_spec(m) is None]
    if missing:
        raise Skip(f"missing package(s): {', '.join(missing)} (a real SGLang server needs them on the GPU machine)")
    rep.device = torch.cuda.get_device_name(0)
    rep.figures.update({"model": TOY, "prompt_tokens": PROMPT, "new_tokens": NEW_TOKENS, "rounds": ROUNDS,
                        "target_loss_pct": TARGET_PCT})  # fmt: skip
    runs: dict[str, dict[str, object]] = {}
    for name, plugin in (("off", False), ("on", True)):
        log = work / f"server-{name}.log"
        runs[name] = _serve(model, plugin, dist, ctx, log)
        if plugin:
            rep.figures["registration_line"] = _registered(log)
            if rep.figures["registration_line"] is None:
                raise RuntimeError("the 'on' server never registered the plugin (see its log)")
        rep.figures["tok_s"] = runs
        rep.save()
    rep.figures["rows"] = [{"batch": b, "off_tok_s": runs["off"][str(b)], "on_tok_s": runs["on"][str(b)],
                            "loss_pct": 100 * (1 - runs["on"][str(b)] / runs["off"][str(b)])} for b in BATCHES]
    rep.figures["pass"] = all(r["loss_pct"] < TARGET_PCT for r in rep.figures["rows"])
    rep.save()


def summary_lines(sec: SectionData) -> list[str]:
    """Decode tok/s per batch with the plugin off and on, and the loss against the < 1% target."""
    figures = sec["figures"]
    rows = figures.get("rows", [])
    if not rows:
        return [f"Plugin registered: {figures.get('plugin_registered', '-')}; no throughput figure (smoke run or "
                "skipped)."]
    lines = [f"Target: loss < {TARGET_PCT:g}% of decode tok/s; pass: {figures.get('pass')}.", "",
             "| batch | off tok/s | on tok/s | loss % |", "|---:|---:|---:|---:|"]
    lines += [f"| {r['batch']} | {r['off_tok_s']:.1f} | {r['on_tok_s']:.1f} | {r['loss_pct']:.2f} |" for r in rows]
    return lines


def main() -> int:
    import argparse
    import tempfile
    import types

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        start = time.monotonic()
        ctx = types.SimpleNamespace(smoke=a.smoke, work=Path(tmp),
                                    remaining=lambda m=0.0: 900 - (time.monotonic() - start) - m)
        rep = types.SimpleNamespace(device="unknown", notes=[], figures={}, status="running")
        rep.save = lambda: (a.out / "integrity_server.json").write_text(json.dumps(
            {"status": rep.status, "device": rep.device, "notes": rep.notes, "figures": rep.figures}, indent=2))
        try:
            run(ctx, rep)
            rep.status = "ok"
        except Skip as exc:
            rep.status, rep.notes = "skipped", [*rep.notes, str(exc)]
        rep.save()
    print(f"integrity_server: {rep.status}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
