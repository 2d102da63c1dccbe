#!/usr/bin/env python
"""Continuous batching on this machine: tok/s against rows, throughput at equal KV memory, flat peak memory.

The logic and the definitions are in :mod:`vase.bench.rows`. Writes ``result.json`` and ``table.md`` into ``--out``.
The commands recorded in scripts/BENCHMARKS.md:

    # (b) tok/s against rows in flight, the real 0.5B model, bf16 and float32, 2 interleaved rounds
    python scripts/bench_rows.py rows --out results/bench/rows

    # (c) throughput at equal KV memory: full vs snapkv / vase_attnv / vase_dkv at ratio 4, 512-token outputs
    python scripts/bench_rows.py memory --new-tokens 512 --prompt-len 64 --window 16 --full-rows 4 --samples 16 \\
        --out results/bench/equal_memory

    # peak memory of 8 vs 64 samples through the same 8 rows (fresh processes)
    python scripts/bench_rows.py flat --new-tokens 64 --out results/bench/flat
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vase.bench.rows import main  # noqa: E402

if __name__ == "__main__":
    from vase.run.oneline import script_main

    script_main(main)
