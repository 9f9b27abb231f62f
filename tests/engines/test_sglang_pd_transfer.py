"""KV pages between a prefill and a decode process through SGLang 0.5.23's own PD transfer code and the real Mooncake
transfer engine (TCP on 127.0.0.1), page sizes 1 and 64 (tests/engines/run_sglang_pd_transfer.py says what runs).

- fp8: the stock FP8/FP8 pair moves the pages byte for byte to the decode's pages, nothing else is touched.
- bf16-fp8: the stock BF16 prefill / FP8 decode pair is refused by the decode ("KV cache dtype mismatch"); the
  prefill's request then times out in Bootstrapping.
- bf16-fp8-forced (control): with only the decode's dtype string changed so the check passes, SGLang copies BF16
  pages with the prefill's item length: both sides report Success, the intended first page stays empty and pages
  beyond the destination are overwritten.
- plugin: QUANTKIT_PD_KV=bf16-to-fp8 on the prefill: the decode's pages equal what the decode would have written
  itself (`mla_pages_to_fp8` with that layer's calibrated k_scale), neighbours untouched.
- plugin-rounds: the same with a staging of one page (QUANTKIT_PD_KV_STAGING_TOKENS = page size): SGLang's send
  runs once per page, each round reusing the one staging slot; same bytes.
- plugin-dsa (GLM-5, `DSA_CASE`): BF16 `DSATokenToKVPool` prefill -> FP8 `DSATokenToKVPool` decode (656 B rows, both
  built by SGLang's `_build_dsa_kv_pool`): the decode pool equals, byte for byte and everywhere, a pool the decode
  wrote itself from the same latents (`set_mla_kv_buffer`); the indexer K cache, SGLang's DSA state, arrives
  unchanged. Page size 1 does not exist for it: SGLang resolves `--page-size 1` to 64 for DSA, and its DSA pool
  refuses anything else.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest
from harness import ENGINES_DIR, HERE, REPO, SOURCES, EngineRunError
from test_kv_backends import MLA_CASE
from test_pd_pair import DSA_CASE

MOONCAKE = ENGINES_DIR / "mooncake"
LIBS = ENGINES_DIR / "mooncake-libs"
LIB_DIRS = (LIBS / "usr" / "lib" / "x86_64-linux-gnu", LIBS / "lib" / "x86_64-linux-gnu")
PAGES = (1, 64)


def _mooncake_env() -> dict[str, str]:
    missing = [p for p in (SOURCES["sglang"], MOONCAKE / "mooncake" / "engine.so", MOONCAKE / "zmq",
                           LIB_DIRS[0] / "libibverbs.so.1") if not p.exists()]
    if missing:
        raise EngineRunError(f"{', '.join(map(str, missing))} missing: run `make engines` first")
    ld = os.pathsep.join([*map(str, LIB_DIRS), os.environ.get("LD_LIBRARY_PATH", "")]).rstrip(os.pathsep)
    return {**os.environ, "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "1", "TOKENIZERS_PARALLELISM": "false",
            "PYTHONPATH": str(REPO), "LD_LIBRARY_PATH": ld}


@pytest.fixture(scope="module")
def transfer(converted, tmp_path_factory) -> dict[tuple[str, int], dict[str, Any]]:
    env = _mooncake_env()
    (src, out), (dsa_src, dsa) = converted(MLA_CASE), converted(DSA_CASE)
    tmp = tmp_path_factory.mktemp("sglang-pd-transfer")
    proc = subprocess.run([sys.executable, str(HERE / "run_sglang_pd_transfer.py"), str(tmp / "transfer.json"),
                           str(out), "--source", str(src), "--dsa", str(dsa), "--dsa-source", str(dsa_src)],
                          capture_output=True, text=True, timeout=600, cwd=tmp, env=env)
    if proc.returncode != 0:
        raise EngineRunError(f"run_sglang_pd_transfer.py exited {proc.returncode}: {proc.stderr[-3000:]}")
    report = json.loads((tmp / "transfer.json").read_text())
    return {(c["case"], c["page_size"]): c for c in report["cases"]}


def _ran(result: dict[str, Any]) -> None:
    assert result["finished"], "a side did not finish (killed)"
    for role in ("prefill", "decode"):
        assert "Traceback" not in (result[role].get("error") or ""), result[role]["error"]


@pytest.mark.parametrize("page", PAGES)
def test_fp8_pair_moves_pages_byte_for_byte(transfer, page: int) -> None:
    result = transfer[("fp8", page)]
    _ran(result)
    assert result["prefill"]["status"] == result["decode"]["status"] == "Success", result
    assert result["prefill"]["kv_item_lens"] == result["decode"]["kv_item_lens"] == [576 * page] * 3
    assert result["decode"]["aux_token"] == 31337  # the metadata row travelled too
    pages = result["pages"]
    assert pages["equal"] and pages["differing_bytes"] == 0, pages
    assert pages["others_untouched"] and pages["written_pages_layer0"] == sorted(pages["dst_pages"]), pages


@pytest.mark.parametrize("page", PAGES)
def test_bf16_prefill_fp8_decode_is_refused(transfer, page: int) -> None:
    result = transfer[("bf16-fp8", page)]
    _ran(result)
    decode, prefill = result["decode"], result["prefill"]
    assert decode["error"].startswith("RuntimeError: KV cache dtype mismatch: prefill server has kv_cache_dtype=bf16, "
                                      "but decode server has kv_cache_dtype=fp8_e4m3"), decode["error"]
    assert decode["status"] == "Bootstrapping"  # the receiver never left it: the scheduler would have exited
    assert prefill["status"] == "Failed" and "Bootstrapping" in prefill["failure"], prefill
    assert result["pages"]["written_pages_layer0"] == [] and result["pages"]["stray_bytes"] == 0


@pytest.mark.parametrize("page", PAGES)
def test_bf16_pages_into_fp8_pool_without_the_check_land_on_the_wrong_pages(transfer, page: int) -> None:
    result = transfer[("bf16-fp8-forced", page)]
    _ran(result)
    assert result["prefill"]["status"] == result["decode"]["status"] == "Success", result  # nobody notices
    assert result["prefill"]["kv_item_lens"] == [2 * x for x in result["decode"]["kv_item_lens"]]
    pages = result["pages"]
    first = pages["dst_pages"][0]
    assert pages["intended_pages_still_canary"] >= 3, pages  # one destination page per layer never written
    assert first not in pages["written_pages_layer0"] and not pages["others_untouched"], pages
    assert pages["written_pages_layer0"] == list(range(2 * first, 2 * (pages["dst_pages"][-1] + 1))), pages


def _plugin_moved(result: dict[str, Any]) -> dict[str, Any]:
    _ran(result)
    assert result["prefill"]["plugin_error"] is None, result["prefill"]["plugin_error"]
    assert result["prefill"]["status"] == result["decode"]["status"] == "Success", result
    assert result["prefill"]["advertised_kv_cache_dtype"] == result["decode"]["advertised_kv_cache_dtype"]
    assert result["prefill"]["kv_item_lens"] == result["decode"]["kv_item_lens"]  # the staging's, the decode's
    assert result["decode"]["aux_token"] == 31337
    pages = result["pages"]
    assert pages["equal"] and pages["differing_bytes"] == 0, pages
    assert pages["others_untouched"] and pages["written_pages_layer0"] == sorted(pages["dst_pages"]), pages
    return pages


@pytest.mark.parametrize("page", PAGES)
def test_plugin_converts_bf16_pages_to_the_decodes_fp8_pages(transfer, page: int) -> None:
    _plugin_moved(transfer[("plugin", page)])
    assert transfer[("plugin", page)]["prefill"]["rounds"] == [{"slots": [0, 1, 2], "dst": [5, 2, 6], "ret": 0}]


@pytest.mark.parametrize("page", PAGES)
def test_plugin_sends_a_request_larger_than_its_staging_in_rounds(transfer, page: int) -> None:
    result = transfer[("plugin-rounds", page)]
    _plugin_moved(result)
    assert result["prefill"]["staging_slots"] == 1
    # one SGLang send per page, each from the one staging slot, to the decode's pages in order
    assert result["prefill"]["rounds"] == [{"slots": [0], "dst": [d], "ret": 0} for d in (5, 2, 6)], result


def test_plugin_dsa_pages_equal_the_decodes_own_write(transfer) -> None:
    result = transfer[("plugin-dsa", 64)]
    pages = _plugin_moved(result)
    prefill, decode = result["prefill"], result["decode"]
    assert prefill["pool_class"] == decode["pool_class"] == "DSATokenToKVPool"
    assert (prefill["store_dtype"], decode["store_dtype"]) == ("torch.bfloat16", "torch.uint8")
    assert decode["kv_item_lens"] == [656 * 64] * 3 and pages["page_bytes_prefill"] == 1152 * 64
    assert pages["differing_bytes_whole_pool"] == 0, pages  # against the decode's own set_mla_kv_buffer write
    # SGLang registers the indexer K cache as state and moves it raw: same pages, same bytes, nothing else
    assert prefill["state_types"] == decode["state_types"] == ["dsa"]
    assert prefill["state_item_lens"] == decode["state_item_lens"] == [[64 * (128 + 4)] * 3]
    state = pages["state"]
    assert state["equal"] and state["stray_bytes"] == 0 and state["intended_pages_still_canary"] == 0, state


def test_dsa_has_no_page_size_1(transfer) -> None:
    """GLM-5 on CUDA: SGLang resolves --page-size 1 to 64, and its DSA pool asserts 64-token pages."""
    result = transfer[("plugin-dsa", 1)]
    _ran(result)
    for role in ("prefill", "decode"):
        side = result[role]
        assert side["page_size_resolved"] == 64 and side["status"] is None, side
        assert side["pool_error"].startswith("AssertionError: DSA requires 64-token physical pages"), side
