"""`quantkit sensitivity` as a function: a source, calibration data and candidate formats -> the table.

Wires the sensitivity pass (sensitivity.py) to the model's quantization units and the candidate formats'
fake quantizers; what a unit is and how each format rounds are the formats' own definitions.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from torch import nn

from quantkit.calibrate.sensitivity import SensitivityOptions, run_sensitivity
from quantkit.calibrate.sensitivity_layer import FakeQuant, LayerUnits, UnitSpec
from quantkit.calibrate.sensitivity_table import SensitivityTable
from quantkit.checkpoint.source import SourceCheckpoint, open_source
from quantkit.core.distributed import SINGLE, World
from quantkit.core.errors import QuantkitError
from quantkit.quant.scheme import FORMATS, FormatName, get_format
from quantkit.quant.units import Unit, list_units, unit_of

__all__ = ["DEFAULT_FORMATS", "FAKE", "fits", "sensitivity_of", "units_of"]

# the candidates scored by default: every computed format a per-unit plan may use on Hopper and Blackwell
# alike (kept BF16 / FP8-block predict 0; NVFP4A16 is scored for Blackwell targets with --formats)
DEFAULT_FORMATS: tuple[FormatName, ...] = ("int4-g32", "int4-g64", "int4-g128", "int8-g128")
_PROJS = ("gate_proj", "up_proj", "down_proj")


def _computed(name: str) -> FormatName:
    fmt = get_format(name)
    if not fmt.computed or not fmt.mixable:
        raise QuantkitError(f"sensitivity: format {name} is not a candidate to score (kept formats predict 0; "
                            f"scored: {', '.join(n for n, f in FORMATS.items() if f.computed and f.mixable)})")
    return fmt.name


def FAKE(name: str) -> FakeQuant:  # noqa: N802 - a table of functions, named like one
    """The fake quantizer of a candidate format: the values the writer stores (RTN), in fp32."""
    return get_format(name).fake_quantize


def fits(name: str, shape: tuple[int, int]) -> bool:
    """Whether format `name` can store a `[out, in]` weight."""
    try:
        get_format(name).check_shape(shape, "weight")
    except QuantkitError:
        return False
    return True


def units_of(source: SourceCheckpoint) -> Callable[[int, nn.Module], LayerUnits]:
    """The units of each decoder layer of `source` (quant/units.py), with their Linears in the built layer."""
    by_layer: dict[int, list[Unit]] = {}
    for u in list_units(source.adapter):
        if not u.mtp:
            by_layer.setdefault(u.layer, []).append(u)

    def of(layer: int, module: nn.Module) -> LayerUnits:
        units = {}
        for u in by_layer.get(layer, []):
            if u.kind == "experts":
                names: tuple[str, ...] = ()
            elif u.kind == "attention":  # the unit's members (quant/units.py decides which projections)
                base = f"{source.adapter.prefix}model.layers.{layer}.self_attn."
                names = tuple(f"self_attn.{n}" for n, m in module.self_attn.named_children()
                              if isinstance(m, nn.Linear) and unit_of(source.adapter, base + n + ".weight") == u.name)
            elif u.kind == "shared_experts":
                names = tuple(f"mlp.shared_experts.{p}" for p in _PROJS)
            else:
                names = tuple(f"mlp.{p}" for p in _PROJS)
            units[u.name] = UnitSpec(u.kind, names, u.matrices)
        return LayerUnits(units)

    return of


def sensitivity_of(src: Path, calib: str | Path, work_dir: Path, samples: int = 128, seq_len: int = 2048,
                   draws: int = 1, formats: tuple[str, ...] = DEFAULT_FORMATS, batch_size: int = 8,
                   checkpoint_every: int = 0, device: str | None = None, world: World = SINGLE,
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
    formats = tuple(_computed(f) for f in formats)
    opts = SensitivityOptions({f: FAKE(f) for f in formats}, units_of(source), fits=fits, draws=draws,
                              batch_size=batch_size, checkpoint_every=checkpoint_every, seed=seed, device=device,
                              tokens=tokens, extra={"calibration": str(calib)})
    return run_sensitivity(source, work_dir, opts, progress, world)
