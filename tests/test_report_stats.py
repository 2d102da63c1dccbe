"""The report's comparisons on synthetic results trees: CIs and seed spread per cell, paired differences with Holm,
retained KV and cost per correct sample, the matched-memory and ablation figures, load_tree's output text and
duplicate runs, compare_runs; and the figures' legibility at single-column width."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from matplotlib.text import Text

from tests.test_analysis import BYTES_PER_TOKEN, PROMPT_TOKENS, make_run, row, tree_dir  # noqa: F401
from vase.analysis.aggregate import summarize
from vase.analysis.comparisons import cell_statistics, compare_runs, paired_comparisons
from vase.analysis.cost_figures import figure_ablation_grid, figure_matched_memory
from vase.analysis.figure_base import COLUMN_WIDTH, MIN_FONT, FigureResult, save_figure
from vase.analysis.load import load_tree
from vase.analysis.report import build_report
from vase.analysis.stats import holm


@pytest.fixture()
def seeds_tree(tmp_path: Path) -> Path:
    """math500, 4 problems x 2 samples, seeds 0 and 1 of the full cache and of snapkv (B=64)."""
    root = tmp_path / "seeds"
    full = {
        0: {"p0": [1, 1], "p1": [1, 0], "p2": [1, 1], "p3": [0, 0]},
        1: {"p0": [1, 1], "p1": [1, 1], "p2": [1, 0], "p3": [0, 0]},
    }
    snap = {
        0: {"p0": [1, 0], "p1": [0, 0], "p2": [1, 1], "p3": [0, 0]},
        1: {"p0": [0, 0], "p1": [1, 0], "p2": [0, 0], "p3": [0, 0]},
    }
    for seed in (0, 1):
        make_run(root, f"full-s{seed}", "math500", "full", 64, full[seed], seed=seed)
        make_run(root, f"snap-s{seed}", "math500", "snapkv", 64, snap[seed], seed=seed, tokens=[100, 300] * 4)
    return root


def test_seeds_pooled_with_ci_and_spread(seeds_tree: Path):
    tree = load_tree(seeds_tree)
    s = cell_statistics(tree, summarize(tree))
    full = row(s, "math500", "full", "full")
    assert full["seeds"] == 2 and full["samples"] == 16 and full["problems"] == 4
    # pooled per problem: p0 4/4, p1 3/4, p2 3/4, p3 0/4 -> 62.5 %; per seed: 62.5 and 62.5
    assert full["accuracy"] == pytest.approx(62.5)
    assert full["seed_accuracies"] == "s0: 62.5, s1: 62.5" and full["seed_sd"] == pytest.approx(0.0)
    assert full["accuracy_ci_low"] <= 62.5 <= full["accuracy_ci_high"]
    snap = row(s, "math500", "snapkv", "B=64")
    assert snap["accuracy"] == pytest.approx(100 * (1 / 4 + 1 / 4 + 2 / 4 + 0) / 4)
    assert snap["seed_min"] == pytest.approx(12.5) and snap["seed_max"] == pytest.approx(37.5)
    assert snap["seed_sd"] == pytest.approx(np.std([37.5, 12.5], ddof=1))
    # the same tree gives the same intervals (seeded)
    again = cell_statistics(tree, summarize(tree))
    assert row(again, "math500", "snapkv", "B=64")["accuracy_ci_low"] == snap["accuracy_ci_low"]


def test_paired_comparisons_against_the_full_cache(seeds_tree: Path):
    tree = load_tree(seeds_tree)
    pairs = paired_comparisons(tree, summarize(tree))
    (r,) = pairs.to_dict("records")
    assert (r["a"], r["b"], r["vs_full"], r["pairs"], r["problems"]) == ("snapkv", "full", True, 16, 4)
    # per problem (a - b): p0 1/4 - 1 = -0.75, p1 1/4 - 3/4 = -0.5, p2 2/4 - 3/4 = -0.25, p3 0 -> mean -0.375
    assert r["diff"] == pytest.approx(-37.5)
    # exact sign flips of (-0.75, -0.5, -0.25, 0): |mean| >= 0.375 only when the three non-zero ones agree: 2 x 2 / 16
    assert r["p"] == pytest.approx(4 / 16) and r["p_holm"] == pytest.approx(r["p"])
    assert r["diff_low"] <= -37.5 <= r["diff_high"] <= 0


def test_holm_over_the_grid(tree_dir: Path, tmp_path: Path):  # noqa: F811
    report = build_report(tree_dir, tmp_path / "report", formats=("png",))
    names = {t.name for t in report.tables}
    assert {"statistics_m_B64", "statistics_m_B128", "paired_m"} <= names
    (paired,) = [t for t in report.tables if t.name == "paired_m"]
    d = paired.data
    assert len(d) >= 3 and d["p_holm"].to_numpy() == pytest.approx(holm(d["p"].to_numpy()))
    assert (d["p_holm"] >= d["p"]).all()
    # every policy against the full cache of its task, and the policies at one operating point against each other
    assert {("gsm8k", "B=64", "snapkv", "full"), ("gsm8k", "B=64", "snapkv", "vase_attnv")} <= set(
        zip(d["task"], d["op"], d["a"], d["b"])
    )
    md = (tmp_path / "report" / "tables" / "paired_m.md").read_text()
    assert "Holm" in md and "95% CI" in md


def test_retained_kv_and_cost_per_correct(seeds_tree: Path):
    s = summarize(load_tree(seeds_tree))
    snap = row(s, "math500", "snapkv", "B=64")
    # make_run: the mean held tokens are 40 per sample, the peak min(total, budget) = 64 tokens
    assert snap["kv_retained_bytes_mean"] == pytest.approx(40 * BYTES_PER_TOKEN)
    assert snap["kv_retained_bytes_peak"] == 64 * BYTES_PER_TOKEN
    # 16 samples of 100 and 300 tokens, 4 correct; 4 problems per run x 1 s of decoding x 2 runs
    assert snap["correct_samples"] == 4
    assert snap["tokens_per_correct"] == pytest.approx(8 * (100 + 300) / 4)
    assert snap["decode_seconds_per_correct"] == pytest.approx(8.0 / 4)
    full = row(s, "math500", "full", "full")
    assert full["kv_retained_bytes_peak"] == (PROMPT_TOKENS + 100) * BYTES_PER_TOKEN


def test_retained_kv_of_a_run_written_before_the_fields(tmp_path: Path):
    d = make_run(tmp_path, "old", "gsm8k", "snapkv", 64, {"p0": [1, 0]})
    lines = [json.loads(x) for x in (d / "samples.jsonl").read_text().splitlines()]
    for r in lines:
        del r["kv_retained_bytes_mean"], r["kv_retained_bytes_peak"], r["held_tokens_max"]
    (d / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    r = row(summarize(load_tree(tmp_path)), "gsm8k", "snapkv", "B=64")
    # held_tokens_mean (40) x bytes per token (kv_full_bytes_end / (prompt + output)); the peak is not known
    assert r["kv_retained_bytes_mean"] == pytest.approx(40 * BYTES_PER_TOKEN)
    assert np.isnan(r["kv_retained_bytes_peak"])


def test_selection_policies_are_labelled_full_cache_kept(tmp_path: Path):
    make_run(tmp_path, "q", "gsm8k", "quest", 64, {"p0": [1, 0]})
    s = summarize(load_tree(tmp_path))
    assert s["method"].iloc[0] == "Quest (full cache kept)" and s["short"].iloc[0] == "Quest (full cache kept)"


def test_load_tree_output_text_and_duplicate_runs(seeds_tree: Path, tmp_path: Path, caplog):
    tree = load_tree(seeds_tree)
    assert "output" not in tree.samples
    assert set(load_tree(seeds_tree, with_output=True).samples["output"]) == {"x"}
    # the same results in a second folder (and a half copy of one run): each sample counted once, one log line
    both = tmp_path / "both"
    shutil.copytree(seeds_tree, both / "a")
    shutil.copytree(seeds_tree, both / "b")
    half = both / "b" / "snap-s1" / "samples.jsonl"
    half.write_text("".join(half.read_text().splitlines(keepends=True)[:3]))
    with caplog.at_level("WARNING"):
        dup = load_tree(both)
    assert len(dup.runs) == 4 and len(dup.samples) == len(tree.samples)
    lines = [r for r in caplog.records if "duplicate" in r.getMessage()]
    assert len(lines) == 1 and "dropped 4 duplicate run(s)" in lines[0].getMessage()
    kept = load_tree(both, drop_duplicates=False)
    assert len(kept.runs) == 8
    # shards of one run (the same identity, other problems) are not duplicates
    shards = tmp_path / "shards"
    make_run(shards, "r0", "gsm8k", "snapkv", 64, {"p0": [1, 0]})
    make_run(shards, "r1", "gsm8k", "snapkv", 64, {"p1": [1, 1]})
    assert len(load_tree(shards).runs) == 2


def test_compare_runs_sample_by_sample(seeds_tree: Path):
    tree = load_tree(seeds_tree, with_output=True)
    d = compare_runs(tree, "full", {"policy": "snapkv", "op": "B=64"})
    assert len(d) == 16 and {"correct_a", "correct_b", "output_a", "output_b", "loop_class_a"} <= set(d.columns)
    lost = d[d["correct_a"] & ~d["correct_b"]]
    # snapkv never solves a sample the full cache missed: every changed verdict is a loss
    assert sorted(set(lost["problem_id"])) == ["p0", "p1", "p2"] and d["changed"].sum() == len(lost) == 6
    # one run against one run: the same problem and seed only
    ids = tree.runs.set_index("run_dir")["run_id"]
    one = compare_runs(tree, int(ids[str(seeds_tree / "full-s0")]), {"policy": "snapkv", "seed": 0})
    assert len(one) == 8
    assert compare_runs(tree, {"policy": "full", "seed": 0}, {"policy": "snapkv", "seed": 1}).empty
    with pytest.raises(ValueError, match="no run matches"):
        compare_runs(tree, "nope", "full")
    with pytest.raises(ValueError, match="no column"):
        compare_runs(tree, {"colour": 1}, "full")


def _ablation(root: Path, correct) -> pd.DataFrame:
    for n_protect in (0.0625, 0.125, 0.25):
        for temp in (0.5, 1.0, 2.0):
            params = {"n_protect": n_protect, "attn_temperature": temp}
            make_run(root, f"r{n_protect}-{temp}", "math500", "vase_attnv", 64, correct(n_protect, temp), params=params)
    make_run(root, "full", "math500", "full", 64, {"p0": [1, 1], "p1": [1, 0]})
    return summarize(load_tree(root))


def test_ablation_grid_fixed_range_se_and_n(tmp_path: Path):
    s = _ablation(tmp_path / "a", lambda n, t: {"p0": [1, int(t == 1.0)], "p1": [int(n > 0.1), 0]})
    # cells at the class default (attn_temperature=1) keep the label; sorted by value
    cells = [p for p in s["policy"] if p != "full"]
    assert (
        cells[:3]
        == [
            "vase_attnv[attn_temperature=0.5,n_protect=0.0625]",
            "vase_attnv[attn_temperature=0.5,n_protect=0.125]",
            "vase_attnv[attn_temperature=0.5,n_protect=0.25]",
        ]
        and "vase_attnv[attn_temperature=1,n_protect=0.25]" in cells
    )
    res = FigureResult()
    figure_ablation_grid(s, res)
    (fig,) = res.figures.values()
    ax = fig.axes[0]
    assert ax.images[0].get_clim() == (0.0, 100.0)
    assert ax.get_xlabel() == "attention temperature T" and ax.get_ylabel() == "protected value slots (n_protect)"
    texts = [t.get_text() for t in ax.texts]
    assert len(texts) == 9 and all("n=4" in t and "±" in t for t in texts)
    # n_protect=0.125, T=1: p0 (1, 1), p1 (1, 0) -> 75 %, SE = std(1, 0.5) / sqrt(2) = 25
    assert "75.0\n±25.0\nn=4" in texts
    # the same grid as a table: rows n_protect, columns attn_temperature
    from vase.analysis.aggregate import ablation_grids
    from vase.analysis.comparisons import ablation_table

    (grid,) = ablation_grids(s)
    t = ablation_table(grid)
    assert t.name == "ablation_m_math500_vase_attnv_B64"
    assert list(t.display.columns)[1:] == ["0.5", "1", "2"]
    assert list(t.display.iloc[:, 0]) == ["0.0625", "0.125", "0.25"]
    assert t.display.set_index(t.display.columns[0]).loc["0.125", "1"] == "75.00 ± 25.00 (4)"
    assert t.data.loc[1, "attn_temperature=1"] == pytest.approx(75.0)


def test_ablation_grid_all_zero(tmp_path: Path):
    s = _ablation(tmp_path / "z", lambda n, t: {"p0": [0, 0], "p1": [0, 0]})
    res = FigureResult()
    figure_ablation_grid(s, res)
    (fig,) = res.figures.values()
    ax = fig.axes[0]
    assert ax.images[0].get_clim() == (0.0, 100.0)  # the colour bar never shows negative accuracy
    colorbar = fig.axes[1]
    assert min(colorbar.get_ylim()) == 0.0 and max(colorbar.get_ylim()) == 100.0
    assert all(t.get_text().startswith("0.0") for t in ax.texts)
    save_figure(fig, tmp_path / "fig", "zero", ("png",))


def test_matched_memory_figure(seeds_tree: Path):
    tree = load_tree(seeds_tree)
    s = cell_statistics(tree, summarize(tree))
    res = FigureResult()
    figure_matched_memory(s, res)
    fig = res.figures["matched_memory_m_math500"]
    ax = fig.axes[0]
    xs = sorted(float(line.get_xdata()[0]) for line in ax.get_lines() if len(line.get_xdata()))
    assert xs[0] == pytest.approx(40 * BYTES_PER_TOKEN / 2**20)
    one = FigureResult()
    figure_matched_memory(s[s["policy"] == "full"], one)
    assert "fewer than two policies" in dict(one.skipped)["matched_memory_m_math500"]


@pytest.mark.slow  # CI's time budget
def test_every_figure_legible_at_column_width(tree_dir: Path, tmp_path: Path):  # noqa: F811
    """Every report figure: at most two columns wide (one for single panels), no text under 7 pt, no rotated tick."""
    report = build_report(tree_dir, tmp_path / "report", formats=("png",))
    from vase.analysis.figures import paper_figures

    tree = load_tree(tree_dir)
    summary = cell_statistics(tree, summarize(tree))
    figs = paper_figures(tree, summary)
    assert {"matched_memory_m_gsm8k", "throughput_memory_m"} <= set(figs.figures)
    for name, fig in figs.figures.items():
        save_figure(fig, tmp_path / "drawn", name, ("png",))  # ticks exist once drawn
        width = fig.get_size_inches()[0]
        assert width <= 2 * COLUMN_WIDTH + 1e-9, name
        for t in fig.findobj(Text):
            if t.get_visible() and t.get_text().strip():
                assert t.get_fontsize() >= MIN_FONT, (name, t.get_text(), t.get_fontsize())
        for ax in fig.axes:
            for t in ax.get_xticklabels() + ax.get_yticklabels():
                assert t.get_rotation() == 0, (name, t.get_text())
    assert len(report.figure_paths) == len(figs.figures)


def test_engine_reports_the_peak_held_tokens(finished_run: Path):
    """A real tiny run (vase_attnv, budget 32, window 16, prompts longer than the budget): the peak is the prompt
    grown to the next eviction point (a multiple of the window), the mean lies below it, the bytes follow."""
    from vase.run.results import read_samples

    rows = read_samples(finished_run)
    metrics = json.loads((finished_run / "metrics.json").read_text())
    per_token = rows[0]["kv_full_bytes_end"] / (rows[0]["prompt_tokens"] + rows[0]["output_tokens"])
    for r in rows:
        p, n, peak = r["prompt_tokens"], r["output_tokens"], r["held_tokens_max"]
        assert r["held_tokens_mean"] <= peak and r["kv_retained_bytes_peak"] == peak * per_token
        assert r["kv_retained_bytes_mean"] == pytest.approx(r["held_tokens_mean"] * per_token)
        first_eviction = -(-(p + 1) // 16) * 16  # the first position that is a multiple of the window
        assert p > 32 and peak == (first_eviction if p + n - 1 >= first_eviction else p + n - 1)
    assert metrics["kv_retained_bytes_peak"] == max(r["kv_retained_bytes_peak"] for r in rows)
    assert metrics["tokens_per_correct"] is None or metrics["correct_samples"] > 0
