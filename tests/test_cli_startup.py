"""A CLI that starts fast: `--help`, every subcommand's `--help`, usage errors, `plan` of a config and a
refused `inspect`/`validate` never import torch, transformers, compressed-tensors or an engine, and
`quantkit --help` / `quantkit pull --help` cost well under a CPU-second (measured on the child process,
not wall time, so a busy machine does not make it flaky)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
HEAVY = ("torch", "transformers", "compressed_tensors", "llmcompressor", "sglang", "vllm", "triton",
         "huggingface_hub", "safetensors", "matplotlib")

# Runs each argument list through the real entry point in ONE child process; after each, which heavy
# modules are loaded (they stay loaded, so the first command that pulls one in is the one named).
_PROBE = r"""
import json, sys
from quantkit.cli import app, main
import typer.main

report_path, extra = sys.argv[1], json.loads(sys.argv[2])


def walk(cmd, prefix):
    subs = getattr(cmd, "commands", None)
    if subs is None:
        yield prefix
        return
    for name, sub in sorted(subs.items()):
        yield from walk(sub, [*prefix, name])

runs = [["--help"]] + [[*p, "--help"] for p in walk(typer.main.get_command(app), [])] + extra
result = []
for args in runs:
    sys.argv = ["quantkit", *args]
    try:
        main()
        code = 0
    except SystemExit as exc:
        code = exc.code
    result.append([args, code, sorted(m for m in HEAVY if m in sys.modules)])
with open(report_path, "w") as fh:
    json.dump(result, fh)
"""


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}


def test_help_usage_errors_and_plan_never_import_torch(tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text("{ not json")
    extra = [
        ["convert", "--no-such-option"], ["convert"], ["convert", "a", "b", "--workers", "many"], ["no-such-command"],
        ["pull"], ["plan", "--tp", "x", "glm-5.2"],
        ["plan", "glm-5.2"], ["plan", str(REPO / "quantkit/plan/configs/glm-5.2/config.json"), "--json"],
        ["inspect", str(bad)], ["inspect", str(tmp_path / "missing")], ["validate", str(tmp_path / "missing")],
    ]
    report = tmp_path / "report.json"
    probe = f"HEAVY = {HEAVY!r}\n" + _PROBE
    proc = subprocess.run([sys.executable, "-c", probe, str(report), json.dumps(extra)], capture_output=True,
                          text=True, timeout=120, env=_env(), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    runs = json.loads(report.read_text())
    assert len(runs) >= 15 + len(extra)  # --help, 14 commands' --help at least, and the extra cases
    for args, code, heavy in runs:
        assert heavy == [], f"`quantkit {' '.join(args)}` imported {heavy}"
        expected = 2 if args[-1] != "--help" and args[:2] != ["plan", "glm-5.2"] and "--json" not in args else 0
        assert code == expected, (args, code)


@pytest.mark.parametrize("args", [["--help"], ["pull", "--help"]])
def test_help_costs_well_under_a_cpu_second(args):
    """CPU seconds of the child (user + system, from wait4), not wall time."""
    proc = subprocess.Popen([sys.executable, "-m", "quantkit", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=_env())
    _, status, usage = os.wait4(proc.pid, 0)
    out = proc.stdout.read().decode() if proc.stdout else ""
    proc.returncode = os.waitstatus_to_exitcode(status)
    assert proc.returncode == 0 and "Usage" in out
    cpu = usage.ru_utime + usage.ru_stime
    assert cpu < 1.0, f"`quantkit {' '.join(args)}` took {cpu:.2f} CPU-s"
