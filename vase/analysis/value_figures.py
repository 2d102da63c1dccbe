"""The value-magnitude analysis's figures and output files (the computation: :mod:`vase.analysis.value_analysis`)."""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.ticker import NullFormatter

from vase.analysis.figure_base import COLUMN_WIDTH, new_figure, paper_style, save_figure, wrap_to
from vase.analysis.value_analysis import POSITION_BUCKETS, SINKS, ValueAnalysis

logger = logging.getLogger(__name__)


def _width(inches: float) -> float:
    """A figure width between one and two paper columns (:data:`COLUMN_WIDTH`): fonts stay >= 7 pt when printed."""
    return min(max(inches, COLUMN_WIDTH), 2 * COLUMN_WIDTH)


def _fit(fig: Figure, title: str, share: float = 0.95) -> str:
    """``title`` broken into lines that fit ``share`` of ``fig``'s width (a caller's long title, a long definition;
    an axes' title is centred on the axes, which the tick labels push off the figure's centre: a smaller share)."""
    return wrap_to(title, share * fig.get_size_inches()[0])


def layer_labels(df: pd.DataFrame, layers) -> list[str]:
    """Tick labels of ``layers``: the model's index, ``"<i> sw"`` for a sliding-window layer (its ring's tokens
    only; ``df``'s ``layer_type``, absent in records written before it: full attention)."""
    kinds = dict(zip(df["layer"], df["layer_type"])) if "layer_type" in df.columns else {}
    return [f"{li} sw" if kinds.get(li) == "sliding_attention" else str(li) for li in layers]


@paper_style
def plot_distributions(df: pd.DataFrame, title: str = "") -> Figure:
    """Violins of the value range and the L2 norm per layer (log scale)."""
    layers = sorted(df["layer"].unique())
    labels = layer_labels(df, layers)
    fig = new_figure(_width(0.55 * len(layers) + 1.6), 2.6)
    axes = fig.subplots(1, 2)
    for ax, stat, color in zip(axes, ("range", "l2"), ("#1f77b4", "#ff7f0e")):
        data = [np.log10(np.clip(df.loc[df["layer"] == li, stat].to_numpy(), 1e-6, None)) for li in layers]
        parts = ax.violinplot(data, showmedians=True, showextrema=True, widths=0.85)
        for body in parts["bodies"]:
            body.set_facecolor(color)
            body.set_alpha(0.55)
        ax.set_xticks(np.arange(1, len(layers) + 1), labels)
        ax.set_xlabel("layer (sw: sliding window)" if any(t.endswith(" sw") for t in labels) else "layer")
        ax.set_ylabel(f"log10 value {'range (max - min)' if stat == 'range' else 'L2 norm'}")
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(_fit(fig, title or "Value-state magnitude per layer (all heads, all tokens)"))
    return fig


@paper_style
def plot_share_above(stats: pd.DataFrame, title: str = "") -> Figure:
    """Grouped bars: share of tokens whose range exceeds k × their (layer, head) median, per layer."""
    cols = [c for c in stats.columns if c.startswith("share_above_")]
    fig = new_figure(_width(0.45 * len(stats) + 1.2), 2.4)
    ax = fig.add_subplot()
    x = np.arange(len(stats))
    w = 0.8 / max(1, len(cols))
    for i, c in enumerate(cols):
        ax.bar(
            x + (i - (len(cols) - 1) / 2) * w,
            100 * stats[c],
            width=w,
            label=c.replace("share_above_", "> ").replace("_median", " median"),
        )
    ax.set_xticks(x, layer_labels(stats, stats["layer"]))
    ax.set_xlabel("layer")
    ax.set_ylabel("% of tokens (per head median)")
    ax.legend()
    ax.grid(axis="y", alpha=0.3)
    ax.set_title(_fit(fig, title or "Share of large-value tokens", 0.75))
    return fig


@paper_style
def plot_locations(loc: pd.DataFrame, title: str = "") -> Figure:
    """Stacked horizontal bars: where the large-value tokens sit (position buckets) per layer, vs all tokens
    (``loc``: one definition's rows of :func:`large_value_locations`)."""
    b = loc[loc["kind"] == "bucket"]
    layers = sorted(b["layer"].unique())
    labels = [x[2] for x in POSITION_BUCKETS]
    colors = ["#d62728", "#ff7f0e", "#bcbd22", "#2ca02c", "#17becf", "#1f77b4"]
    fig = new_figure(2 * COLUMN_WIDTH, 0.22 * (len(layers) + 1) + 1.2)
    ax = fig.add_subplot()
    rows = [f"layer {li} (large)" for li in layers] + ["all tokens"]
    left = np.zeros(len(rows))
    for label, color in zip(labels, colors):
        vals = [float(b[(b["layer"] == li) & (b["where"] == label)]["large_share"].fillna(0).sum()) for li in layers]
        vals.append(float(b[(b["layer"] == layers[0]) & (b["where"] == label)]["all_share"].sum()) if layers else 0)
        ax.barh(rows, vals, left=left, color=color, label=label)
        left += np.asarray(vals)
    ax.set_xlim(0, 1)
    ax.invert_yaxis()
    ax.set_xlabel("share of tokens")
    ax.legend(fontsize=7, ncols=3, loc="lower center", bbox_to_anchor=(0.5, 1.0))
    definition = loc["definition"].iloc[0] if len(loc) else ""
    ax.set_title(_fit(fig, title or f"Where the large-value tokens ({definition}) sit", 0.75), pad=40)
    return fig


@paper_style
def plot_top_tokens(tokens: pd.DataFrame, title: str = "") -> Figure:
    """Horizontal bars: the text tokens most often large-valued (count over layers × heads × occurrences)."""
    fig = new_figure(2 * COLUMN_WIDTH, 0.16 * max(len(tokens), 1) + 1.0)
    ax = fig.add_subplot()
    labels = [f"{t!r} @{p}" if p >= 0 else repr(t) for t, p in zip(tokens["text"], tokens["sink_position"])]
    ax.barh(np.arange(len(tokens)), tokens["large"], color="#1f77b4")
    ax.set_yticks(np.arange(len(tokens)), labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("large-value (layer, head, position) entries")
    definition = tokens["definition"].iloc[0] if len(tokens) else ""
    ax.set_title(_fit(fig, title or f"Tokens with large values ({definition}); @p: also a sink at position p", 0.75))
    return fig


#: ``correlation=``: the column of :func:`~vase.analysis.value_analysis.quant_error_correlation` shown, its symbol and
#: what it correlates (``spearman``: the harness's default; ``pearson``: the paper's, with HQQ)
CORRELATIONS = {
    "spearman": ("spearman_relative", "Spearman ρ", "Spearman(value range, relative quantization error)"),
    "pearson": ("pearson_mse", "Pearson r", "Pearson(value range, per-token MSE), sinks left out"),
}


@paper_style
def plot_quant_error(
    df: pd.DataFrame,
    corr: pd.DataFrame,
    bits: int,
    group_size: int,
    title: str = "",
    max_points: int = 2500,
    seed: int = 0,
    correlation: str = "spearman",
) -> Figure:
    """Per layer: scatter of value range vs relative quantization error (b bits, groups of g), the correlation
    (:data:`CORRELATIONS`) in the titles."""
    column, symbol, _ = CORRELATIONS[correlation]
    layers = sorted(df["layer"].unique())
    cols = min(len(layers), 3)
    rows = int(np.ceil(len(layers) / cols))
    fig = new_figure(_width(2.2 * cols), 1.7 * rows + 0.5)
    axes = np.atleast_1d(fig.subplots(rows, cols, squeeze=False)).ravel()
    col = f"qerr_b{bits}_g{group_size}"
    rng = np.random.default_rng(seed)
    for ax, li in zip(axes, layers):
        sub = df[df["layer"] == li]
        if len(sub) > max_points:
            sub = sub.iloc[rng.choice(len(sub), max_points, replace=False)]
        x = np.clip(sub["range"].to_numpy(dtype=float), 1e-6, None)
        ax.hexbin(x, sub[col], xscale="log", gridsize=28, mincnt=1, bins="log", cmap="Blues", linewidths=0)
        sinks = sub[sub["position"] < SINKS]
        ax.scatter(np.clip(sinks["range"], 1e-6, None), sinks[col], s=6, c="#d62728", linewidths=0)
        r = corr[(corr["layer"] == li) & (corr["bits"] == bits) & (corr["group_size"] == group_size)]
        rho = r[column].iloc[0] if len(r) else np.nan
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.tick_params(labelsize=7)
        ax.set_title(f"layer {li}: {symbol.split()[-1]} = {rho:.2f}")
        if ax in axes[(rows - 1) * cols :] or li == layers[-1]:
            ax.set_xlabel("value range")
        if list(axes).index(ax) % cols == 0:
            ax.set_ylabel("relative error")
    for ax in axes[len(layers) :]:
        ax.set_visible(False)
    fig.suptitle(
        _fit(fig, title or f"Value range vs {bits}-bit quantization error\n(groups of {group_size}; red: sinks)")
    )
    return fig


@paper_style
def plot_correlation_heatmap(corr: pd.DataFrame, title: str = "", correlation: str = "spearman") -> Figure:
    """Heatmap of the correlation (:data:`CORRELATIONS`) per layer × (bits, group size)."""
    column, symbol, what = CORRELATIONS[correlation]
    corr = corr.assign(setting=[f"{b}b/g{g}" for b, g in zip(corr["bits"], corr["group_size"])])
    grid = corr.pivot(index="setting", columns="layer", values=column)
    fig = new_figure(_width(0.6 * grid.shape[1] + 1.6), 0.3 * grid.shape[0] + 1.2)
    ax = fig.add_subplot()
    im = ax.imshow(grid.to_numpy(dtype=float), cmap="coolwarm", vmin=-1, vmax=1, aspect="auto")
    for i in range(grid.shape[0]):
        for j in range(grid.shape[1]):
            ax.text(j, i, f"{grid.iat[i, j]:.2f}", ha="center", va="center")
    ax.set_xticks(range(grid.shape[1]), [str(c) for c in grid.columns])
    ax.set_yticks(range(grid.shape[0]), list(grid.index))
    ax.set_xlabel("layer")
    fig.colorbar(im, ax=ax, label=symbol)
    ax.set_title(_fit(fig, title or what, 0.75))
    return fig


def write_outputs(
    res: ValueAnalysis,
    out_dir: str | Path,
    formats: Sequence[str] = ("png", "pdf"),
    title: str = "",
    save_records: bool = False,
    scatter: Sequence[tuple[int, int]] | None = None,
    correlation: str = "spearman",
) -> list[Path]:
    """Write the CSV tables and every figure into ``out_dir``; return the paths.

    ``scatter``: the (bits, group size) settings that get a range-vs-error scatter figure (default: all).
    ``correlation``: the one the heatmap ``quant_error_<correlation>`` shows (:data:`CORRELATIONS`); the table
    ``quant_error_<correlation>.csv`` has every column either way.
    """
    if correlation not in CORRELATIONS:
        raise ValueError(f"correlation: must be one of {', '.join(CORRELATIONS)}, got {correlation!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, df in (
        ("per_layer_stats", res.per_layer),
        ("large_value_positions", res.locations),
        ("large_value_tokens", res.tokens),
        (f"quant_error_{correlation}", res.correlation),
    ):
        df.to_csv(out / f"{name}.csv", index=False)
        paths.append(out / f"{name}.csv")
    if save_records:
        res.records.to_csv(out / "records.csv.gz", index=False)
        paths.append(out / "records.csv.gz")
    suffix = f" — {title}" if title else ""
    figs = {
        "value_distributions": plot_distributions(res.records, f"Value-state magnitude per layer{suffix}"),
        "large_value_share": plot_share_above(res.per_layer, f"Share of large-value tokens{suffix}"),
        f"quant_error_{correlation}": plot_correlation_heatmap(res.correlation, correlation=correlation),
    }
    for i, definition in enumerate(res.definitions):
        tag = "" if i == 0 else f"_{re.sub(r'[^a-z0-9]+', '_', definition.lower()).strip('_')}"
        loc = res.locations[res.locations["definition"] == definition]
        if loc["large_tokens"].sum() == 0:
            logger.info("no large-value token (%s): no position / token figure for it", definition)
            continue
        figs[f"large_value_positions{tag}"] = plot_locations(loc)
        figs[f"large_value_tokens{tag}"] = plot_top_tokens(res.tokens[res.tokens["definition"] == definition])
    settings = sorted({(int(b), int(g)) for b, g in zip(res.correlation["bits"], res.correlation["group_size"])})
    for b, g in settings if scatter is None else scatter:
        figs[f"quant_error_b{b}_g{g}"] = plot_quant_error(res.records, res.correlation, b, g, correlation=correlation)
    for name, fig in figs.items():
        paths += save_figure(fig, out, name, formats, dpi=200)
    return paths
