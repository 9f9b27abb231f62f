"""Checkpoints for the engine-conformance tests: every preset x source form, converted by quantkit.

A case is (family, source format, group size, KV): family is a quantkit family or the `kimi_k25`
multimodal wrapper (INT4 passthrough, as Kimi ships it); KV "fp8" converts with `--kv-cache fp8` (the KV scales
the measured rule ships; "fp8-calibrated" / "fp8-unit" force them, `--kv-scales`)
(layer-by-layer calibration on the bundled corpus, a tokenizer trained here). `make test` runs a covering
subset (`cases.CORE_CASES`); `make test-all` adds the whole matrix. Engine runs go in batches (the engine is
imported once per batch, one forked child per run).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from cases import REAL_MLA, Case, case_id
from harness import run_engine_batch

from quantkit.checkpoint.synth import make_checkpoint, wrap_multimodal
from quantkit.convert.pipeline import convert
from quantkit.quant.recipe import load_recipe

CORPUS = Path(__file__).resolve().parents[2] / "calibration_data" / "default.jsonl"

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
        if kv:  # "fp8", or "fp8-calibrated" / "fp8-unit": the KV scales forced (--kv-scales) instead of the rule's
            kv_cache, _, kv_scales = kv.partition("-")
            fields.update({"kv_cache": kv_cache, "calibration.dataset": str(CORPUS), "calibration.samples": 4,
                           "calibration.seq_len": 32, **({"kv_scales": kv_scales} if kv_scales else {})})
        out = root / "out"
        convert(src, out, load_recipe(None, config, fields))
        cache[case] = (src, out)
        return cache[case]

    return make


@pytest.fixture(scope="session")
def engine_report(converted):
    """engine_report(engine, case) -> the engine's report on the case's output, launched with the record's args.

    The first request for a core case runs every core case in one batch."""
    from cases import CORE_CASES

    cache: dict[tuple[str, Case], dict] = {}

    def get(engine: str, case: Case) -> dict:
        if (engine, case) not in cache:
            batch = CORE_CASES if case in CORE_CASES else [case]
            runs = []
            for c in batch:
                out = converted(c)[1]
                runs.append((out, json.loads((out / "quantkit.json").read_text())["serving"][engine]["args"]))
            for c, report in zip(batch, run_engine_batch(engine, runs), strict=True):
                cache[(engine, c)] = report
        return cache[(engine, case)]

    return get
