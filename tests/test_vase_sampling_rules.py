"""The stochastic VaSE-repo configs against their authors' rules (tests/authors_rules_vase_sampling.py).

Two checks. The matrix (tests/test_policies.py, tests/test_family_matrix.py) gives a port the random numbers the
policy draws and asks for the same kept set; here, that check fails a wrong rule. The law: on small cases the
policies' draws, over a few thousand rows of independent streams (fixed seeds: deterministic), have the law of the
authors' sampler — ``torch.multinomial(p, k, replacement=False)`` (sequential draws without replacement, enumerated
exactly) or a uniform ``k``-subset — to five standard errors per subset; a wrong sampler (top-k of ``p * u``; a random
contiguous block, whose inclusion frequencies are right) fails.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

import baselines.random
import vase.policies.attnv
from tests.authors_rules import check_rule_on_geometry
from tests.authors_rules_vase_sampling import authors_attention_scores
from tests.test_policies import DIM, LAYOUTS, load_policy
from vase.engine.policy import EvictionInputs
from vase.engine.scores import topk_with_protection, windowed_attention_score

M = 4000  # draws (rows, each its own stream)
Z = 5.0  # standard errors allowed per subset frequency


def _wrong_sampler(weights, k, uniform, protected=None, excluded=None):
    """A plausible wrong sampler: the top ``k`` of ``weights * uniform``."""
    return topk_with_protection(weights.double() * uniform.double(), k, protected=protected, excluded=excluded)


def _score_with_the_window(self, inputs):
    """A plausible wrong score: the softmax over the candidates and the recent window (theirs: the candidates)."""
    keys = torch.cat([inputs.keys, inputs.window_keys], 2)
    score = windowed_attention_score(inputs.queries, keys, inputs.scaling, smooth_kernel=self.smooth_kernel)
    return score[..., : inputs.keys.shape[2]]


# ---- the matrix check fails a wrong rule -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("name", "overrides", "patch"),
    [
        ("vase_attnv", {"sample": False}, None),  # sampling replaced by top-k (the authors' range_attn)
        ("vase_attnv", {"smooth_kernel": 1}, None),  # no --smooth
        ("snapkv_sample", {}, "top-k of p*u"),
        ("vase_attnv", {}, "softmax over the candidates and the window"),
        ("vase_dkv", {"rank": 10}, None),  # another sketch than their r = 20
        ("vase_dkv", {"sinks": 0}, None),  # the sinks not forced
        ("random", {"sinks": 4}, None),  # sinks the authors' random eviction does not protect
    ],
)
def test_a_wrong_rule_fails_the_authors_rule_check(name, overrides, patch, monkeypatch):
    h, hq = LAYOUTS["gqa"]
    if patch == "top-k of p*u":
        monkeypatch.setattr(vase.policies.attnv, "sample_without_replacement", _wrong_sampler)
    elif patch:
        monkeypatch.setattr(vase.policies.attnv.WindowedAttentionEviction, "score", _score_with_the_window)
    with pytest.raises(AssertionError, match="keeps another set than its authors' rule"):
        check_rule_on_geometry(load_policy(name, **overrides), name, h, hq, DIM, [0, 1, 2])


# ---- the law of the draws --------------------------------------------------------------------------------------------
def sequential_law(weights: list[float], k: int) -> dict[tuple[int, ...], float]:
    """Exact probability of each ``k``-subset under ``k`` successive draws without replacement, each proportional to
    ``weights`` among the items left (what ``torch.multinomial(weights, k, replacement=False)`` samples)."""
    law: dict[tuple[int, ...], float] = {}
    for seq in itertools.permutations(range(len(weights)), k):
        p, left = 1.0, math.fsum(weights)
        for i in seq:
            p *= weights[i] / left
            left -= weights[i]
        key = tuple(sorted(seq))
        law[key] = law.get(key, 0.0) + p
    return law


def check_law(kept: torch.Tensor, law: dict[tuple[int, ...], float], always: tuple[int, ...] = ()) -> None:
    """``kept (M, k)`` indices: every row holds ``always``; the rest's subsets (and each item's inclusion) have the
    frequencies ``law`` gives, each within ``Z`` standard errors of a frequency over ``M`` draws."""
    m = kept.shape[0]
    rows = [tuple(sorted(set(r) - set(always))) for r in kept.tolist()]
    assert all(set(always) <= set(r) for r in kept.tolist()), "a protected candidate was not kept"
    assert set(rows) <= set(law), "a subset the law never draws"
    counts = {s: 0 for s in law}
    for r in rows:
        counts[r] += 1
    items = sorted({i for s in law for i in s})
    incl = {i: math.fsum(p for s, p in law.items() if i in s) for i in items}
    for what, p, f in [*((s, law[s], counts[s] / m) for s in law),
                       *((i, incl[i], sum(i in r for r in rows) / m) for i in items)]:  # fmt: skip
        assert abs(f - p) <= Z * math.sqrt(p * (1 - p) / m) + 1e-12, f"{what}: frequency {f:.4f}, law {p:.4f}"


def _event(keys, values, positions, queries, n_keep) -> EvictionInputs:
    """One eviction event of ``M`` identical rows (``(1, H, N, D)`` tensors repeated), each with its own stream."""
    rep = lambda t: t.expand(M, *t.shape[1:]).contiguous()  # noqa: E731
    return EvictionInputs(
        keys=rep(keys),
        values=rep(values),
        positions=rep(positions),
        n_keep=n_keep,
        layer_idx=0,
        scaling=keys.shape[-1] ** -0.5,
        queries=rep(queries),
        generators=[torch.Generator().manual_seed(s) for s in range(M)],
    )


def _tensors(n: int, seed: int, sinks_at: tuple[int, ...] = ()):
    """``(1, 1, n, 4)`` keys and values, shuffled positions (``sinks_at``: the slots of positions 0, 1, ...), two
    query heads of one window query: attention weights spread over about an order of magnitude."""
    g = torch.Generator().manual_seed(seed)
    keys = 5.0 * torch.randn(1, 1, n, 4, generator=g)
    values = torch.randn(1, 1, n, 4, generator=g)
    queries = torch.randn(1, 2, 1, 4, generator=g)
    rest = [p for p in range(n) if p >= len(sinks_at)]
    order = [rest[i] for i in torch.randperm(len(rest), generator=g).tolist()]
    pos = [None] * n
    for p, slot in enumerate(sinks_at):
        pos[slot] = p
    it = iter(order)
    positions = torch.tensor([[[p if p is not None else next(it) for p in pos]]])
    return keys, values, positions, queries


def test_the_exact_law_is_torch_multinomials():
    """The enumeration is the law of ``torch.multinomial(replacement=False)`` (its frequencies over ``M`` draws)."""
    w = [0.4, 0.25, 0.15, 0.1, 0.06, 0.04]
    drawn = torch.multinomial(torch.tensor(w).expand(M, 6), 3, generator=torch.Generator().manual_seed(0))
    check_law(drawn, sequential_law(w, 3))
    with pytest.raises(AssertionError, match="frequency"):  # and it tells p * u apart
        check_law(_wrong_sampler(torch.tensor(w), 3, torch.rand(M, 6, generator=torch.Generator().manual_seed(0))),
                  sequential_law(w, 3))  # fmt: skip


@pytest.mark.parametrize("wrong", [False, True])
def test_snapkv_sample_draws_as_torch_multinomial(wrong, monkeypatch):
    """SnapKV + sampling, 6 candidates, keep 3: the law of ``torch.multinomial`` on the authors' attention scores."""
    keys, values, positions, queries = _tensors(6, seed=6)
    policy = load_policy("snapkv_sample", budget=4, window=1)
    w = authors_attention_scores(queries, keys)[0, 0].tolist()
    assert max(w) / min(w) > 3  # a law far from uniform
    if wrong:
        monkeypatch.setattr(vase.policies.attnv, "sample_without_replacement", _wrong_sampler)
    kept = policy.keep(_event(keys, values, positions, queries, policy.n_keep))[:, 0]
    if wrong:
        with pytest.raises(AssertionError, match="frequency"):
            check_law(kept, sequential_law(w, 3))
    else:
        check_law(kept, sequential_law(w, 3))


@pytest.mark.parametrize("wrong", [False, True])
def test_vase_attnv_draws_as_torch_multinomial(wrong, monkeypatch):
    """VaSE-AttnV, 11 candidates: the 4 sinks (in shuffled slots) and the largest value range always kept, then 3 of
    the other 6 with the law of ``torch.multinomial`` on the attention scores, the protected ones' set to 0."""
    keys, values, positions, queries = _tensors(11, seed=1, sinks_at=(7, 2, 9, 4))
    values[0, 0, 5] *= 8.0  # the largest value range, not a sink
    policy = load_policy("vase_attnv", budget=9, window=1, n_protect=5)
    protected = (7, 2, 9, 4, 5)
    free = [i for i in range(11) if i not in protected]
    scores = authors_attention_scores(queries, keys)[0, 0]
    law = {tuple(free[i] for i in s): p for s, p in sequential_law(scores[free].tolist(), 3).items()}
    if wrong:
        monkeypatch.setattr(vase.policies.attnv, "sample_without_replacement", _wrong_sampler)
    kept = policy.keep(_event(keys, values, positions, queries, policy.n_keep))[:, 0]
    if wrong:
        with pytest.raises(AssertionError, match="frequency"):
            check_law(kept, law, always=protected)
    else:
        check_law(kept, law, always=protected)


def _cyclic_block(score, k, protected=None):
    """A wrong uniform sampler: ``k`` consecutive candidates (cyclically) from a uniform start, the sinks first. Its
    inclusion frequencies are uniform; its subsets are not."""
    n = score.shape[-1]
    free = (~protected).sum(-1, keepdim=True)  # the sinks are protected = positions 0.., here the first slots
    n_sinks = n - free
    start = (score[..., -1:] * free).long()
    block = n_sinks + (start + torch.arange(k - int(n_sinks.max()))) % free
    return torch.cat([torch.arange(int(n_sinks.max())).expand(*score.shape[:-1], -1), block], -1)


@pytest.mark.parametrize(
    ("name", "sinks", "wrong"),
    [("random", 0, False), ("random_keep_prompt", 0, False), ("random", 2, False), ("random", 0, True),
     ("random", 2, True)],
)  # fmt: skip
def test_random_keeps_a_uniform_subset(name, sinks, wrong, monkeypatch):
    """``random`` (and ``sinks`` > 0): the sinks always, then each 3-subset of the 6 others with probability 1/20
    (``random_keep_prompt``: the same among the generated candidates; the engine pins the prompt)."""
    n = 6 + sinks
    keys, values, _, queries = _tensors(n, seed=3)
    positions = torch.arange(n).view(1, 1, n)  # the sinks in the first slots (the wrong sampler assumes it)
    policy = load_policy(name, budget=3 + sinks + 1, window=1, sinks=sinks)
    law = {tuple(sinks + i for i in s): 1 / 20 for s in itertools.combinations(range(6), 3)}
    if wrong:
        monkeypatch.setattr(baselines.random, "topk_with_protection", _cyclic_block)
    kept = policy.keep(_event(keys, values, positions, queries, policy.n_keep))[:, 0]
    if wrong:
        with pytest.raises(AssertionError, match="frequency"):
            check_law(kept, law, always=tuple(range(sinks)))
    else:
        check_law(kept, law, always=tuple(range(sinks)))
