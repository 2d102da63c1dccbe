"""Each score of :mod:`vase.engine.scores` against a short loop-based reference from its formula (method.md §2–3)."""

from __future__ import annotations

import math

import pytest
import torch

from vase.engine.scores import (
    cur_score,
    page_min_max,
    page_upper_bound,
    protect_largest,
    redundancy_score,
    sample_without_replacement,
    topk_with_protection,
    value_statistic,
    windowed_attention_score,
)


def _randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# ---- windowed attention ---------------------------------------------------------------------------------------------


def ref_windowed_attention(queries, keys, scaling, temperature=1.0, kernel=5, positions=None):
    """Loops: per (row, KV head, group query head, window query) softmax; mean; avg-pool (zero pad counted); mean."""
    b, hq, wq, d = queries.shape
    h, n = keys.shape[1], keys.shape[2]
    g = hq // h
    out = torch.zeros(b, h, n, dtype=torch.float64)
    for bi in range(b):
        for hi in range(h):
            order = list(range(n)) if positions is None else sorted(range(n), key=lambda i: int(positions[bi, hi, i]))
            for gi in range(g):
                qh = hi * g + gi  # transformers' layout: query head qh uses KV head qh // g
                mean = [0.0] * n
                for t in range(wq):
                    logits = [float(queries[bi, qh, t] @ keys[bi, hi, i]) * scaling / temperature for i in range(n)]
                    z = sum(math.exp(x) for x in logits)
                    for i in range(n):
                        mean[i] += math.exp(logits[i]) / z / wq
                if kernel > 1:
                    seq = [mean[i] for i in order]  # pool along storage order, or position order
                    half = kernel // 2
                    pooled = [
                        sum(seq[j] for j in range(p - half, p + half + 1) if 0 <= j < n) / kernel for p in range(n)
                    ]
                    for rank, i in enumerate(order):
                        mean[i] = pooled[rank]
                for i in range(n):
                    out[bi, hi, i] += mean[i] / g
    return out


@pytest.mark.parametrize("hq,h", [(2, 2), (6, 2)], ids=["mha", "gqa"])
@pytest.mark.parametrize("temperature,kernel", [(1.0, 5), (2.0, 5), (1.0, 1), (0.5, 3)])
def test_windowed_attention_matches_reference(hq, h, temperature, kernel):
    q, k = _randn(2, hq, 3, 4, seed=1), _randn(2, h, 9, 4, seed=2)
    got = windowed_attention_score(q, k, scaling=0.5, temperature=temperature, smooth_kernel=kernel)
    want = ref_windowed_attention(q, k, 0.5, temperature, kernel)
    assert got.shape == (2, h, 9) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("chunk", [1, 27, 100, 10**9], ids=["one-slice", "two-slices", "odd", "one-shot"])
def test_windowed_attention_chunking_does_not_change_the_result(chunk):
    # (G*Wq, N) = (6, 9): 54 logits per (row, KV head), 2 x 3 slices. Chunks of 1 slice, 2 slices, 1 slice (100 // 54)
    # and everything at once must give the same bits.
    q, k = _randn(2, 6, 2, 4, seed=5), _randn(2, 3, 9, 4, seed=6)
    got = windowed_attention_score(q, k, scaling=0.5, max_chunk_elements=chunk)
    want = windowed_attention_score(q, k, scaling=0.5, max_chunk_elements=10**9)
    assert torch.equal(got, want)
    torch.testing.assert_close(got.double(), ref_windowed_attention(q, k, 0.5, 1.0, 5), rtol=1e-5, atol=1e-7)


def test_windowed_attention_smooths_along_positions_when_given():
    q, k = _randn(2, 4, 3, 4, seed=3), _randn(2, 2, 8, 4, seed=4)
    pos = (
        torch.stack(
            [
                torch.stack([torch.randperm(8, generator=torch.Generator().manual_seed(10 * b + h)) for h in range(2)])
                for b in range(2)
            ]
        )
        * 3
    )
    got = windowed_attention_score(q, k, scaling=0.5, positions=pos)
    torch.testing.assert_close(got.double(), ref_windowed_attention(q, k, 0.5, 1.0, 5, pos), rtol=1e-5, atol=1e-7)
    # Without smoothing, a candidate's score does not depend on where it is stored.
    perm = torch.randperm(8)
    raw = windowed_attention_score(q, k, scaling=0.5, smooth_kernel=1)
    torch.testing.assert_close(windowed_attention_score(q, k[:, :, perm], 0.5, smooth_kernel=1), raw[:, :, perm])


def test_windowed_attention_hand_made():
    # One query, two keys: logits (0, log 3) -> softmax (1/4, 3/4); one KV head, one query head, no smoothing.
    q = torch.tensor([[[[1.0, 0.0]]]])
    k = torch.tensor([[[[0.0, 5.0], [math.log(3.0), 0.0]]]])
    got = windowed_attention_score(q, k, scaling=1.0, smooth_kernel=0)
    torch.testing.assert_close(got, torch.tensor([[[0.25, 0.75]]]))
    # Kernel 3 with zero padding counted: (0 + .25 + .75) / 3 and (.25 + .75 + 0) / 3.
    got = windowed_attention_score(q, k, scaling=1.0, smooth_kernel=3)
    torch.testing.assert_close(got, torch.tensor([[[1 / 3, 1 / 3]]]))


# ---- value statistics -----------------------------------------------------------------------------------------------


def ref_value_stat(v: torch.Tensor, stat: str) -> torch.Tensor:
    out = torch.zeros(v.shape[:-1], dtype=torch.float64)
    for idx in torch.cartesian_prod(*[torch.arange(s) for s in v.shape[:-1]]).tolist():
        x = [float(t) for t in v[tuple(idx)]]
        mean = sum(x) / len(x)
        out[tuple(idx)] = {
            "range": max(x) - min(x),
            "l2": math.sqrt(sum(t * t for t in x)),
            "absmax": max(abs(t) for t in x),
            "variance": sum((t - mean) ** 2 for t in x) / (len(x) - 1),
        }[stat]
    return out


@pytest.mark.parametrize("stat", ["range", "l2", "absmax", "variance"])
def test_value_statistic_matches_reference(stat):
    v = _randn(2, 3, 5, 6, seed=5)
    torch.testing.assert_close(value_statistic(v, stat).double(), ref_value_stat(v, stat), rtol=1e-5, atol=1e-6)


def test_value_statistic_hand_made():
    v = torch.tensor([[[[1.0, -3.0, 2.0]]]])
    assert value_statistic(v, "range").item() == pytest.approx(5.0)
    assert value_statistic(v, "l2").item() == pytest.approx(math.sqrt(14))
    assert value_statistic(v, "absmax").item() == pytest.approx(3.0)
    assert value_statistic(v, "variance").item() == pytest.approx(7.0)  # mean 0, (1 + 9 + 4) / 2
    with pytest.raises(ValueError, match="value_stat"):
        value_statistic(v, "median")


# ---- R-KV redundancy ------------------------------------------------------------------------------------------------


def ref_redundancy(keys: torch.Tensor) -> torch.Tensor:
    b, h, n, _ = keys.shape
    out = torch.zeros(b, h, n, dtype=torch.float64)
    for bi in range(b):
        for hi in range(h):
            ks = [keys[bi, hi, i].double() for i in range(n)]
            cos = lambda x, y: float(x @ y) / (float(x.norm()) * float(y.norm()))  # noqa: E731
            mean_sim = [sum(cos(ks[i], ks[j]) for j in range(n) if j != i) / n for i in range(n)]
            z = sum(math.exp(s) for s in mean_sim)
            for i in range(n):
                out[bi, hi, i] = math.exp(mean_sim[i]) / z
    return out


def test_redundancy_matches_reference():
    k = _randn(2, 2, 7, 5, seed=6)
    torch.testing.assert_close(redundancy_score(k).double(), ref_redundancy(k), rtol=1e-5, atol=1e-7)


def test_redundancy_equals_the_explicit_similarity_matrix():
    k = _randn(2, 3, 300, 16, seed=13).double()
    kn = k / (k.norm(dim=-1, keepdim=True) + 1e-8)
    sim = kn @ kn.transpose(-1, -2)
    sim.diagonal(dim1=-2, dim2=-1).zero_()
    torch.testing.assert_close(redundancy_score(k).double(), sim.mean(-1).softmax(-1), rtol=1e-5, atol=1e-9)


def test_redundancy_ranks_duplicates_highest():
    k = torch.tensor([[[[1.0, 0.0], [1.0, 0.0], [0.0, 1.0], [-1.0, -1.0]]]])  # cos sums: .29, .29, -.71, -2.1
    r = redundancy_score(k)[0, 0]
    assert r[0] == r[1] and r[0] > r[2] > r[3]


# ---- CUR ------------------------------------------------------------------------------------------------------------


def ref_cur(keys, values, sketch):
    b, h, n, d = keys.shape
    r = sketch.shape[-1]
    out = torch.zeros(b, h, n, dtype=torch.float64)
    for bi in range(b):
        for hi in range(h):
            raw = []
            for i in range(n):
                kg = [sum(float(keys[bi, hi, i, x]) * float(sketch[bi, x, c]) for x in range(d)) for c in range(r)]
                vg = [sum(float(values[bi, hi, i, x]) * float(sketch[bi, x, c]) for x in range(d)) for c in range(r)]
                raw.append(sum(t * t for t in kg) * sum(t * t for t in vg))
            for i in range(n):
                out[bi, hi, i] = raw[i] / sum(raw)
    return out


def test_cur_matches_reference():
    k, v, g = _randn(2, 2, 6, 4, seed=7), _randn(2, 2, 6, 4, seed=8), _randn(2, 4, 3, seed=9)
    torch.testing.assert_close(cur_score(k, v, g).double(), ref_cur(k, v, g), rtol=1e-5, atol=1e-7)
    # A (D, r) sketch is shared by every row.
    torch.testing.assert_close(cur_score(k, v, g[0]), cur_score(k, v, g[0].expand(2, -1, -1)))


def test_cur_identity_sketch_is_product_of_norms():
    k = torch.tensor([[[[1.0, 0.0], [0.0, 2.0]]]])
    v = torch.tensor([[[[3.0, 0.0], [1.0, 1.0]]]])
    got = cur_score(k, v, torch.eye(2))
    torch.testing.assert_close(got, torch.tensor([[[9.0 / 17.0, 8.0 / 17.0]]]))  # |k|^2 |v|^2 = 1*9, 4*2


# ---- Quest page bounds ----------------------------------------------------------------------------------------------


def test_page_min_max_with_partial_page():
    k = _randn(2, 2, 37, 4, seed=10)
    kmax, kmin = page_min_max(k, 16)
    assert kmax.shape == (2, 2, 3, 4)
    for p, (s, e) in enumerate([(0, 16), (16, 32), (32, 37)]):
        torch.testing.assert_close(kmax[:, :, p], k[:, :, s:e].amax(dim=2))
        torch.testing.assert_close(kmin[:, :, p], k[:, :, s:e].amin(dim=2))


@pytest.mark.parametrize("hq,h", [(2, 2), (8, 2)], ids=["mha", "gqa"])
@pytest.mark.parametrize("reduce", ["max", "sum"])
def test_page_bound_formula_and_upper_bound(hq, h, reduce):
    q, k = _randn(3, hq, 1, 8, seed=11), _randn(3, h, 50, 8, seed=12)
    kmax, kmin = page_min_max(k, 16)
    got = page_upper_bound(q, kmax, kmin, reduce)
    g = hq // h
    for b in range(3):
        for hi in range(h):
            for p in range(kmax.shape[2]):
                per_head, true_max = [], []
                for qh in range(hi * g, hi * g + g):
                    qv = q[b, qh, 0]
                    per_head.append(
                        sum(max(float(qv[d] * kmax[b, hi, p, d]), float(qv[d] * kmin[b, hi, p, d])) for d in range(8))
                    )
                    true_max.append(float((k[b, hi, p * 16 : (p + 1) * 16] @ qv).max()))
                want = max(per_head) if reduce == "max" else sum(per_head)
                assert got[b, hi, p].item() == pytest.approx(want, rel=1e-5, abs=1e-5)
                # The bound is >= the true max of q·k in the page, for every head of the group.
                assert all(ph >= tm - 1e-5 for ph, tm in zip(per_head, true_max))
                assert got[b, hi, p].item() >= (max(true_max) if reduce == "max" else sum(true_max)) - 1e-4


# ---- choosing k -----------------------------------------------------------------------------------------------------


def test_topk_with_protection():
    score = torch.tensor([[0.5, 0.1, 0.9, 0.3, 0.7]])
    assert topk_with_protection(score, 2).tolist() == [[2, 4]]
    prot = torch.tensor([[False, True, False, False, False]])
    assert topk_with_protection(score, 2, protected=prot).tolist() == [[1, 2]]
    excl = torch.tensor([[False, False, True, False, False]])
    assert topk_with_protection(score, 2, excluded=excl).tolist() == [[4, 0]]
    assert topk_with_protection(score, 5, excluded=excl)[0, -1].item() == 2  # excluded only when nothing is left


def test_protect_largest_puts_sinks_first():
    stat = torch.tensor([[[5.0, 1.0, 9.0, 0.5, 7.0, 3.0]]])
    sinks = torch.tensor([[[False, True, False, True, False, False]]])
    idx, mask = protect_largest(stat, 4, sinks)
    assert set(idx[0, 0, :2].tolist()) == {1, 3} and idx[0, 0, 2:].tolist() == [2, 4]
    assert mask[0, 0].tolist() == [False, True, True, True, True, False]


def test_sampling_frequencies_match_weights():
    # k = 1: one draw, P(i) = w_i / sum(w).
    n_draws = 20000
    w = torch.tensor([1.0, 2.0, 3.0, 4.0, 0.0]).expand(n_draws, -1)
    u = torch.rand(n_draws, 5, generator=torch.Generator().manual_seed(0))
    idx = sample_without_replacement(w, 1, u)
    freq = torch.bincount(idx[:, 0], minlength=5).double() / n_draws
    torch.testing.assert_close(freq, torch.tensor([0.1, 0.2, 0.3, 0.4, 0.0], dtype=torch.float64), atol=0.015, rtol=0)
    # k = 2 without replacement: P(first two = {3, 2}) = .4*.3/.6 + .3*.4/.7.
    idx = sample_without_replacement(w, 2, u)
    both = ((idx == 3).any(-1) & (idx == 2).any(-1)).double().mean().item()
    assert both == pytest.approx(0.4 * 0.3 / 0.6 + 0.3 * 0.4 / 0.7, abs=0.015)


def test_sampling_order_of_zero_excluded_protected():
    w = torch.tensor([[0.0, 1.0, 0.0, 2.0, 5.0, 0.0]])
    u = torch.rand(1, 6, generator=torch.Generator().manual_seed(1))
    prot = torch.tensor([[True, False, False, False, False, False]])
    excl = torch.tensor([[False, False, False, False, True, False]])
    idx = sample_without_replacement(w, 6, u, protected=prot, excluded=excl)[0].tolist()
    assert idx[0] == 0  # protected first
    assert set(idx[1:3]) == {1, 3}  # positive weights next
    assert set(idx[3:5]) == {2, 5}  # zero weights after every positive one
    assert idx[5] == 4  # excluded last


def test_sampling_is_a_function_of_the_noise():
    w = torch.rand(4, 3, 30)
    u = torch.rand(4, 3, 30, generator=torch.Generator().manual_seed(2))
    a = sample_without_replacement(w, 10, u)
    assert torch.equal(a, sample_without_replacement(w, 10, u.clone()))
    assert (a.sort(-1).values.diff(dim=-1) > 0).all()  # unique
