"""Model-card pieces shared by sections: Markdown tables, and the Serving section (engine verdicts, launch
commands, the SGLang prefill/decode pair and the plugin split recorded in quantkit.json)."""

from __future__ import annotations

from quantkit.core.jsontypes import JSONObject
from quantkit.engines.verdicts import ENGINES

__all__ = ["NOT_RECORDED", "precision_section", "serving_section", "table"]

NOT_RECORDED = "engine verdicts: not recorded (run quantkit validate --engine all)"


def table(header: list[str], rows: list[list[object]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def serving_section(serving: JSONObject | None, model_ref: str) -> str:
    """Per engine: verdict, arguments, KV use, launch lines, and the SGLang PD pair / plugin split."""
    if not serving:
        return f"## Serving\n\n{NOT_RECORDED.capitalize()}."
    parts = ["## Serving", "Engine verdicts and launch commands (the `serving` record of quantkit.json, from "
             "quantkit's engine rules, checked by executing SGLang's and vLLM's loader code):"]
    for engine in [e for e in ENGINES if e in serving] + sorted(set(serving) - set(ENGINES)):
        rec = serving[engine]
        kv = rec.get("kv_cache") or {}
        lines = [f"### {engine} {rec.get('version', '')}".rstrip(), f"Verdict: **{rec.get('verdict', '?')}**"]
        if rec.get("args"):
            lines.append("Required arguments: `" + " ".join(str(a) for a in rec["args"]) + "`")
        if kv:
            lines.append(f"KV cache: {kv.get('dtype', '?')}, scale {kv.get('scale', '?')}, attention backend "
                         f"{kv.get('attention_backend', 'engine default')}. {kv.get('detail', '')}")
        launch = [str(cmd).replace("<MODEL>", model_ref) for cmd in rec.get("launch") or []]
        if launch:
            label = "Launch (prefill / decode pair):" if len(launch) == 2 else "Launch:"
            lines.append(label + "\n\n```bash\n" + "\n".join(launch) + "\n```")
        lines += [f"- **fails:** {p}" for p in rec.get("problems") or []]
        lines += [f"- **warning:** {w}" for w in rec.get("warnings") or []]
        lines += [f"- {note}" for note in rec.get("notes") or []]
        if rec.get("pd"):
            lines.append(_pd_pair(rec["pd"], model_ref))
        if rec.get("pd_split"):
            lines.append(_pd_pair(rec["pd_split"], model_ref, split=True))
        parts.append("\n\n".join(lines))
    return "\n\n".join(parts)


def _pd_pair(pd: JSONObject, model_ref: str, split: bool = False) -> str:
    """The prefill/decode pair SGLang accepts (quantkit/engines/pd.py): three commands and what they store."""
    def env(side: str) -> str:
        return "".join(f"{k}={v} " for k, v in (pd[side].get("env") or {}).items())

    cmds = [(env(side) + " ".join(str(a) for a in pd[side]["args"])).replace("<MODEL>", model_ref)
            for side in ("prefill", "decode", "router")]
    rows = [[side, pd[side]["checkpoint"].replace("<MODEL>", model_ref), pd[side]["kv_dtype_resolved"],
             pd[side]["kv_scale"], pd[side]["attention_backend"],
             f"{pd[side]['kv_row']} ({pd[side]['kv_row_bytes']} B)"]
            for side in ("prefill", "decode")]
    title = ("Production split: BF16 KV on the prefill, FP8 on the decode (quantkit's SGLang plugin)" if split
             else "Prefill/decode pair (PD disaggregation)")
    text = (f"#### {title}\n\n"
            + table(["side", "checkpoint", "KV dtype", "KV scale", "attention", "KV row per token and layer"], rows)
            + "\n\n```bash\n" + "\n".join(cmds) + "\n```\n\n" + f"The prefill gives up: {pd.get('gives_up', '')}.")
    return text + "".join(f"\n- {n}" for n in pd.get("notes") or [])


_KINDS = (("experts", "routed experts"), ("shared_experts", "shared experts"), ("attention", "attention"),
          ("mlp", "dense MLP"))


def precision_section(precision: JSONObject | None) -> str:
    """A per-unit (mixed) checkpoint: each layer's format per unit, and the bytes per format (quantkit.json
    `precision`); empty for a uniform checkpoint."""
    if not precision or not precision.get("units"):
        return ""
    units = precision["units"]
    kinds = [(k, label) for k, label in _KINDS if any(u["kind"] == k for u in units)]
    by_layer: dict[int, dict[str, JSONObject]] = {}
    for u in units:
        by_layer.setdefault(int(u["layer"]), {})[u["kind"]] = u
    kl = any("predicted_kl" in u for u in units)
    rows = []
    for layer, row in sorted(by_layer.items()):
        mtp = any(u.get("mtp") for u in row.values())
        cells: list[object] = [f"{layer}{' (MTP)' if mtp else ''}"]
        cells += [row[k]["label"] if k in row else "" for k, _ in kinds]
        if kl:
            cells.append(f"{sum(u.get('predicted_kl', 0.0) for u in row.values()):.3g}")
        rows.append(cells)
    header = ["layer", *[label for _, label in kinds]] + (["predicted KL"] if kl else [])
    totals = [[name, f["units"], f"{f['params']:,}", f"{f['bytes']:,}"]
              for name, f in (precision.get("formats") or {}).items()]
    return ("## Per-layer precision\n\nEach unit's format (a routed-experts unit is every expert and projection of "
            "its layer: SGLang and vLLM take one scheme per MoE layer). The engines' loader code was executed on "
            "such mixes (docs/mixed-precision.md).\n\n" + table(header, rows) + "\n\n"
            + table(["format", "units", "weights", "bytes"], totals))
