#!/usr/bin/env bash
# The paper's throughput table (method.md §5) on one GPU in under 8 minutes (sized for an H200, 141 GB):
# a Qwen3-14B-shaped random model in bf16, FlashAttention-2 when `flash_attn` is importable (SDPA otherwise),
# batch 16 over 4 random prompts of different lengths (256 tokens and 16, 32, 48 fewer; steady state: the planned
# prompt and up to a window less, so rows hold different lengths and evict at different steps, never in lockstep),
# greedy, EOS ignored, budgets 2048/4096/6144, window 64, outputs 16K and 32K, policies full / streaming / rkv /
# vase_attnv / vase_dkv.
#
# What is shortened to fit (say so when quoting the numbers): one full-length 16K run of a 14B model alone takes
# minutes, so the sweep uses `--protocol steady` (see vase/bench/throughput.py): each eviction policy is timed in
# its steady state (prompt = budget: the cache is full from the first step and evicts every 64 steps; capacity
# budget + 64 as in the real run) over 192 decode steps, 1 warm-up (72 steps, one eviction) + 2 timed runs (mean of 2:
# the paper drops min and max of 5); the full cache is timed at the end of each output length (prompt = 256 + N - 192,
# the real run's capacity, KV bytes and peak memory) and at its start (prompt 256); tokens/s of the full-length runs is
# estimated from those step latencies (linear in the held length). The full cache at 32K needs ~87 GB of KV on top of
# ~30 GB of weights: an out-of-memory error is caught and recorded as "OOM". Configs left when --time-limit (380 s)
# runs out are recorded as "skipped (time limit)".
#
# Usage:
#   scripts/gpu_bench_14b.sh              # on the GPU machine: gpu_check (~40 s) then the sweep (<= ~7 min)
#   CHECK=0 scripts/gpu_bench_14b.sh      # the sweep only
#   scripts/gpu_bench_14b.sh --dry-run    # the same sweep scaled down on the CPU (tiny model): checks the script
set -euo pipefail
cd "$(dirname "$0")/.."
STAMP=$(date +%Y%m%d_%H%M%S)
OUT=${OUT:-results/bench/paper14b_${STAMP}}
source scripts/project_python.sh   # PY: PY=, the active venv / conda env, else .venv (as the Makefile), else python3

if [[ "${1:-}" == "--dry-run" ]]; then
  exec "$PY" scripts/bench_throughput.py --preset paper14b --device cpu --model tiny --dtype float32 --batch 4 \
    --prompt-len 48 --budgets 64,128,192 --window 32 --output-lens 512,1024 --steady-steps 64 --warmup-steps 40 \
    --time-limit 0 --out "${OUT}_dryrun"
fi

mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/nvidia_smi.csv" || true
"$PY" -c "import importlib.util as u; print('flash_attn importable:', u.find_spec('flash_attn') is not None)"
if [[ "${CHECK:-1}" == "1" ]]; then
  # the default SDPA dispatch (and FA2 when it imports) against the math kernel: a Qwen3-0.6B-shaped model, staggered
  # rows, 128 teacher-forced steps
  timeout 90 "$PY" scripts/gpu_check.py --steps 128 --out "$OUT/gpu_check.json" || echo "gpu_check: FAILED or timed out"
fi
timeout 430 "$PY" scripts/bench_throughput.py --preset paper14b --out "$OUT" || echo "bench: exit $?"
echo "results in $OUT (bench.csv, bench.png, table.txt, machine.json, gpu_check.json)"
