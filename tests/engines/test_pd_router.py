"""The router line of every PD pair quantkit records, parsed by SGLang's own router launcher (`sglang-router`,
`sglang_router.launch_router.parse_router_args`, its Rust core imported): the router must pair the prefill's
HTTP port with the prefill's bootstrap port and point at the decode's HTTP port, or requests never meet their KV.
Not run: the router serving (it would need two live servers)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from harness import ENGINES_DIR, EngineRunError
from test_kv_backends import MLA_CASE
from test_pd_pair import DSA_CASE

ROUTER = ENGINES_DIR / "router"
PARSE = """
import json, sys
from sglang_router.launch_router import parse_router_args
out = []
for argv in json.load(sys.stdin):
    a = parse_router_args(argv)
    out.append({"pd": a.pd_disaggregation, "prefill": [[u, p] for u, p in a.prefill_urls],
                "decode": list(a.decode_urls), "port": a.port})
print(json.dumps(out))
"""


def _flag(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


@pytest.fixture(scope="module")
def records(converted) -> list[tuple[str, dict]]:
    out = []
    for name, case in (("mla", MLA_CASE), ("dsa", DSA_CASE)):
        serving = json.loads((converted(case)[1] / "quantkit.json").read_text())["serving"]["sglang"]
        out += [(f"{name}-{key}", serving[key]) for key in ("pd", "pd_split")]
    return out


def test_router_pairs_the_recorded_servers(records) -> None:
    if not (ROUTER / "sglang_router").is_dir():
        raise EngineRunError(f"{ROUTER} missing: run `make engines` first")
    argvs = []
    for _, pair in records:
        argv = pair["router"]["args"]
        assert argv[:3] == ["python", "-m", "sglang_router.launch_router"]
        argvs.append(argv[3:])
    path = os.pathsep.join(str(p) for p in (ROUTER, ENGINES_DIR / "mooncake", ENGINES_DIR / "deps-sglang"))
    proc = subprocess.run([sys.executable, "-c", PARSE], input=json.dumps(argvs), capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": path})
    if proc.returncode != 0:
        raise EngineRunError(f"sglang_router exited {proc.returncode}: {proc.stderr[-2000:]}")
    for (name, pair), got in zip(records, json.loads(proc.stdout), strict=True):
        prefill, decode = pair["prefill"]["args"], pair["decode"]["args"]
        assert got["pd"], name
        [(url, bootstrap)] = got["prefill"]
        assert url.endswith(f":{_flag(prefill, '--port')}"), (name, got)
        assert bootstrap == int(_flag(prefill, "--disaggregation-bootstrap-port")) == int(
            _flag(decode, "--disaggregation-bootstrap-port")), (name, got)
        assert [u.rsplit(":", 1)[1] for u in got["decode"]] == [_flag(decode, "--port")], (name, got)
