"""The tiny GLM-4.x MoE model variants the real-engine tests serve: source, quantkit's INT4 conversions
(RTN, GPTQ), a deliberately damaged INT4 checkpoint, and the dequantized twin for transformers."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]


def convert(src: Path, out: Path, method: str) -> Path:
    """`quantkit convert` (the CLI, as a user runs it); GPTQ calibrates on a small slice of the corpus."""
    if (out / "quantkit.json").exists():
        return out
    cmd = [sys.executable, "-m", "quantkit", "convert", str(src), str(out), "--method", method, "--group-size", "32"]
    if method == "gptq":
        cmd += ["--samples", "64", "--seq-len", "128"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "2"}
    subprocess.run(cmd, check=True, capture_output=True, env=env)
    return out


def scramble_experts(src: Path, out: Path, layer: int = 2) -> Path:
    """A copy of INT4 checkpoint `src` whose `layer` has its routed experts rotated by one (expert e's
    tensors stored under e+1's names): same names, shapes and dtypes, so it loads and serves — wrongly."""
    from safetensors.torch import load_file, save_file

    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(src, out)
    (out / "SHA256SUMS").unlink(missing_ok=True)
    n = json.loads((src / "config.json").read_text())["n_routed_experts"]
    prefix = f"model.layers.{layer}.mlp.experts."
    changed = 0
    for shard in sorted(out.glob("*.safetensors")):
        tensors = load_file(shard)
        moved = {}
        for name, t in tensors.items():
            if name.startswith(prefix):
                e, rest = name[len(prefix):].split(".", 1)
                moved[f"{prefix}{(int(e) + 1) % n}.{rest}"] = t
                changed += 1
            else:
                moved[name] = t
        save_file(moved, str(shard), metadata={"format": "pt"})
    assert changed, f"no routed experts of layer {layer} in {src}"
    return out


def dequantized_twin(int4: Path) -> torch.nn.Module:
    """transformers' model (fp32) of INT4 checkpoint `int4`, dequantized by quantkit's reader, with the expert
    weights rounded to bf16 as vLLM's int4 emulation stores them (q * scale is exact in fp32, so this is
    the same correctly rounded value vLLM computes in bf16)."""
    from quantkit.calibrate.eval import load_model

    model = load_model(int4)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".experts." in name:
                p.copy_(p.to(torch.bfloat16).float())
    return model
