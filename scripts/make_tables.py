#!/usr/bin/env python
"""Regenerate the published tables (docs/pilot.md's generated blocks, the README's summary blocks) from the compact
results committed under docs/data/ (``make tables``; seconds).

Logic in :mod:`vase.analysis.published`. A pilot whose compact results are absent is named in one line with the
commands that produce them; ``--check`` writes nothing and exits 1 when a generated block differs.

    python scripts/make_tables.py
    python scripts/make_tables.py --check
"""

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from vase.analysis.published import stale_tables, write_tables  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repo", type=Path, default=ROOT, help="the checkout whose docs to write (default: this one)")
    ap.add_argument("--data", type=Path, default=None, help="the compact results (default: <repo>/docs/data)")
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 when a generated block is stale")
    args = ap.parse_args()
    if args.check:
        stale, absent = stale_tables(args.repo, args.data)
        for line in absent:
            print(f"not checked: {line}", file=sys.stderr)
        for line in stale:
            print(f"stale: {line}; run make tables", file=sys.stderr)
        return 1 if stale else 0
    written, absent = write_tables(args.repo, args.data)
    for line in absent:
        print(line, file=sys.stderr)
    for line in written:
        print(f"wrote {line}")
    return 0


if __name__ == "__main__":
    from vase.run.oneline import script_main

    script_main(main)
