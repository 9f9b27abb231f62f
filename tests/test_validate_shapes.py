"""The TP divisibility rule validate applies to packed linears (uniform and per-unit checkpoints alike)."""

from __future__ import annotations

from quantkit.arch import Role
from quantkit.validate.report import ValidationReport
from quantkit.validate.shapes import PackedShape, tp_fit_problems


def test_routed_experts_need_the_group_per_rank_dense_also_marlin_tiles() -> None:
    report = ValidationReport("x")
    # a routed expert's down_proj splits its input: 512 / 8 = 64 is a multiple of group 32 -> TP 8 fits
    expert = PackedShape("model.layers.1.mlp.experts.0.down_proj", Role.ROUTED_EXPERT, 256, 512, 32)
    assert tp_fit_problems([expert], report, "group 32") == []
    assert report.facts == {"tp_ok": [1, 2, 4, 8], "max_tp": 8}
    # a dense gate_proj splits its output: 192 / 2 = 96 is not a multiple of Marlin's 64 -> TP 1 only
    dense = PackedShape("model.layers.0.mlp.gate_proj", Role.DENSE_MLP, 192, 256, 32)
    assert tp_fit_problems([expert, dense], report, "group 32") == []
    assert report.facts == {"tp_ok": [1], "max_tp": 1}


def test_a_shape_that_fits_no_tp_is_a_problem_naming_the_module() -> None:
    report = ValidationReport("x")
    odd = PackedShape("model.layers.0.self_attn.o_proj", Role.ATTENTION, 128, 96, 64)  # 96 % 64 != 0
    problems = tp_fit_problems([odd], report, "its group")
    assert problems == ["model.layers.0.self_attn.o_proj: shape does not fit its group / Marlin tiles even at TP 1"]
    assert report.facts == {"tp_ok": [], "max_tp": 0}
