#!/usr/bin/env python
"""Decode throughput and memory of every cache policy on a random-weight model (the paper's protocol, method.md §5).

The protocols, the columns of ``bench.csv`` and the targets are described in :mod:`vase.bench.throughput`; the
logic lives in ``vase/bench/``. Writes ``bench.csv``, ``bench.png``/``bench.pdf``, ``table.txt``, ``targets.json``,
``machine.json`` and ``rows.json`` into ``--out``; ``--help`` lists every option.

    # the CPU run recorded in scripts/BENCHMARKS.md (about 15 minutes on 2 cores)
    python scripts/bench_throughput.py --model cpu-small --budgets 128 --window 32 --output-lens 512,1024,2048 \\
        --batch 4 --prompt-len 128 --warmup 1 --repeats 5 --out results/bench/cpu_small

    # a quick look (tiny model, two policies)
    python scripts/bench_throughput.py --model tiny --policies full,streaming,vase_attnv --output-lens 64 \\
        --budgets 32 --window 16 --repeats 1 --warmup 0 --out /tmp/bench_tiny

    # the paper's table (Qwen3-14B-shaped random model, batch 16, FA2) on one GPU in ~8 minutes, steady-state protocol
    python scripts/bench_throughput.py --preset paper14b --out results/bench/paper14b    # see scripts/gpu_bench_14b.sh

    # recompute ratios, targets, CSV, table and plot of a finished sweep
    python scripts/bench_throughput.py --reanalyze results/bench/cpu_small
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vase.bench.throughput import main  # noqa: E402

if __name__ == "__main__":
    from vase.run.oneline import script_main

    script_main(main)
