#!/usr/bin/env python
"""Choose the reasoning pilot's problems from a full-cache selection run (its own seed; docs/pilot.md).

Logic in :func:`vase.analysis.pilot.selection_table`: a problem is selected when the fraction of its selection-run
samples that are right lies in ``[--low, --high]`` (the full cache neither at the floor nor at the ceiling). Prints a
summary and the selected ids as the ``task.problem_ids`` list that ``conf/sweep/pilot_reasoning.yaml`` commits.

    python scripts/pilot_select.py results/pilot_reasoning_select --low 0.25 --high 0.75
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vase.analysis.pilot import selection_table  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("results", type=Path, help="the selection run's results tree (full cache)")
    ap.add_argument("--low", type=float, default=0.25, help="lowest fraction of right samples kept")
    ap.add_argument("--high", type=float, default=0.75, help="highest fraction of right samples kept")
    ap.add_argument("--csv", type=Path, default=None, help="also write the per-problem table as CSV")
    args = ap.parse_args()
    if not args.results.is_dir():
        print(f"error: results: no such directory: {args.results}", file=sys.stderr)
        return 2
    if not 0 <= args.low <= args.high <= 1:
        print(f"error: --low/--high: need 0 <= low <= high <= 1, got {args.low}, {args.high}", file=sys.stderr)
        return 2
    t = selection_table(args.results, args.low, args.high)
    sel = t[t["selected"]]
    print(
        f"pool: {len(t)} problems x {int(t['samples'].max())} samples; full-cache pass@1 {100 * t['rate'].mean():.1f} %"
    )
    print(
        "right samples per problem: "
        + ", ".join(f"{c}: {n}" for c, n in t["correct"].value_counts().sort_index().items())
    )
    print(
        f"selected ({args.low:g} <= rate <= {args.high:g}): {len(sel)} problems, selection-run pass@1 "
        f"{100 * sel['rate'].mean():.1f} %, prompt {sel['prompt_tokens'].mean():.0f} tokens (max "
        f"{sel['prompt_tokens'].max():.0f}), {sel['output_tokens'].mean():.0f} output tokens on average"
    )
    print("problem_ids: " + json.dumps(list(sel["problem_id"])))
    if args.csv:
        t.to_csv(args.csv, index=False)
    return 0


if __name__ == "__main__":
    from vase.run.oneline import script_main

    script_main(main)
