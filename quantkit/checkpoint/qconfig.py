"""The `quantization_config` block of config.json, in compressed-tensors' own serialized form.

SGLang and vLLM read exactly this: one config group targeting `Linear` (SGLang's MoE path looks the
scheme up under that target), symmetric INT4 group-wise weights, an ignore list covering every Linear
module the recipe keeps, and optionally the static FP8 KV-cache scheme. A per-unit (mixed) plan gets one group
per format with per-layer `re:` targets (`build_mixed_quantization_config`, docs/mixed-precision.md).

The dict is what compressed-tensors' `QuantizationConfig(...).model_dump(mode="json")` produces for this
scheme, written out literally: importing compressed-tensors (and the transformers it pulls in) costs ~3
CPU-seconds, a sixth of a whole RTN conversion of a 2 GB checkpoint. A test builds the same block with
compressed-tensors' models and compares, and `quantkit validate` parses every written config with them.
"""

from __future__ import annotations

import re
from typing import Any

from quantkit.arch import Adapter, KVLayout, Role
from quantkit.quant.scheme import FORMATS, FormatName, WeightFormat
from quantkit.quant.units import Unit, UnitKind

__all__ = ["build_fp4_quantization_config", "build_mixed_quantization_config", "build_quantization_config",
           "FP8_KV_CACHE_SCHEME", "format_of_group", "group_of_module", "is_ignored", "is_per_unit", "mixed_ignore",
           "unit_formats_of_config", "unit_target"]

FP8_KV_CACHE_SCHEME = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}


def _args(num_bits: int, kind: str, strategy: str, group_size: int | None, observer: str | None) -> dict[str, Any]:
    """One serialized `QuantizationArgs` (compressed-tensors' field order and defaults)."""
    return {"num_bits": num_bits, "type": kind, "symmetric": True, "group_size": group_size, "strategy": strategy,
            "block_structure": None, "dynamic": False, "actorder": None, "scale_dtype": None, "zp_dtype": None,
            "observer": observer, "observer_kwargs": {}}


def build_quantization_config(group_size: int, ignore: list[str], kv_cache: bool = False) -> dict[str, Any]:
    """A W4A16 pack-quantized config (plus the FP8 KV scheme when KV scales are written)."""
    weights = _args(4, "int", "group", group_size, "minmax")
    group = {"targets": ["Linear"], "weights": weights, "input_activations": None, "output_activations": None,
             "format": None}
    kv = _args(8, "float", "tensor", None, None) if kv_cache else None
    return {"config_groups": {"group_0": group}, "quant_method": "compressed-tensors", "kv_cache_scheme": kv,
            "format": "pack-quantized", "quantization_status": "compressed", "global_compression_ratio": None,
            "ignore": list(ignore)}


_FP4_FORMATS = {"nvfp4a16": "nvfp4-pack-quantized", "mxfp4a16": "mxfp4-pack-quantized", "nvfp4": "nvfp4-pack-quantized"}


def _fp4_args(group_size: int, dynamic: bool | str, observer: str | None) -> dict[str, Any]:
    """compressed-tensors' FP4 `QuantizationArgs` as its presets serialize them (NVFP4: tensor_group + e4m3 scales,
    MXFP4: group + uint8 E8M0 scales)."""
    nv = group_size == 16
    args = _args(4, "float", "tensor_group" if nv else "group", group_size, observer)
    args.update(dynamic=dynamic, scale_dtype="torch.float8_e4m3fn" if nv else "torch.uint8")
    return args


def build_fp4_quantization_config(scheme: str, ignore: list[str], kv_cache: bool = False) -> dict[str, Any]:
    """An FP4 config: compressed-tensors' preset scheme (NVFP4A16, MXFP4A16, NVFP4) targeting `Linear`, format
    `nvfp4-pack-quantized` / `mxfp4-pack-quantized`, the ignore list and optionally the static FP8 KV scheme.

    Written literally, like the INT4 block (importing compressed-tensors costs ~3-4 CPU-s per run); a test
    compares it with `QuantizationConfig(config_groups={"group_0": preset_name_to_scheme(...)}, ...)` for
    every scheme, and `quantkit validate` parses it with compressed-tensors."""
    weights = _fp4_args(32 if scheme == "mxfp4a16" else 16, False, None)
    acts = _fp4_args(16, "local", "static_minmax") if scheme == "nvfp4" else None
    group = {"targets": ["Linear"], "weights": weights, "input_activations": acts, "output_activations": None,
             "format": None}
    kv = _args(8, "float", "tensor", None, None) if kv_cache else None
    return {"config_groups": {"group_0": group}, "quant_method": "compressed-tensors", "kv_cache_scheme": kv,
            "format": _FP4_FORMATS[scheme], "quantization_status": "compressed", "global_compression_ratio": None,
            "ignore": list(ignore)}


# ---- per-unit (mixed) plans -----------------------------------------------------------------------
_UNIT_TARGET = {
    "experts": r"mlp\.experts\..*",
    "shared_experts": r"mlp\.shared_experts\..*",
    "mlp": r"mlp\.(gate|up|gate_up|down)_proj$",
}
_ATTENTION_TARGET = {KVLayout.GQA: r"self_attn\.(q|k|v|o|qkv)_proj$"}
_MLA_ATTENTION_TARGET = r"self_attn\.(q_b|o)_proj$"
# MLA attention Linears that are no unit (kept whenever some layer's attention is quantized): the fused
# q_a / kv_a pair and kv_b_proj (quantkit/quant/units.py), and the DSA indexer's Linears
_MLA_KEPT = (r"re:.*self_attn\.(q_proj|q_a_proj|kv_a_proj_with_mqa|kv_b_proj)$", r"re:.*self_attn\.indexer\..*")


def unit_target(adapter: Adapter, kind: UnitKind, layers: list[int]) -> str:
    """One `re:` target matching the Linears of units `kind` of `layers`, under the names both engines build
    (SGLang's `experts.0.gate_proj`, vLLM's `experts.routed_experts.0.gate_proj`, fused `gate_up_proj` / `qkv_proj`
    and their shards); `re.match` from the start, as both engines' `find_matched_target` apply it. SGLang's NextN
    draft builds the MTP layer as `model.decoder` (deepseek_nextn.py, glm4_moe_nextn.py): an MTP layer's units
    match that name too."""
    numbers = str(layers[0]) if len(layers) == 1 else "(" + "|".join(str(i) for i in sorted(layers)) + ")"
    layer = rf"layers\.{numbers}"
    if any(i >= adapter.num_layers for i in layers):
        layer = f"({layer}|decoder)"
    tail = _UNIT_TARGET[kind] if kind != "attention" else _ATTENTION_TARGET.get(adapter.kv_layout,
                                                                                  _MLA_ATTENTION_TARGET)
    return rf"re:.*{layer}\.{tail}"


def _scheme(fmt: WeightFormat, targets: list[str], fp8_block: tuple[int, int]) -> Any:
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.quant_scheme import preset_name_to_scheme

    if fmt.kind == "int":
        weights = QuantizationArgs(num_bits=fmt.bits, type="int", symmetric=True, strategy="group",
                                   group_size=fmt.group, dynamic=False, observer="minmax")
        return QuantizationScheme(targets=targets, weights=weights, format="pack-quantized")
    preset = {"fp8": "FP8_BLOCK", "fp4": fmt.name.upper()}[fmt.kind]
    scheme = preset_name_to_scheme(preset, targets)
    if fmt.kind == "fp8":
        assert scheme.weights is not None
        scheme.weights.block_structure = list(fp8_block)
    scheme.format = fmt.ct_format
    return scheme


def mixed_ignore(adapter: Adapter, units: list[Unit], formats: dict[str, FormatName]) -> list[str]:
    """The `ignore` list of a per-unit plan: every kept Linear (SGLang raises "Unable to find matching target"
    for a Linear no group matches): whole roles with no quantized unit as for a uniform recipe, the kept units of
    partly quantized kinds by layer, and MLA attention's non-unit Linears."""
    quantized = {u.name for u in units if FORMATS[formats[u.name]].quantized}
    roles = {u.role for u in units if u.name in quantized}
    ignore = adapter.ignore_patterns(roles)
    for kind in ("experts", "shared_experts", "mlp", "attention"):
        of_kind = [u for u in units if u.kind == kind]
        kept = [u.layer for u in of_kind if u.name not in quantized]
        if kept and len(kept) < len(of_kind):
            ignore.append(unit_target(adapter, kind, kept))  # type: ignore[arg-type]
    if Role.ATTENTION in roles and adapter.kv_layout != KVLayout.GQA:
        ignore += list(_MLA_KEPT)
    return ignore


def build_mixed_quantization_config(adapter: Adapter, units: list[Unit], formats: dict[str, FormatName],
                                    kv_cache: bool = False, fp8_block: tuple[int, int] = (128, 128)
                                    ) -> dict[str, Any]:
    """The `quantization_config` of a per-unit plan, built with compressed-tensors' own models: one config group
    per format, its targets the units' layers by kind (`unit_target`), `ignore` from `mixed_ignore`; the top-level
    format the one group format, or `pack-quantized` for INT + FP8 groups (compressed-tensors would write
    `mixed-precision`, which SGLang 0.5.23's WNA16 MoE refuses; both engines read each group's own format)."""
    from compressed_tensors.quantization import QuantizationConfig

    by_format: dict[FormatName, dict[str, list[int]]] = {}
    for u in units:
        name = formats[u.name]
        if FORMATS[name].quantized:
            by_format.setdefault(name, {}).setdefault(u.kind, []).append(u.layer)
    groups = {}
    for i, (name, kinds) in enumerate(sorted(by_format.items(), key=lambda kv: list(FORMATS).index(kv[0]))):
        targets = [unit_target(adapter, kind, layers) for kind, layers in kinds.items()]  # type: ignore[arg-type]
        if FORMATS[name].kind == "fp8":
            # SGLang's merged / fused FP8 Linears take their block from `weight_block_size`, which reads only the
            # group targeting `Linear` (compressed_tensors.py); both engines match names before classes, and every
            # other Linear is matched by name or ignored, so `Linear` reaches no module of another format
            targets.append("Linear")
        groups[f"group_{i}"] = _scheme(FORMATS[name], targets, fp8_block)
    ct_formats = sorted({str(s.format) for s in groups.values()})
    top = ct_formats[0] if len(ct_formats) == 1 else "pack-quantized"
    kv = _args(8, "float", "tensor", None, None) if kv_cache else None
    config = QuantizationConfig(config_groups=groups, format=top, quantization_status="compressed",
                                ignore=mixed_ignore(adapter, units, formats), kv_cache_scheme=kv)
    data: dict[str, Any] = config.model_dump(mode="json")
    data["format"] = top  # as decided above, whatever the model infers
    return data


# ---- reading a written config per unit -----------------------------------------------------------
def _matches(target: str, name: str) -> bool:
    return bool(re.match(target[3:], name)) if target.startswith("re:") else target == name


def is_ignored(qc: dict[str, Any], module: str) -> bool:
    """Whether an `ignore` entry matches `module` (exactly or by `re.match`)."""
    return any(_matches(t, module) for t in qc.get("ignore") or [])


def group_of_module(qc: dict[str, Any], module: str) -> dict[str, Any] | None:
    """The config group a Linear `module` gets, as SGLang's and vLLM's `find_matched_target` decide it: None when
    an `ignore` entry matches; else the first group (config order) with a target matching the name (`re.match` or
    exact), else one targeting the class `Linear`; None when nothing matches."""
    if is_ignored(qc, module):
        return None
    groups = list((qc.get("config_groups") or {}).values())
    for group in groups:
        if any(t != "Linear" and _matches(t, module) for t in group.get("targets") or []):
            return group  # type: ignore[no-any-return]
    return next((g for g in groups if "Linear" in (g.get("targets") or [])), None)


def format_of_group(group: dict[str, Any] | None) -> FormatName | None:
    """The quantkit format a config group describes (None: not one quantkit writes)."""
    if group is None:
        return "bf16"
    w = group.get("weights") or {}
    if w.get("type") == "int" and w.get("num_bits") in (4, 8) and w.get("strategy") == "group":
        name = f"int{w['num_bits']}-g{w.get('group_size')}"
    elif w.get("type") == "float" and w.get("num_bits") == 8 and w.get("strategy") == "block":
        name = "fp8-block"
    elif w.get("type") == "float" and w.get("num_bits") == 4:
        name = ("nvfp4" if group.get("input_activations") else "nvfp4a16") if w.get("group_size") == 16 else "mxfp4a16"
    else:
        return None
    return name if name in FORMATS else None  # type: ignore[return-value]


_PROBE = {"experts": "mlp.experts.0.gate_proj", "shared_experts": "mlp.shared_experts.gate_proj",
          "mlp": "mlp.gate_proj", "attention": "self_attn.o_proj"}


def is_per_unit(qc: dict[str, Any]) -> bool:
    """Whether a config gives formats per layer (quantkit's per-unit outputs: `re:` targets naming layers), rather
    than one format for all (a group targeting `Linear`, or a peer's regex over every layer's experts)."""
    groups = list((qc.get("config_groups") or {}).values())
    return any(t.startswith("re:") and r"layers\." in t for g in groups for t in g.get("targets") or [])


def unit_formats_of_config(qc: dict[str, Any], adapter: Adapter, units: list[Unit]) -> dict[str, FormatName | None]:
    """Each unit's format in a written config, probed on the module name the engines look up (SGLang's
    `get_moe_scheme` takes `experts.0.gate_proj`); None for a group quantkit does not write."""
    return {u.name: format_of_group(group_of_module(qc, f"{adapter.prefix}model.layers.{u.layer}.{_PROBE[u.kind]}"))
            for u in units}
