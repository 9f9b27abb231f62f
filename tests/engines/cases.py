"""The engine-conformance matrix: every preset x source form quantkit converts (see conftest.py)."""

from __future__ import annotations

import itertools

import pytest

# vLLM's Hopper MLA prefill backends accept only the real head dims, its sparse-MLA FP8 layout needs 576
REAL_MLA = {"qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "kv_lora_rank": 512}
Case = tuple[str, str, int, str | None]  # family, source format, group size, kv (None | "fp8" | "fp8-<kv-scales>")

CORE_CASES: list[Case] = [
    ("deepseek_v3", "fp8", 32, "fp8"),
    ("deepseek_v3", "bf16", 128, None),
    ("kimi_k25", "int4", 32, None),
    ("glm4_moe", "fp8", 32, "fp8"),
    ("glm4_moe", "bf16", 64, None),
    ("glm_moe_dsa", "fp8", 32, None),
    ("glm_moe_dsa", "bf16", 128, "fp8"),
    ("glm_moe_dsa", "fp8", 64, None),
]
_SOURCES = [("deepseek_v3", "bf16"), ("deepseek_v3", "fp8"), ("kimi_k25", "int4"), ("glm4_moe", "bf16"),
            ("glm4_moe", "fp8"), ("glm_moe_dsa", "bf16"), ("glm_moe_dsa", "fp8")]
ALL_CASES: list[Case] = [
    (family, fmt, group, kv)
    for (family, fmt), group, kv in itertools.product(_SOURCES, (32, 64, 128), (None, "fp8"))
    if not (fmt == "int4" and group != 32)  # an INT4 source passes through at its own group size
]


def case_id(case: Case) -> str:
    family, fmt, group, kv = case
    return f"{family}-{fmt}-g{group}" + (f"-kv{kv}" if kv else "")


def engine_params(cases: list[Case]) -> list[object]:
    """pytest params: the core cases as they are, the rest marked slow."""
    return [pytest.param(c, id=case_id(c), marks=() if c in CORE_CASES else pytest.mark.slow) for c in cases]
