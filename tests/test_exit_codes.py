"""The exit-code contract at the CLI boundary: 0 done; 2 anything the user can fix (QuantkitError, click
usage errors caught by class, a full disk), one line; 130 interrupted; 1 an internal error, one line."""

from __future__ import annotations

import errno
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import quantkit.convert.pipeline
import quantkit.validate.checkpoint

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("args, needle", [
    (["convert", "--no-such-option"], "No such option"),
    (["convert"], "Missing argument"),
    (["convert", "a", "b", "--workers", "many"], "Invalid value for '--workers'"),
    (["convert", "a", "b", "--workers", "0"], "greater than or equal to 1"),
    (["no-such-command"], "No such command"),
])
def test_usage_errors_exit_2(cli, args, needle):
    code, _, err = cli(*args)
    assert code == 2 and needle in err and "Traceback" not in err, err


def test_internal_error_is_one_line_exit_1(cli, monkeypatch, ckpt_factory, tmp_path):
    def boom(*args, **kwargs):
        raise RuntimeError("a bug\nspanning lines")

    monkeypatch.setattr(quantkit.convert.pipeline, "convert", boom)
    code, _, err = cli("convert", str(ckpt_factory("glm_moe_dsa", "fp8")), str(tmp_path / "out"), "--quiet")
    assert code == 1 and err.strip() == "internal error: RuntimeError: a bug spanning lines"


def test_ctrl_c_is_130_with_a_resume_hint(cli, monkeypatch, ckpt_factory, tmp_path):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(quantkit.convert.pipeline, "convert", interrupted)
    code, _, err = cli("convert", str(ckpt_factory("glm_moe_dsa", "fp8")), str(tmp_path / "out"), "--quiet")
    assert code == 130 and "rerun the same command to resume" in err


def test_full_disk_outside_convert_is_exit_2(cli, monkeypatch, tmp_path):
    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "report.json"))

    monkeypatch.setattr(quantkit.validate.checkpoint, "validate_checkpoint", full)
    tmp_path.joinpath("out").mkdir()
    code, _, err = cli("validate", str(tmp_path / "out"))
    assert code == 2 and err.strip() == f"error: {tmp_path / 'report.json'}: no space left on device"


def test_validate_source_on_an_output_quantkit_did_not_write(ckpt_factory, tmp_path, cli):
    """Was: FileNotFoundError, exit 1. Now a failed check naming the missing quantkit.json, exit 2."""
    src = ckpt_factory("glm_moe_dsa", "bf16")
    out = tmp_path / "out"
    assert cli("convert", str(src), str(out), "--quiet")[0] == 0
    (out / "quantkit.json").unlink()  # what any other tool's output looks like
    code, stdout, err = cli("validate", str(out), "--source", str(src), "--json")
    assert code == 2 and "Traceback" not in err and "internal error" not in err
    checks = {c["name"]: c for c in json.loads(stdout)["checks"]}
    assert checks["source accounting"]["status"] == "fail"
    assert f"{out / 'quantkit.json'} is missing" in checks["source accounting"]["detail"]
    assert checks["files"]["status"] == "ok"  # the rest of the report is still there


_PEER = r"""
import sys
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
from llmcompressor import model_free_ptq
scheme = QuantizationScheme(targets=[r"re:.*mlp\.experts\.\d+\.(gate|up|down)_proj$"], weights=QuantizationArgs(
    num_bits=4, type="int", symmetric=True, strategy="group", group_size=32))
model_free_ptq(sys.argv[1], sys.argv[2], scheme=scheme, ignore=[], max_workers=1)
"""


@pytest.mark.slow
def test_validate_source_on_llm_compressor_output(ckpt_factory, tmp_path):
    """The same through the peer's real model_free_ptq output and a real quantkit process."""
    src = ckpt_factory("glm_moe_dsa", "bf16")
    peer = tmp_path / "peer"
    subprocess.run([sys.executable, "-c", _PEER, str(src), str(peer)], check=True, capture_output=True, timeout=600)
    proc = subprocess.run([sys.executable, "-m", "quantkit", "validate", str(peer), "--source", str(src), "--json"],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    checks = {c["name"]: c for c in json.loads(proc.stdout)["checks"]}
    assert "quantkit.json is missing" in checks["source accounting"]["detail"]
    shutil.rmtree(peer)
