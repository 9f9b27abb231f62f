"""The prefill/decode pair quantkit records and prints, put through SGLang 0.5.23's own PD checks on the CPU.

`run_sglang_pd.py` executes, per side, SGLang's argument resolution, quantization-config parsing,
`configure_kv_cache_dtype` and `calculate_mla_kv_cache_dim`, then the decode's first-request handshake
`CommonKVManager.try_ensure_parallel_info` against the prefill's bootstrap reply. SGLang is imported once for
the whole module (one runner process, each side in a forked child).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from harness import HERE, REPO, SOURCES, EngineRunError

from quantkit.engines.pd import PDPair, pd_problems

MLA_CASE = ("deepseek_v3", "fp8", 32, "fp8")  # FP8 source, INT4 output with the MLA KV scales the rule ships
DSA_CASE = ("glm_moe_dsa", "fp8", 32, None)


def _argv(args: list[str], src: Path, out: Path) -> list[str]:
    """A recorded launch argv as server args on this machine's checkpoints (the launcher prefix dropped)."""
    assert args[:3] == ["python", "-m", "sglang.launch_server"]
    return [str(src) if a == "<fp8-source>" else str(out) if a == "<MODEL>" else a for a in args[3:]]


def _with(args: list[str], flag: str, value: str) -> list[str]:
    args = list(args)
    args[args.index(flag) + 1] = value
    return args


@pytest.fixture(scope="module")
def sglang_pd(converted, tmp_path_factory) -> dict[str, Any]:
    """name -> SGLang's report for each pair: quantkit's recorded pairs, today's printed pair, broken variants."""
    if not SOURCES["sglang"].is_dir():
        raise EngineRunError(f"{SOURCES['sglang']} is missing: run `make engines` first")
    jobs = []
    pairs = {}
    for name, case in (("mla", MLA_CASE), ("dsa", DSA_CASE)):
        src, out = converted(case)
        record = json.loads((out / "quantkit.json").read_text())["serving"]["sglang"]["pd"]
        pair = PDPair.from_dict(record)
        pairs[name] = pair
        p, d = _argv(pair.prefill.args, src, out), _argv(pair.decode.args, src, out)
        jobs.append({"name": name, "prefill": {"ckpt": str(src), "args": p}, "decode": {"ckpt": str(out), "args": d}})
        if name == "mla":
            # what `quantkit plan --compare` printed before this pair existed: prefill `auto` on the FP8 source,
            # decode `fp8_e4m3` on the output; and `auto` on both (the output's kv_cache_scheme resolves it)
            jobs.append({"name": "today", "prefill": {"ckpt": str(src), "args": _with(p, "--kv-cache-dtype", "auto")},
                         "decode": {"ckpt": str(out), "args": d}})
            jobs.append({"name": "auto-both", "prefill": {"ckpt": str(src), "args": _with(p, "--kv-cache-dtype",
                                                                                            "auto")},
                         "decode": {"ckpt": str(out), "args": _with(d, "--kv-cache-dtype", "auto")}})
            jobs.append({"name": "auto-vs-bf16", "prefill": {"ckpt": str(src), "args": _with(p, "--kv-cache-dtype",
                                                                                               "auto")},
                         "decode": {"ckpt": str(src), "args": _with(d, "--kv-cache-dtype", "bf16")}})
        else:
            jobs.append({"name": "dsa-rows", "prefill": {"ckpt": str(src), "args": p},
                         "decode": {"ckpt": str(out), "args": _with(d, "--dsa-decode-backend", "trtllm")}})
    tmp = tmp_path_factory.mktemp("sglang-pd")
    (tmp / "jobs.json").write_text(json.dumps(jobs))
    proc = subprocess.run([sys.executable, str(HERE / "run_sglang_pd.py"), str(tmp / "jobs.json"),
                           str(tmp / "out.json")], capture_output=True, text=True, timeout=600, cwd=tmp,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO),
                               "TOKENIZERS_PARALLELISM": "false"})
    if proc.returncode != 0:
        raise EngineRunError(f"run_sglang_pd.py exited {proc.returncode}: {proc.stderr[-3000:]}")
    reports = {r["name"]: r for r in json.loads((tmp / "out.json").read_text())}
    for r in reports.values():
        for role in ("prefill", "decode"):
            assert "error" not in r[role], r[role].get("error")
    return {"reports": reports, "pairs": pairs}


def test_todays_printed_pair_is_refused_by_sglang(sglang_pd) -> None:
    today = sglang_pd["reports"]["today"]
    assert today["prefill"]["kv_cache_dtype_str"] == "auto"  # FP8 source: no kv_cache_scheme, `auto` stays `auto`
    assert not today["handshake"]["accepted"]
    assert "KV cache dtype mismatch" in today["handshake"]["error"]


def test_string_rule_auto_resolves_only_with_a_kv_cache_scheme(sglang_pd) -> None:
    """SGLang compares strings: `auto` on the INT4 output (static FP8 kv_cache_scheme) becomes fp8_e4m3, `auto`
    on the FP8 source stays `auto`; `auto` vs `bf16` is refused although both pools are BF16."""
    from quantkit.engines.pd import resolve_kv_dtype_str

    both = sglang_pd["reports"]["auto-both"]
    assert both["decode"]["kv_cache_dtype_str"] == resolve_kv_dtype_str("auto", True) == "fp8_e4m3"
    assert both["prefill"]["kv_cache_dtype_str"] == resolve_kv_dtype_str("auto", False) == "auto"
    assert "KV cache dtype mismatch" in both["handshake"]["error"]
    bf16 = sglang_pd["reports"]["auto-vs-bf16"]
    assert bf16["prefill"]["kv_dtype"] == bf16["decode"]["kv_dtype"] == "bfloat16"
    assert "KV cache dtype mismatch" in bf16["handshake"]["error"]


@pytest.mark.parametrize("name", ["mla", "dsa"])
def test_recorded_pair_is_accepted_and_matches_what_sglang_resolves(sglang_pd, name: str) -> None:
    report, pair = sglang_pd["reports"][name], sglang_pd["pairs"][name]
    assert report["handshake"] == {"accepted": True, "error": None}
    assert pd_problems(pair) == []
    for role, side in (("prefill", pair.prefill), ("decode", pair.decode)):
        got = report[role]
        assert got["kv_cache_dtype_str"] == side.kv_dtype_resolved == "fp8_e4m3"
        assert got["page_size"] == side.page_size and got["dtype"] == side.dtype
        assert got["kv_row_bytes"] == side.kv_row_bytes
        backend = got[f"dsa_{role}_backend"] if name == "dsa" else got["attention_backend"]
        assert backend == side.attention_backend
    if name == "dsa":
        assert pair.decode.kv_row_bytes == 656  # 512 FP8 + 4 fp32 tile scales + 64 bf16 rope (flashmla_kv, SM90)


def test_dsa_rows_sglang_accepts_but_quantkit_refuses(sglang_pd) -> None:
    """Both sides say fp8_e4m3, SGLang's handshake passes, and the rows differ: 656 B pages copied into 576 B."""
    report, pair = sglang_pd["reports"]["dsa-rows"], sglang_pd["pairs"]["dsa"]
    assert report["handshake"]["accepted"]
    assert (report["prefill"]["kv_row_bytes"], report["decode"]["kv_row_bytes"]) == (656, 576)
    from dataclasses import replace

    broken = replace(pair, decode=replace(pair.decode, attention_backend="trtllm", kv_row="dsa-576",
                                          kv_row_bytes=report["decode"]["kv_row_bytes"]))
    assert any("--dsa-decode-backend" in p for p in pd_problems(broken))


def test_validate_refuses_a_pair_sglang_refuses(converted, tmp_path) -> None:
    """`validate` reads the recorded pair; one with today's `auto` prefill fails, naming the flag."""
    import shutil
    from dataclasses import replace

    from quantkit.validate.checkpoint import validate_checkpoint

    out = tmp_path / "out"
    shutil.copytree(converted(MLA_CASE)[1], out)
    manifest = json.loads((out / "quantkit.json").read_text())
    pair = PDPair.from_dict(manifest["serving"]["sglang"]["pd"])
    assert next(c for c in validate_checkpoint(out).checks if c.name == "sglang PD pair").status == "ok"
    bad = replace(pair, prefill=replace(pair.prefill, kv_cache_dtype="auto", kv_dtype_resolved="auto"))
    manifest["serving"]["sglang"]["pd"] = bad.to_dict()
    (out / "quantkit.json").write_text(json.dumps(manifest))
    check = next(c for c in validate_checkpoint(out).checks if c.name == "sglang PD pair")
    assert check.status == "fail" and "--kv-cache-dtype" in check.detail
