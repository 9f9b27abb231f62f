"""Predicted vs measured KL, unit by unit: how well `quantkit sensitivity` ranks the units of a real model.

    python bench/sensitivity_validation.py [--arch deepseek_v3] [--draws 1] [--samples 32] [--table S.json]

On a tiny *trained* model (quantkit.calibrate.tiny): the sensitivity table from calibration text
(calibration_data/default.jsonl), then, for every unit and candidate format, the real KL(source || model) on
held-out text (calibration_data/heldout.jsonl, 64 windows x 128 tokens, as bench/gptq_vs_llmcompressor.py)
of the source with that one unit fake-quantized (RTN, the values the writer stores). Reports the rank
correlation (Spearman) across units per format and pooled over every (unit, format), the ratio predicted /
measured, and the same for whole plans (uniform INT4 of the routed experts: predictions add over units).
Prints one JSON line at the end; docs/mixed-precision.md quotes it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "2")

import torch  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def spearman(a: list[float], b: list[float]) -> float:
    """Rank correlation (average ranks for ties are not needed: the values are continuous)."""
    ra = torch.tensor(a).argsort().argsort().double()
    rb = torch.tensor(b).argsort().argsort().double()
    ra, rb = ra - ra.mean(), rb - rb.mean()
    return float((ra * rb).sum() / (ra.norm() * rb.norm()))


def _hf_params(model: torch.nn.Module, unit: str) -> list[tuple[torch.Tensor, bool]]:
    """The transformers parameters of a unit: (tensor, per-expert stack?)."""
    _, layer, kind = unit.split(".")
    base = model.model.layers[int(layer)]
    if kind == "experts":
        return [(base.mlp.experts.gate_up_proj, True), (base.mlp.experts.down_proj, True)]
    if kind == "shared_experts":
        return [(getattr(base.mlp.shared_experts, p).weight, False) for p in ("gate_proj", "up_proj", "down_proj")]
    if kind == "mlp":
        return [(getattr(base.mlp, p).weight, False) for p in ("gate_proj", "up_proj", "down_proj")]
    attn = base.self_attn
    names = ("q_b_proj", "o_proj") if hasattr(attn, "q_b_proj") else ("q_proj", "k_proj", "v_proj", "o_proj")
    return [(getattr(attn, n).weight, False) for n in names]


def _freeze_routing(model: torch.nn.Module, state: dict) -> None:
    """Every router returns the top-k experts it chose for the source (recorded in `state["frozen"]` while
    `state["mode"] == "record"`), with weights from the current scores: routing changes switched off."""
    for i, layer in enumerate(model.model.layers):
        gate = getattr(layer.mlp, "gate", None)
        if gate is None:
            continue
        orig = gate.forward

        def forward(h: torch.Tensor, i: int = i, gate: torch.nn.Module = gate, orig=orig):  # type: ignore[no-untyped-def]
            logits, w, idx = orig(h)
            key = (i, state["batch"])
            if state["mode"] == "record":
                state["frozen"][key] = idx
            elif state["mode"] == "frozen":
                idx = state["frozen"][key]
                w = logits.sigmoid().gather(1, idx)
                if gate.norm_topk_prob:
                    w = w / (w.sum(-1, keepdim=True) + 1e-20)
                w = w * gate.routed_scaling_factor
            return logits, w, idx

        gate.forward = forward


def _batched_log_probs(model: torch.nn.Module, tokens: torch.Tensor, state: dict) -> torch.Tensor:
    out = []
    for b in range(0, tokens.shape[0], 8):
        state["batch"] = b
        out.append(torch.log_softmax(model(input_ids=tokens[b : b + 8]).logits[:, :-1].float(), dim=-1))
    return torch.cat(out)


@torch.no_grad()
def measured(src: Path, table: dict, fake: dict, windows: int = 64, frozen: bool = False
             ) -> dict[str, dict[str, float]]:
    """Real KL per (unit, format): the source model with that unit alone fake-quantized (`frozen`: every router
    keeps the source's top-k choices)."""
    from transformers import AutoModelForCausalLM

    from quantkit.calibrate.eval import heldout_tokens
    from quantkit.calibrate.tiny import HELDOUT

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    tokens = heldout_tokens(HELDOUT, src, 128, windows)
    state: dict = {"mode": "record", "batch": 0, "frozen": {}}
    _freeze_routing(model, state)
    ref = _batched_log_probs(model, tokens, state)
    state["mode"] = "frozen" if frozen else "live"

    def _log_probs(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
        return _batched_log_probs(model, tokens, state)

    out: dict[str, dict[str, float]] = {}
    for unit, row in table["units"].items():
        out[unit] = {}
        params = _hf_params(model, unit)
        for fmt in row["kl"]:
            saved = [p.data.clone() for p, _ in params]
            for p, stacked in params:
                p.data = torch.stack([fake[fmt](w) for w in p.data]) if stacked else fake[fmt](p.data)
            lp = _log_probs(model, tokens)
            out[unit][fmt] = float((ref.exp() * (ref - lp)).sum(-1).mean())
            for (p, _), w in zip(params, saved, strict=True):
                p.data = w
    return out


def plan_kl(src: Path, plan: dict[str, str], fake: dict, windows: int = 64) -> float:
    """Real KL of a whole plan (unit -> format) applied at once."""
    from transformers import AutoModelForCausalLM

    from quantkit.calibrate.eval import _log_probs, heldout_tokens
    from quantkit.calibrate.tiny import HELDOUT

    with torch.no_grad():
        model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
        tokens = heldout_tokens(HELDOUT, src, 128, windows)
        ref = _log_probs(model, tokens)
        for unit, fmt in plan.items():
            for p, stacked in _hf_params(model, unit):
                p.data = torch.stack([fake[fmt](w) for w in p.data]) if stacked else fake[fmt](p.data)
        lp = _log_probs(model, tokens)
        return float((ref.exp() * (ref - lp)).sum(-1).mean())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", default="deepseek_v3")
    ap.add_argument("--draws", type=int, default=1)
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--table", type=Path, help="An existing S.json (else it is computed into the work dir).")
    ap.add_argument("--work", type=Path, default=Path("/tmp/quantkit-sensitivity-validation"))
    ap.add_argument("--frozen-routing", action="store_true", help="Also measure each unit with every router's "
                    "top-k choice frozen at the source's (the KL without routing changes).")
    a = ap.parse_args()
    torch.set_num_threads(2)
    from quantkit.calibrate.sensitivity_run import FAKE, sensitivity_of
    from quantkit.calibrate.tiny import CORPUS, build_tiny

    src = build_tiny(a.arch)
    seconds = None
    if a.table is None:
        t = time.perf_counter()
        table = sensitivity_of(src, CORPUS, a.work / "work", samples=a.samples, seq_len=128, draws=a.draws)
        seconds = time.perf_counter() - t
        a.table = a.work / "S.json"
        a.table.write_text(json.dumps(table.to_json(), indent=1))
    data = json.loads(a.table.read_text())
    fake = {f: FAKE(f) for f in data["formats"]}
    real = measured(src, data, fake)
    rows, report = [], {"arch": a.arch, "draws": data["draws"], "sequences": data["sequences"],
                        "sensitivity_seconds": seconds}
    for key in ("kl", "kl_fisher"):
        pred, meas = [], []
        for unit, row in data["units"].items():
            for fmt, kl in row[key].items():
                pred.append(kl)
                meas.append(real[unit][fmt])
        report[f"spearman_{key}_pooled"] = round(spearman(pred, meas), 3)
        report[f"log_ratio_{key}_median"] = round(float(torch.tensor(
            [math.log(p / m) for p, m in zip(pred, meas, strict=True) if p > 0 and m > 0]).median()), 3)
        for fmt in data["formats"]:
            units = [u for u, r in data["units"].items() if fmt in r[key]]
            report[f"spearman_{key}_{fmt}"] = round(spearman([data["units"][u][key][fmt] for u in units],
                                                             [real[u][fmt] for u in units]), 3)
    for unit, row in data["units"].items():
        for fmt, kl in row["kl"].items():
            rows.append(f"{unit:<24} {fmt:<10} predicted {kl:.2e} (fisher {row['kl_fisher'][fmt]:.2e}) "
                        f"measured {real[unit][fmt]:.2e}")
    experts = {u: "int4-g32" for u, r in data["units"].items() if r["kind"] == "experts"}
    report["uniform_int4_experts_predicted"] = sum(data["units"][u]["kl"]["int4-g32"] for u in experts)
    report["uniform_int4_experts_measured"] = plan_kl(src, experts, fake)
    report["unit_kl_measured"] = real
    if a.frozen_routing:
        report["unit_kl_frozen_routing"] = measured(src, data, fake, frozen=True)
    print("\n".join(rows))
    print(json.dumps(report))


if __name__ == "__main__":
    main()
