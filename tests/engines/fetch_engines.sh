#!/usr/bin/env bash
# Fetch the engines whose loader code the conformance tests execute: the released PyPI wheels of
# SGLang and vLLM, unpacked as plain Python under .cache/engines/src (never vendored into the repo),
# vLLM's pinned compressed-tensors in its own directory (never the project venv), and the few
# pure-Python modules the engines import at module level. Idempotent; a finished step is kept.
# Usage: tests/engines/fetch_engines.sh [PYTHON]   (env: SGLANG_VERSION, VLLM_VERSION to try others)
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${1:-.venv/bin/python}
SGLANG_VERSION=${SGLANG_VERSION:-0.5.23}
VLLM_VERSION=${VLLM_VERSION:-0.33.0}
VLLM_CT_VERSION=${VLLM_CT_VERSION:-0.17.0}
ROOT=.cache/engines
STAMP="$ROOT/.ready-sglang-$SGLANG_VERSION-vllm-$VLLM_VERSION"
MOONCAKE_VERSION=${MOONCAKE_VERSION:-0.3.13.post1}
MOONCAKE_STAMP="$ROOT/.ready-mooncake-$MOONCAKE_VERSION"

# The Mooncake transfer engine (TCP mode, no CUDA) for the PD transfer test (tests/engines/run_sglang_pd_transfer.py):
# the wheel plus what SGLang's disaggregation code imports that the venv lacks (pyzmq, aiohttp for the bootstrap
# server, prometheus_client), installed with --no-deps into .cache/engines/mooncake; the wheel's engine.so links
# libibverbs, taken from Debian's packages and only unpacked (dpkg -x) into .cache/engines/mooncake-libs.
# Its own stamp: machines that already hold the older engines pick this step up.
mooncake() {
  [ -f "$MOONCAKE_STAMP" ] && return 0
  local dir=$ROOT/mooncake libs=$ROOT/mooncake-libs tmp deb
  rm -rf "$dir" "$libs" && mkdir -p "$dir" "$libs"
  "$PY" -m pip install -q --no-deps --target "$dir" "mooncake-transfer-engine-non-cuda==$MOONCAKE_VERSION" \
    pyzmq==27.3.0 prometheus-client==0.26.0 aiohttp==3.14.5 aiohappyeyeballs==2.7.1 aiosignal==1.4.0 \
    frozenlist==1.8.0 multidict==7.2.1 propcache==0.5.4 yarl==1.25.1 msgpack==1.2.4
  tmp=$(mktemp -d)
  if ! (cd "$tmp" && apt-get download -q libibverbs1 libnl-3-200 libnl-route-3-200 >/dev/null 2>&1); then
    apt-get update -q >/dev/null && (cd "$tmp" && apt-get download -q libibverbs1 libnl-3-200 libnl-route-3-200 >/dev/null)
  fi
  for deb in "$tmp"/*.deb; do dpkg -x "$deb" "$libs"; done
  rm -rf "$tmp"
  touch "$MOONCAKE_STAMP"
}
mooncake

# SGLang's PD router (the `sglang-router` wheel, its Rust core included) and what its launcher imports, for the
# test that parses the router command quantkit records with the router's own argument parser.
ROUTER_VERSION=${ROUTER_VERSION:-0.3.2}
ROUTER_STAMP="$ROOT/.ready-router-$ROUTER_VERSION"
router() {
  [ -f "$ROUTER_STAMP" ] && return 0
  rm -rf "$ROOT/router" && mkdir -p "$ROOT/router"
  "$PY" -m pip install -q --no-deps --target "$ROOT/router" "sglang-router==$ROUTER_VERSION" setproctitle==1.3.7 \
    uvicorn==0.54.0 h11==0.16.0 fastapi==0.122.0
  touch "$ROUTER_STAMP"
}
router
[ -f "$STAMP" ] && exit 0
mkdir -p "$ROOT/wheels"

fetch() {  # fetch NAME VERSION DEST: download the wheel (no deps) and unpack it into DEST
  local name=$1 version=$2 dest=$3
  [ -f "$dest/.unpacked-$version" ] && return 0
  "$PY" -m pip download -q --no-deps "$name==$version" -d "$ROOT/wheels"
  rm -rf "$dest" && mkdir -p "$dest"
  local wheel
  wheel=$(ls "$ROOT"/wheels/"${name//-/_}"-"$version"-*.whl | head -n 1)
  "$PY" -m zipfile -e "$wheel" "$dest"
  touch "$dest/.unpacked-$version"
}

fetch sglang "$SGLANG_VERSION" "$ROOT/src/sglang"
fetch vllm "$VLLM_VERSION" "$ROOT/src/vllm"
fetch compressed-tensors "$VLLM_CT_VERSION" "$ROOT/ct017"

# Pure-Python modules the engines import at module level that the project venv lacks (no compiled code).
deps() {  # deps DIR REQ...
  local dir=$1; shift
  [ $# -eq 0 ] && return 0
  "$PY" -m pip install -q --no-deps --target "$dir" "$@"
}
SGLANG_DEPS=(msgspec==0.23.0 orjson==3.13.0 openai==2.8.0 distro==1.9.0 sniffio==1.3.1 partial_json_parser==0.2.1.1.post7 einops==0.8.1 starlette==0.50.0)
VLLM_DEPS=()
deps "$ROOT/deps-sglang" "${SGLANG_DEPS[@]}"
deps "$ROOT/deps-vllm" "${VLLM_DEPS[@]}"
touch "$STAMP"
