#!/usr/bin/env python
"""The embedded default (``python run.py``) under several variants side by side: revisions, threads, settings.

A variant is ``LABEL:REV:THREADS[:RUN_ARGS]`` (or ``--revs LABEL=REV,... --threads N,...``); each revision runs from
its own ``git worktree`` with this Python environment, every run a fresh process, ABBA order. Prints and writes
(``variants.json``, ``variants.csv``, ``table.md``) decode tok/s, wall time, prefill time and pass@1 of each run's
``metrics.json``. The method: :mod:`vase.bench.variants`.

    # issue 19 (a): before (08d79e0) against after (HEAD), one and two threads, two ABBA rounds
    python scripts/bench_variants.py --revs before=08d79e0,after=HEAD --threads 1,2 --rounds 2 \\
        --out results/bench/default_before_after
    # issue 22: inline against background grading (the setting's name as that change defines it)
    python scripts/bench_variants.py --variant inline:HEAD:1 --variant bg:HEAD:1:generation.grading=background
    # a smoke (one problem, one sample)
    python scripts/bench_variants.py --revs before=08d79e0,after=HEAD --run-args "limit=1 n_samples=1" --rounds 1
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vase.bench.variants import main  # noqa: E402

if __name__ == "__main__":
    from vase.run.oneline import script_main

    script_main(main)
