"""Validating a per-unit (mixed-precision) checkpoint: every module against the config group the engines give it.

A uniform checkpoint has one group targeting `Linear` (`quantkit.validate.checkpoint`); a mixed one has one group
per format with per-layer `re:` targets. Each Linear's group is found the way SGLang and vLLM find it
(`quantkit.checkpoint.qconfig.group_of_module`: ignore list, then names, then `Linear`), and then:
- the config parses with compressed-tensors and every group is a format quantkit writes, the top-level format
  the engines need (`pack-quantized` beside FP8 groups);
- each quantized module holds the tensors of its group's format with the shapes its bits and group imply
  (packed width, scale grid), each kept Linear is ignored, every module of a unit has the unit's format;
- a spread-out sample decompresses through compressed-tensors' own decompressor, with its own group's scheme;
- per-rank divisibility for TP 1..8 with each module's own group.
"""

from __future__ import annotations

import torch

from quantkit.arch import Adapter, Role, get_adapter
from quantkit.checkpoint.qconfig import format_of_group, group_of_module, is_ignored, unit_formats_of_config
from quantkit.core.jsontypes import JSONObject
from quantkit.quant.scheme import FORMATS, FormatName, WeightFormat
from quantkit.quant.units import list_units, unit_of
from quantkit.validate.report import Output, ValidationReport
from quantkit.validate.shapes import PackedShape, tp_fit_problems

__all__ = ["check_mixed"]

_SKIP = (Role.EMBEDDING, Role.NORM, Role.ROUTER)


def check_mixed(out: Output, report: ValidationReport, sample: int) -> list[str]:
    """Run the format and engine-rule checks of a per-unit checkpoint; returns its packed (INT / FP4) modules."""
    qc: JSONObject = out.config.get("quantization_config") or {}
    adapter = get_adapter(out.config)
    report.add("quantization_config", _qconfig_problems(qc), f"{len(qc.get('config_groups') or {})} per-unit groups, "
               f"format {qc.get('format')!r}")
    formats: dict[str, FormatName | None] = {}  # module -> the format its group says
    linear: dict[str, str] = {}  # module -> the format its tensors say
    for name, (_, entry) in out.tensors.items():
        module, _, param = name.rpartition(".")
        role = adapter.classify(name).role
        if role in _SKIP or not (param == "weight_packed" or (param == "weight" and len(entry.shape) == 2)):
            continue
        formats[module] = format_of_group(group_of_module(qc, module))
        linear[module] = "packed" if param == "weight_packed" else ("fp8" if entry.dtype == "F8_E4M3" else "bf16")
    problems = []
    for module, stored in sorted(linear.items()):
        fmt = formats[module]
        if fmt is None:
            problems.append(f"{module}: its config group is not a format quantkit writes")
            continue
        problems += _module_problems(out, module, FORMATS[fmt], stored, is_ignored(qc, module))
    units: dict[str, set[FormatName | None]] = {}
    for module in linear:
        unit = unit_of(adapter, module)
        if unit is not None:
            units.setdefault(unit, set()).add(formats[module])
    problems += [f"unit {u}: its modules have several formats {sorted(map(str, f))}; engines take one per unit"
                 for u, f in sorted(units.items()) if len(f) > 1]
    config_units = unit_formats_of_config(qc, adapter, [u for u in list_units(adapter) if u.name in units])
    problems += [f"unit {u}: the engines' lookup gives {config_units[u]}, its modules {sorted(map(str, f))}"
                 for u, f in sorted(units.items()) if len(f) == 1 and config_units.get(u) not in f]
    report.add("quantized modules", problems, f"{len(linear)} Linear modules match their groups; "
               f"{len(units)} units, one format each")
    packed = sorted(m for m, s in linear.items() if s == "packed")
    report.add("decompression", _decompress_problems(out, qc, packed, sample),
               f"{min(sample, len(packed))} sampled modules decompress with compressed-tensors to finite weights")
    report.add("Marlin / MoE shapes", _shape_problems(out, adapter, packed, formats, report),
               f"each module's group divides every per-rank shape up to TP {report.facts.get('max_tp')}")
    return packed


def _qconfig_problems(qc: JSONObject) -> list[str]:
    from compressed_tensors.quantization import QuantizationConfig

    try:
        QuantizationConfig.model_validate(qc)
    except Exception as exc:  # pydantic's ValidationError and friends
        return [f"does not parse with compressed-tensors: {str(exc).splitlines()[0]}"]
    groups = qc.get("config_groups") or {}
    problems = [f"{g}: not a format quantkit writes" for g, v in groups.items() if format_of_group(v) is None]
    kinds = {FORMATS[f].ct_format for f in (format_of_group(v) for v in groups.values()) if f is not None}
    top = qc.get("format")
    if len(kinds) > 1 and top != "pack-quantized":
        problems.append(f"top-level format {top!r} beside INT groups: SGLang's WNA16 MoE accepts only "
                        "'pack-quantized' there (compressed_tensors_wNa16_moe.py)")
    return problems


def _module_problems(out: Output, module: str, fmt: WeightFormat, stored: str, ignored: bool) -> list[str]:
    if not fmt.quantized:  # no group: ignored, or matched by nothing
        if stored != "bf16":
            return [f"{module} is {stored} but matches the ignore list"]
        return [] if ignored else [f"{module} is unquantized but not ignored: SGLang raises 'Unable to find "
                                   "matching target'"]
    want = {"int": "packed", "fp4": "packed", "fp8": "fp8"}[fmt.kind]
    if stored != want:
        return [f"{module}: its group is {fmt.name} but it is stored as {stored}"]
    names = {"packed": "weight_packed", "fp8": "weight"}
    rows, cols = _logical_shape(out, module, names[stored], fmt)
    expected = {f"{module}.{suffix}": shape for suffix, _, shape in fmt.stored((rows, cols))}
    bad = [n for n, shape in expected.items() if n not in out.tensors or tuple(out.tensors[n][1].shape) != shape]
    return [f"{module}: {bad[0]} missing or not {list(expected[bad[0]])} for {fmt.label}"] if bad else []


def _logical_shape(out: Output, module: str, primary: str, fmt: WeightFormat) -> tuple[int, int]:
    shape = out.tensors[f"{module}.{primary}"][1].shape
    if primary == "weight":
        return int(shape[0]), int(shape[1])
    per = 32 // fmt.bits if fmt.kind == "int" else 2
    return int(shape[0]), int(shape[1]) * per


def _decompress_problems(out: Output, qc: JSONObject, packed: list[str], sample: int) -> list[str]:
    from compressed_tensors.compressors.pack_quantized import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationScheme
    from safetensors import safe_open

    problems = []
    for m in packed[:: max(1, len(packed) // max(sample, 1))][:sample]:
        group = group_of_module(qc, m)
        fmt = format_of_group(group)
        if group is None or fmt is None or FORMATS[fmt].kind != "int":
            continue  # FP4 units: validate/fp4.py's checks
        state = {}
        for p in ("weight_packed", "weight_scale", "weight_shape"):
            with safe_open(out.root / out.tensors[f"{m}.{p}"][0], "pt") as fh:
                state[p] = fh.get_tensor(f"{m}.{p}")
        weight = PackedQuantizationCompressor.decompress(state, QuantizationScheme.model_validate(group))["weight"]
        if not torch.isfinite(weight).all() or not (state["weight_scale"].float() > 0).all():
            problems.append(f"{m}: non-finite weights or non-positive scales after decompression")
        if tuple(weight.shape) != tuple(state["weight_shape"].tolist()):
            problems.append(f"{m}: decompressed shape {list(weight.shape)} != weight_shape")
    return problems


def _shape_problems(out: Output, adapter: Adapter, packed: list[str], formats: dict[str, FormatName | None],
                    report: ValidationReport) -> list[str]:
    """Per-rank divisibility for TP 1..8 with each module's own group (as the uniform check does with one)."""
    shapes = []
    for m in packed:
        fmt = FORMATS[formats[m] or "int4-g32"]
        out_f, in_f = _logical_shape(out, m, "weight_packed", fmt)
        shapes.append(PackedShape(m, adapter.classify(m + ".weight").role, out_f, in_f, fmt.group or 1))
    return tp_fit_problems(shapes, report, "its group")
