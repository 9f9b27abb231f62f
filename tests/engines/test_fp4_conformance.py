"""FP4 engine conformance: SGLang's and vLLM's own loader code on quantkit's NVFP4A16 / MXFP4A16 outputs agrees
with the serving record (quantkit.json `serving`), at the SM 9.0 (Hopper) and SM 10.0 (Blackwell) answers of
the platform probe.

Per case: the engine raises exactly when the record says `fails` (SGLang has no MXFP4 path for these models);
otherwise every checkpoint tensor lands (except those the record says are skipped by design), no parameter
expecting data is left without it (vLLM's A16 NVFP4 MoE creates `*_input_global_scale` and never reads them),
the routed experts get the record's FP4 MoE method and nothing else an FP4 or INT4 one, the cache is BF16 or
(KV cases) FP8 with the calibrated scale, and every gate/up pair the engine fuses carries one global scale.
Fast: the three families' SM 9.0 cases.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest
from cases import REAL_MLA
from harness import run_engine_batch
from test_conformance import check_kv_read

from quantkit.checkpoint.synth import make_checkpoint, wrap_multimodal
from quantkit.convert.pipeline import convert
from quantkit.quant.recipe import load_recipe

CORPUS = Path(__file__).resolve().parents[2] / "calibration_data" / "default.jsonl"
FP4Case = tuple[str, str, str, str | None]  # family, source format, scheme, KV (None | "fp8": calibrated scales)
FAST: list[FP4Case] = [(f, fmt, s, None) for f, fmt in (("deepseek_v3", "fp8"), ("glm_moe_dsa", "fp8"),
                                                         ("kimi_k25", "int4")) for s in ("nvfp4a16", "mxfp4a16")]
SLOW: list[FP4Case] = [("deepseek_v3", "bf16", "nvfp4a16", None), ("glm4_moe", "bf16", "nvfp4a16", None),
                       ("glm4_moe", "fp8", "mxfp4a16", None), ("glm_moe_dsa", "bf16", "mxfp4a16", None),
                       ("deepseek_v3", "fp8", "nvfp4a16", "fp8"), ("glm4_moe", "fp8", "nvfp4a16", "fp8")]
# NVFP4 W4A4 (calibrated input_global_scale): SM 10.0 picks the W4A4 schemes, SM 9.0 weight-only
W4A4: list[FP4Case] = [("deepseek_v3", "fp8", "nvfp4", None)]
SMS = ("9.0", "10.0")
# vLLM's CUTLASS MLA backend (its SM 10.0 default) allocates with real CUDA torch at construction: the harness
# runs the Triton MLA backend instead, for the MTP draft too (attention is not what these cases check)
_MTP_TRITON = json.dumps({"method": "mtp", "num_speculative_tokens": 1, "attention_backend": "TRITON_MLA"})


def _harness_limit(engine: str, case: FP4Case, sm: str) -> str | None:
    """Why the harness cannot run this case (None: it can)."""
    if engine == "vllm" and sm != "9.0" and case[0] == "glm_moe_dsa":
        return ("vLLM's sparse-MLA backends at SM 10.0 need CUDA at construction (CUTLASS MLA) or FP8 KV "
                "(FlashMLA sparse); Triton MLA has no sparse mode: a harness limit, not the checkpoint's")
    return None


def _harness_args(engine: str, case: FP4Case, sm: str) -> list[str]:
    if engine != "vllm" or sm == "9.0" or case[0] == "glm4_moe":  # GQA: vLLM's default backend constructs
        return []
    return ["--attention-backend", "TRITON_MLA"] + (["--speculative-config", _MTP_TRITON]
                                                     if case[0] != "kimi_k25" else [])
EXPERTS = re.compile(r"\.mlp\.experts(\.routed_experts)?$")
_METHOD = {"nvfp4a16": "Nvfp4", "mxfp4a16": "Mxfp4", "nvfp4": "Nvfp4"}


def _params() -> list[object]:
    out = []
    for sm in SMS:
        for case in FAST + SLOW + W4A4:
            slow = sm != "9.0" or case in SLOW + W4A4
            name = "-".join(case[:3]) + (f"-kv{case[3]}" if case[3] else "")
            out.append(pytest.param(case, sm, id=f"{name}-sm{sm}", marks=pytest.mark.slow if slow else ()))
    return out


@pytest.fixture(scope="module")
def fp4_converted(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest):
    cache: dict[FP4Case, Path] = {}

    def make(case: FP4Case) -> Path:
        if case not in cache:
            family, fmt, scheme, kv = case
            root = tmp_path_factory.mktemp("-".join(case[:3]))
            base = "deepseek_v3" if family == "kimi_k25" else family
            overrides: dict[str, int] = dict(REAL_MLA) if base != "glm4_moe" else {}
            calibrated = kv is not None or scheme == "nvfp4"  # KV scales / W4A4 activation scales
            if calibrated:
                overrides["vocab_size"] = 512  # the trained tokenizer's vocabulary
            src = make_checkpoint(root / "src", base, fmt, size="tiny", config_overrides=overrides or None,
                                  mtp=family != "kimi_k25")
            if family == "kimi_k25":
                src = wrap_multimodal(src, root / "src-kimi", "kimi_k25", vision_tensor=False)
            fields: dict[str, object] = {"scheme": scheme}
            if calibrated:
                tok = request.getfixturevalue("tokenizer_dir")
                for f in tok.iterdir():
                    if f.is_file() and f.name != "config.json":
                        shutil.copy2(f, src / f.name)
                fields.update({"calibration.dataset": str(CORPUS), "calibration.samples": 4,
                               "calibration.seq_len": 32, **({"kv_cache": kv} if kv else {})})
            config = json.loads((src / "config.json").read_text())
            convert(src, root / "out", load_recipe(None, config, fields))
            cache[case] = root / "out"
        return cache[case]

    return make


@pytest.fixture(scope="module")
def fp4_report(fp4_converted):
    """fp4_report(engine, case, sm): the engine's report; the first fast request runs all fast cases in one batch,
    the first slow one all slow cases of its SM."""
    cache: dict[tuple[str, FP4Case, str], dict] = {}

    def get(engine: str, case: FP4Case, sm: str) -> dict:
        if (engine, case, sm) not in cache:
            fast = case in FAST and sm == "9.0"  # slow requests batch every slow case of their SM too
            batch = FAST if fast else [c for c in FAST + SLOW if (c in SLOW or sm != "9.0")
                                       and (engine, c, sm) not in cache and not _harness_limit(engine, c, sm)]
            if case in W4A4:  # a batch of its own (run alone with -k nvfp4-)
                batch = [case]
            runs = []
            for c in batch:
                out = fp4_converted(c)
                args = json.loads((out / "quantkit.json").read_text())["serving"][engine]["args"]
                runs.append((out, args + _harness_args(engine, c, sm)))
            old = os.environ.get("QUANTKIT_ENGINE_SM")
            os.environ["QUANTKIT_ENGINE_SM"] = sm
            try:
                reports = run_engine_batch(engine, runs)
            finally:
                os.environ.pop("QUANTKIT_ENGINE_SM") if old is None else os.environ.__setitem__("QUANTKIT_ENGINE_SM",
                                                                                                 old)
            for c, report in zip(batch, reports, strict=True):
                cache[(engine, c, sm)] = report
        return cache[(engine, case, sm)]

    return get


def _global_scales(out: Path, kind: str = "weight") -> dict[str, float]:
    from safetensors import safe_open

    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    values = {}
    for name, shard in index.items():
        if name.endswith(f".{kind}_global_scale"):
            with safe_open(out / shard, "pt") as fh:
                values[name.removesuffix(f".{kind}_global_scale")] = float(fh.get_tensor(name).item())
    return values


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
@pytest.mark.parametrize(("case", "sm"), _params())
def test_engine_loads_fp4_output_as_the_record_says(engine, case, sm, fp4_converted, fp4_report) -> None:
    out = fp4_converted(case)
    scheme = case[2]
    verdict = json.loads((out / "quantkit.json").read_text())["serving"][engine]
    assert set(verdict["gpus"]) == {"hopper (SM90)", "blackwell (SM100)"}
    limit = _harness_limit(engine, case, sm)
    if limit:
        pytest.skip(limit)
    report = fp4_report(engine, case, sm)
    sections = [report] + ([report["draft"]] if report.get("draft") else [])
    if verdict["verdict"] == "fails":
        assert report["error"] is not None, "the record says this engine fails, but it loaded the checkpoint"
        return
    for section in sections:
        assert section["error"] is None, section["error"]
    skipped = set(report["skipped_tensors"])
    if report.get("draft"):
        skipped &= set(report["draft"]["skipped_tensors"])
    ignored = set(verdict["ignored_tensors"])
    assert skipped == ignored, (sorted(skipped - ignored)[:6], sorted(ignored - skipped)[:6])
    for section in sections:
        unloaded = [p for p in section["unloaded_params"] if not p.startswith(("vision_tower.", "mm_projector."))]
        if engine == "vllm" and scheme == "nvfp4a16":  # use_a16: created, never read
            unloaded = [p for p in unloaded if not p.endswith(("w13_input_global_scale", "w2_input_global_scale"))]
        assert unloaded == [], unloaded[:8]
        experts = 0
        for module, method in section["methods"].items():
            if EXPERTS.search(module):
                experts += 1
                assert method and _METHOD[scheme] in method, (module, method)
                if scheme == "nvfp4":  # SGLang: W4A4 scheme on SM 10.0, weight-only W4A16 below; vLLM: one class,
                    want = "W4A4" if engine == "vllm" or sm != "9.0" else "W4A16"  # its backend Marlin below SM100
                    assert want in method, (module, method, sm)
                    if engine == "vllm":
                        assert (":MARLIN" in method) == (sm == "9.0"), (module, method, sm)
            else:
                assert method is None or not any(k in method for k in ("Fp4", "fp4", "WNA16", "Int4")), (module,
                                                                                                       method)
        assert experts, "no routed-expert module reported"
    check_kv_read(verdict["kv_cache"], report, out)  # the KV scale the attention reads is the record's
    for kind in ("weight", "input") if scheme == "nvfp4" else ("weight",) if scheme == "nvfp4a16" else ():
        scales = _global_scales(out, kind)  # one per gate/up pair: what SGLang demands and vLLM keeps one of
        pairs = [m for m in scales if m.endswith(".gate_proj")]
        assert pairs
        for gate in pairs:
            assert scales[gate] == scales[gate.removesuffix("gate_proj") + "up_proj"], gate


def test_fp4_config_parses_with_vllms_compressed_tensors_017(fp4_converted) -> None:
    """vLLM 0.33.0 pins compressed-tensors 0.17.0: it parses quantkit's NVFP4A16 and MXFP4A16 configs."""
    import subprocess
    import sys

    from harness import CT017
    from test_conformance import _CT017_PARSE

    outs = [fp4_converted(c) for c in FAST[:2]]
    res = subprocess.run([sys.executable, "-c", _CT017_PARSE, str(CT017), *(str(o / "config.json") for o in outs)],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.split() == ["0.17.0", "nvfp4-pack-quantized", "False", "0.17.0", "mxfp4-pack-quantized", "False"]
