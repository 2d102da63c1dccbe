"""Every figure the analysis makes (``vase/analysis/*figures*``) fits its canvas at a paper's column width: drawn as
saved (:data:`~vase.analysis.figure_base.PAPER_RC`), no text artist's window extent leaves the figure.

The data are sized like a real sweep, where the clipping showed (issue 39): every policy of the harness in one
legend, long ablation labels, two tasks, a long machine name, and a Qwen3-sized value analysis (36 layers). The
report figures are one column (3.3 in) wide; the value-analysis figures span one to two columns by design
(:func:`vase.analysis.value_figures._width`) and are checked at the width they are made at.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from matplotlib import rc_context
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.text import Text

from tests.test_analysis import TARGETS, make_run
from tests.test_report_stats import _ablation
from vase.analysis import value_analysis as V
from vase.analysis import value_figures as VF
from vase.analysis.aggregate import summarize
from vase.analysis.comparisons import cell_statistics
from vase.analysis.cost_figures import figure_ablation_grid
from vase.analysis.figure_base import COLUMN_WIDTH, PAPER_RC, FigureResult
from vase.analysis.figures import figure_diversity, paper_figures
from vase.analysis.load import load_tree

MACHINE = "Intel(R) Xeon(R) Platinum 8480+ (AMX), 2 threads, bfloat16"


def outside(fig: Figure, tol_px: float = 0.5) -> list[tuple[str, tuple[int, int, int, int]]]:
    """The drawn texts of ``fig`` whose window extent leaves the canvas: ``(text, (x0, y0, x1, y1))`` in pixels.
    Tick labels of ticks outside their axis' view interval are not drawn, so they do not count."""
    with rc_context(PAPER_RC):
        canvas = FigureCanvasAgg(fig)
        canvas.draw()
        renderer = canvas.get_renderer()
    undrawn = set()
    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):
            lo, hi = sorted(axis.get_view_interval())
            eps = 1e-9 * max(1.0, abs(hi - lo))
            for tick in axis.get_major_ticks() + axis.get_minor_ticks():
                if not lo - eps <= tick.get_loc() <= hi + eps:
                    undrawn |= {id(tick.label1), id(tick.label2)}
    w, h = fig.bbox.width, fig.bbox.height
    out = []
    for t in fig.findobj(Text):
        if id(t) in undrawn or not t.get_visible() or not t.get_text().strip():
            continue
        b = t.get_window_extent(renderer)
        if b.x0 < -tol_px or b.y0 < -tol_px or b.x1 > w + tol_px or b.y1 > h + tol_px:
            out.append((t.get_text()[:60], (round(b.x0), round(b.y0), round(b.x1), round(b.y1))))
    return out


def report_figures(tmp_path: Path) -> dict[str, Figure]:
    rng = np.random.default_rng(0)
    root = tmp_path / "results"
    for task in ("livecodebench", "gpqa_diamond"):
        for budget in (64, 1024):
            for policy in TARGETS:
                correct = {f"p{i}": [int(x) for x in rng.integers(0, 2, 2)] for i in range(3)}
                classes = [str(c) for c in rng.choice(["ok", "loop", "truncated", "garbage"], 6)]
                tokens = [int(x) for x in rng.integers(100, 30000, 6)]
                make_run(root, f"{task}/{policy}-{budget}", task, policy, budget, correct, model="qwen3_14b",
                         classes=classes, tokens=tokens)  # fmt: skip
    tree = load_tree(root)
    tree.runs["machine"] = MACHINE
    figs = dict(paper_figures(tree, cell_statistics(tree, summarize(tree))).figures)
    res = FigureResult()
    figure_ablation_grid(_ablation(tmp_path / "ablation", lambda n, t: {"p0": [1, int(t == 1.0)], "p1": [1, 0]}), res)
    diversity = pd.DataFrame(
        {"method": [f"{p} B=1024" for p in TARGETS], "heads": 0.5, "layers": 0.4, "samples": 0.3}
    )  # fmt: skip
    figure_diversity(diversity, res)
    figs.update(res.figures)
    return figs


def value_figures() -> dict[str, Figure]:
    """The value analysis's figures for a Qwen3-sized model: 36 layers (2 heads, 24 positions), long titles."""
    rng = np.random.default_rng(1)
    layers, heads, positions = 36, 2, 24
    n = layers * heads * positions
    rec = pd.DataFrame({
        "problem_id": "p",
        "layer": np.repeat(np.arange(layers), heads * positions),
        "head": np.tile(np.repeat(np.arange(heads), positions), layers),
        "position": np.tile(np.arange(positions), layers * heads),
        "token_id": rng.integers(0, 50, n),
        "is_prompt": np.tile(np.arange(positions) < 8, layers * heads),
    })  # fmt: skip
    for stat in ("range", "l2", "absmax"):
        rec[stat] = rng.lognormal(0, 1, n)
    for bits, group in ((2, 32), (4, 128)):
        rec[f"qerr_b{bits}_g{group}"] = rec["range"] * rng.uniform(0.1, 1, n)
        rec[f"qabs_b{bits}_g{group}"] = rng.uniform(0, 1, n)
    va = V.analyze(rec, token_text=lambda i: f" token_{i}_with_a_long_text", large=("10x", "top1%"))
    title = "Qwen3-14B, AIME 2025, 8 problems, the first 4,096 tokens of each output, every head of every layer"
    figs = {
        "value_distributions": VF.plot_distributions(va.records, f"Value-state magnitude per layer — {title}"),
        "large_value_share": VF.plot_share_above(va.per_layer, f"Share of large-value tokens — {title}"),
        "quant_error_spearman": VF.plot_correlation_heatmap(va.correlation),
        "quant_error_b2_g32": VF.plot_quant_error(va.records, va.correlation, 2, 32),
    }
    for d in va.definitions:
        loc = va.locations[va.locations["definition"] == d]
        figs[f"large_value_positions {d}"] = VF.plot_locations(loc)
        figs[f"large_value_tokens {d}"] = VF.plot_top_tokens(va.tokens[va.tokens["definition"] == d])
    return figs


def test_outside_sees_a_title_that_leaves_the_canvas():
    fig = Figure(figsize=(COLUMN_WIDTH, 2), layout="constrained")
    fig.add_subplot().set_title("a title far too long for one column of a two-column paper, set in 12 pt", size=12)
    assert [t for t, _ in outside(fig)] == [
        "a title far too long for one column of a two-column paper, set in 12 pt"[:60]
    ]
    fig.axes[0].set_title("short")
    assert outside(fig) == []


def test_every_report_figure_fits_one_column(tmp_path: Path):
    figs = report_figures(tmp_path)
    assert {"accuracy_vs_budget_qwen3_14b_gpqa_diamond", "matched_memory_qwen3_14b_livecodebench",
            "throughput_memory_qwen3_14b", "cache_diversity"} <= set(figs)  # fmt: skip
    assert any(k.startswith("ablation_") for k in figs) and any(k.startswith("failure_modes_") for k in figs)
    for name, fig in figs.items():
        assert fig.get_size_inches()[0] == pytest.approx(COLUMN_WIDTH), name
        assert outside(fig) == [], name


def test_every_value_figure_fits_its_width():
    for name, fig in value_figures().items():
        assert COLUMN_WIDTH - 1e-9 <= fig.get_size_inches()[0] <= 2 * COLUMN_WIDTH + 1e-9, name
        assert outside(fig) == [], name
