#!/usr/bin/env python
"""Build the W&B dashboard of a sweep's paper tables and figures (a report, or a saved workspace) from code.

    python scripts/report.py results/ --group main_table --wandb online           # the summary run + report.json
    python scripts/dashboard.py --entity E --project vase --group main_table --report results/report
    python scripts/dashboard.py --entity E --project vase --group main_table --report results/report --save
    python scripts/dashboard.py --entity E --group main_table --workspace --save   # a saved workspace view instead
    python scripts/dashboard.py --report results/report                            # print only: no entity needed

One section per paper table and figure: live panels over the sweep's runs (bound to the metrics the runner logs)
and the report's tables, figures and charts from its summary run (their keys from ``--report``'s ``report.json``;
without ``--report`` only the live panels; with it, only the sections its data has: no ablation or GSM8K pilot
section for a tree without them). Bars group the runs by the cell's config keys (the policy and the hyper-parameters
that tell the report's cells apart, so ablation cells get a bar each). Without ``--save`` nothing leaves the
machine: the structure is printed (and written to ``--out`` as JSON; no ``--entity`` needed). ``--save`` needs
``wandb login``, an entity and the network, and prints the URL. The logic lives in :mod:`vase.analysis.dashboard`;
see docs/analysis.md.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--entity", default=None, help="W&B entity (default: report.json's, else $WANDB_ENTITY; needed for --save only)"
    )
    p.add_argument("--project", default=None, help="W&B project (default: report.json's, else vase)")
    p.add_argument("--group", default=None, help="the sweep's W&B group (default: report.json's)")
    p.add_argument("--report", default=None, help="a scripts/report.py output folder (its report.json)")
    p.add_argument("--workspace", action="store_true", help="build a saved workspace view instead of a report")
    p.add_argument("--title", default=None, help="report title (default: 'vase: paper figures, GROUP')")
    p.add_argument("--save", action="store_true", help="publish to W&B (needs `wandb login` and the network)")
    p.add_argument("--out", default=None, help="write the structure (sections, panels, bound keys) as JSON here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    log = logging.getLogger("dashboard")
    from vase.analysis import dashboard as D

    try:
        manifest = D.load_manifest(args.report) if args.report else None
        m = manifest or {}
        entity = args.entity or m.get("entity") or os.environ.get("WANDB_ENTITY")
        project = args.project or m.get("project") or "vase"
        group = args.group or m.get("group")
        if args.workspace:
            built = D.build_workspace(entity, project, group, manifest)
        else:
            built = D.build_report(entity, project, group, manifest, title=args.title)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    structure = D.outline(built)
    for section in structure:
        panels = [p for grid in section["grids"] for p in grid["panels"]]
        log.info("%s: %d panel%s", section["title"], len(panels), "" if len(panels) == 1 else "s")
        for p in panels:
            log.info("  %-24s %s", p["type"], ", ".join(p["binds"]))
    if args.out:
        Path(args.out).write_text(json.dumps(structure, indent=2) + "\n")
    if not args.save:
        log.info("not saved (add --save to publish to %s/%s)", entity or "<--entity>", project)
        return 0
    try:
        log.info("saved: %s", D.publish(built))
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    from vase.run.oneline import script_main

    script_main(main)
