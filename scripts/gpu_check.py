#!/usr/bin/env python
"""Check the engine's attention kernels on the real decode path: rows of different lengths, prefill and decode.

Compares the default SDPA dispatch (whatever torch picks; no flash-attn needed) against SDPA's math kernel, and
FlashAttention-2 against it when ``flash_attn`` imports: per-call outputs on identical inputs, the kernel each call
ran, teacher-forced logits and kept sets against a float32 reference. The pairs, checks and criteria:
:mod:`vase.bench.attention_check` (the logic lives in ``vase/bench/``).

    python scripts/gpu_check.py                      # CUDA: sdpa vs math (+ flash_attn vs math when it imports)
    python scripts/gpu_check.py --device cpu         # the same on the CPU (SDPA's CPU kernels), runs anywhere
    python scripts/gpu_check.py --dry-run            # small model, CPU, a few steps: checks the script itself

Exit status 0 when every criterion holds; a JSON summary is printed (and written with ``--out``).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vase.bench.attention_check import main  # noqa: E402

if __name__ == "__main__":
    from vase.run.oneline import script_main

    script_main(main)
