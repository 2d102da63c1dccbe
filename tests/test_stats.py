"""Report statistics (vase.analysis.stats) on synthetic data with known answers.

Bootstrap coverage on a known proportion over many seeded repetitions (the cluster bootstrap covers the true pass@1,
a bootstrap over samples that ignores the problems does not), paired differences against hand-computed values and the
exact sign-flip test, Holm's adjustment against a hand-computed example, the spread between seeds.
"""

from __future__ import annotations

import itertools

import numpy as np
import pandas as pd
import pytest

from vase.analysis.stats import (
    EXACT_PROBLEMS,
    accuracy_ci,
    bootstrap_ci,
    bootstrap_means,
    holm,
    match_samples,
    paired_difference,
    per_problem,
    seed_spread,
    sign_flip_pvalue,
)


def frame(correct: dict[str, list[int]], seed: int = 0) -> pd.DataFrame:
    """Samples ``{problem: [correct of sample 0, 1, ...]}`` with the run seed ``seed`` (each sample's seed derived)."""
    rows = [
        {"problem_id": pid, "sample": i, "seed": 1000 * seed + i, "run_seed": seed, "correct": bool(c)}
        for pid, cs in correct.items()
        for i, c in enumerate(cs)
    ]
    return pd.DataFrame(rows)


def test_bootstrap_covers_a_known_proportion():
    """One sample per problem, p = 0.3, 60 problems: the 95 % interval covers p in about 95 % of 300 draws."""
    rng = np.random.default_rng(12345)
    p, n, reps = 0.3, 60, 300
    hits = 0
    for r in range(reps):
        values = (rng.random(n) < p).astype(float)
        _, low, high = bootstrap_ci(values, n_boot=400, seed=r)
        hits += low <= p <= high
    assert 0.90 <= hits / reps <= 0.985, hits / reps


def test_cluster_bootstrap_covers_where_a_sample_bootstrap_does_not():
    """Problems differ in difficulty (p_i ~ Beta(0.5, 0.5), mean 0.5) and have 8 samples each: samples of a problem
    are correlated. Resampling problems covers the true 0.5; resampling samples as if independent is too narrow."""
    rng = np.random.default_rng(7)
    n_problems, n_samples, reps = 30, 8, 200
    cluster = naive = 0
    for r in range(reps):
        p = rng.beta(0.5, 0.5, n_problems)
        correct = rng.random((n_problems, n_samples)) < p[:, None]
        s = frame({f"q{i}": list(row) for i, row in enumerate(correct)})
        _, low, high = accuracy_ci(s, n_boot=400, seed=r)
        cluster += low <= 0.5 <= high
        _, low, high = bootstrap_ci(correct.ravel().astype(float), n_boot=400, seed=r)
        naive += low <= 0.5 <= high
    assert 0.90 <= cluster / reps <= 0.99, cluster / reps
    assert naive / reps < 0.75, naive / reps


def test_bootstrap_is_seeded_and_needs_two_problems():
    values = np.array([0.0, 0.5, 1.0, 1.0])
    assert bootstrap_ci(values, seed=3) == bootstrap_ci(values, seed=3)
    assert np.array_equal(bootstrap_means(values, 50, seed=3), bootstrap_means(values, 50, seed=3))
    assert not np.array_equal(bootstrap_means(values, 50, seed=3), bootstrap_means(values, 50, seed=4))
    mean, low, high = bootstrap_ci(np.array([0.5]))
    assert mean == 0.5 and np.isnan(low) and np.isnan(high)
    assert all(np.isnan(bootstrap_ci(np.array([]))))
    # pass@1 is the mean of the problems' accuracies, not of the samples
    s = frame({"a": [1, 1, 1, 1], "b": [0, 0]})
    assert accuracy_ci(s)[0] == pytest.approx(0.5)
    assert list(per_problem(s)) == [1.0, 0.0]


def test_paired_difference_hand_computed():
    a = frame({"p0": [1, 1], "p1": [1, 0], "p2": [1, 1]})
    b = frame({"p0": [0, 1], "p1": [0, 0], "p2": [0, 0]})
    r = paired_difference(a, b, n_boot=500)
    # per problem: p0 (1 + 1) / 2 - (0 + 1) / 2 = 0.5, p1 0.5 - 0 = 0.5, p2 1 - 0 = 1
    assert r.diff == pytest.approx(2 / 3)
    assert (r.problems, r.pairs) == (3, 6)
    assert r.acc_a == pytest.approx(5 / 6) and r.acc_b == pytest.approx(1 / 6)
    # exact sign flips of (0.5, 0.5, 1): only all + and all - reach |mean| >= 2/3: p = 2 / 8
    assert r.p == pytest.approx(0.25)
    assert 0.5 <= r.low <= r.diff <= r.high <= 1.0
    # b - a is the mirror image
    back = paired_difference(b, a, n_boot=500)
    assert back.diff == pytest.approx(-r.diff) and back.p == r.p


def test_paired_difference_uses_only_shared_samples():
    a = pd.concat([frame({"p0": [1, 1], "p1": [0, 1]}, seed=0), frame({"p0": [1, 1]}, seed=1)])
    b = frame({"p0": [0, 0], "p1": [0, 1], "p9": [1, 1]}, seed=0)  # no seed 1, and a problem a does not have
    m = match_samples(a, b)
    assert sorted(zip(m["problem_id"], m["sample"])) == [("p0", 0), ("p0", 1), ("p1", 0), ("p1", 1)]
    r = paired_difference(a, b)
    assert r.pairs == 4 and r.problems == 2 and r.diff == pytest.approx((1.0 + 0.0) / 2)
    none = paired_difference(a, frame({"zz": [1]}))
    assert none.pairs == 0 and np.isnan(none.diff) and np.isnan(none.p)


def test_sign_flip_exact_and_random():
    d = np.array([0.2, -0.1, 0.4, 0.3])
    # by hand: every sign pattern, the share whose |mean| reaches the observed one
    patterns = np.array(list(itertools.product((1, -1), repeat=4)))
    expected = np.mean(np.abs(patterns @ d) >= abs(d.sum()) - 1e-12)
    assert sign_flip_pvalue(d) == pytest.approx(expected)
    assert sign_flip_pvalue(np.zeros(5)) == 1.0
    big = np.ones(EXACT_PROBLEMS + 14)  # every difference positive: no random pattern reaches it
    assert sign_flip_pvalue(big, n_perm=999, seed=1) == pytest.approx(1 / 1000)
    noise = np.random.default_rng(0).normal(size=40)
    p1, p2 = sign_flip_pvalue(noise, n_perm=2000, seed=5), sign_flip_pvalue(noise, n_perm=2000, seed=5)
    assert p1 == p2 and 0.0 < p1 <= 1.0


def test_holm_against_a_hand_computed_example():
    p = [0.01, 0.04, 0.03, 0.005]
    # sorted: 0.005 x 4 = 0.02; 0.01 x 3 = 0.03; 0.03 x 2 = 0.06; 0.04 x 1 = 0.04 -> max so far 0.06
    assert holm(p) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    got = holm([float("nan"), 0.02, 0.5])  # NaN is not a test: m = 2
    assert np.isnan(got[0]) and got[1:] == pytest.approx([0.04, 0.5])
    assert holm([0.4, 0.6]) == pytest.approx([0.8, 0.8])  # capped at 1 and monotone
    assert holm([]).size == 0
    # Holm rejects what Bonferroni rejects, and here one more
    p = np.array([0.001, 0.012, 0.02, 0.3])
    assert (p * len(p) <= 0.05).sum() == 2 and (holm(p) <= 0.05).sum() == 3


def test_seed_spread():
    s = pd.concat(
        [
            frame({"a": [1, 1], "b": [0, 0]}, seed=0),
            frame({"a": [1, 0], "b": [0, 0]}, seed=1),
            frame({"a": [1, 1], "b": [1, 1]}, seed=2),
        ]
    )
    got = seed_spread(s)
    assert got["seeds"] == 3 and got["per_seed"] == {0: 0.5, 1: 0.25, 2: 1.0}
    assert got["sd"] == pytest.approx(np.std([0.5, 0.25, 1.0], ddof=1))
    assert (got["min"], got["max"]) == (0.25, 1.0)
    assert np.isnan(seed_spread(frame({"a": [1]}))["sd"])
