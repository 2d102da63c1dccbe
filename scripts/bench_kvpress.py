#!/usr/bin/env python
"""Our ``snapkv`` against kvpress's ``DecodingPress(SnapKVPress)``: same random model, same settings, same machine.

kvpress pins an older transformers than ours, so its side runs from its own virtual environment, in fresh processes
(ABBA rounds). The equal settings on both sides and the measurement: :mod:`vase.bench.kvpress` (the logic lives in
``vase/bench/``). Writes ``kvpress.csv`` and ``kvpress.json`` into ``--out``.

Setup (once; torch is pinned FIRST so pip never pulls another torch build)::

    python scripts/bench_kvpress.py --setup-venv            # = the three commands below
    python -m venv /tmp/kvpress-venv
    /tmp/kvpress-venv/bin/pip install torch==2.13.0
    echo torch==2.13.0 > /tmp/kvpress-constraints.txt
    /tmp/kvpress-venv/bin/pip install -c /tmp/kvpress-constraints.txt kvpress==0.5.5

Run (the comparison recorded in scripts/BENCHMARKS.md)::

    python scripts/bench_kvpress.py --model cpu-small --batch 4 --prompt-len 128 --output-lens 512,2048 \\
        --budget 128 --window 32 --warmup 1 --repeats 3 --rounds 2 --out results/bench/kvpress_cpu_small
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vase.bench.kvpress import main  # noqa: E402

if __name__ == "__main__":
    from vase.run.oneline import script_main

    script_main(main)
