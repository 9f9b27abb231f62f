"""Validating a converted checkpoint before anyone spends GPU hours on it.

Checks, each reported as ok / warn / fail with a one-line detail:
- files: config, index and shard headers agree exactly (no stale index, no unlisted or truncated shard);
- format: `quantization_config` parses with compressed-tensors; every quantized module is complete and
  consistent; a sample decompresses through compressed-tensors' own decompressor to finite values;
- engines: the ignore list covers exactly the modules left unquantized; fused modules (q_a/kv_a,
  q/k/v, gate/up) and each layer's experts are quantized uniformly; MLA attention stays unquantized
  (SGLang reads kv_b_proj.weight); Marlin / MoE group-size and per-rank divisibility for TP 1..8;
  MTP layer present; KV-cache scales complete (k == v for MLA);
- with `--source`: every source tensor is accounted for in quantkit.json and present in the output,
  and quantized weights reproduce the source within half a quantization step;
- per engine (`quantkit.engines.verdicts`): SGLang's and vLLM's verdict — loads / loads-with-warnings / fails —
  the launch args the checkpoint needs and the KV-cache scale each engine will really use.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from quantkit.arch import Adapter, KVLayout, Role, get_adapter
from quantkit.checkpoint.qconfig import is_per_unit
from quantkit.checkpoint.safetensors_header import ShardHeader, read_header
from quantkit.checkpoint.source import INDEX_NAME
from quantkit.core.errors import QuantkitError
from quantkit.core.jsontypes import JSONObject
from quantkit.engines.verdicts import ENGINES, Engine, engine_verdicts, read_checkpoint_facts
from quantkit.validate.fp4 import (
    FP4_FORMATS,
    decompress_problems,
    module_problems,
    qconfig_problems,
    unfused_scale_problems,
)
from quantkit.validate.mixed import check_mixed
from quantkit.validate.report import Check, CheckStatus, Output, ValidationReport
from quantkit.validate.serving import check_kv_choice, check_kv_scales, check_pd_pairs
from quantkit.validate.shapes import PackedShape, tp_fit_problems

if TYPE_CHECKING:
    from compressed_tensors.quantization import QuantizationConfig

    from quantkit.checkpoint.source import SourceCheckpoint

    QConfig = QuantizationConfig | None  # the output's quantization_config as compressed-tensors parsed it

__all__ = ["Check", "CheckStatus", "ValidationReport", "validate_checkpoint"]

_FUSED = [("q_a_proj", "kv_a_proj_with_mqa"), ("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")]


def validate_checkpoint(path: str | Path, source: str | Path | None = None, sample: int = 8,
                        engines: tuple[Engine, ...] = ENGINES) -> ValidationReport:
    """Run every check on a converted checkpoint directory (against its source when given), and give
    each engine's verdict."""
    root = Path(path)
    report = ValidationReport(str(root))
    out = _load(root, report)
    if out is None:
        return report
    if is_per_unit(out.config.get("quantization_config") or {}):  # per-unit formats: validate/mixed.py
        modules = check_mixed(out, report, sample)
        _check_mtp(out, get_adapter(out.config), report)
    else:
        qconfig = _check_qconfig(out, report)
        modules = _quantized_modules(out)
        _check_modules(out, modules, qconfig, report)
        _check_decompress(out, modules, qconfig, report, sample)
        _check_engine_rules(out, modules, qconfig, report)
    report.facts.update(quantized_modules=len(modules), shards=len(out.headers),
                        bytes=sum(h.file_size for h in out.headers.values()))
    check_kv_scales(out, report)
    report.engines = engine_verdicts(read_checkpoint_facts(root), engines)
    check_pd_pairs(root, report)
    check_kv_choice(root, report)
    if source is not None:
        _check_against_source(out, Path(source), modules, report)
    return report


# ---- files --------------------------------------------------------------------------------------
def _load(root: Path, report: ValidationReport) -> Output | None:
    try:
        config = json.loads((root / "config.json").read_text())
        index = json.loads((root / INDEX_NAME).read_text())
        weight_map: dict[str, str] = index["weight_map"]
    except (OSError, json.JSONDecodeError, KeyError, TypeError, RecursionError) as exc:
        report.add("files", [f"config.json / {INDEX_NAME} unreadable: {exc}"], "")
        return None
    problems: list[str] = []
    headers: dict[str, ShardHeader] = {}
    for f in sorted(set(weight_map.values())):
        try:
            headers[f] = read_header(root / f)
        except QuantkitError as exc:
            problems.append(str(exc))
    tensors = {n: (f, e) for f, h in headers.items() for n, e in h.tensors.items()}
    problems += [f"index lists {n} in {f}, which does not hold it" for n, f in weight_map.items()
                 if f in headers and tensors.get(n, ("",))[0] != f]
    problems += [f"{f} holds {n}, which the index does not list" for n, (f, _) in tensors.items()
                 if n not in weight_map]
    problems += [f"{p.name} is not referenced by the index" for p in root.glob("*.safetensors")
                 if p.name not in headers]
    report.add("files", problems, f"index matches {len(headers)} shard headers ({len(tensors)} tensors)")
    return Output(root, config, headers, tensors) if not problems else None


# ---- format -------------------------------------------------------------------------------------
def _check_qconfig(out: Output, report: ValidationReport) -> QConfig:
    from compressed_tensors.quantization import QuantizationConfig

    raw = out.config.get("quantization_config")
    try:
        qconfig = QuantizationConfig.model_validate(raw)
    except Exception as exc:  # pydantic's ValidationError and friends
        report.add("quantization_config", [f"does not parse with compressed-tensors: {str(exc).splitlines()[0]}"], "")
        return None
    if qconfig.format in FP4_FORMATS:
        fp4, detail = qconfig_problems(qconfig)
        report.add("quantization_config", fp4, detail)
        return qconfig
    problems = []
    if qconfig.format != "pack-quantized":
        problems.append(f"format is {qconfig.format!r}, expected 'pack-quantized'")
    groups = list(qconfig.config_groups.values())
    if len(groups) != 1 or "Linear" not in groups[0].targets:
        problems.append("expected one config group targeting 'Linear' (SGLang's MoE path looks it up there)")
    args = groups[0].weights if groups else None
    if args is None or args.num_bits != 4 or not args.symmetric or args.strategy != "group":
        problems.append("weights must be 4-bit symmetric group-wise (SGLang's MoE kernels ignore zero points)")
    report.add("quantization_config", problems, f"W4A16 pack-quantized, group {args.group_size if args else '?'}")
    return qconfig


def _quantized_modules(out: Output) -> list[str]:
    return sorted(n.removesuffix(".weight_packed") for n in out.tensors if n.endswith(".weight_packed"))


def _group_size(qconfig: QConfig) -> int:
    return int(next(iter(qconfig.config_groups.values())).weights.group_size) if qconfig else 0


def _fp4(qconfig: QConfig) -> str | None:
    return FP4_FORMATS.get(qconfig.format) if qconfig is not None else None


def _check_modules(out: Output, modules: list[str], qconfig: QConfig, report: ValidationReport) -> None:
    fp4 = _fp4(qconfig)
    if fp4:
        report.add("quantized modules", module_problems(out.tensors, modules, fp4),
                   f"{len(modules)} modules complete and consistent")
        if fp4 == "nvfp4":
            report.add("fused global scales", unfused_scale_problems(out.root, out.tensors, modules),
                       "every fused group (gate/up, q_a/kv_a, q/k/v) shares one NVFP4 global scale")
        return
    group, problems = _group_size(qconfig), []
    for m in modules:
        parts = {p: out.tensors.get(f"{m}.{p}") for p in ("weight_packed", "weight_scale", "weight_shape")}
        missing = [p for p, v in parts.items() if v is None]
        if missing:
            problems.append(f"{m}: missing {', '.join(missing)}")
            continue
        packed, scale = parts["weight_packed"][1], parts["weight_scale"][1]
        rows, cols = packed.shape[0], packed.shape[1] * 8
        if packed.dtype != "I32" or scale.shape != (rows, cols // max(group, 1)):
            problems.append(f"{m}: weight_packed {packed.dtype}{list(packed.shape)} and weight_scale "
                            f"{list(scale.shape)} do not match group {group}")
        if f"{m}.weight" in out.tensors:
            problems.append(f"{m}: holds both weight and weight_packed")
    report.add("quantized modules", problems, f"{len(modules)} modules complete and consistent")


def _check_decompress(out: Output, modules: list[str], qconfig: QConfig, report: ValidationReport, sample: int) -> None:
    """Decompress a spread-out sample with compressed-tensors' own decompressor (the engines' reference)."""
    from compressed_tensors.compressors.pack_quantized import PackedQuantizationCompressor
    from safetensors import safe_open

    if not modules or qconfig is None:
        return
    if _fp4(qconfig):
        report.add("decompression", decompress_problems(out.root, out.tensors, modules, qconfig, sample),
                   f"{min(sample, len(modules))} sampled modules decompress with compressed-tensors to finite weights")
        return
    scheme = next(iter(qconfig.config_groups.values()))
    step = max(1, len(modules) // max(sample, 1))
    problems = []
    for m in modules[::step][:sample]:
        state = {}
        for p in ("weight_packed", "weight_scale", "weight_shape"):
            with safe_open(out.root / out.tensors[f"{m}.{p}"][0], "pt") as fh:
                state[p] = fh.get_tensor(f"{m}.{p}")
        weight = PackedQuantizationCompressor.decompress(state, scheme)["weight"]
        if not torch.isfinite(weight).all() or not (state["weight_scale"].float() > 0).all():
            problems.append(f"{m}: non-finite weights or non-positive scales after decompression")
        if tuple(weight.shape) != tuple(state["weight_shape"].tolist()):
            problems.append(f"{m}: decompressed shape {list(weight.shape)} != weight_shape")
    report.add("decompression", problems, f"{min(sample, len(modules))} sampled modules decompress with "
               "compressed-tensors to finite weights")


# ---- engine rules -------------------------------------------------------------------------------
def _linear_modules(out: Output, adapter: Adapter) -> dict[str, Role]:
    """Modules an engine builds as Linear layers: 2-D `.weight` tensors or quantized triples."""
    mods: dict[str, Role] = {}
    for name, (_, entry) in out.tensors.items():
        module, _, param = name.rpartition(".")
        if (param == "weight" and len(entry.shape) == 2) or param == "weight_packed":
            role = adapter.classify(name).role
            if role not in (Role.EMBEDDING, Role.NORM):
                mods[module] = role
    return mods


def _check_engine_rules(out: Output, modules: list[str], qconfig: QConfig, report: ValidationReport) -> None:
    from compressed_tensors.utils.match import match_name

    if qconfig is None:
        return
    adapter = get_adapter(out.config)
    quantized = set(modules)
    linear = _linear_modules(out, adapter)
    ignore = list(qconfig.ignore or [])

    def ignored(m: str) -> bool:
        return any(match_name(m, pattern) for pattern in ignore)

    problems = [f"{m} is quantized but matches the ignore list" for m in sorted(quantized) if ignored(m)]
    problems += [f"{m} is unquantized but not ignored: engines would look for {m}.weight_packed"
                 for m in sorted(set(linear) - quantized) if not ignored(m) and linear[m] != Role.ROUTER]
    report.add("ignore list", problems, f"covers the {len(set(linear) - quantized)} unquantized Linear modules")

    report.add("fused modules", _fused_problems(linear, quantized, adapter), "fused groups quantized uniformly")
    mla = adapter.kv_layout in (KVLayout.MLA, KVLayout.DSA)
    attn = [m for m in quantized if adapter.classify(m + ".weight").role in (Role.ATTENTION, Role.INDEXER)]
    report.add("MLA attention", [f"{attn[0]} is quantized: SGLang's MLA reads kv_b_proj.weight directly"]
               if mla and attn else [], "attention kept unquantized" if mla else "GQA attention")
    report.add("Marlin / MoE shapes", _shape_problems(out, adapter, modules, _group_size(qconfig), report,
                                                      2 if _fp4(qconfig) else 8),
               f"group {_group_size(qconfig)} divides every per-rank shape up to TP {report.facts.get('max_tp')}")
    _check_mtp(out, adapter, report)


def _fused_problems(linear: dict[str, Role], quantized: set[str], adapter: Adapter) -> list[str]:
    problems = []
    experts_by_layer: dict[int, set[bool]] = defaultdict(set)
    for m, role in linear.items():
        if role == Role.ROUTED_EXPERT:
            experts_by_layer[adapter.classify(m + ".weight").layer].add(m in quantized)
        for group in _FUSED:
            leaf = m.rsplit(".", 1)[-1]
            if leaf == group[0]:
                base = m.rsplit(".", 1)[0]
                states = {f"{base}.{g}" in quantized for g in group if f"{base}.{g}" in linear}
                if len(states) > 1:
                    problems.append(f"{base}: {'/'.join(group)} quantized unevenly; engines refuse to load it")
    problems += [f"layer {layer}: some routed experts quantized and some not"
                 for layer, states in sorted(experts_by_layer.items()) if len(states) > 1]
    return problems


def _shape_problems(out: Output, adapter: Adapter, modules: list[str], group: int, report: ValidationReport,
                    per_word: int = 8) -> list[str]:
    """Per-rank divisibility for TP 1..8: MoE (group | hidden, group | moe_inter/TP), dense Marlin (64/128).
    `per_word`: weights per packed element (8 in INT4's int32, 2 in FP4's uint8)."""
    problems: list[str] = []
    if per_word == 8 and group not in (32, 64, 128):
        problems.append(f"group size {group} is not one Marlin accepts (32, 64, 128)")
    shapes = []
    for m in modules:
        out_f, in_f = (d * (per_word if i else 1) for i, d in enumerate(out.tensors[f"{m}.weight_packed"][1].shape))
        shapes.append(PackedShape(m, adapter.classify(m + ".weight").role, out_f, in_f, group))
    return problems + tp_fit_problems(shapes, report, f"group {group}")


def _check_mtp(out: Output, adapter: Adapter, report: ValidationReport) -> None:
    if not adapter.num_mtp_layers:
        return
    layer = adapter.num_layers
    present = any(re.match(rf"^(.*\.)?model\.layers\.{layer}\.", n) for n in out.tensors)
    report.add("MTP layer", [] if present else [f"config declares {adapter.num_mtp_layers} MTP layer(s) but layer "
               f"{layer} is absent: speculative decoding will not work"], f"layer {layer} present", warn=True)


# ---- against the source -------------------------------------------------------------------------
def _check_against_source(out: Output, source_dir: Path, modules: list[str], report: ValidationReport) -> None:
    from quantkit.checkpoint.source import open_source

    source = open_source(source_dir)
    physical = {n for h in source.headers.values() for n in h.tensors}
    manifest_path = out.root / "quantkit.json"
    try:  # an output another tool wrote has no quantkit.json: a failed check (exit 2), not a crash
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        problems = [f"source tensor {n} is not accounted for in quantkit.json"
                    for n in sorted(physical - set(manifest.get("tensors", {})))]
    except FileNotFoundError:
        manifest = {}
        problems = [f"{manifest_path} is missing: not written by quantkit; its source tensors cannot be accounted for"]
    except (OSError, ValueError, AttributeError, RecursionError) as exc:
        manifest = {}
        problems = [f"{manifest_path} is unreadable ({type(exc).__name__})"]
    quantized = set(modules)
    for name in source.logical:
        module = name.removesuffix(".weight")
        if name not in out.tensors and not (name.endswith(".weight") and module in quantized):
            problems.append(f"source tensor {name} has no counterpart in the output")
    report.add("source accounting", problems, f"all {len(physical)} source tensors accounted for and present")
    report.add("quantization error", _error_problems(out, source, modules, manifest),
               "sampled quantized weights within half a quantization step of the source")


def _error_problems(out: Output, source: SourceCheckpoint, modules: list[str], manifest: JSONObject) -> list[str]:
    """RTN guarantees |w - q*s| <= s/2 per element (s/2 + clipping for MSE search; GPTQ trades this away)."""
    from safetensors import safe_open

    recipe = manifest.get("recipe", {})
    if (recipe.get("method"), recipe.get("scale_search"), recipe.get("scheme", "w4a16")) != ("rtn", "minmax", "w4a16"):
        return []
    problems = []
    for m in modules[:: max(1, len(modules) // 8)][:8]:
        name = m + ".weight"
        if name not in source.logical:
            continue
        w = source.read(name, torch.float32).to(source.model_dtype).float()
        with safe_open(out.root / out.tensors[f"{m}.weight_scale"][0], "pt") as fh:
            scale = fh.get_tensor(f"{m}.weight_scale").float()
        with safe_open(out.root / out.tensors[f"{m}.weight_packed"][0], "pt") as fh:
            packed = fh.get_tensor(f"{m}.weight_packed")
        from quantkit.quant.int4 import dequantize_group, qrange, unpack_int4, unpack_int8

        group, bits = w.shape[1] // scale.shape[1], 32 * packed.shape[1] // w.shape[1]  # per module (mixed outputs)
        codes = unpack_int4(packed, tuple(w.shape)) if bits == 4 else unpack_int8(packed)
        deq = dequantize_group(codes, scale, group)
        # half a step, plus the clamp at qmax when the bf16-rounded scale came out below absmax / divisor
        bound = scale.repeat_interleave(group, 1) * (0.5 + qrange(bits)[2] * 2**-8) + 1e-6
        if not ((w - deq).abs() <= bound).all():
            problems.append(f"{m}: dequantized weight differs from the source by more than half a step")
    return problems
