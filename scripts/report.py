"""Every paper table and figure from a results tree, with one command; optionally mirrored to a W&B summary run.

    python scripts/report.py results/                                  # -> results/report/
    python scripts/report.py results/ --out paper/ --wandb offline --group main_table
    python scripts/report.py results/ --wandb disabled --formats png

Reads every run under RESULTS_DIR (any mix of runs and sweeps; found by their metrics.json / samples.jsonl, read from
their saved config, samples.jsonl and throughput.jsonl, never from directory names; half-finished runs are recomputed
from samples.jsonl and marked †) and writes:

  tables/   accuracy_<model>_<op>  policy x task pass@1 ± SE, full cache first, the five-task average
            failures_<model>_<op>  loop / garbage / truncated / ok (+ non-finite / prompt too long when
                                   present) rates, answered rate, mean output length
            efficiency_<model>_<op>  decode tokens/s, rows in flight, allocated KV (static), KV held vs
                                     full-cache KV per sample, retained KV per sample (mean, peak) beside the
                                     budget, tokens and decode seconds per correct sample, peak memory, evictions
            statistics_<model>_<op>  pass@1 with its 95 % bootstrap CI over problems, seeds pooled, each seed's
                                     pass@1 and the SD between seeds
            ablation_<model>_<task>_<policy>_<op>  the ablation as an n_protect x attn_temperature grid
            paired_<model>         paired differences (same problem, seed, sample) against the full cache and
                                   between policies: CI, sign-flip p, Holm-adjusted p over the grid
            summary                every (model, task, policy, operating point) with every metric
            diversity              kept-set Jaccard across heads / layers / samples (runs with record_kept=true)
            each as .csv, .md and .tex
  figures/  accuracy_vs_budget_*, failure_modes_*, output_lengths_*, throughput_memory_* (spread over rounds, the
            machine named), matched_memory_* (accuracy vs mean retained KV), ablation_* (protection x temperature
            grid), gsm8k_pilot_* / accuracy_bars_*, cache_diversity; each as .png and .pdf, single-column width
  report.md every table and figure, and the figures the data cannot support with the reason
  report.json the W&B group and the keys the summary run logs (scripts/dashboard.py --report binds them)

--wandb offline (default) writes a W&B summary run (job_type=summary) into <out>/wandb, grouped with the sweep
(--group, default: the runs' logger.group or the results directory's name); upload later with
`wandb sync <out>/wandb/offline-run-*`. See docs/analysis.md.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("results_dir", help="a results tree (runs and sweeps, any depth)")
    p.add_argument("--out", default=None, help="output directory (default: RESULTS_DIR/report)")
    p.add_argument(
        "--wandb",
        default="offline",
        choices=("offline", "online", "disabled"),
        help="W&B summary run mode (default: %(default)s; WANDB_MODE overrides)",
    )
    p.add_argument("--group", default=None, help="W&B group (default: the runs' logger.group, else the dir name)")
    p.add_argument("--project", default="vase", help="W&B project (default: %(default)s)")
    p.add_argument("--entity", default=None, help="W&B entity")
    p.add_argument("--formats", default="png,pdf", help="figure formats (default: %(default)s)")
    p.add_argument("-q", "--quiet", action="store_true", help="warnings only")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=logging.WARNING if args.quiet else logging.INFO,
        format="[%(asctime)s %(levelname)s %(name)s] %(message)s",
        datefmt="%H:%M:%S",
    )
    import os

    from vase.analysis.report import build_report

    mode = os.environ.get("WANDB_MODE", args.wandb) if args.wandb != "disabled" else "disabled"
    if mode not in ("offline", "online", "disabled"):
        mode = "offline" if mode == "dryrun" else mode
    try:
        report = build_report(
            args.results_dir,
            args.out,
            formats=[f for f in args.formats.split(",") if f],
            wandb_mode=mode,
            group=args.group,
            project=args.project,
            entity=args.entity,
        )
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    n_runs = len(report.summary)
    print(f"{n_runs} run groups -> {report.out_dir}")
    print(f"  tables:  {len(report.tables)} ({len(report.table_paths)} files) in {report.out_dir / 'tables'}")
    print(f"  figures: {len(report.figure_paths)} files in {report.out_dir / 'figures'}")
    for name, why in report.skipped:
        print(f"  skipped {name}: {why}")
    if report.wandb_run_id:
        print(f"  W&B summary run {report.wandb_run_id} ({mode}) in {report.out_dir / 'wandb'}")
    print(f"  index:   {report.out_dir / 'report.md'}")
    return 0


if __name__ == "__main__":
    from vase.run.oneline import script_main

    script_main(main)
