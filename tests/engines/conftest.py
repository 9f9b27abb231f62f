"""Checkpoints for the engine-conformance tests: every preset x source form, converted by quantkit.

A case is (family, source format, group size, KV): family is a quantkit family or the `kimi_k25`
multimodal wrapper (INT4 passthrough, as Kimi ships it); KV "fp8" converts with `--kv-cache fp8`
(layer-by-layer calibration on the bundled corpus, a tokenizer trained here). `make test` runs a covering
subset (`CORE_CASES`); `make test-all` adds the whole matrix.
"""

from __future__ import annotations

import itertools
import json
import shutil
import sys
from pathlib import Path

import pytest

from quantkit.convert import convert
from quantkit.recipe import load_recipe
from quantkit.synth import make_checkpoint, wrap_multimodal

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
CORPUS = REPO / "calibration_data" / "default.jsonl"
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

# vLLM's Hopper MLA prefill backends accept only the real head dims, its sparse-MLA FP8 layout needs 576
REAL_MLA = {"qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "kv_lora_rank": 512}
Case = tuple[str, str, int, str | None]  # family, source format, group size, kv (None | "fp8")

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


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A byte-level BPE tokenizer (512 tokens) for calibrating synthetic checkpoints."""
    from quantkit.calibrate.tiny import build_tokenizer

    out = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer(out)
    return out


@pytest.fixture(scope="session")
def converted(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest):
    """converted(case) -> (source dir, quantkit output dir), cached for the session."""
    cache: dict[Case, tuple[Path, Path]] = {}

    def make(case: Case) -> tuple[Path, Path]:
        if case in cache:
            return cache[case]
        family, fmt, group, kv = case
        root = tmp_path_factory.mktemp(case_id(case))
        base = "deepseek_v3" if family == "kimi_k25" else family
        overrides: dict[str, int] = {"vocab_size": 512} if kv else {}  # the trained tokenizer's vocabulary
        size = "small" if group > 64 else "tiny"  # hidden and moe_intermediate must hold whole groups
        if base != "glm4_moe":
            overrides.update(REAL_MLA)
        src = make_checkpoint(root / "src", base, fmt, size=size, group_size=group,
                              config_overrides=overrides or None, mtp=family != "kimi_k25")  # K2.x: no MTP
        if family == "kimi_k25":
            src = wrap_multimodal(src, root / "src-kimi", "kimi_k25", vision_tensor=False)
        if kv:
            tok = request.getfixturevalue("tokenizer_dir")
            for f in tok.iterdir():
                if f.is_file() and f.name != "config.json":
                    shutil.copy2(f, src / f.name)
        config = json.loads((src / "config.json").read_text())
        fields = {"group_size": group}
        if kv:
            fields.update({"kv_cache": kv, "calibration.dataset": str(CORPUS), "calibration.samples": 4,
                           "calibration.seq_len": 32})
        out = root / "out"
        convert(src, out, load_recipe(None, config, fields))
        cache[case] = (src, out)
        return cache[case]

    return make
