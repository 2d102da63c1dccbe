"""Comparisons a reviewer accepts: per-cell bootstrap intervals and seed spread, paired differences with Holm.

A **cell** is one row of :func:`~vase.analysis.aggregate.summarize` (model, task, policy identity, operating point),
its runs pooled (several ``seed=`` runs of one cell are more samples of the same problems). The statistics are those
of :mod:`vase.analysis.stats`:

* :func:`cell_statistics` adds to the summary the 95 % bootstrap interval of pass@1 by problem
  (``accuracy_ci_low`` / ``accuracy_ci_high``, %) and the spread between seeds (``seed_accuracies``: each seed's
  pass@1 on its own, ``seed_sd``, ``seed_min``, ``seed_max``, %).
* :func:`paired_comparisons` compares, within each (model, task), every cell with the full cache and every two cells
  at the same operating point, on the samples they share (same problem, seed, sample index), and adjusts the p-values
  of the whole grid (every comparison of the report: one family) with Holm's method.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import numpy as np
import pandas as pd

from vase.analysis.aggregate import AblationGrid, at_op
from vase.analysis.labels import MISSING, PARAM_NAMES, POLICY_LABELS, TASK_LABELS, fmt_value, policy_sort_key, slug
from vase.analysis.load import Tree
from vase.analysis.stats import PAIR_KEYS, accuracy_ci, fmt_p, holm, match_samples, paired_difference, seed_spread
from vase.analysis.tables import Table, _fmt, _fmt_pm

logger = logging.getLogger(__name__)

CELL = ("model", "task", "policy", "op")
#: the statistics' defaults (seeded: a report is reproducible to the digit)
N_BOOT, N_PERM, SEED = 2000, 10000, 0


def cell_samples(tree: Tree) -> dict[tuple, pd.DataFrame]:
    """Each cell's samples (:data:`CELL` -> samples, each ``(problem_id, sample, seed)`` once, the run's ``seed=`` as
    ``run_seed``), pooled over its runs as :func:`~vase.analysis.aggregate.summarize` pools them."""
    runs = tree.runs[["run_id", *CELL, "seed"]].rename(columns={"seed": "run_seed"})
    s = tree.samples.merge(runs, on="run_id")
    out = {}
    for key, g in s.groupby(list(CELL), sort=False):
        out[key] = g.drop_duplicates(subset=["problem_id", "sample", "seed"], keep="first")
    return out


def cell_statistics(
    tree: Tree, summary: pd.DataFrame, n_boot: int = N_BOOT, seed: int = SEED, cells: dict | None = None
) -> pd.DataFrame:
    """``summary`` with the bootstrap interval and the seed spread of every cell's pass@1 (%, NaN without samples)."""
    cells = cell_samples(tree) if cells is None else cells
    cols: dict[str, list] = {k: [] for k in ("accuracy_ci_low", "accuracy_ci_high", "seed_sd", "seed_min", "seed_max")}
    per_seed = []
    for key in zip(*(summary[c] for c in CELL)):
        s = cells.get(key)
        if s is None or s.empty:
            for v in cols.values():
                v.append(float("nan"))
            per_seed.append("")
            continue
        _, low, high = accuracy_ci(s, n_boot=n_boot, seed=seed)
        spread = seed_spread(s)
        cols["accuracy_ci_low"].append(100 * low)
        cols["accuracy_ci_high"].append(100 * high)
        for k in ("sd", "min", "max"):
            cols[f"seed_{k}"].append(100 * spread[k])
        per_seed.append(", ".join(f"s{k}: {100 * v:.1f}" for k, v in sorted(spread["per_seed"].items())))
    out = summary.copy()
    for k, v in cols.items():
        out[k] = v
    out["seed_accuracies"] = per_seed
    return out


def _pairs(summary: pd.DataFrame) -> Iterable[tuple[int, int]]:
    """Index pairs ``(a, b)`` of the summary to compare: every cell against its (model, task)'s full cache, and every
    two cells at the same operating point (``a`` before ``b`` in the policy order)."""
    for (_, _), sub in summary.groupby(["model", "task"], sort=False):
        full = sub.index[sub["op_kind"] == "full"]
        rest = sub[sub["op_kind"] != "full"]
        for f in full:
            for i in rest.index:
                yield i, f
        for _, at in rest.groupby("op", sort=False):
            idx = sorted(at.index, key=lambda i: policy_sort_key(summary.loc[i, "policy"]))
            for k, i in enumerate(idx):
                for j in idx[k + 1 :]:
                    yield i, j


def paired_comparisons(
    tree: Tree,
    summary: pd.DataFrame,
    n_boot: int = N_BOOT,
    n_perm: int = N_PERM,
    seed: int = SEED,
    cells: dict | None = None,
) -> pd.DataFrame:
    """One row per comparison (see the module docstring): ``model``, ``task``, ``op``, ``a`` / ``b`` (policy
    identities), ``method_a`` / ``method_b``, ``vs_full``, ``diff`` (a - b, percentage points) with ``diff_low`` /
    ``diff_high`` (95 % bootstrap by problem), ``acc_a`` / ``acc_b`` (% on the shared samples), ``p`` (sign-flip
    test), ``p_holm`` (Holm over every comparison of the table), ``problems`` and ``pairs`` (matched samples).

    Cells that share no sample (other seeds, other problems) are left out, with one log line.
    """
    cells = cell_samples(tree) if cells is None else cells
    rows, unmatched = [], []
    for i, j in _pairs(summary):
        a, b = summary.loc[i], summary.loc[j]
        sa, sb = cells.get(tuple(a[c] for c in CELL)), cells.get(tuple(b[c] for c in CELL))
        if sa is None or sb is None:
            continue
        r = paired_difference(sa, sb, n_boot=n_boot, n_perm=n_perm, seed=seed)
        if not r.pairs:
            unmatched.append(f"{a['policy']} vs {b['policy']} ({a['task']}, {a['op']})")
            continue
        rows.append(
            {
                "model": a["model"],
                "task": a["task"],
                "op": a["op"],
                "a": a["policy"],
                "b": b["policy"],
                "method_a": a["method"],
                "method_b": b["method"],
                "vs_full": b["op_kind"] == "full",
                "diff": 100 * r.diff,
                "diff_low": 100 * r.low,
                "diff_high": 100 * r.high,
                "acc_a": 100 * r.acc_a,
                "acc_b": 100 * r.acc_b,
                "p": r.p,
                "problems": r.problems,
                "pairs": r.pairs,
            }
        )
    if unmatched:
        logger.info(
            "no shared samples (same problem, seed, sample) for %d comparison(s): %s", len(unmatched), unmatched
        )
    out = pd.DataFrame(rows)
    if not out.empty:
        out["p_holm"] = holm(out["p"].to_numpy(dtype=float))
    return out


def significant(pairs: pd.DataFrame, alpha: float = 0.05) -> np.ndarray:
    """Whether each comparison's Holm-adjusted p-value is at most ``alpha``."""
    return (pairs["p_holm"] <= alpha).to_numpy() if "p_holm" in pairs else np.zeros(len(pairs), dtype=bool)


def statistics_table(summary: pd.DataFrame, model: str, op: str) -> Table:
    """Per task and cell at one operating point (the full cache first): pass@1 with its 95 % bootstrap interval,
    problems, samples, seeds and each seed's pass@1 with the SD between seeds."""
    sub = at_op(summary, model, op)
    cols = ["task", "policy", "method", "problems", "samples", "seeds", "accuracy", "accuracy_ci_low"]
    cols += ["accuracy_ci_high", "seed_sd", "seed_min", "seed_max", "seed_accuracies", "complete"]
    data = sub[[c for c in cols if c in sub]].reset_index(drop=True)
    display = pd.DataFrame(
        {
            "Task": [TASK_LABELS.get(t, t) for t in data["task"]],
            "Method": [m + ("" if c else " †") for m, c in zip(data["method"], data["complete"])],
            "Problems": data["problems"].astype(int).astype(str),
            "Samples": data["samples"].astype(int).astype(str),
            "pass@1 %": data["accuracy"].map(lambda x: _fmt(x, 1)),
            "95% CI": [_ci(lo, hi) for lo, hi in zip(data["accuracy_ci_low"], data["accuracy_ci_high"])],
            "Seeds": data["seeds"].astype(int).astype(str),
            "Per seed %": [s or MISSING for s in data["seed_accuracies"]],
            "SD seeds": data["seed_sd"].map(lambda x: _fmt(x, 1)),
        }
    )
    notes = [
        f"95% CI: percentile bootstrap over problems ({N_BOOT} resamples, seed {SEED}); a cell's seeds are pooled "
        "(more samples of the same problems). Per seed: each seed's pass@1 on its own; SD seeds: their standard "
        "deviation (ddof=1)."
    ]
    if not data["complete"].all():
        notes.append("† incomplete run.")
    return Table(f"statistics_{slug(model)}_{slug(op)}", data, display, f"pass@1 with 95% CIs, {model}, {op}", notes, 2)


def paired_table(pairs: pd.DataFrame, model: str, alpha: float = 0.05) -> Table:
    """``model``'s paired comparisons (:func:`paired_comparisons`): difference, interval, raw and Holm p-values."""
    data = pairs[pairs["model"] == model].reset_index(drop=True)
    sig = significant(data, alpha)
    display = pd.DataFrame(
        {
            "Task": [TASK_LABELS.get(t, t) for t in data["task"]],
            "Op": data["op"],
            "A": data["method_a"],
            "B": data["method_b"],
            "A − B (pp)": [_fmt(d, 1) + (" *" if s else "") for d, s in zip(data["diff"], sig)],
            "95% CI": [_ci(lo, hi) for lo, hi in zip(data["diff_low"], data["diff_high"])],
            "p": data["p"].map(fmt_p),
            "p (Holm)": data["p_holm"].map(fmt_p),
            "Problems": data["problems"].astype(str),
            "Pairs": data["pairs"].astype(str),
        }
    )
    notes = [
        "Paired on the samples both cells have (same problem, seed and sample index). A − B: mean over problems of "
        "the difference in accuracy, percentage points; 95% CI: bootstrap over problems; p: two-sided sign-flip "
        f"test by problem; Holm: adjusted over all {len(pairs)} comparisons of the report; * Holm p <= {alpha}."
    ]
    return Table(f"paired_{slug(model)}", data, display, f"Paired differences, {model}", notes, label_cols=4)


def ablation_table(g: AblationGrid) -> Table:
    """An ablation as a grid (:func:`~vase.analysis.aggregate.ablation_grids`): one row per value of the row
    parameter, one column per value of the column parameter, each cell ``pass@1 ± SE (n)``."""
    data = pd.DataFrame(g.acc, index=g.rows, columns=g.cols)
    data.index.name = g.row_param
    data.columns = [f"{g.col_param}={fmt_value(c)}" for c in g.cols]
    data = data.reset_index()
    row_name, col_name = PARAM_NAMES.get(g.row_param, g.row_param), PARAM_NAMES.get(g.col_param, g.col_param)
    display = pd.DataFrame({row_name: [fmt_value(r) for r in g.rows]})
    for j, c in enumerate(g.cols):
        display[fmt_value(c)] = [
            MISSING if np.isnan(g.acc[i, j]) else f"{_fmt_pm(g.acc[i, j], g.se[i, j])} ({int(g.n[i, j])})"
            for i in range(len(g.rows))
        ]
    caption = (
        f"{POLICY_LABELS.get(g.policy_name, g.policy_name)}: pass@1 (%) ± SE (samples), rows: {row_name}, columns: "
        f"{col_name}; {TASK_LABELS.get(g.task, g.task)}, {g.model}, {g.op}"
    )
    name = f"ablation_{slug(g.model)}_{slug(g.task)}_{slug(g.policy_name)}_{slug(g.op)}"
    return Table(name, data, display, caption, label_cols=1)


def _ci(lo: float, hi: float) -> str:
    return MISSING if pd.isna(lo) or pd.isna(hi) else f"[{lo:.1f}, {hi:.1f}]"


def _select(tree: Tree, which: int | str | dict) -> set[int]:
    """Run ids of ``which``: a run id, a policy identity (``"vase_attnv[n_protect=16]"``) or ``{column: value}``
    filters over :attr:`Tree.runs` (``{"policy": "snapkv", "op": "B=64", "task": "math500"}``)."""
    runs = tree.runs
    if isinstance(which, (int, np.integer)):
        mask = runs["run_id"] == which
    elif isinstance(which, str):
        mask = runs["policy"] == which
    else:
        mask = np.ones(len(runs), dtype=bool)
        for col, value in which.items():
            if col not in runs:
                raise ValueError(f"compare_runs: no column {col!r} in tree.runs; choose from {sorted(runs.columns)}")
            mask &= runs[col] == value
    ids = set(runs.loc[mask, "run_id"])
    if not ids:
        raise ValueError(f"compare_runs: no run matches {which!r}")
    return ids


def compare_runs(tree: Tree, a: int | str | dict, b: int | str | dict) -> pd.DataFrame:
    """Two runs (or cells) side by side, sample by sample: the same problem, seed and sample index.

    ``a`` / ``b``: a run id, a policy identity, or ``{column: value}`` filters over ``tree.runs`` (several matching
    runs are pooled, e.g. a cell's seeds). One row per shared sample: ``problem_id``, ``seed``, ``sample`` and each
    side's columns suffixed ``_a`` / ``_b`` (``correct``, ``loop_class``, ``output_tokens``, ..., and ``output``
    when the tree was loaded with ``with_output=True``), plus ``task_a``/``task_b`` and ``changed`` (the verdicts
    differ). For example, the samples the full cache solved and a policy lost, with their texts::

        tree = load_tree("results/", with_output=True)
        d = compare_runs(tree, "full", {"policy": "vase_attnv", "op": "B=512"})
        d[d.correct_a & ~d.correct_b][["problem_id", "output_a", "output_b"]]
    """
    sides = []
    for which in (a, b):
        ids = _select(tree, which)
        s = tree.samples[tree.samples["run_id"].isin(ids)]
        s = s.merge(tree.runs[["run_id", "task", "policy", "op"]], on="run_id")
        if s["task"].nunique() > 1:
            logger.warning("compare_runs: %r spans tasks %s; problems are matched by id", which, sorted(set(s["task"])))
        sides.append(s)
    out = match_samples(*sides)
    out["changed"] = out["correct_a"].astype(bool) != out["correct_b"].astype(bool)
    logger.info(
        "compare_runs: %d shared samples (%d only in a, %d only in b), %d verdicts differ",
        len(out),
        len(sides[0].drop_duplicates(subset=list(PAIR_KEYS))) - len(out),
        len(sides[1].drop_duplicates(subset=list(PAIR_KEYS))) - len(out),
        int(out["changed"].sum()),
    )
    return out.sort_values(["problem_id", "seed", "sample"]).reset_index(drop=True)
