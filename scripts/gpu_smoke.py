#!/usr/bin/env python
"""The first run on a new GPU machine (run through ``scripts/gpu_smoke.sh``): kernel check, a real decode with
staggered rows, tok/s against rows at equal KV memory, peak memory; one table, at most 8 minutes on one GPU.

The sections, their time caps and what each checks: :mod:`vase.bench.smoke`.

    scripts/gpu_smoke.sh                     # = python scripts/gpu_smoke.py under a 470 s hard limit
    python scripts/gpu_smoke.py --dry-run    # the CPU, tiny shapes: every code path but the kernels
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vase.bench.smoke import main  # noqa: E402

if __name__ == "__main__":
    from vase.run.oneline import script_main

    script_main(main)
