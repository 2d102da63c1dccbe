"""Report statistics: bootstrap confidence intervals by problem, paired differences, Holm's correction, seed spread.

Every function is pure (NumPy / pandas in, numbers out) and seeded: the same data and ``seed`` give the same result.

* **The unit of resampling is the problem.** pass@1 is the mean over problems of each problem's accuracy (the mean
  over its samples; a cell's seeds pooled: ``seed=0,1,2`` runs of one cell are more samples of the same problems).
  Samples of one problem are not independent (they share the problem's difficulty), so the bootstrap draws problems
  with replacement (a cluster bootstrap) and recomputes the mean of their accuracies; the 95 % interval is the 2.5th
  and 97.5th percentile of ``n_boot`` such means.
* **Paired differences** compare two cells on the samples they share: the same problem, the same seed and the same
  sample index (the harness's sampling is counter-based, so the same ``(seed, sample)`` means the same random draws
  until the two caches differ). The difference of a problem is the mean over its matched samples of
  ``correct_a - correct_b``; the estimate is the mean over problems, its interval the cluster bootstrap of it, and its
  p-value a two-sided sign-flip (permutation) test by problem: under "no difference" each problem's difference is as
  likely to have either sign. The test is exact (every sign pattern) up to :data:`EXACT_PROBLEMS` problems, else
  ``n_perm`` seeded random flips, with the ``(1 + hits) / (1 + n_perm)`` rule (never 0).
* **Holm** (step-down Bonferroni) adjusts the p-values of a family of tests so that the chance of any false
  rejection stays under the level: with ``m`` p-values sorted ascending, ``p_(i)`` becomes
  ``max_{j <= i} min(1, (m - j + 1) p_(j))`` (1-based).
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass

import numpy as np
import pandas as pd

#: problems up to which the sign-flip test enumerates every sign pattern (2**16 patterns)
EXACT_PROBLEMS = 16
#: the columns that match two cells' samples: the same problem, seed and sample index
PAIR_KEYS = ("problem_id", "seed", "sample")


def per_problem(samples: pd.DataFrame, column: str = "correct") -> np.ndarray:
    """``(n_problems,)`` each problem's mean of ``column`` over its samples (problems in sorted order)."""
    if samples.empty:
        return np.zeros(0)
    return samples.assign(_c=samples[column].astype(float)).groupby("problem_id")["_c"].mean().to_numpy(dtype=float)


def bootstrap_means(values: np.ndarray, n_boot: int = 2000, seed: int = 0) -> np.ndarray:
    """``(n_boot,)`` means of ``values`` ``(n,)`` resampled with replacement (one value per cluster)."""
    values = np.asarray(values, dtype=float)
    if values.size == 0:
        return np.full(n_boot, np.nan)
    idx = np.random.default_rng(seed).integers(0, values.size, size=(n_boot, values.size))
    return values[idx].mean(axis=1)


def bootstrap_ci(
    values: np.ndarray, n_boot: int = 2000, seed: int = 0, level: float = 0.95
) -> tuple[float, float, float]:
    """``(mean, low, high)``: the mean of ``values`` ``(n,)`` (one per cluster) and its percentile bootstrap interval.

    NaN interval with fewer than two clusters (one problem says nothing about the spread).
    """
    values = np.asarray(values, dtype=float)
    if values.size == 0:
        return float("nan"), float("nan"), float("nan")
    mean = float(values.mean())
    if values.size < 2:
        return mean, float("nan"), float("nan")
    means = bootstrap_means(values, n_boot, seed)
    alpha = (1 - level) / 2
    low, high = np.quantile(means, [alpha, 1 - alpha])
    return mean, float(low), float(high)


def accuracy_ci(
    samples: pd.DataFrame, column: str = "correct", n_boot: int = 2000, seed: int = 0, level: float = 0.95
) -> tuple[float, float, float]:
    """pass@1 of ``samples`` and its bootstrap interval by problem (fractions, not %)."""
    return bootstrap_ci(per_problem(samples, column), n_boot, seed, level)


@functools.lru_cache(maxsize=EXACT_PROBLEMS + 1)
def _sign_patterns(n: int) -> np.ndarray:
    """``(2**n, n)`` every pattern of ``n`` signs (computed once per ``n``)."""
    return np.array(list(itertools.product((1.0, -1.0), repeat=n)))


def sign_flip_pvalue(diffs: np.ndarray, n_perm: int = 10000, seed: int = 0) -> float:
    """Two-sided p-value of "the mean of ``diffs`` ``(n,)`` is 0" by flipping each one's sign.

    Exact (every one of ``2**n`` sign patterns) for ``n <=`` :data:`EXACT_PROBLEMS`, else ``n_perm`` seeded random
    patterns with the ``(1 + hits) / (1 + n_perm)`` rule. 1.0 when every difference is 0 (no evidence either way).
    """
    d = np.asarray(diffs, dtype=float)
    if d.size == 0:
        return float("nan")
    observed = abs(d.mean())
    if not np.any(d):
        return 1.0
    tol = 1e-12 * max(1.0, observed)
    if d.size <= EXACT_PROBLEMS:
        return float(np.mean(np.abs(_sign_patterns(d.size) @ d / d.size) >= observed - tol))
    signs = np.random.default_rng(seed).choice((1.0, -1.0), size=(n_perm, d.size))
    hits = int(np.sum(np.abs(signs @ d / d.size) >= observed - tol))
    return (1 + hits) / (1 + n_perm)


@dataclass
class Paired:
    """A paired comparison of cell ``a`` against cell ``b`` on their shared samples (fractions, not %).

    Attributes:
        diff: mean over problems of ``correct_a - correct_b`` on matched samples.
        low, high: its bootstrap interval by problem.
        p: the sign-flip test's two-sided p-value.
        problems: problems with at least one matched sample; ``pairs``: matched samples.
        acc_a, acc_b: each cell's pass@1 on the matched samples only.
    """

    diff: float
    low: float
    high: float
    p: float
    problems: int
    pairs: int
    acc_a: float
    acc_b: float


def match_samples(a: pd.DataFrame, b: pd.DataFrame, keys: tuple[str, ...] = PAIR_KEYS) -> pd.DataFrame:
    """The samples of ``a`` and ``b`` with the same ``keys`` (problem, seed, sample), one row per pair: the keys and
    every other column of each side suffixed ``_a`` / ``_b``. Each side counts a key once (its first row)."""
    a = a.drop_duplicates(subset=list(keys), keep="first")
    b = b.drop_duplicates(subset=list(keys), keep="first")
    return a.merge(b, on=list(keys), suffixes=("_a", "_b"))


def paired_difference(
    a: pd.DataFrame, b: pd.DataFrame, column: str = "correct", n_boot: int = 2000, n_perm: int = 10000, seed: int = 0
) -> Paired:
    """Cell ``a`` minus cell ``b`` on their matched samples (:func:`match_samples`); NaN when none match."""
    m = match_samples(a[[*PAIR_KEYS, column]], b[[*PAIR_KEYS, column]])
    if m.empty:
        nan = float("nan")
        return Paired(nan, nan, nan, nan, 0, 0, nan, nan)
    m = m.assign(_a=m[f"{column}_a"].astype(float), _b=m[f"{column}_b"].astype(float))
    by = m.groupby("problem_id")
    d = (by["_a"].mean() - by["_b"].mean()).to_numpy(dtype=float)
    diff, low, high = bootstrap_ci(d, n_boot, seed)
    return Paired(
        diff=diff,
        low=low,
        high=high,
        p=sign_flip_pvalue(d, n_perm, seed),
        problems=int(d.size),
        pairs=len(m),
        acc_a=float(by["_a"].mean().mean()),
        acc_b=float(by["_b"].mean().mean()),
    )


def holm(pvalues: list[float] | np.ndarray) -> np.ndarray:
    """Holm-adjusted p-values, in the input order (NaN stays NaN and is not counted in the family).

    With the ``m`` finite p-values sorted ascending, the i-th (1-based) becomes
    ``max_{j <= i} min(1, (m - j + 1) * p_(j))``; reject at level ``alpha`` where the adjusted value is ``<= alpha``.
    """
    p = np.asarray(pvalues, dtype=float)
    out = np.full(p.shape, np.nan)
    ok = np.flatnonzero(~np.isnan(p))
    m = ok.size
    if not m:
        return out
    order = ok[np.argsort(p[ok], kind="stable")]
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * p[i]))
        out[i] = running
    return out


def seed_spread(samples: pd.DataFrame, column: str = "correct", by: str = "run_seed") -> dict:
    """pass@1 of each run seed's samples on its own (fractions): ``seeds``, ``per_seed`` (seed -> pass@1), ``sd``
    (the standard deviation between seeds, ddof=1; NaN with one seed), ``min``, ``max``.

    ``by``: the column holding the run's ``seed=`` (each sample's own ``seed`` is derived from it, per problem and
    sample index).
    """
    if samples.empty:
        return {"seeds": 0, "per_seed": {}, "sd": float("nan"), "min": float("nan"), "max": float("nan")}
    per = {int(s): float(per_problem(g, column).mean()) for s, g in samples.groupby(by)}
    vals = np.array(list(per.values()))
    return {
        "seeds": len(per),
        "per_seed": per,
        "sd": float(vals.std(ddof=1)) if len(vals) > 1 else float("nan"),
        "min": float(vals.min()),
        "max": float(vals.max()),
    }


def fmt_p(p: float) -> str:
    """A p-value as text: ``<0.001`` below it, else three decimals; ``–`` for NaN."""
    if p is None or math.isnan(p):
        return "–"
    return "<0.001" if p < 0.001 else f"{p:.3f}"
