"""The original baselines (R-KV as Zefan-Cai/R-KV computes it, CurDKV as kvpress's CURPress, Random Attention's
prompt-keeping random eviction): each score against a loop-by-loop reference written from the original code, and
each policy's choice against the top-k of that reference."""

from __future__ import annotations

import math

import pytest
import torch

from baselines.curdkv_original import CurDKVOriginal
from baselines.random import RandomEviction, RandomKeepPrompt
from baselines.rkv_original import RKVOriginal
from vase.engine.original_scores import (
    kvpress_cur_score,
    rkv_original_attention,
    rkv_original_redundancy,
    rkv_original_score,
)
from vase.engine.policy import EvictionInputs


def _randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _keys_with_near_duplicates(b: int, h: int, n: int, d: int, seed: int) -> torch.Tensor:
    """Random keys where every third key is a small perturbation of an earlier one (so similarities > 0.5 occur, and
    some keys have no similar key at all)."""
    k = _randn(b, h, n, d, seed=seed)
    for i in range(3, n, 3):
        k[:, :, i] = k[:, :, i // 2] + 0.1 * _randn(b, h, d, seed=seed + i)
    return k


# ---- R-KV, by the letter of rkv/utils.py and rkv/compression/r1_kv.py ------------------------------------------------


def ref_rkv(queries, keys, window_keys, scaling, lam, kernel, threshold):
    """Loops over (row, KV head): R-KV's attention (group max of the logits, softmax over the candidates, mean over the
    window, max-pool) and redundancy (cosine matrix of every key, diagonal and each row's newest similar key zeroed,
    column mean, softmax over every key), then ``lam * attn - (1 - lam) * redundancy`` on the candidates."""
    b, hq, wq, d = queries.shape
    h, n = keys.shape[1], keys.shape[2]
    g = hq // h
    out = torch.zeros(b, h, n, dtype=torch.float64)
    for bi in range(b):
        for hi in range(h):
            mean = [0.0] * n
            for t in range(wq):
                logits = []
                for j in range(n):
                    key = keys[bi, hi, j].double()
                    per_head = [float(queries[bi, hi * g + gi, t].double() @ key) for gi in range(g)]
                    logits.append(max(per_head) * scaling)
                z = sum(math.exp(x) for x in logits)
                for j in range(n):
                    mean[j] += math.exp(logits[j]) / z / wq
            half = kernel // 2
            attn = [max(mean[i] for i in range(j - half, j + half + 1) if 0 <= i < n) for j in range(n)]
            every = [keys[bi, hi, j].double() for j in range(n)] + [
                window_keys[bi, hi, j].double() for j in range(window_keys.shape[2])
            ]
            length = len(every)
            unit = [k / (float(k.norm()) + 1e-8) for k in every]
            sim = [[float(unit[i] @ unit[j]) for j in range(length)] for i in range(length)]
            for i in range(length):
                sim[i][i] = 0.0
            for i in range(length):
                similar = [j for j in range(length) if sim[i][j] > threshold]
                newest = max(similar) if similar else 0  # R-KV: max over where(mask, arange, 0)
                sim[i][newest] = 0.0
            col = [sum(sim[i][j] for i in range(length)) / length for j in range(length)]
            z = sum(math.exp(c) for c in col)
            red = [math.exp(c) / z for c in col]
            for j in range(n):
                out[bi, hi, j] = lam * attn[j] - (1 - lam) * red[j]
    return out


@pytest.mark.parametrize("hq,h", [(2, 2), (6, 2)], ids=["mha", "gqa"])
@pytest.mark.parametrize("lam,kernel,threshold", [(0.1, 7, 0.5), (0.07, 3, 0.5), (0.5, 1, 0.2)])
def test_rkv_original_score_matches_reference(hq, h, lam, kernel, threshold):
    q = _randn(2, hq, 3, 4, seed=1)
    keys = _keys_with_near_duplicates(2, h, 12, 4, seed=2)
    window_keys = torch.cat([keys[:, :, 4:5] + 0.05, _randn(2, h, 2, 4, seed=3)], dim=2)  # one echoes a candidate
    got = rkv_original_score(q, keys, window_keys, 0.5, lam, kernel, threshold)
    want = ref_rkv(q, keys, window_keys, 0.5, lam, kernel, threshold)
    assert got.shape == (2, h, 12) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-7)


def test_rkv_original_pieces_do_not_depend_on_chunking():
    q, k = _randn(2, 8, 4, 8, seed=4), _keys_with_near_duplicates(2, 2, 40, 8, seed=5)
    one = rkv_original_attention(q, k, 0.3, 7, max_chunk_elements=10**9)
    assert torch.equal(rkv_original_attention(q, k, 0.3, 7, max_chunk_elements=1), one)
    red = rkv_original_redundancy(k, max_chunk_elements=10**9)
    assert torch.equal(rkv_original_redundancy(k, max_chunk_elements=1), red)  # one (row, head) at a time
    assert torch.equal(rkv_original_redundancy(k[1:]), red[1:])  # a row alone
    torch.testing.assert_close(red.sum(-1), torch.ones(2, 2))
    # Matrices wider than one block of columns: the same numbers as the reference (a loop would take too long).
    from vase.engine import original_scores

    big = _keys_with_near_duplicates(1, 2, 700, 4, seed=6)
    blocked = rkv_original_redundancy(big)
    kn = big / (big.norm(dim=-1, keepdim=True) + 1e-8)
    sim = kn @ kn.transpose(-1, -2)
    sim.diagonal(dim1=-2, dim2=-1).zero_()
    newest = torch.where(sim > 0.5, torch.arange(700), 0).amax(-1, keepdim=True)
    sim.scatter_(-1, newest, 0.0)
    torch.testing.assert_close(blocked, sim.mean(-2).softmax(-1), rtol=1e-5, atol=1e-9)
    assert original_scores.SIMILARITY_COLUMNS < 700


def test_rkv_original_redundancy_spares_the_newest_copy():
    # Keys a, a, a, b (a ⟂ b). Row 0's newest similar key is 2, row 1's is 2, row 2's is 1; row 3 has none, so R-KV
    # zeroes its column 0 (already 0). Column sums: 2, 1, 0, 0: the newest copy of a is the least redundant.
    a, b = [1.0, 0.0], [0.0, 1.0]
    red = rkv_original_redundancy(torch.tensor([[[a, a, a, b]]]))[0, 0]
    want = torch.tensor([2.0, 1.0, 0.0, 0.0]).div(4).softmax(-1)
    torch.testing.assert_close(red, want)


def test_rkv_original_attention_takes_the_group_max_before_the_softmax():
    # One KV head, two query heads. Head 0 favours key 0 (logit 2), head 1 key 1 (logit 1): the group max is (2, 1),
    # softmax (e^2, e^1) / Z. A mean of the heads' softmaxes (VaSE's rule) would give ((.5 + e^0/Z'), ...) instead.
    q = torch.tensor([[[[1.0, 0.0]], [[0.0, 1.0]]]])  # (1, 2, 1, 2)
    k = torch.tensor([[[[2.0, 0.0], [0.0, 1.0]]]])  # (1, 1, 2, 2)
    got = rkv_original_attention(q, k, scaling=1.0, pool_kernel=1)
    torch.testing.assert_close(got, torch.tensor([2.0, 1.0]).softmax(-1).view(1, 1, 2))
    # Max-pool 3 with padding: each candidate takes its neighbourhood's max.
    pooled = rkv_original_attention(q, k, scaling=1.0, pool_kernel=3)
    torch.testing.assert_close(pooled, got.amax(-1, keepdim=True).expand(1, 1, 2))


def test_rkv_original_score_in_bf16_rounds_like_the_original():
    q, k = _randn(1, 4, 8, 16, seed=6), _keys_with_near_duplicates(1, 2, 64, 16, seed=7)
    w = _randn(1, 2, 8, 16, seed=8)
    full = rkv_original_score(q, k, w, 0.25)
    half = rkv_original_score(q, k, w, 0.25, dtype=torch.bfloat16)
    assert half.dtype == torch.float32 and torch.equal(half, half.bfloat16().float())  # values on the bf16 grid
    torch.testing.assert_close(half, full, atol=2e-3, rtol=2e-2)


def rkv_inputs(b=2, h=2, hq=4, n=40, w=8, d=8, seed=0, n_keep=16):
    g = torch.Generator().manual_seed(seed)
    keys = _keys_with_near_duplicates(b, h, n, d, seed)
    return EvictionInputs(
        keys=keys,
        values=torch.randn(b, h, n, d, generator=g),
        positions=torch.arange(n).expand(b, h, n).clone() + 3,
        n_keep=n_keep,
        layer_idx=0,
        scaling=d**-0.5,
        generators=[torch.Generator().manual_seed(100 + i) for i in range(b)],
        queries=torch.randn(b, hq, w, d, generator=g),
        window_keys=torch.randn(b, h, w, d, generator=g),
    )


def test_rkv_original_keeps_the_top_of_the_reference_in_decreasing_order():
    policy = RKVOriginal(budget=24, window=8)
    assert (policy.rkv_lambda, policy.pool_kernel, policy.similarity_threshold) == (0.1, 7, 0.5)
    assert (policy.evict_every, policy.compress_prefill, policy.sinks, policy.window) == (128, True, 0, 8)
    inputs = rkv_inputs()
    idx = policy.keep(inputs)
    want = ref_rkv(inputs.queries, inputs.keys, inputs.window_keys, inputs.scaling, 0.1, 7, 0.5)
    top = want.topk(16, dim=-1).indices
    assert torch.equal(idx.sort(-1).values, top.sort(-1).values)  # the same set ...
    assert (want.gather(-1, idx).diff(dim=-1) <= 0).all()  # ... in R-KV's storage order (decreasing score)
    assert policy.describe()["evict_every"] == 128 and policy.describe()["compress_prefill"] is True


# ---- kvpress CURPress, by the letter of kvpress/presses/cur_press.py -------------------------------------------------


def ref_kvpress_cur(keys, values, window, leverage="kv_product", sketch=None):
    b, h, n, _ = keys.shape
    out = torch.zeros(b, h, n, dtype=torch.float64)
    for bi in range(b):
        for hi in range(h):
            ks = [keys[bi, hi, i].double() for i in range(n)]
            vs = [values[bi, hi, i].double() for i in range(n)]
            if sketch is not None:
                ks = [k @ sketch[bi].double() for k in ks]
                vs = [v @ sketch[bi].double() for v in vs]
            k2 = [float(k @ k) for k in ks]
            v2 = [float(v @ v) for v in vs]
            if window:
                for start in range(0, n, window):
                    block = range(start, min(start + window, n))
                    sk, sv = sum(k2[i] for i in block), sum(v2[i] for i in block)
                    for i in block:
                        k2[i], v2[i] = k2[i] / sk, v2[i] / sv
            raw = {
                "key": k2,
                "value": v2,
                "kv_avg": [(x + y) / 2 for x, y in zip(k2, v2)],
                "kv_product": [x * y for x, y in zip(k2, v2)],
            }[leverage]
            for i in range(n):
                out[bi, hi, i] = raw[i] / sum(raw)
    return out


@pytest.mark.parametrize("n", [37, 48], ids=["partial-block", "whole-blocks"])
@pytest.mark.parametrize("window", [16, 5, 0])
@pytest.mark.parametrize("leverage", ["kv_product", "kv_avg", "key", "value"])
def test_kvpress_cur_score_matches_reference(n, window, leverage):
    k, v = _randn(2, 3, n, 6, seed=9), _randn(2, 3, n, 6, seed=10)
    got = kvpress_cur_score(k, v, window, leverage)
    torch.testing.assert_close(got.double(), ref_kvpress_cur(k, v, window, leverage), rtol=1e-5, atol=1e-8)


def test_kvpress_cur_score_with_a_projection_matches_reference():
    k, v, g = _randn(2, 2, 20, 6, seed=11), _randn(2, 2, 20, 6, seed=12), _randn(2, 6, 4, seed=13)
    got = kvpress_cur_score(k, v, 16, sketch=g)
    torch.testing.assert_close(got.double(), ref_kvpress_cur(k, v, 16, sketch=g), rtol=1e-5, atol=1e-8)


def test_kvpress_local_normalisation_hand_made():
    # Two blocks of 2 tokens: k2 = (1, 3 | 4, 4) -> (.25, .75 | .5, .5); v2 = 1 everywhere -> (.5, .5 | .5, .5).
    k = torch.tensor([[[[1.0], [math.sqrt(3)], [2.0], [2.0]]]])
    v = torch.ones(1, 1, 4, 1)
    got = kvpress_cur_score(k, v, local_window=2)
    torch.testing.assert_close(got, torch.tensor([[[0.125, 0.375, 0.25, 0.25]]]))


def test_curdkv_original_keeps_sinks_then_the_top_of_the_reference():
    policy = CurDKVOriginal(budget=24, window=8)
    defaults = (policy.sinks, policy.local_window, policy.leverage, policy.random_projection)
    assert defaults == (4, 16, "kv_product", False)
    inputs = rkv_inputs(seed=3)
    inputs.positions = torch.randperm(40, generator=torch.Generator().manual_seed(1)).expand(2, 2, 40).clone()
    idx = policy.keep(inputs)
    score = ref_kvpress_cur(inputs.keys, inputs.values, 16)
    sinks = inputs.positions < 4
    for b in range(2):
        for hi in range(2):
            head = idx[b, hi].tolist()
            assert set(head[:4]) == set(torch.nonzero(sinks[b, hi]).flatten().tolist())
            rest = sorted((i for i in range(40) if not sinks[b, hi, i]), key=lambda i: -float(score[b, hi, i]))
            assert head[4:] == rest[:12]


def test_curdkv_original_random_projection_is_redrawn_per_eviction_from_the_rows_generator():
    policy = CurDKVOriginal(budget=24, window=8, random_projection=True)
    inputs = rkv_inputs(seed=5)
    first, second = policy.keep(inputs), policy.keep(inputs)  # the same generators, advanced: a new projection
    assert not torch.equal(first, second)
    assert torch.equal(policy.keep(rkv_inputs(seed=5)), first)  # reproducible from the seeds


# ---- Random Attention ------------------------------------------------------------------------------------------------


def test_random_keep_prompt_is_random_eviction_with_the_prompt_pinned():
    policy = RandomKeepPrompt(budget=24, window=8)
    assert policy.keep_prompt and policy.sinks == 0 and policy.name == "random_keep_prompt"
    assert policy.describe()["keep_prompt"] is True
    inputs = rkv_inputs(seed=7)
    assert torch.equal(policy.keep(inputs), RandomEviction(budget=24, window=8).keep(rkv_inputs(seed=7)))
    # Each KV head draws its own subset.
    idx = policy.keep(rkv_inputs(seed=8))
    assert not torch.equal(idx[:, 0].sort(-1).values, idx[:, 1].sort(-1).values)
