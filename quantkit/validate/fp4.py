"""`quantkit validate` on FP4 checkpoints (nvfp4-pack-quantized, mxfp4-pack-quantized), ours or another tool's.

The check the engines make the hard way: every group of Linears an engine fuses (gate/up per expert, shared
experts and dense MLPs, MLA q_a/kv_a, GQA q/k/v) must carry one NVFP4 `weight_global_scale`. SGLang refuses
unfused gate/up scales in an NVFP4 MoE; vLLM warns and keeps one of them, which mis-scales the others (what
llm-compressor 0.14's `model_free_ptq` writes for MoE experts, docs/fp4.md).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from quantkit.checkpoint.safetensors_header import HeaderEntry
from quantkit.quant.fp4 import fused_groups

if TYPE_CHECKING:
    from compressed_tensors.quantization import QuantizationConfig

__all__ = ["FP4_FORMATS", "decompress_problems", "module_problems", "qconfig_problems", "unfused_scale_problems"]

FP4_FORMATS = {"nvfp4-pack-quantized": "nvfp4", "mxfp4-pack-quantized": "mxfp4"}
_GROUP = {"nvfp4": 16, "mxfp4": 32}
Tensors = dict[str, tuple[str, HeaderEntry]]  # name -> (shard file, safetensors header entry)


def qconfig_problems(qconfig: QuantizationConfig) -> tuple[list[str], str]:
    """The FP4 `quantization_config` (parsed by compressed-tensors): problems and the one-line description."""
    fmt = FP4_FORMATS[qconfig.format]
    groups = list(qconfig.config_groups.values())
    problems = []
    if len(groups) != 1 or "Linear" not in groups[0].targets:
        problems.append("expected one config group targeting 'Linear' (SGLang's MoE path looks it up there)")
    args = groups[0].weights if groups else None
    if args is None or args.num_bits != 4 or args.type != "float" or args.group_size != _GROUP[fmt]:
        problems.append(f"{qconfig.format}: weights must be 4-bit float, group {_GROUP[fmt]}")
    acts = "W4A4" if groups and groups[0].input_activations is not None else "A16"
    return problems, f"{fmt.upper()} {acts} ({qconfig.format})"


def module_problems(tensors: Tensors, modules: list[str], fmt: str) -> list[str]:
    problems = []
    parts = ("weight_packed", "weight_scale") + (("weight_global_scale",) if fmt == "nvfp4" else ())
    for m in modules:
        missing = [p for p in parts if f"{m}.{p}" not in tensors]
        if missing:
            problems.append(f"{m}: missing {', '.join(missing)}")
            continue
        packed, scale = tensors[f"{m}.weight_packed"][1], tensors[f"{m}.weight_scale"][1]
        rows, cols = packed.shape[0], packed.shape[1] * 2
        want = "F8_E4M3" if fmt == "nvfp4" else "U8"
        if packed.dtype != "U8" or scale.dtype != want or tuple(scale.shape) != (rows, cols // _GROUP[fmt]):
            problems.append(f"{m}: weight_packed {packed.dtype}{list(packed.shape)} and weight_scale "
                            f"{scale.dtype}{list(scale.shape)} are not {fmt} group {_GROUP[fmt]}")
        if f"{m}.weight" in tensors:
            problems.append(f"{m}: holds both weight and weight_packed")
    return problems


def _read(root: Path, tensors: Tensors, name: str) -> torch.Tensor:
    from safetensors import safe_open

    with safe_open(root / tensors[name][0], "pt") as fh:
        return fh.get_tensor(name)


def decompress_problems(root: Path, tensors: Tensors, modules: list[str], qconfig: QuantizationConfig,
                        sample: int) -> list[str]:
    """Decompress a spread-out sample with compressed-tensors' own FP4 compressor."""
    from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor

    fmt = FP4_FORMATS[qconfig.format]
    compressor = NVFP4PackedCompressor if fmt == "nvfp4" else MXFP4PackedCompressor
    scheme = next(iter(qconfig.config_groups.values()))
    problems = []
    for m in modules[:: max(1, len(modules) // max(sample, 1))][:sample]:
        state = {p: _read(root, tensors, f"{m}.{p}") for p in ("weight_packed", "weight_scale", "weight_global_scale")
                 if f"{m}.{p}" in tensors}
        weight = compressor.decompress(state, scheme)["weight"]
        if not torch.isfinite(weight).all():
            problems.append(f"{m}: non-finite weights after decompression")
    return problems


def unfused_scale_problems(root: Path, tensors: Tensors, modules: list[str]) -> list[str]:
    """Fused groups whose members carry different NVFP4 weight (or W4A4 input) global scales (reads only the
    [1]-sized scales)."""
    problems = []
    for kind in ("weight", "input"):
        name = f"{kind}_global_scale"
        for group, members in sorted(fused_groups([m for m in modules if f"{m}.{name}" in tensors]).items()):
            values = {m.rsplit(".", 1)[-1]: float(_read(root, tensors, f"{m}.{name}").float().item()) for m in members}
            if len(set(values.values())) > 1:
                shown = ", ".join(f"{k} {v:g}" for k, v in values.items())
                if kind == "weight":
                    problems.append(f"{group}: unfused NVFP4 global scales ({shown}); SGLang refuses to load them "
                                    "and vLLM keeps one, mis-scaling the others (reconvert with quantkit --scheme "
                                    "nvfp4a16)")
                else:  # W4A4: the engines quantize the fused GEMM's one input with one scale
                    problems.append(f"{group}: unfused NVFP4 input global scales ({shown}); the engines quantize "
                                    "the fused input with one of them (reconvert with quantkit --scheme nvfp4)")
    return problems
