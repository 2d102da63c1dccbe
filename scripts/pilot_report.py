#!/usr/bin/env python
"""The pilot studies' tables (every policy against the full cache, ± standard errors) from a results tree.

Logic in :mod:`vase.analysis.pilot`. Prints the Markdown of ``--block pilot`` (the first pilot's form) or ``--block
reasoning`` (the second pilot's: the regime, the table, the paired comparisons and the full cache on the selection
run and the unselected control set). docs/pilot.md's blocks are written by ``make tables`` alone
(``scripts/make_tables.py``, from the committed compact results), never from a results tree.

    python scripts/pilot_report.py results/pilot --wall-seconds 4980
    python scripts/pilot_report.py results/pilot_reasoning --block reasoning \\
        --selection results/pilot_reasoning_select --control results/pilot_reasoning_control
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vase.analysis.pilot import (  # noqa: E402
    BLOCKS,
    pilot_comparisons,
    pilot_markdown,
    pilot_table,
    reasoning_markdown,
)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("results", type=Path, help="the results tree of the pilot sweep")
    ap.add_argument("--block", choices=sorted(BLOCKS), default="pilot", help="which pilot form")
    ap.add_argument("--wall-seconds", type=float, default=None, help="wall time of the command that ran the pilot")
    ap.add_argument("--csv", type=Path, default=None, help="also write the table as CSV")
    ap.add_argument("--control", type=Path, default=None, help="reasoning: the full cache on the unselected problems")
    ap.add_argument("--selection", type=Path, default=None, help="reasoning: the selection run's results tree")
    args = ap.parse_args()
    for name in ("results", "control", "selection"):
        path = getattr(args, name)
        if path is not None and not path.is_dir():
            print(f"error: {name}: no such directory: {path}", file=sys.stderr)
            return 2
    table = pilot_table(args.results)
    if table.empty:
        print(f"error: no runs under {args.results}", file=sys.stderr)
        return 2
    command = f"python scripts/pilot_report.py {args.results}"
    if args.block == "reasoning":
        command += " --block reasoning"
        command += f" --selection {args.selection}" if args.selection else ""
        command += f" --control {args.control}" if args.control else ""
        text = reasoning_markdown(
            args.results,
            control=args.control,
            selection=args.selection,
            wall_seconds=args.wall_seconds,
            command=command,
        )
    else:
        text = pilot_markdown(table, args.wall_seconds, command=command, comparisons=pilot_comparisons(args.results))
    print(text)
    if args.csv:
        table.to_csv(args.csv, index=False)
    return 0


if __name__ == "__main__":
    from vase.run.oneline import script_main

    script_main(main)
