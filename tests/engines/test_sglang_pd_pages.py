"""The plugin's BF16 -> FP8 page conversion, byte for byte against the pages SGLang's decode server writes itself
(SGLang's real MLA and DSA pools on the CPU, page sizes 1 and 64; tests/engines/run_sglang_pd_pages.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest
from harness import HERE, REPO, SOURCES, EngineRunError
from test_kv_backends import MLA_CASE, _k_scale


@pytest.fixture(scope="module")
def pages(converted, tmp_path_factory) -> dict[int, dict[str, Any]]:
    if not SOURCES["sglang"].is_dir():
        raise EngineRunError(f"{SOURCES['sglang']} is missing: run `make engines` first")
    out = converted(MLA_CASE)[1]
    tmp = tmp_path_factory.mktemp("sglang-pages")
    proc = subprocess.run([sys.executable, str(HERE / "run_sglang_pd_pages.py"), str(tmp / "pages.json"), str(out),
                           repr(_k_scale(out))], capture_output=True, text=True, timeout=600, cwd=tmp,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "1",
                               "PYTHONPATH": str(REPO), "TOKENIZERS_PARALLELISM": "false"})
    if proc.returncode != 0:
        raise EngineRunError(f"run_sglang_pd_pages.py exited {proc.returncode}: {proc.stderr[-3000:]}")
    report = json.loads((tmp / "pages.json").read_text())
    return {p["page_size"]: p for p in report["pages"]}


@pytest.mark.parametrize(("page", "layout", "row"), [(1, "mla", 576), (64, "mla", 576), (1, "dsa", 656),
                                                    (64, "dsa", 656)])
def test_converted_prefill_pages_equal_the_decodes_own_pages(pages, page: int, layout: str, row: int) -> None:
    result = pages[page]
    assert "error" not in result, result.get("error")
    got = result[layout]
    assert got["decode_written"] and got["bytes_per_page"] == page * row
    assert got["equal"], got


def test_plugin_reads_the_split_record_and_the_decodes_scales(converted) -> None:
    """`convert` records the plugin split; the plugin reads from the decode's checkpoint the dtype string and rows
    the decode stores and, as its attention applies them (triton), every layer's calibrated k_scale; validate
    checks the split."""
    from safetensors import safe_open

    from quantkit.serving.pd.sglang import decode_target
    from quantkit.validate.checkpoint import validate_checkpoint

    out = converted(MLA_CASE)[1]
    split = json.loads((out / "quantkit.json").read_text())["serving"]["sglang"]["pd_split"]
    assert split["decode"]["attention_backend"] == "triton" and split["decode"]["kv_scale"] == "calibrated"
    target = decode_target(out)
    assert (target.kv_dtype, target.row) == ("fp8_e4m3", "mla")
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    names = {n: f for n, f in index.items() if n.endswith("self_attn.k_proj.k_scale")}
    assert len(target.scales) == len(names) >= 2
    for name, shard in names.items():
        with safe_open(out / shard, "pt") as f:
            assert target.scales[int(name.split(".")[2])] == float(f.get_tensor(name))
    assert len(set(target.scales.values())) > 1  # per layer, not one number
    checks = {c.name: c for c in validate_checkpoint(out).checks}
    assert checks["sglang PD split (plugin)"].status == "ok", checks["sglang PD split (plugin)"]
