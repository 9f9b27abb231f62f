"""`quantkit sensitivity` as a function: a source, calibration data and candidate formats -> the table.

Wires the sensitivity pass (sensitivity.py) to the model's quantization units and the candidate formats'
fake quantizers; what a unit is and how each format rounds are the formats' own definitions.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from quantkit.calibrate.moe import ExpertMoE
from quantkit.calibrate.sensitivity import SensitivityOptions, run_sensitivity
from quantkit.calibrate.sensitivity_layer import FakeQuant, LayerUnits, UnitSpec
from quantkit.calibrate.sensitivity_table import SensitivityTable
from quantkit.checkpoint.source import SourceCheckpoint, open_source
from quantkit.core.distributed import SINGLE, World
from quantkit.core.errors import QuantkitError

__all__ = ["DEFAULT_FORMATS", "FAKE", "fits", "sensitivity_of", "units_of"]

# the candidates scored by default: every computed format a per-unit plan may use on Hopper and Blackwell
# alike (kept BF16 / FP8-block predict 0; NVFP4A16 is added for Blackwell targets with --formats)
DEFAULT_FORMATS = ("int4-g32", "int4-g64", "int4-g128", "int8-g128")
_PROJS = ("gate_proj", "up_proj", "down_proj")


def _group(name: str) -> tuple[int, int]:
    """(bits, group) of an INT format name `intB-gN`."""
    try:
        bits, group = name.removeprefix("int").split("-g")
        return int(bits), int(group)
    except ValueError:
        raise QuantkitError(f"unknown candidate format {name!r} (known: {', '.join(DEFAULT_FORMATS)})") from None


def FAKE(name: str) -> FakeQuant:  # noqa: N802 - a table of functions, named like one
    """The fake quantizer of a candidate format (the values the writer stores, in fp32)."""
    from quantkit.quant.int4 import dequantize_group, quantize_rtn

    bits, group = _group(name)

    def fq(w: torch.Tensor) -> torch.Tensor:
        if bits == 4:
            q, s = quantize_rtn(w, group)
            return dequantize_group(q, s, group)
        x = w.float().to(torch.bfloat16).float().unflatten(-1, (-1, group))
        half = 2 ** (bits - 1)
        s = (x.abs().amax(-1, keepdim=True) / (half - 0.5)).to(torch.bfloat16).float()
        s = torch.where(s == 0, torch.finfo(torch.bfloat16).eps, s)
        return (torch.round(x / s).clamp(-half, half - 1) * s).flatten(-2)

    return fq


def fits(name: str, shape: tuple[int, int]) -> bool:
    """Whether format `name` can store a `[out, in]` weight (its group divides the input size)."""
    bits, group = _group(name)
    return shape[1] % group == 0 and shape[1] % (32 // bits) == 0


def units_of(source: SourceCheckpoint) -> Callable[[int, nn.Module], LayerUnits]:
    """The units of each decoder layer of `source`, with their Linears inside the built layer."""
    from quantkit.arch import KVLayout

    cfg = source.config
    mla = source.adapter.kv_layout != KVLayout.GQA
    attn = ("q_b_proj", "o_proj") if mla else ("q_proj", "k_proj", "v_proj", "o_proj")

    def of(layer: int, module: nn.Module) -> LayerUnits:
        def shapes(names: tuple[str, ...]) -> tuple[tuple[tuple[int, int], int], ...]:
            return tuple((tuple(module.get_submodule(n).weight.shape), 1) for n in names)  # type: ignore[misc]

        names = tuple(f"self_attn.{n}" for n in attn if hasattr(module.self_attn, n))
        units = {f"layers.{layer}.attention": UnitSpec("attention", names, shapes(names))}
        if isinstance(module.mlp, ExpertMoE):
            hidden, inter = int(cfg.get("hidden_size")), int(cfg.get("moe_intermediate_size"))
            n = len(module.mlp.experts)
            units[f"layers.{layer}.experts"] = UnitSpec(
                "experts", (), (((inter, hidden), 2 * n), ((hidden, inter), n)))
            if module.mlp.shared_experts is not None:
                names = tuple(f"mlp.shared_experts.{p}" for p in _PROJS)
                units[f"layers.{layer}.shared_experts"] = UnitSpec("shared_experts", names, shapes(names))
        else:
            names = tuple(f"mlp.{p}" for p in _PROJS)
            units[f"layers.{layer}.mlp"] = UnitSpec("mlp", names, shapes(names))
        return LayerUnits(units)

    return of


def sensitivity_of(src: Path, calib: str | Path, work_dir: Path, samples: int = 128, seq_len: int = 2048,
                   draws: int = 1, formats: tuple[str, ...] = DEFAULT_FORMATS, batch_size: int = 8,
                   checkpoint_every: int = 1, device: str | None = None, world: World = SINGLE,
                   progress: Callable[[str], None] | None = None, seed: int = 0) -> SensitivityTable:
    """Score every unit of the checkpoint at `src` in every format of `formats` on `samples` windows of
    `seq_len` tokens of `calib` (resumable in `work_dir`)."""
    from transformers import AutoTokenizer

    from quantkit.calibrate.data import calibration_tokens

    source = open_source(src)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(source.root))
    except Exception as exc:
        raise QuantkitError(f"{source.root}: cannot load the tokenizer for calibration ({exc})") from None
    tokens = calibration_tokens(calib, tokenizer, samples, seq_len, seed)
    for f in formats:
        _group(f)
    opts = SensitivityOptions({f: FAKE(f) for f in formats}, units_of(source), fits=fits, draws=draws,
                              batch_size=batch_size, checkpoint_every=checkpoint_every, seed=seed, device=device,
                              tokens=tokens, extra={"calibration": str(calib)})
    return run_sensitivity(source, work_dir, opts, progress, world)
