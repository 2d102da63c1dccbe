#!/usr/bin/env python
"""Tok/s against rows at equal KV memory on one GPU: Qwen3-4B-shaped random model, 16K context, vase_dkv vs full.

Not part of CI (needs a GPU; < 8 minutes on an 80-141 GB GPU). The protocol is in :mod:`vase.bench.gpu_rows`.

    python scripts/gpu_bench_rows.py --out results/bench/gpu_rows          # on the GPU machine
    python scripts/gpu_bench_rows.py --dry-run                             # tiny model on CPU: checks the script
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vase.bench.gpu_rows import main  # noqa: E402

if __name__ == "__main__":
    from vase.run.oneline import script_main

    script_main(main)
