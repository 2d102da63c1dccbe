"""The paper's figures, rendered headless (pyplot-free ``matplotlib.figure.Figure``, Agg; no global state).

:func:`paper_figures` makes every figure a tree supports; the others are listed in :attr:`FigureResult.skipped`
with the reason (e.g. "one budget only", "no kept_sets recorded").
"""

from __future__ import annotations

import logging
import math

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from vase.analysis.aggregate import at_op, operating_points, present_classes
from vase.analysis.cost_figures import figure_ablation_grid, figure_matched_memory, figure_throughput_memory
from vase.analysis.figure_base import (  # noqa: F401 - re-exported: figures' public helpers live here too
    _PALETTE,
    COLUMN_WIDTH,
    PAPER_RC,
    FigureResult,
    _wrap,
    legend_below,
    new_figure,
    paper_style,
    policy_color,
    save_figure,
)
from vase.analysis.labels import (
    CLASS_LABELS,
    LOOP_COLORS,
    PILOT_ORDER,
    TASK_LABELS,
    natural_key,
    policy_sort_key,
    slug,
    task_sort_key,
)
from vase.analysis.load import Tree
from vase.analysis.paper import GSM8K_PILOT

logger = logging.getLogger(__name__)


def _panels(n: int, entries: int, extra: float = 0.9) -> tuple[Figure, list]:
    """``n`` panels of ``entries`` horizontal bars each: one column (:data:`COLUMN_WIDTH`) up to two panels, else two
    columns (a figure spanning both columns of a paper); the height grows with the bars, never the font."""
    cols = 1 if n <= 2 else 2
    rows = math.ceil(n / cols)
    fig = new_figure(COLUMN_WIDTH * cols, rows * (0.17 * entries + 0.55) + extra)
    axes = fig.subplots(rows, cols, squeeze=False).ravel().tolist()
    for ax in axes[n:]:
        ax.set_visible(False)
    return fig, axes[:n]


@paper_style
def figure_accuracy_vs_budget(summary: pd.DataFrame, res: FigureResult) -> None:
    """Per (model, task): accuracy ± SE vs compression ratio (runs launched with ``ratio=``) and/or vs budget (runs
    launched with ``budget=``), one line per policy identity seen at two or more points; the full cache as a band."""
    for (model, task), sub in summary.groupby(["model", "task"], sort=False):
        full = sub[sub["op_kind"] == "full"]
        for kind in ("ratio", "budget"):
            name = f"accuracy_vs_{kind}_{slug(model)}_{slug(task)}"
            ev = sub[sub["op_kind"] == kind]
            ev = ev.assign(x=ev["op_value"])
            lines = [(p, ps.sort_values("x")) for p, ps in ev.groupby("policy") if ps["x"].nunique() >= 2]
            if not lines:
                if len(ev):
                    res.skip(
                        name, f"{model}/{task}: no policy at two {kind} values ({', '.join(sorted(set(ev['op'])))})"
                    )
                continue
            fig = new_figure(COLUMN_WIDTH, 2.4 + 0.14 * (len(lines) + 1))
            ax = fig.add_subplot()
            for k, (pol, ps) in enumerate(sorted(lines, key=lambda kv: policy_sort_key(kv[0]))):
                ax.errorbar(
                    ps["x"],
                    ps["accuracy"],
                    yerr=ps["accuracy_se"].fillna(0),
                    marker="o",
                    capsize=2,
                    label=ps["short"].iloc[0],
                    color=policy_color(pol, k if "[" in pol else 0),
                )
            if len(full):
                acc, se = full["accuracy"].iloc[0], full["accuracy_se"].iloc[0]
                ax.axhline(acc, color="black", ls="--", lw=1, label="Full cache")
                if not math.isnan(se):
                    ax.axhspan(acc - se, acc + se, color="black", alpha=0.08)
            xs = sorted(set(ev["x"]))
            ax.set_xscale("log", base=2)
            ax.set_xticks(xs, [f"{x:g}×" if kind == "ratio" else f"{x:g}" for x in xs])
            ax.minorticks_off()
            ax.set_xlabel("compression ratio" if kind == "ratio" else "budget B (tokens per layer, KV head)")
            ax.set_ylabel("pass@1 (%, ± SE)")
            ax.set_title(f"{TASK_LABELS.get(task, task)}\n{model}")
            ax.grid(alpha=0.3)
            legend_below(fig)
            res.figures[name] = fig


@paper_style
def figure_failure_modes(summary: pd.DataFrame, res: FigureResult) -> None:
    """Per (model, operating point): stacked bars of loop / garbage / truncated / ok per policy, one panel per task;
    ``nonfinite`` and ``prompt_too_long`` get their own segments when a sample of the figure has them."""
    for model in sorted(summary["model"].unique()):
        for op in operating_points(summary, model):
            sub = at_op(summary, model, op)
            classes = present_classes(sub)
            name = f"failure_modes_{slug(model)}_{slug(op)}"
            tasks = sorted(sub["task"].unique(), key=task_sort_key)
            fig, axes = _panels(len(tasks), int(sub.groupby("task").size().max()))
            for ax, task in zip(axes, tasks):
                ts = sub[sub["task"] == task]
                ts = ts.iloc[sorted(range(len(ts)), key=lambda i: policy_sort_key(ts["policy"].iloc[i]))]
                y = np.arange(len(ts))
                left = np.zeros(len(ts))
                for c in classes:
                    vals = ts[f"{c}_rate"].fillna(0).to_numpy()
                    ax.barh(y, vals, left=left, color=LOOP_COLORS[c], label=CLASS_LABELS.get(c, c), height=0.75)
                    left += vals
                ax.set_yticks(y, _wrap(ts["short"], 30))
                ax.invert_yaxis()
                ax.set_xlim(0, 100)
                ax.set_xlabel("% of samples")
                ax.set_title(TASK_LABELS.get(task, task))
            legend_below(fig, *axes[0].get_legend_handles_labels(), ncols=3)
            fig.suptitle(f"Output failure modes: {op}\n{model}")
            res.figures[name] = fig


@paper_style
def figure_output_lengths(tree: Tree, summary: pd.DataFrame, res: FigureResult) -> None:
    """Per (model, operating point): output-length distributions per policy (violins), one panel per task."""
    s = tree.samples.merge(tree.runs[["run_id", "model", "task", "policy", "short", "op"]], on="run_id")
    s = s.drop_duplicates(subset=["model", "task", "policy", "op", "problem_id", "sample", "seed"])
    for model in sorted(summary["model"].unique()):
        for op in operating_points(summary, model):
            name = f"output_lengths_{slug(model)}_{slug(op)}"
            keys = at_op(summary, model, op)[["task", "policy", "op"]]
            ms = s[s["model"] == model].merge(keys, on=["task", "policy", "op"])
            if ms.empty:
                res.skip(name, f"{model}: no samples on disk")
                continue
            tasks = sorted(ms["task"].unique(), key=task_sort_key)
            fig, axes = _panels(len(tasks), 2 * int(ms.groupby("task")["policy"].nunique().max()))
            for ax, task in zip(axes, tasks):
                ts = ms[ms["task"] == task]
                pols = sorted(ts["policy"].unique(), key=policy_sort_key)
                data = [ts.loc[ts["policy"] == p, "output_tokens"].astype(float).to_numpy() for p in pols]
                parts = ax.violinplot(data, orientation="horizontal", showmedians=True, showextrema=True)
                for body, p in zip(parts["bodies"], pols):
                    body.set_facecolor(policy_color(p))
                    body.set_alpha(0.6)
                labels = [ts.loc[ts["policy"] == p, "short"].iloc[0] for p in pols]
                ax.set_yticks(np.arange(1, len(pols) + 1), _wrap(labels, 30))
                ax.invert_yaxis()
                ax.set_xlabel("output tokens")
                ax.set_title(TASK_LABELS.get(task, task))
            fig.suptitle(f"Output lengths: {op}\n{model}")
            res.figures[name] = fig


@paper_style
def figure_policy_bars(summary: pd.DataFrame, res: FigureResult) -> None:
    """Per (model, task, operating point) with several policies: accuracy bars in the GSM8K pilot's order
    (full, random, evict_large_value, snapkv and its variants, VaSE-AttnV, CurDKV variants); ``gsm8k_pilot_*`` on
    GSM8K. Markers: pass@1 under each grader rule where the runs recorded both, and on GSM8K the paper's number of
    the same row (:data:`vase.analysis.paper.GSM8K_PILOT`)."""
    for model in sorted(summary["model"].unique()):
        for op in operating_points(summary, model):
            sub = at_op(summary, model, op)
            for task, ts in sub.groupby("task"):
                stem = "gsm8k_pilot" if task == "gsm8k" else f"accuracy_bars_{slug(task)}"
                name = f"{stem}_{slug(model)}_{slug(op)}"
                if len(ts) < 2:
                    res.skip(name, f"{model}/{task}: one policy only")
                    continue

                def order(p: str) -> tuple:
                    base = p.split("[", 1)[0]
                    return (PILOT_ORDER.index(base) if base in PILOT_ORDER else len(PILOT_ORDER), natural_key(p))

                ts = ts.iloc[sorted(range(len(ts)), key=lambda i: order(ts["policy"].iloc[i]))]
                fig = new_figure(COLUMN_WIDTH, 0.22 * len(ts) + 1.6)
                ax = fig.add_subplot()
                y = np.arange(len(ts))
                colors = [policy_color(p) for p in ts["policy"]]
                ax.barh(y, ts["accuracy"], xerr=ts["accuracy_se"].fillna(0), color=colors, capsize=2, height=0.7)
                for yi, acc, se, done in zip(y, ts["accuracy"], ts["accuracy_se"].fillna(0), ts["complete"]):
                    if not math.isnan(acc):
                        label = f"{acc:.1f}" + ("" if done else "†")
                        ax.text(acc + se + 1.5, yi, label, va="center", fontsize=7)
                marks = [  # the same outputs under each grader rule; the paper's pilot numbers on GSM8K
                    (ts[f"accuracy_{rule}"], m, f"grader {rule}")
                    for rule, m in (("strict", "|"), ("last_boxed", "x"))
                    if f"accuracy_{rule}" in ts and ts[f"accuracy_{rule}"].notna().any()
                ]
                if task == "gsm8k":
                    paper = [GSM8K_PILOT.match(n, p) for n, p in zip(ts["policy_name"], ts["params"])]
                    marks.append((pd.Series([r.accuracy if r else np.nan for r in paper]), "*", "paper"))
                for values, marker, label in marks:
                    ax.scatter(
                        values.to_numpy(dtype=float), y, marker=marker, color="black", s=18, zorder=3, label=label
                    )
                if marks:
                    legend_below(fig, ncols=3)
                ax.set_yticks(y, _wrap(ts["short"], 30))
                ax.invert_yaxis()
                ax.set_xlabel("pass@1 (%, ± SE)")
                ax.set_xlim(0, max(100.0, float(np.nanmax(ts["accuracy"].to_numpy(dtype=float), initial=0)) + 12))
                ax.set_title(f"{TASK_LABELS.get(task, task)}, {op}\n{model}")
                ax.grid(axis="x", alpha=0.3)
                res.figures[name] = fig


@paper_style
def figure_diversity(diversity: pd.DataFrame, res: FigureResult) -> None:
    """Mean kept-set Jaccard across heads / layers / samples per policy (grouped bars)."""
    name = "cache_diversity"
    if diversity is None or diversity.empty:
        res.skip(name, "no kept_sets recorded (run with record_kept=true)")
        return
    d = diversity.groupby("method", sort=False)[["heads", "layers", "samples"]].mean()
    fig = new_figure(COLUMN_WIDTH, 0.45 * len(d) + 1.1)
    ax = fig.add_subplot()
    y = np.arange(len(d))
    for k, (col, color) in enumerate(zip(("heads", "layers", "samples"), ("#1f77b4", "#ff7f0e", "#2ca02c"))):
        ax.barh(y + (k - 1) * 0.27, d[col].to_numpy(dtype=float), height=0.27, label=f"across {col}", color=color)
    ax.set_yticks(y, _wrap(d.index, 30))
    ax.invert_yaxis()
    ax.set_xlabel("mean Jaccard of kept sets")
    ax.set_xlim(0, 1)
    legend_below(fig, ncols=3)
    fig.suptitle("Cache diversity (lower = more diverse)")  # over the figure: long labels narrow the axes
    res.figures[name] = fig


def paper_figures(tree: Tree, summary: pd.DataFrame, diversity: pd.DataFrame | None = None) -> FigureResult:
    """Every figure the tree supports; the others are listed in :attr:`FigureResult.skipped` with the reason."""
    res = FigureResult()
    figure_accuracy_vs_budget(summary, res)
    figure_failure_modes(summary, res)
    figure_output_lengths(tree, summary, res)
    figure_throughput_memory(tree, summary, res)
    figure_ablation_grid(summary, res)
    figure_matched_memory(summary, res)
    figure_policy_bars(summary, res)
    if diversity is not None and not diversity.empty:
        figure_diversity(diversity, res)
    else:
        res.skip("cache_diversity", "no kept_sets recorded (run with record_kept=true)")
    return res
