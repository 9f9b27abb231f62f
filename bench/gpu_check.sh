#!/usr/bin/env bash
# The H200 check of issue 14 as one prepared command: <= 8 minutes on one H200, <= 8 files in $OUT.
#
#   bash bench/gpu_check.sh                 # on the GPU machine (results in $OUT, or ./gpu-out)
#   bash bench/gpu_check.sh --smoke         # the same code paths at tiny sizes on the CPU (CI, tests)
#   bash bench/gpu_check.sh --only kernels,rtn   # rerun some sections (the summary covers what is there)
#   bash bench/gpu_check.sh --only integrity_server,attention   # the extra sections (registry: extra=True)
#   bash bench/gpu_check.sh --fetch-wheels  # HERE, with PyPI: wheels of the packages the GPU image lacks
#   GPU_CHECK_BOXES="kernels=200" bash bench/gpu_check.sh --only kernels   # other time boxes (seconds)
#
# Sections run one after the other, each in its own process under `timeout` (one failure or hang never
# kills the rest) and each writes <section>.json as it goes; summary.md comes last. Needs torch (and
# triton, nvcc for the kernels) on the machine, nothing else: the code runs from this checkout via
# PYTHONPATH; packages a section needs and the machine lacks make that section "skipped" with the
# reason. Wheels in $GPU_CHECK_WHEELS (default ./.whl) are installed offline first, into a scratch dir.
# CPU-only preparation (the tiny model's training, the CUDA extension's build) starts in the
# background at once and overlaps the GPU sections that do not need it.
set -uo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
smoke=0
only=""
fetch=0
while [ $# -gt 0 ]; do
  case "$1" in
    --smoke) smoke=1 ;;
    --only) only="${2:?--only needs a comma-separated list of sections}"; shift ;;
    --only=*) only="${1#--only=}" ;;
    --fetch-wheels) fetch=1 ;;
    -h|--help) sed -n '2,16p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "gpu_check.sh: unknown option '$1' (see --help)" >&2; exit 2 ;;
  esac
  shift
done

if [ -n "${PYTHON:-}" ]; then py="$PYTHON"
elif [ -x "$repo/.venv/bin/python" ]; then py="$repo/.venv/bin/python"
else py="$(command -v python3 || command -v python)"; fi
[ -n "$py" ] || { echo "gpu_check.sh: no python found (set PYTHON)" >&2; exit 2; }

# Packages quantkit needs that the GPU image lacks (docs/benchmarks.md, GPU check), at the versions the
# project's environment runs, as CPython 3.12 manylinux wheels (the image's python is 3.12).
if [ "$fetch" = 1 ]; then
  exec "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$repo/.whl" compressed-tensors==0.19.0 loguru==0.7.3 pydantic==2.14.4 pydantic-core==2.50.5 \
    annotated-types==0.8.0 typing-inspection==0.4.5
fi

out="${OUT:-$PWD/gpu-out}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
work="$(mktemp -d "${TMPDIR:-/tmp}/qk-gpu-check.XXXXXX")"
bg_pids=()
cleanup() {
  for pid in "${bg_pids[@]}"; do kill "$pid" 2>/dev/null; done
  rm -rf "$work"
}
trap cleanup EXIT

flag=()
[ "$smoke" = 1 ] && flag=(--smoke)  # CPU: the same sections at tiny sizes; the time boxes only stop a hang
# The sections, in the order they run, and their time boxes (seconds): bench/gpu_sections/__init__.py. GPU-only
# sections come first; the tests and the tiny model last, when their background preparation is done.
declare -A budget=() extra=()
order=()
boxes="$("$py" "$repo/bench/gpu_check.py" boxes "${flag[@]}")" || { echo "gpu_check.sh: no section list" >&2; exit 2; }
while read -r name secs is_extra; do
  order+=("$name")
  budget[$name]=$secs
  extra[$name]=${is_extra:-0}
done <<<"$boxes"
# GPU_CHECK_BOXES="kernels=200,tests=60" overrides time boxes (seconds), e.g. for a rerun of a few sections
for kv in ${GPU_CHECK_BOXES:+${GPU_CHECK_BOXES//,/ }}; do
  if [ -z "${budget[${kv%%=*}]:-}" ] || ! [[ "${kv#*=}" =~ ^[0-9]+$ ]]; then
    echo "gpu_check.sh: bad GPU_CHECK_BOXES entry '$kv' (section=seconds)" >&2; exit 2
  fi
  budget[${kv%%=*}]=${kv#*=}
done
for name in ${only:+${only//,/ }}; do
  [ -n "${budget[$name]:-}" ] || { echo "gpu_check.sh: unknown section '$name' (${order[*]})" >&2; exit 2; }
done

export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export TORCH_EXTENSIONS_DIR="$work/torch_extensions"  # fresh: no stale build lock from an earlier run
[ "$smoke" = 1 ] || export TRITON_INTERPRET=0  # real kernels on the GPU
wheels="${GPU_CHECK_WHEELS:-$repo/.whl}"
if compgen -G "$wheels/*.whl" >/dev/null; then
  if "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$work/site" "$wheels"/*.whl \
      >"$work/wheels.log" 2>&1; then
    export PYTHONPATH="$PYTHONPATH:$work/site"
    echo "wheels installed from $wheels"
  else
    echo "wheels in $wheels did not install (sections needing them will say so): $(tail -n 1 "$work/wheels.log")"
  fi
fi
if [ "$smoke" = 0 ]; then  # CPU work in the background, overlapping the GPU-only sections that come first
  timeout 300 "$py" -c "from quantkit.kernels import cuda_ext; cuda_ext.load_extension()" \
    >"$work/prep_cuda_ext.log" 2>&1 &
  bg_pids+=($!)
  timeout 300 "$py" -m quantkit.calibrate.tiny deepseek_v3 >"$work/prep_tiny.log" 2>&1 &
  tiny_pid=$!
  bg_pids+=("$tiny_pid")
fi

run_section() {
  local name=$1 secs=${budget[$1]} t0=$SECONDS rc
  echo "== $name (time box ${secs} s)"
  timeout -k 10 "$secs" "$py" "$repo/bench/gpu_check.py" "$name" --out "$out" --work "$work/$name" \
    --budget-s "$secs" "${flag[@]}" >"$work/$name.log" 2>&1
  rc=$?
  tail -n 3 "$work/$name.log" | sed 's/^/   /'
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    "$py" "$repo/bench/gpu_check.py" stub --name "$name" --out "$out" --status timeout \
      --reason "hit its ${secs} s time box" --log "$work/$name.log" "${flag[@]}"
  elif [ "$rc" -ne 0 ] || [ ! -f "$out/$name.json" ]; then
    "$py" "$repo/bench/gpu_check.py" stub --name "$name" --out "$out" --status error \
      --reason "exited with status $rc" --log "$work/$name.log" "${flag[@]}"
  fi
  echo "   ($((SECONDS - t0)) s)"
}

for name in "${order[@]}"; do
  if [ -n "$only" ] && [[ ",$only," != *",$name,"* ]]; then continue; fi
  if [ -z "$only" ] && [ "${extra[$name]}" = 1 ]; then continue; fi  # extra sections: only by name (--only)
  if [ "$name" = gptq_tiny ] && [ -n "${tiny_pid:-}" ]; then
    wait "$tiny_pid" 2>/dev/null  # the tiny model's training (bounded by its own timeout)
    tail -n 2 "$work/prep_tiny.log" | sed 's/^/   tiny model: /'
  fi
  run_section "$name"
done

"$py" "$repo/bench/gpu_check.py" summary --out "$out" "${flag[@]}" || echo "summary failed" >&2
echo "== results in $out:"
ls -1 "$out"
sed -n '/^## Targets/,/^## Sections/p' "$out/summary.md" | head -n 14
