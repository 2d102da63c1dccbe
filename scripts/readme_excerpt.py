#!/usr/bin/env python
"""The README's excerpt of the ``make run`` summary, from a finished run (logic in :mod:`vase.analysis.readme_excerpt`).

Prints the block; with ``--update README.md`` it replaces the block between the README's markers. Run it on the
machine that made the run (the CPU's name comes from this machine's ``/proc/cpuinfo`` unless ``--cpu`` names it).

    OMP_NUM_THREADS=1 python run.py
    python scripts/readme_excerpt.py results/humaneval/qwen2.5_coder_0.5b/vase_attnv-b64-<hash>-s0 \\
        --command "OMP_NUM_THREADS=1 python run.py" --note "other jobs running" --update README.md
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vase.analysis.readme_excerpt import cpu_name, excerpt_markdown, update_readme  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", type=Path, help="a finished run directory (its metrics.json and manifest.json)")
    ap.add_argument("--command", default="make run", help="the command that made the run, as the README shows it")
    ap.add_argument("--cpu", help="the CPU that made it (default: this machine's, from /proc/cpuinfo)")
    ap.add_argument("--note", default="", help='what else the machine was doing, e.g. "other jobs running"')
    ap.add_argument("--update", type=Path, help="write the block between the markers of this file (README.md)")
    args = ap.parse_args()
    try:
        cpu = args.cpu or cpu_name(Path("/proc/cpuinfo").read_text())
        block = excerpt_markdown(args.run_dir, args.command, cpu, args.note)
        if args.update:
            update_readme(args.update, block)
    except (ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(block, end="")
    return 0


if __name__ == "__main__":
    from vase.run.oneline import script_main

    script_main(main)
