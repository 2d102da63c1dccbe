"""The paper's figures, rendered headless (pyplot-free ``matplotlib.figure.Figure``, Agg; no global state).

:func:`paper_figures` makes every figure a tree supports; the others are listed in :attr:`FigureResult.skipped`
with the reason (e.g. "one budget only", "no kept_sets recorded").
"""

from __future__ import annotations

import json
import logging
import math
import textwrap
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from vase.analysis.aggregate import at_op, operating_points, present_classes
from vase.analysis.labels import (
    LOOP_COLORS,
    MISSING,
    PILOT_ORDER,
    POLICY_LABELS,
    POLICY_ORDER,
    TASK_LABELS,
    fmt_value,
    natural_key,
    op_sort_key,
    policy_sort_key,
    slug,
    task_sort_key,
)
from vase.analysis.load import Tree
from vase.analysis.paper import GSM8K_PILOT

logger = logging.getLogger(__name__)


@dataclass
class FigureResult:
    """Figures made, and the ones skipped with the reason."""

    figures: dict[str, Figure] = field(default_factory=dict)
    skipped: list[tuple[str, str]] = field(default_factory=list)

    def skip(self, name: str, reason: str) -> None:
        logger.info("figure %s skipped: %s", name, reason)
        self.skipped.append((name, reason))


_PALETTE = [
    "#7f7f7f",
    "#1f77b4",
    "#ff7f0e",
    "#2ca02c",
    "#d62728",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#bcbd22",
    "#17becf",
    "#aec7e8",
    "#ffbb78",
    "#98df8a",
    "#ff9896",
    "#c5b0d5",
    "#c49c94",
]


def _wrap(labels: Iterable[str], width: int = 26) -> list[str]:
    """Tick labels wrapped at ``width`` characters (long ablation names)."""
    return [textwrap.fill(str(t), width) for t in labels]


def policy_color(policy: str, index: int = 0) -> str:
    """A stable colour per policy name (the variants of one policy get shades via ``index``)."""
    base = policy.split("[", 1)[0]
    i = POLICY_ORDER.index(base) if base in POLICY_ORDER else len(POLICY_ORDER) + abs(hash(base)) % 4
    return _PALETTE[(i + 5 * index) % len(_PALETTE)]


def new_figure(width: float = 6.0, height: float = 4.0) -> Figure:
    """A pyplot-free figure (renders headless with Agg; no global state)."""
    return Figure(figsize=(width, height), layout="constrained")


def save_figure(
    fig: Figure, out_dir: str | Path, name: str, formats: Sequence[str] = ("png", "pdf"), dpi: int = 130
) -> list[Path]:
    """Save ``fig`` as ``<out_dir>/<name>.<fmt>`` for each format; return the paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for fmt in formats:
        path = out_dir / f"{name}.{fmt}"
        fig.savefig(path, dpi=dpi, format=fmt)
        paths.append(path)
    return paths


def _grid(n: int, width: float = 4.2, height: float = 3.4, max_cols: int = 3) -> tuple[Figure, list]:
    cols = min(n, max_cols)
    rows = math.ceil(n / cols)
    fig = new_figure(width * cols, height * rows)
    axes = fig.subplots(rows, cols, squeeze=False).ravel().tolist()
    for ax in axes[n:]:
        ax.set_visible(False)
    return fig, axes[:n]


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
            fig = new_figure(6.6, 4.2)
            ax = fig.add_subplot()
            for k, (pol, ps) in enumerate(sorted(lines, key=lambda kv: policy_sort_key(kv[0]))):
                ax.errorbar(
                    ps["x"],
                    ps["accuracy"],
                    yerr=ps["accuracy_se"].fillna(0),
                    marker="o",
                    capsize=3,
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
            ax.set_xlabel("compression ratio" if kind == "ratio" else "budget B (tokens per layer and KV head)")
            ax.set_ylabel("pass@1 (%)")
            ax.set_title(f"{TASK_LABELS.get(task, task)} — {model}")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7, loc="best")
            res.figures[name] = fig


def figure_failure_modes(summary: pd.DataFrame, res: FigureResult) -> None:
    """Per (model, operating point): stacked bars of loop / garbage / truncated / ok per policy, one panel per task;
    ``nonfinite`` and ``prompt_too_long`` get their own segments when a sample of the figure has them."""
    for model in sorted(summary["model"].unique()):
        for op in operating_points(summary, model):
            sub = at_op(summary, model, op)
            classes = present_classes(sub)
            name = f"failure_modes_{slug(model)}_{slug(op)}"
            tasks = sorted(sub["task"].unique(), key=task_sort_key)
            fig, axes = _grid(len(tasks), max(4.6, 0.8 * sub.groupby("task").size().max()), 4.2)
            for ax, task in zip(axes, tasks):
                ts = sub[sub["task"] == task]
                ts = ts.iloc[sorted(range(len(ts)), key=lambda i: policy_sort_key(ts["policy"].iloc[i]))]
                x = np.arange(len(ts))
                bottom = np.zeros(len(ts))
                for c in classes:
                    vals = ts[f"{c}_rate"].fillna(0).to_numpy()
                    ax.bar(x, vals, bottom=bottom, color=LOOP_COLORS[c], label=c, width=0.75)
                    bottom += vals
                ax.set_xticks(x, _wrap(ts["short"]), rotation=45, ha="right", rotation_mode="anchor", fontsize=7)
                ax.set_ylim(0, 100)
                ax.set_ylabel("% of samples")
                ax.set_title(TASK_LABELS.get(task, task))
            handles, labels = axes[0].get_legend_handles_labels()
            fig.legend(handles, labels, loc="outside right upper", fontsize=8)
            fig.suptitle(f"Output failure modes — {model}, {op}")
            res.figures[name] = fig


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
            fig, axes = _grid(len(tasks), max(4.6, 0.8 * ms.groupby("task")["policy"].nunique().max()), 4.2)
            for ax, task in zip(axes, tasks):
                ts = ms[ms["task"] == task]
                pols = sorted(ts["policy"].unique(), key=policy_sort_key)
                data = [ts.loc[ts["policy"] == p, "output_tokens"].astype(float).to_numpy() for p in pols]
                parts = ax.violinplot(data, showmedians=True, showextrema=True)
                for body, p in zip(parts["bodies"], pols):
                    body.set_facecolor(policy_color(p))
                    body.set_alpha(0.6)
                labels = [ts.loc[ts["policy"] == p, "short"].iloc[0] for p in pols]
                ax.set_xticks(
                    np.arange(1, len(pols) + 1),
                    _wrap(labels),
                    rotation=45,
                    ha="right",
                    rotation_mode="anchor",
                    fontsize=7,
                )
                ax.set_ylabel("output tokens")
                ax.set_title(TASK_LABELS.get(task, task))
            fig.suptitle(f"Output lengths — {model}, {op}")
            res.figures[name] = fig


# (summary column, scale, panel title) of the throughput / memory figure, one panel each
_EFFICIENCY_PANELS = (
    ("decode_tokens_per_second", 1.0, "decode tokens / s"),
    ("rows_in_flight", 1.0, "rows in flight (bar: max, tick: mean per step)"),
    ("kv_allocated_bytes", 2.0**-20, "allocated KV, static (MiB)"),
    ("kv_held_bytes_mean", 2.0**-20, "KV per sample (MiB): held (filled), full cache (outline)"),
    ("peak_memory_bytes", 2.0**-30, "peak memory (GiB)"),
    ("compression_ratio", 1.0, "compression (full / held tokens, ×)"),
)


def _entry_values(ts: pd.DataFrame, entries: list[tuple[str, str]], col: str, scale: float) -> np.ndarray:
    """``ts[col] * scale`` at each ``(policy, op)`` of ``entries`` (``ts`` indexed by them; NaN where absent)."""
    return np.array([float(ts.loc[e, col]) * scale if e in ts.index and col in ts else np.nan for e in entries])


def figure_throughput_memory(summary: pd.DataFrame, res: FigureResult) -> None:
    """Per model: one bar per (policy, operating point) and task in each of six panels — decode throughput, rows in
    flight (max, and the mean per decode step as a tick), the static KV allocation, the KV held per sample against
    what a full cache would hold, peak memory and compression."""
    cols = [c for c, _, _ in _EFFICIENCY_PANELS] + ["kv_full_bytes_mean", "rows_in_flight_mean"]
    for model in sorted(summary["model"].unique()):
        name = f"throughput_memory_{slug(model)}"
        sub = summary[summary["model"] == model]
        measured = sub[[c for c in cols if c in sub and c != "compression_ratio"]].apply(pd.to_numeric, errors="coerce")
        if not np.isfinite(measured.to_numpy(dtype=float)).any():
            res.skip(name, f"{model}: no throughput.jsonl and no per-sample KV bytes")
            continue
        several = sub.loc[sub["op_kind"] != "full", "op"].nunique() > 1
        order = {
            (p, op): op_sort_key(k, v) for p, op, k, v in zip(sub["policy"], sub["op"], sub["op_kind"], sub["op_value"])
        }
        entries = sorted(order, key=lambda e: (policy_sort_key(e[0]), order[e]))
        labels = []
        for p, op in entries:
            short = sub.loc[(sub["policy"] == p) & (sub["op"] == op), "short"].iloc[0]
            labels.append(short + (f" ({op})" if several and op != "full" else ""))
        tasks = sorted(sub["task"].unique(), key=task_sort_key)
        width = 0.8 / len(tasks)
        fig, axes = _grid(len(_EFFICIENCY_PANELS), max(4.6, 0.55 * len(entries) * max(1, len(tasks) ** 0.5)), 3.6)
        x = np.arange(len(entries))
        for k, task in enumerate(tasks):
            ts = sub[sub["task"] == task].set_index(["policy", "op"])
            color = _PALETTE[(k + 1) % len(_PALETTE)]
            xs = x + (k - (len(tasks) - 1) / 2) * width
            for ax, (col, scale, _) in zip(axes, _EFFICIENCY_PANELS):
                if col == "kv_held_bytes_mean":
                    full = _entry_values(ts, entries, "kv_full_bytes_mean", scale)
                    ax.bar(xs, full, width=width, fill=False, edgecolor=color, linewidth=1.2)
                ax.bar(
                    xs,
                    _entry_values(ts, entries, col, scale),
                    width=width,
                    color=color,
                    label=TASK_LABELS.get(task, task),
                )
                if col == "rows_in_flight":
                    mean = _entry_values(ts, entries, "rows_in_flight_mean", 1.0)
                    ax.scatter(xs, mean, marker="_", s=120, color="black", zorder=3)
        for ax, (_, _, title) in zip(axes, _EFFICIENCY_PANELS):
            ax.set_title(title, fontsize=9)
            ax.set_xticks(x, _wrap(labels), rotation=45, ha="right", rotation_mode="anchor", fontsize=7)
            ax.grid(axis="y", alpha=0.3)
        handles, names = axes[0].get_legend_handles_labels()
        fig.legend(handles, names, loc="outside right upper", fontsize=8, title="task")
        fig.suptitle(f"Throughput and memory per policy — {model}")
        res.figures[name] = fig


def figure_ablation_heatmap(
    summary: pd.DataFrame, res: FigureResult, row_param: str = "n_protect", col_param: str = "attn_temperature"
) -> None:
    """Per (model, task, policy name, operating point) where both parameters vary: accuracy heatmap."""
    for (model, task, name_, op), sub in summary.groupby(["model", "task", "policy_name", "op"]):
        params = [json.loads(p) for p in sub["params"]]
        if not all(row_param in p and col_param in p for p in params):
            continue
        rows = sorted({json.dumps(p[row_param]) for p in params}, key=_num_key)
        cols = sorted({json.dumps(p[col_param]) for p in params}, key=_num_key)
        name = f"ablation_{slug(model)}_{slug(task)}_{slug(name_)}_{slug(op)}"
        if len(rows) < 2 or len(cols) < 2:
            if len(rows) > 1 or len(cols) > 1:
                res.skip(name, f"needs >= 2 values of both {row_param} and {col_param}")
            continue
        grid = np.full((len(rows), len(cols)), np.nan)
        for p, acc in zip(params, sub["accuracy"]):
            grid[rows.index(json.dumps(p[row_param])), cols.index(json.dumps(p[col_param]))] = acc
        fig = new_figure(1.3 * len(cols) + 2.5, 0.8 * len(rows) + 1.8)
        ax = fig.add_subplot()
        im = ax.imshow(grid, cmap="viridis", aspect="auto")
        mid = np.nanmean(grid) if np.isfinite(grid).any() else 0.0
        for i in range(len(rows)):
            for j in range(len(cols)):
                txt = MISSING if np.isnan(grid[i, j]) else f"{grid[i, j]:.1f}"
                color = "black" if np.isfinite(grid[i, j]) and grid[i, j] > mid else "white"
                ax.text(j, i, txt, ha="center", va="center", color=color, fontsize=9)
        ax.set_xticks(range(len(cols)), [_param_text(c) for c in cols])
        ax.set_yticks(range(len(rows)), [_param_text(r) for r in rows])
        ax.set_xlabel(col_param)
        ax.set_ylabel(row_param)
        fig.colorbar(im, ax=ax, label="pass@1 (%)")
        ax.set_title(f"{POLICY_LABELS.get(name_, name_)} — {TASK_LABELS.get(task, task)}, {model}")
        res.figures[name] = fig


def _num_key(s: str) -> tuple[int, float, str]:
    v = json.loads(s)
    return (0, float(v), s) if isinstance(v, (int, float)) else (1, 0.0, s)


def _param_text(s: str) -> str:
    v = json.loads(s)
    return "default" if v is None else fmt_value(v)


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
                fig = new_figure(max(5.0, 0.75 * len(ts) + 2), 4.2)
                ax = fig.add_subplot()
                x = np.arange(len(ts))
                colors = [policy_color(p) for p in ts["policy"]]
                ax.bar(x, ts["accuracy"], yerr=ts["accuracy_se"].fillna(0), color=colors, capsize=3)
                for xi, acc, se, done in zip(x, ts["accuracy"], ts["accuracy_se"].fillna(0), ts["complete"]):
                    if not math.isnan(acc):
                        label = f"{acc:.1f}" + ("" if done else "†")
                        ax.text(xi, acc + se + 1.5, label, ha="center", fontsize=7)
                marks = [  # the same outputs under each grader rule; the paper's pilot numbers on GSM8K
                    (ts[f"accuracy_{rule}"], m, f"grader {rule}")
                    for rule, m in (("strict", "_"), ("last_boxed", "x"))
                    if f"accuracy_{rule}" in ts and ts[f"accuracy_{rule}"].notna().any()
                ]
                if task == "gsm8k":
                    paper = [GSM8K_PILOT.match(n, p) for n, p in zip(ts["policy_name"], ts["params"])]
                    marks.append((pd.Series([r.accuracy if r else np.nan for r in paper]), "*", "paper"))
                for values, marker, label in marks:
                    ax.scatter(
                        x, values.to_numpy(dtype=float), marker=marker, color="black", s=40, zorder=3, label=label
                    )
                if marks:
                    ax.legend(fontsize=7, loc="upper right")
                ax.set_xticks(x, _wrap(ts["short"]), rotation=40, ha="right", rotation_mode="anchor", fontsize=8)
                ax.set_ylabel("pass@1 (%)")
                ax.set_ylim(0, max(100.0, float(np.nanmax(ts["accuracy"].to_numpy(dtype=float), initial=0)) + 8))
                ax.set_title(f"{TASK_LABELS.get(task, task)} — {model}, {op}")
                ax.grid(axis="y", alpha=0.3)
                res.figures[name] = fig


def figure_diversity(diversity: pd.DataFrame, res: FigureResult) -> None:
    """Mean kept-set Jaccard across heads / layers / samples per policy (grouped bars)."""
    name = "cache_diversity"
    if diversity is None or diversity.empty:
        res.skip(name, "no kept_sets recorded (run with record_kept=true)")
        return
    d = diversity.groupby("method", sort=False)[["heads", "layers", "samples"]].mean()
    fig = new_figure(max(5.0, 1.2 * len(d) + 2), 4.0)
    ax = fig.add_subplot()
    x = np.arange(len(d))
    for k, (col, color) in enumerate(zip(("heads", "layers", "samples"), ("#1f77b4", "#ff7f0e", "#2ca02c"))):
        ax.bar(x + (k - 1) * 0.27, d[col].to_numpy(dtype=float), width=0.27, label=f"across {col}", color=color)
    ax.set_xticks(x, _wrap(d.index), rotation=30, ha="right", rotation_mode="anchor", fontsize=8)
    ax.set_ylabel("mean Jaccard of kept sets")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=8)
    ax.set_title("Cache diversity (lower = more diverse)")
    res.figures[name] = fig


def paper_figures(tree: Tree, summary: pd.DataFrame, diversity: pd.DataFrame | None = None) -> FigureResult:
    """Every figure the tree supports; the others are listed in :attr:`FigureResult.skipped` with the reason."""
    res = FigureResult()
    figure_accuracy_vs_budget(summary, res)
    figure_failure_modes(summary, res)
    figure_output_lengths(tree, summary, res)
    figure_throughput_memory(summary, res)
    figure_ablation_heatmap(summary, res)
    figure_policy_bars(summary, res)
    if diversity is not None and not diversity.empty:
        figure_diversity(diversity, res)
    else:
        res.skip("cache_diversity", "no kept_sets recorded (run with record_kept=true)")
    return res
