#!/usr/bin/env bash
# The first thing to run on a new GPU machine (and what a lent GPU runs first): at most 8 minutes on one GPU
# (H100/H200 class, 80+ GB), one table:
#   env     device, torch / CUDA / cuDNN, whether flash_attn imports, attn_backend=auto, torch's default SDPA kernel
#           for a staggered decode call;
#   kernel  the default SDPA dispatch against the math kernel (and FlashAttention-2 against it when it imports),
#           rows of different lengths, prefill and decode, teacher-forced against float32 (scripts/gpu_check.py);
#   decode  a short real decode on a Qwen3-4B-shaped random model: vase_dkv, sampled, staggered rows refilled;
#   rows    tok/s against rows at equal KV memory, full vs vase_dkv, staggered prompts (scripts/gpu_bench_rows.py);
#   and the peak memory of each section. Each section has a time cap (vase/bench/smoke.py: CAPS); this script stops
#   the whole run at 470 s (SIGINT: the partial table is still printed).
#
# Usage:
#   scripts/gpu_smoke.sh              # on the GPU machine; results in results/bench/gpu_smoke_<time>/
#   scripts/gpu_smoke.sh --dry-run    # on a CPU, tiny shapes: every code path the GPU run takes but the kernels
# Python: PY=/path/to/python, else the active virtual environment or conda env, else .venv/ (as the Makefile;
# no .venv: python3 from PATH; scripts/project_python.sh), so it runs right after `make run` without activation.
# A machine without a package registry: build the carry folder on a connected machine (scripts/gpu_carry.py, the
# wheels the image lacks, <= 64 MiB), copy it here as .carry/ (or set CARRY=dir). This script then checks the
# machine's own torch, huggingface-hub, ... against it, installs it without a registry into .carry/site and puts
# that first on PYTHONPATH (the image's own packages stay untouched). See docs/gpus.md.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/project_python.sh   # PY: PY=, the active venv / conda env, else .venv (as the Makefile), else python3

if [[ -n "${CARRY:-}" && ! -f "$CARRY/carry.json" ]]; then
  echo "$0: CARRY=$CARRY has no carry.json; build it with \`python scripts/gpu_carry.py --out $CARRY\` (docs/gpus.md)" >&2
  exit 2
fi
CARRY="${CARRY:-.carry}"
if [[ -f "$CARRY/carry.json" ]]; then
  CARRY="$(cd "$CARRY" && pwd)"
  # the machine's own torch, huggingface-hub, numpy, ... first: one line naming what is missing
  "$PY" scripts/gpu_carry.py --out "$CARRY" --check || exit 2
  if ! cmp -s "$CARRY/carry.json" "$CARRY/site/.installed"; then
    rm -rf "$CARRY/site"
    if ! "$PY" -m pip install --quiet --no-index --no-deps --target "$CARRY/site" "$CARRY"/wheels/*.whl; then
      echo "$0: could not install $CARRY/wheels into $CARRY/site (pip --no-index --no-deps --target)" >&2
      exit 2
    fi
    cp "$CARRY/carry.json" "$CARRY/site/.installed"
  fi
  export PYTHONPATH="$CARRY/site${PYTHONPATH:+:$PYTHONPATH}"
  "$PY" scripts/gpu_carry.py --out "$CARRY" --verify || exit 2
fi
"$PY" scripts/gpu_carry.py --preflight || exit 2

if [[ "${1:-}" == "--dry-run" ]]; then
  shift
  exec "$PY" scripts/gpu_smoke.py --dry-run "$@"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "nvidia-smi: not found"
exec timeout --signal=INT --kill-after=10 470 "$PY" scripts/gpu_smoke.py "$@"
