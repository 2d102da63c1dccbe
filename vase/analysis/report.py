"""``build_report``: every table and figure of a results tree into one folder, and its W&B summary run.

Pipeline (what ``scripts/report.py`` runs)::

    tree = load_tree("results/")            # load: one row per run, every sample, every throughput.jsonl line
    summary = summarize(tree)               # aggregate: one row per (model, task, policy, operating point)
    summary = cell_statistics(tree, summary)  # comparisons: 95 % bootstrap CI by problem, spread between seeds
    pairs = paired_comparisons(tree, summary) # paired differences (same problem, seed, sample), Holm over the grid
    tables = paper_tables(summary)          # tables: accuracy (± SE, five-task avg), failures, efficiency, summary
    figures = paper_figures(tree, summary)  # figures: accuracy vs budget, failure modes, lengths, throughput, ...
    log_to_wandb(tables, figure_paths, summary, group=...)  # wandb_summary: the summary run
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from vase.analysis.aggregate import AblationGrid, ablation_grids, operating_points, summarize
from vase.analysis.comparisons import (
    ablation_table,
    cell_samples,
    cell_statistics,
    paired_comparisons,
    paired_table,
    statistics_table,
)
from vase.analysis.diversity import diversity_table
from vase.analysis.figures import paper_figures, save_figure
from vase.analysis.load import Tree, load_tree
from vase.analysis.tables import Table, paper_tables, to_markdown, write_table
from vase.analysis.wandb_summary import default_group, log_to_wandb, logged_keys
from vase.run.rundir import check_writable

logger = logging.getLogger(__name__)

MANIFEST = "report.json"  # the group and the media keys the summary run logs (what the W&B dashboard binds)


@dataclass
class Report:
    """What :func:`build_report` wrote."""

    out_dir: Path
    tables: list[Table]
    table_paths: list[Path]
    figure_paths: list[Path]
    skipped: list[tuple[str, str]]
    summary: pd.DataFrame
    wandb_run_id: str | None = None


def build_report(
    results_dir: str | Path,
    out_dir: str | Path | None = None,
    *,
    formats: Sequence[str] = ("png", "pdf"),
    wandb_mode: str = "disabled",
    group: str | None = None,
    project: str = "vase",
    entity: str | None = None,
) -> Report:
    """Every table and figure of a results tree into ``out_dir`` (default ``<results_dir>/report``), and W&B.

    Writes ``tables/*.{csv,md,tex}``, ``figures/*.{png,pdf}``, ``report.md`` (every table and figure, and the
    figures skipped with the reason), ``report.json`` (the W&B group and the keys of every table, figure and chart
    the summary run logs: what ``scripts/dashboard.py`` binds its panels to) and, unless
    ``wandb_mode == "disabled"``, a W&B summary run in ``group``.
    """
    out = Path(out_dir) if out_dir is not None else Path(results_dir) / "report"
    tree = load_tree(results_dir)  # every sample line checked (vase.schema) before anything is written
    check_writable(out, "--out", "give --out a directory you can write")
    for sub, exts in (("tables", (".csv", ".md", ".tex")), ("figures", (".png", ".pdf", ".svg"))):
        stale = [p for p in (out / sub).glob("*") if p.suffix in exts] if (out / sub).is_dir() else []
        for p in stale:  # the report owns these folders: a rerun must not leave figures of runs since removed
            p.unlink()
        if stale:
            logger.info("removed %d old files from %s", len(stale), out / sub)
    summary = summarize(tree)
    cells = cell_samples(tree)
    summary = cell_statistics(tree, summary, cells=cells)  # 95 % bootstrap CIs by problem, the spread between seeds
    summary.attrs["root"] = str(Path(results_dir).resolve())
    pairs = paired_comparisons(tree, summary, cells=cells)  # paired differences, Holm over the whole grid
    diversity = diversity_table(tree)
    tables = paper_tables(summary, diversity) + statistics_tables(summary, pairs)
    table_paths = [p for t in tables for p in write_table(t, out / "tables")]
    figs = paper_figures(tree, summary, diversity)
    figure_paths = []
    for name, fig in figs.figures.items():
        figure_paths += save_figure(fig, out / "figures", name, formats)
    skipped = figs.skipped + [(d, f"run skipped: {why}") for d, why in tree.skipped]
    _write_index(out, tables, figure_paths, skipped, tree)
    report = Report(out, tables, table_paths, figure_paths, skipped, summary)
    group = group or default_group(tree)
    if wandb_mode != "disabled":
        report.wandb_run_id = log_to_wandb(
            tables,
            figure_paths,
            summary,
            group=group,
            out_dir=out,
            mode=wandb_mode,
            project=project,
            entity=entity,
        )
    manifest = {"group": group, "project": project, "entity": entity, "wandb_run_id": report.wandb_run_id}
    manifest["cell_keys"] = cell_config_keys(summary)
    manifest |= logged_keys(tables, figure_paths, summary)
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    logger.info(
        "report: %d tables, %d figure files, %d skipped -> %s", len(tables), len(figure_paths), len(skipped), out
    )
    return report


def cell_config_keys(summary: pd.DataFrame) -> list[str]:
    """The run config keys of the hyper-parameters in the summary's policy identities (``vase_attnv[n_protect=16]``:
    ``policy.n_protect``; the preset: ``protocol.name``), in first-seen order: what tells the cells apart on W&B."""
    keys: dict[str, None] = {}
    for label in summary["policy"]:
        inner = str(label).partition("[")[2].rstrip("]")
        for part in filter(None, inner.split(",")):
            k = part.split("=", 1)[0]
            keys["protocol.name" if k == "protocol" else f"policy.{k}"] = None
    return list(keys)


def statistics_tables(summary: pd.DataFrame, pairs: pd.DataFrame) -> list[Table]:
    """Per model and operating point the CI / seed table; per model the paired comparisons (when any pair shares
    samples); each ablation as a grid (``n_protect`` x ``attn_temperature``)."""
    out = []
    for model in sorted(summary["model"].unique()):
        out += [statistics_table(summary, model, op) for op in operating_points(summary, model)]
        if not pairs.empty and (pairs["model"] == model).any():
            out.append(paired_table(pairs, model))
    out += [ablation_table(g) for g in ablation_grids(summary) if isinstance(g, AblationGrid)]
    return out


def _write_index(
    out: Path, tables: list[Table], figure_paths: list[Path], skipped: list[tuple[str, str]], tree: Tree
) -> None:
    n_inc = int((~tree.runs["complete"]).sum())
    lines = [
        f"# Report: {tree.root}",
        "",
        f"{len(tree.runs)} runs ({n_inc} incomplete), {len(tree.samples)} samples.",
        "",
    ]
    for t in tables:
        lines += [f"## {t.name}", "", to_markdown(t), ""]
    pngs = [p for p in figure_paths if p.suffix == ".png"]
    if pngs:
        lines += ["## Figures", ""] + [f"![{p.stem}](figures/{p.name})" for p in pngs] + [""]
    if skipped:
        lines += ["## Skipped", ""] + [f"- `{n}`: {why}" for n, why in skipped] + [""]
    (out / "report.md").write_text("\n".join(lines))
