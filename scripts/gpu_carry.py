#!/usr/bin/env python
"""Build the carry folder for a GPU machine without a package registry (``vase.bench.carry``): the wheels the smoke
needs that the machine's image lacks (transformers 5.24.0, hydra-core, omegaconf, antlr4-python3-runtime 4.9.3 built
from its sdist, and whatever their requirements add), checked against the target's torch and huggingface-hub and
at most 64 MiB in all. Run on a connected machine; ``scripts/gpu_smoke.sh`` checks and uses the folder there.

    python scripts/gpu_carry.py                            # .carry/ for torch 2.11.0, huggingface-hub 1.33.0
    python scripts/gpu_carry.py --torch 2.9.1 --hub 1.20.0 --out /tmp/carry
    python scripts/gpu_carry.py --out .carry --check       # on the machine: its packages against the manifest
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vase.bench.carry import main  # noqa: E402
from vase.run.oneline import script_main  # noqa: E402

if __name__ == "__main__":
    script_main(main)
