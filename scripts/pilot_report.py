#!/usr/bin/env python
"""The pilot study's table (every policy against the full cache, ± standard errors) from a results tree.

Logic in :mod:`vase.analysis.pilot`. Prints the Markdown table; with ``--update docs/pilot.md`` it also replaces the
generated block of that file (``make pilot`` does both, after ``python run.py -m sweep=pilot`` and
``scripts/report.py``).

    python scripts/pilot_report.py results/pilot --update docs/pilot.md --wall-seconds 4980
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vase.analysis.pilot import pilot_markdown, pilot_table, update_block  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("results", type=Path, help="the results tree of the pilot sweep")
    ap.add_argument("--update", type=Path, default=None, help="replace the generated block of this Markdown file")
    ap.add_argument("--wall-seconds", type=float, default=None, help="wall time of the command that ran the pilot")
    ap.add_argument("--csv", type=Path, default=None, help="also write the table as CSV")
    args = ap.parse_args()
    table = pilot_table(args.results)
    if table.empty:
        print(f"error: no runs under {args.results}", file=sys.stderr)
        return 2
    text = pilot_markdown(table, args.wall_seconds, command=f"python scripts/pilot_report.py {args.results}")
    print(text)
    if args.csv:
        table.to_csv(args.csv, index=False)
    if args.update:
        update_block(args.update, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
