"""Shared fixtures: synthetic checkpoints (real tensor names, real source formats) and an independent
fake-quantized reference built only from compressed-tensors and safetensors (no quantkit code)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from quantkit.checkpoint.synth import make_checkpoint

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def ckpt_factory(tmp_path_factory):
    """make(family, fmt, **kw) -> a cached synthetic checkpoint directory."""
    cache: dict[tuple, Path] = {}

    def make(family: str = "glm_moe_dsa", fmt: str = "fp8", **kw) -> Path:
        key = (family, fmt, tuple(sorted(kw.items())))
        if key not in cache:
            cache[key] = make_checkpoint(tmp_path_factory.mktemp(f"{family}-{fmt}"), family, fmt, **kw)
        return cache[key]

    return make


@pytest.fixture
def cli(capsys, monkeypatch):
    """Run `quantkit ARGS...` in-process through the real entry point; returns (exit code, stdout, stderr)."""
    from quantkit.cli import main

    def run(*args: str) -> tuple[int, str, str]:
        monkeypatch.setattr(sys, "argv", ["quantkit", *args])
        capsys.readouterr()
        try:
            main()
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        out, err = capsys.readouterr()
        return code, out, err

    return run
