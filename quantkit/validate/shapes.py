"""Which tensor-parallel sizes a checkpoint's packed linears split into: the one divisibility rule the uniform and
the per-unit checks share (validate/checkpoint.py, validate/mixed.py)."""

from __future__ import annotations

from dataclasses import dataclass

from quantkit.arch import Role
from quantkit.validate.report import ValidationReport

__all__ = ["PackedShape", "tp_fit_problems"]

TPS = (1, 2, 4, 8)


@dataclass(frozen=True)
class PackedShape:
    """One packed linear: its name, role, logical `[out, in]` and quantization group along `in`."""

    module: str
    role: Role
    out_features: int
    in_features: int
    group: int


def _fits(s: PackedShape, tp: int) -> bool:
    """MoE: group | per-rank in; dense (Marlin): also 128 | per-rank in and 64 | per-rank out."""
    row_parallel = s.module.endswith(("down_proj", "o_proj"))
    out_f, in_f = s.out_features, s.in_features
    per_in, per_out = (in_f // tp, out_f) if row_parallel else (in_f, out_f // tp)
    if in_f % tp or out_f % tp or per_in % s.group:
        return False
    return s.role == Role.ROUTED_EXPERT or not (per_in % 128 or per_out % 64)


def tp_fit_problems(shapes: list[PackedShape], report: ValidationReport, group_text: str) -> list[str]:
    """Record the TP sizes of 1..8 every module splits into (`tp_ok`, `max_tp`); a problem when not even TP 1 fits.
    `group_text` names the group in that message ("group 32", "its group")."""
    ok_tps, problems = [], []
    for tp in TPS:
        bad = [s.module for s in shapes if not _fits(s, tp)]
        if not bad:
            ok_tps.append(tp)
        elif tp == 1:
            problems.append(f"{bad[0]}: shape does not fit {group_text} / Marlin tiles even at TP 1")
    report.facts["tp_ok"] = ok_tps
    report.facts["max_tp"] = max(ok_tps) if ok_tps else 0
    return problems
