#!/usr/bin/env python
"""Check that the fast attention path decodes like the reference path: logits and kept sets, teacher-forced.

The pairs compared, the two checks (the kernel on identical inputs; end to end, teacher-forced, against a float32
reference) and their criteria: :mod:`vase.bench.attention_check` (the logic lives in ``vase/bench/``).

    python scripts/gpu_check.py                      # CUDA: flash_attn vs sdpa (or SDPA flash vs math)
    python scripts/gpu_check.py --device cpu         # the CPU fallback (SDPA flash vs math kernels), runs anywhere
    python scripts/gpu_check.py --dry-run            # tiny model, CPU, a few steps: checks the script itself

Exit status 0 when every criterion holds; a JSON summary is printed (and written with ``--out``).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vase.bench.attention_check import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
