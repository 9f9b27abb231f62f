"""The facts about a checkpoint that the engines' loaders decide on (`CheckpointFacts`), from a written
checkpoint (config.json and its tensor names) or, for the planner, from a config and a recipe; and the KV-scale
tensor names quantkit writes. The engines' rules on these facts are in `quantkit/engines/verdicts.py`."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from quantkit.arch import Adapter, KVLayout, Role, get_adapter
from quantkit.checkpoint.qconfig import is_per_unit, unit_formats_of_config
from quantkit.core.jsontypes import JSONObject
from quantkit.engines.fp4 import WeightScheme
from quantkit.engines.kv_choice import KVScaleMode, choose_scale_mode
from quantkit.quant.scheme import FORMATS, FormatName
from quantkit.quant.units import list_units, unit_of

__all__ = ["CheckpointFacts", "facts_from_checkpoint", "facts_from_recipe", "kv_scale_names",
           "read_checkpoint_facts", "scheme_of_config"]


@dataclass(frozen=True)
class CheckpointFacts:
    """The facts about a (planned or written) checkpoint that the engines' loaders decide on."""

    adapter: Adapter
    group_size: int
    quantized_roles: frozenset[Role]
    kv_cache_scheme: bool
    kv_scale_names: frozenset[str]  # KV scale tensors present (full names)
    indexer_layers: tuple[int, ...]  # layers whose DSA indexer weights are present
    mtp_present: bool
    kv_saturation_at_1: float | None = None  # worst layer's saturated fraction at scale 1.0 (calibration report)
    scheme: WeightScheme = "w4a16"
    # a per-unit (mixed) output: unit -> format (None: a group quantkit does not write); empty for uniform ones
    units: tuple[tuple[str, FormatName | None], ...] = ()
    # per-unit outputs: the roles of quantized Linears outside every unit (what the role rules judge)
    roles_outside_units: frozenset[Role] = frozenset()
    kv_scale_mode: KVScaleMode = "calibrated"  # the KV scale values shipped: calibrated, or all 1.0 (kv_choice)

    @property
    def quantized(self) -> bool:
        return bool(self.quantized_roles)


def kv_scale_names(adapter: Adapter, layer: int) -> list[str]:
    """The KV-scale tensor names quantkit writes for one layer, so that every consumer finds them.

    GQA: `self_attn.{k,v}_scale` (vLLM remaps it to `self_attn.attn.*`; transformers reads it).
    MLA: the same names for transformers / compressed-tensors, plus `self_attn.k_proj.k_scale` and
    `self_attn.v_proj.v_scale`, the only names SGLang's DeepSeek loader remaps to its `attn_mqa`
    (deepseek_weight_loader.py: do_load_weights). DSA: none (the engines scale FP8 tiles themselves).
    """
    base = f"{adapter.prefix}model.layers.{layer}.self_attn"
    if adapter.kv_layout == KVLayout.DSA:
        return []
    names = [f"{base}.k_scale", f"{base}.v_scale"]
    if adapter.kv_layout == KVLayout.MLA:
        names += [f"{base}.k_proj.k_scale", f"{base}.v_proj.v_scale"]
    return names


_LAYER_OF = re.compile(r"model\.layers\.(\d+)\.")


def facts_from_checkpoint(config: JSONObject, tensor_names: Iterable[str],
                          kv_report: JSONObject | None = None) -> CheckpointFacts:
    """Facts of a written checkpoint: its config.json and the tensor names its shards hold."""
    adapter = get_adapter(config)
    names = set(tensor_names)
    qc = config.get("quantization_config") or {}
    groups = list((qc.get("config_groups") or {}).values())
    weights = (groups[0].get("weights") or {}) if groups else {}
    packed = [n for n in names if n.endswith(".weight_packed")]
    roles = frozenset(adapter.classify(n).role for n in packed)
    units: tuple[tuple[str, FormatName | None], ...] = ()
    outside: frozenset[Role] = frozenset()
    if is_per_unit(qc):
        present = {unit_of(adapter, n) for n in names if n.endswith(("weight", "weight_packed"))} - {None}
        formats = unit_formats_of_config(qc, adapter, [u for u in list_units(adapter) if u.name in present])
        units = tuple(formats.items())
        outside = frozenset(adapter.classify(n).role for n in packed if unit_of(adapter, n) is None)
    indexer = sorted({int(m.group(1)) for n in names if ".self_attn.indexer." in n and (m := _LAYER_OF.search(n))})
    mtp = any(_LAYER_OF.search(n) and int(_LAYER_OF.search(n).group(1)) >= adapter.num_layers  # type: ignore[union-attr]
              for n in names)
    return CheckpointFacts(
        adapter=adapter,
        group_size=int(weights.get("group_size") or 0),
        quantized_roles=roles,
        kv_cache_scheme=bool(qc.get("kv_cache_scheme")),
        kv_scale_names=frozenset(n for n in names if n.endswith(("k_scale", "v_scale"))),
        indexer_layers=tuple(indexer),
        mtp_present=mtp,
        kv_saturation_at_1=_worst_saturation(kv_report),
        scheme=scheme_of_config(qc),
        units=units,
        roles_outside_units=outside,
        kv_scale_mode=_scale_mode(kv_report),
    )


def scheme_of_config(qc: JSONObject) -> WeightScheme:
    """The weight scheme a compressed-tensors `quantization_config` describes (w4a16 for anything not FP4)."""
    groups = list((qc.get("config_groups") or {}).values())
    if qc.get("format") == "mxfp4-pack-quantized":
        return "mxfp4a16"
    if qc.get("format") == "nvfp4-pack-quantized":
        return "nvfp4" if groups and groups[0].get("input_activations") else "nvfp4a16"
    return "w4a16"


def facts_from_recipe(config: JSONObject, group_size: int, roles: Iterable[Role],
                      kv_scales: bool, scheme: WeightScheme = "w4a16",
                      units: dict[str, FormatName] | None = None,
                      kv_scale_mode: KVScaleMode | None = None) -> CheckpointFacts:
    """Facts of the checkpoint quantkit would write for `config` with a recipe (used by the planner); `units` is a
    per-unit plan's unit -> format (quantkit/quant/precision.py); the KV scales are the rule's choice
    (`kv_choice.choose_scale_mode`) unless `kv_scale_mode` forces one."""
    adapter = get_adapter(config)
    mode = kv_scale_mode or choose_scale_mode(adapter.kv_layout)[0]
    if units:
        roles = {u.role for u in list_units(adapter) if u.name in units and FORMATS[units[u.name]].quantized}
    # calibration measures the decoder layers; the MTP layer gets no KV scale
    names = [n for layer in range(adapter.num_layers) for n in kv_scale_names(adapter, layer)] if kv_scales else []
    return CheckpointFacts(
        adapter=adapter,
        group_size=group_size,
        quantized_roles=frozenset(roles),
        kv_cache_scheme=bool(names),
        kv_scale_names=frozenset(names),
        indexer_layers=tuple(adapter.indexer_layers()),
        mtp_present=adapter.num_mtp_layers > 0,
        scheme=scheme,
        units=tuple(units.items()) if units else (),
        kv_scale_mode=mode,
    )


def _worst_saturation(kv_report: JSONObject | None) -> float | None:
    if not kv_report or not kv_report.get("layers"):
        return None
    worst = 0.0
    for layer in kv_report["layers"]:
        for key in ("kv", "k", "v"):
            if key in layer:
                worst = max(worst, float(layer[key]["at_scale_1"]["saturated"]))
    return worst


def _scale_mode(kv_report: JSONObject | None) -> KVScaleMode:
    """What the KV report says was shipped (reports before the rule existed: calibrated)."""
    written = ((kv_report or {}).get("scales") or {}).get("written")
    return "unit" if written == "unit" else "calibrated"


def read_checkpoint_facts(ckpt: Path) -> CheckpointFacts:
    """Facts of a checkpoint directory from its config.json, index (or single shard) and KV report."""
    import json

    from quantkit.checkpoint.safetensors_header import read_header

    config = json.loads((ckpt / "config.json").read_text(encoding="utf-8"))
    index = ckpt / "model.safetensors.index.json"
    if index.exists():
        names: Iterable[str] = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
    else:
        names = [n for p in sorted(ckpt.glob("*.safetensors")) for n in read_header(p).tensors]
    report = ckpt / "kv_cache_report.json"
    kv_report = json.loads(report.read_text(encoding="utf-8")) if report.exists() else None
    return facts_from_checkpoint(config, names, kv_report)
