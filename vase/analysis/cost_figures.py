"""Figures of cost and comparisons: the ablation grid, accuracy at matched memory, throughput and memory.

* :func:`figure_ablation_grid`: pass@1 of a policy over two hyper-parameters (``sweep=vase_ablation``: protected
  value slots x attention temperature) as a grid: readable axis names, a fixed 0-100 % colour range (noise never looks
  like signal, all-zero data is a dark grid), each cell's pass@1, SE and number of samples.
* :func:`figure_matched_memory`: pass@1 (95 % bootstrap interval) against the mean KV bytes a sample's cache retained,
  every policy and budget of a (model, task) in one panel; selection policies sit at the full cache's memory.
* :func:`figure_throughput_memory`: decode throughput with its spread over the stretches of decoding
  (``throughput.jsonl`` lines: every round that ran), retained and full-cache KV per sample, the static allocation and
  peak memory; the machine named in the title.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
from matplotlib.ticker import FuncFormatter, NullFormatter

from vase.analysis.aggregate import ablation_grids
from vase.analysis.figure_base import (
    _PALETTE,
    COLUMN_WIDTH,
    FigureResult,
    legend_below,
    new_figure,
    paper_style,
    policy_color,
    wrap_to,
)
from vase.analysis.labels import (
    MISSING,
    PARAM_NAMES,
    POLICY_LABELS,
    TASK_LABELS,
    fmt_value,
    op_sort_key,
    policy_sort_key,
    slug,
    task_sort_key,
)
from vase.analysis.load import Tree

MIB, GIB = 2.0**20, 2.0**30


@paper_style
def figure_ablation_grid(
    summary: pd.DataFrame, res: FigureResult, row_param: str = "n_protect", col_param: str = "attn_temperature"
) -> None:
    """Per (model, task, policy name, operating point) where both parameters take two or more values: the grid."""
    for g in ablation_grids(summary, row_param, col_param):
        if isinstance(g, tuple):
            res.skip(*g)
            continue
        model, task, name_, op, rows, cols, acc, se, n = (
            g.model,
            g.task,
            g.policy_name,
            g.op,
            g.rows,
            g.cols,
            g.acc,
            g.se,
            g.n,
        )
        name = f"ablation_{slug(model)}_{slug(task)}_{slug(name_)}_{slug(op)}"
        fig = new_figure(COLUMN_WIDTH, 0.55 * len(rows) + 1.3)
        ax = fig.add_subplot()
        im = ax.imshow(acc, cmap="viridis", vmin=0.0, vmax=100.0, aspect="auto")
        for i in range(len(rows)):
            for j in range(len(cols)):
                if np.isnan(acc[i, j]):
                    text, color = MISSING, "black"
                else:
                    sd = "" if np.isnan(se[i, j]) else f"\n±{se[i, j]:.1f}"
                    text, color = f"{acc[i, j]:.1f}{sd}\nn={int(n[i, j])}", "black" if acc[i, j] > 55 else "white"
                ax.text(j, i, text, ha="center", va="center", color=color, fontsize=7, linespacing=0.95)
        ax.set_xticks(range(len(cols)), [fmt_value(c) for c in cols])
        ax.set_yticks(range(len(rows)), [fmt_value(r) for r in rows])
        ax.set_xlabel(PARAM_NAMES.get(col_param, col_param))
        ax.set_ylabel(PARAM_NAMES.get(row_param, row_param))
        fig.colorbar(im, ax=ax, label="pass@1 (%)", ticks=[0, 25, 50, 75, 100], fraction=0.06, pad=0.02)
        ax.set_title(f"{POLICY_LABELS.get(name_, name_)}, {TASK_LABELS.get(task, task)}, {op}\n{model}")
        res.figures[name] = fig


@paper_style
def figure_matched_memory(summary: pd.DataFrame, res: FigureResult) -> None:
    """Per (model, task): pass@1 against mean retained KV per sample (MiB), one line per policy across its budgets;
    error bars: the 95 % bootstrap interval where computed (``accuracy_ci_low``/``_high``), else ± SE."""
    for (model, task), sub in summary.groupby(["model", "task"], sort=False):
        name = f"matched_memory_{slug(model)}_{slug(task)}"
        mem = pd.to_numeric(sub.get("kv_retained_bytes_mean"), errors="coerce")
        sub = sub.assign(x=mem / MIB)
        sub = sub[np.isfinite(sub["x"]) & sub["accuracy"].notna()]
        if sub["policy"].nunique() < 2:
            res.skip(name, f"{model}/{task}: fewer than two policies with retained-KV bytes")
            continue
        fig = new_figure(COLUMN_WIDTH, 2.9)
        ax = fig.add_subplot()
        pols = sorted(sub["policy"].unique(), key=policy_sort_key)
        for k, pol in enumerate(pols):
            ps = sub[sub["policy"] == pol].sort_values("x")
            if {"accuracy_ci_low", "accuracy_ci_high"} <= set(ps) and ps["accuracy_ci_low"].notna().any():
                yerr = np.vstack([ps["accuracy"] - ps["accuracy_ci_low"], ps["accuracy_ci_high"] - ps["accuracy"]])
                yerr = np.nan_to_num(yerr)
            else:
                yerr = ps["accuracy_se"].fillna(0).to_numpy()
            full = ps["op_kind"].iloc[0] == "full"
            ax.errorbar(
                ps["x"],
                ps["accuracy"],
                yerr=yerr,
                marker="s" if full else "o",
                ls="none" if full else "-",
                capsize=2,
                label=ps["short"].iloc[0],
                color="black" if full else policy_color(pol, k if "[" in pol else 0),
            )
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:.3g}"))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("mean retained KV per sample (MiB)")
        ax.set_ylabel("pass@1 (%)")
        ax.set_ylim(-2, 102)
        ax.grid(alpha=0.3)
        ax.set_title(f"Matched memory, {TASK_LABELS.get(task, task)}\n{model}")
        legend_below(fig, ncols=1 if len(pols) < 4 else 2)
        res.figures[name] = fig


def _round_rates(tree: Tree, summary: pd.DataFrame) -> dict[tuple, np.ndarray]:
    """Per cell (model, task, policy, op): decode tokens/s of each ``throughput.jsonl`` line of its runs."""
    t = tree.throughput.merge(tree.runs[["run_id", "model", "task", "policy", "op"]], on="run_id")
    t = t[pd.to_numeric(t["decode_seconds"], errors="coerce") > 0]
    rates = pd.to_numeric(t["tokens"], errors="coerce") / pd.to_numeric(t["decode_seconds"], errors="coerce")
    t = t.assign(rate=rates)
    return {k: g["rate"].to_numpy(dtype=float) for k, g in t.groupby(["model", "task", "policy", "op"])}


# (summary column, scale, axis label) of the throughput / memory figure's panels
_PANELS = (
    ("decode_tokens_per_second", 1.0, "decode tokens/s\n• per round, — range"),
    ("kv_retained_bytes_mean", 1 / MIB, "KV per sample (MiB)\n■ mean, | peak, □ full"),
    ("kv_allocated_bytes", 1 / MIB, "allocated KV, static (MiB)"),
    ("peak_memory_bytes", 1 / GIB, "peak memory (GiB)"),
)


@paper_style
def figure_throughput_memory(tree: Tree, summary: pd.DataFrame, res: FigureResult) -> None:
    """Per model: one horizontal bar per (policy, operating point) and task in each of four stacked panels."""
    rates = _round_rates(tree, summary)
    for model in sorted(summary["model"].unique()):
        name = f"throughput_memory_{slug(model)}"
        sub = summary[summary["model"] == model]
        cols = [c for c, _, _ in _PANELS if c in sub]
        if not np.isfinite(sub[cols].apply(pd.to_numeric, errors="coerce").to_numpy(dtype=float)).any():
            res.skip(name, f"{model}: no throughput.jsonl and no per-sample KV bytes")
            continue
        several = sub.loc[sub["op_kind"] != "full", "op"].nunique() > 1
        order = {
            (p, o): op_sort_key(k, v) for p, o, k, v in zip(sub["policy"], sub["op"], sub["op_kind"], sub["op_value"])
        }
        entries = sorted(order, key=lambda e: (policy_sort_key(e[0]), order[e]))
        labels = []
        for p, o in entries:
            short = sub.loc[(sub["policy"] == p) & (sub["op"] == o), "short"].iloc[0]
            labels.append(short + (f" ({o})" if several and o != "full" else ""))
        tasks = sorted(sub["task"].unique(), key=task_sort_key)
        height = 0.16 * len(entries) * len(tasks) ** 0.6 + 0.55
        fig = new_figure(COLUMN_WIDTH, len(_PANELS) * height + 0.6)
        axes = fig.subplots(len(_PANELS), 1, sharey=True)
        y = np.arange(len(entries))
        bar = 0.8 / len(tasks)
        for k, task in enumerate(tasks):
            ts = sub[sub["task"] == task].set_index(["policy", "op"])
            color = _PALETTE[(k + 1) % len(_PALETTE)]
            ys = y + (k - (len(tasks) - 1) / 2) * bar

            def vals(col: str, scale: float, ts: pd.DataFrame = ts, entries: list = entries) -> np.ndarray:
                return np.array(
                    [float(ts.loc[e, col]) * scale if e in ts.index and col in ts else np.nan for e in entries]
                )

            for ax, (col, scale, _) in zip(axes, _PANELS):
                v = vals(col, scale)
                ax.barh(ys, v, height=bar, color=color, label=TASK_LABELS.get(task, task))
                if col == "decode_tokens_per_second":
                    for yi, (p, o) in zip(ys, entries):
                        r = rates.get((model, task, p, o))
                        if r is not None and len(r) > 1:
                            ax.plot([r.min(), r.max()], [yi, yi], color="black", lw=0.8)
                            ax.scatter(r, np.full(len(r), yi), s=4, color="black", zorder=3)
                if col == "kv_retained_bytes_mean":
                    ax.barh(ys, vals("kv_full_bytes_mean", scale), height=bar, fill=False, edgecolor=color, lw=0.8)
                    ax.scatter(vals("kv_retained_bytes_peak", scale), ys, marker="|", s=30, color="black", zorder=3)
        for ax, (_, _, title) in zip(axes, _PANELS):
            ax.set_xlabel(title)
            ax.grid(axis="x", alpha=0.3)
        axes[0].set_yticks(y, labels)
        axes[0].invert_yaxis()
        machines = sorted({m for m in tree.runs.loc[tree.runs["model"] == model, "machine"].dropna()})
        where = ", ".join(machines) if machines else "machine not recorded"
        if len(tasks) > 1:
            legend_below(fig, *axes[0].get_legend_handles_labels(), ncols=3)
        fig.suptitle(wrap_to(f"Throughput and memory: {model}\non {where}", 0.95 * COLUMN_WIDTH))
        res.figures[name] = fig
