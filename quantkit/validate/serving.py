"""`quantkit validate`: the checks on what the engines will serve from the checkpoint (KV-cache scales and the
choice between calibrated and unit scales, the SGLang prefill/decode pairs quantkit.json records)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from quantkit.arch import KVLayout, get_adapter
from quantkit.validate.report import Output, ValidationReport

__all__ = ["check_kv_choice", "check_kv_scales", "check_pd_pairs"]


def check_kv_scales(out: Output, report: ValidationReport) -> None:
    """Scales exist for every layer, are positive and finite; MLA's k and v scales are equal (one latent)."""
    from safetensors import safe_open

    qc = out.config.get("quantization_config") or {}
    names = sorted(n for n in out.tensors if n.endswith(("self_attn.k_scale", "self_attn.v_scale")))
    if not qc.get("kv_cache_scheme"):
        report.add("KV-cache scales", ["no kv_cache_scheme: engines will use FP8 KV scale 1.0 (or BF16 KV)"]
                   if not names else [], "none (BF16 KV or engine-computed)", warn=True)
        return
    adapter = get_adapter(out.config)
    problems, values = [], {}
    for n in names:
        with safe_open(out.root / out.tensors[n][0], "pt") as fh:
            values[n] = fh.get_tensor(n).float()
    layers = sorted({int(re.search(r"layers\.(\d+)\.", n).group(1)) for n in names})  # type: ignore[union-attr]
    if adapter.kv_layout != KVLayout.DSA and len(layers) < adapter.num_layers:
        problems.append(f"kv scales for {len(layers)} of {adapter.num_layers} layers")
    for n, v in values.items():
        if not torch.isfinite(v).all() or not (v > 0).all():
            problems.append(f"{n} is not a positive finite number")
    if _shipped(out.root) == "unit":
        problems += [f"{n} is {float(v.flatten()[0]):g}, but the KV report says the checkpoint ships scale 1.0"
                     for n, v in values.items() if not torch.all(v == 1.0)]
    if adapter.kv_layout == KVLayout.MLA:
        for layer in layers:
            k = values.get(f"{adapter.prefix}model.layers.{layer}.self_attn.k_scale")
            v = values.get(f"{adapter.prefix}model.layers.{layer}.self_attn.v_scale")
            if k is not None and v is not None and not torch.equal(k, v):
                problems.append(f"layer {layer}: k_scale != v_scale, but MLA caches one latent for both")
    report.add("KV-cache scales", problems, f"{len(layers)} layers with FP8 KV scales")


def check_pd_pairs(root: Path, report: ValidationReport) -> None:
    """The prefill/decode pairs quantkit.json records (the stock pair, and the plugin split where there is one):
    refused if SGLang would refuse or corrupt them."""
    from quantkit.engines.pd import PDPair, pd_problems

    try:
        records = json.loads((root / "quantkit.json").read_text())["serving"]["sglang"]
    except (OSError, json.JSONDecodeError, KeyError, TypeError):
        return  # no pair recorded (older outputs): nothing to check
    for key, name in (("pd", "sglang PD pair"), ("pd_split", "sglang PD split (plugin)")):
        try:
            pair = PDPair.from_dict(records[key])
        except (KeyError, TypeError):
            continue
        row, row_bytes = pair.prefill.sent_row
        report.add(name, pd_problems(pair),
                   f"prefill and decode both advertise {pair.decode.kv_dtype_resolved!r}, page "
                   f"{pair.decode.page_size}, {row} rows of {row_bytes} B on the wire, KV scale {pair.decode.kv_scale}")


def _shipped(root: Path) -> str | None:
    try:
        return json.loads((root / "kv_cache_report.json").read_text())["scales"]["written"]
    except (OSError, json.JSONDecodeError, KeyError, TypeError):
        return None


def check_kv_choice(root: Path, report: ValidationReport) -> None:
    """Both KV-scale options as quantkit.json records them (quantkit/engines/kv_choice.py): the backend each pins,
    the measured KL and its paired delta against the threshold, the modelled speed delta; a warning when the
    checkpoint ships the option the rule did not choose (`--kv-scales` forced it)."""
    try:
        choice = json.loads((root / "quantkit.json").read_text())["serving"]["sglang"]["kv_choice"]
    except (OSError, json.JSONDecodeError, KeyError, TypeError):
        return  # no KV scales, or an output written before the choice was recorded
    opts = choice["options"]

    def kl(x: object) -> str:
        return f"{x:.2e}" if isinstance(x, (int, float)) else "not measured"

    parts = [f"ships {choice['shipped']}", *(f"{m}: {opts[m]['backend']}, KL {kl(opts[m].get('kl'))}"
                                            for m in ("calibrated", "unit"))]
    if choice.get("kl_delta_unit_minus_calibrated") is not None:
        parts.append(f"unit - calibrated KL {choice['kl_delta_unit_minus_calibrated']:+.2e} (threshold "
                     f"{choice['threshold']:.2e})")
    speed = choice.get("speed")
    if speed:
        parts.append(f"unit over calibrated {speed['speed_delta_unit_over_calibrated']:+.1%} modelled decode at "
                     f"{speed['requests']} x {speed['context'] // 1024}K on {speed['gpu']}")
    rule = choice.get("rule_choice")
    problems = [f"ships {choice['shipped']} scales where the measured rule chooses {rule} (--kv-scales forced it); "
                + "; ".join(parts)] if rule and rule != choice["shipped"] else []
    report.add("KV scale choice", problems, "; ".join(parts), warn=True)
