"""Ports of the original baselines' selection rules (read from their authors' code, written here in float64), for the
shared policy matrix (:data:`tests.authors_rules.AUTHORS_RULES`; the conventions are that module's: a rule maps
``(policy, inputs)`` to ``(B, H, N)`` reference scores of the candidates, the protected ones at ``+inf``, and the
authors keep the ``n_keep`` highest).

* **R-KV** (``rkv_original``; Zefan-Cai/R-KV at ``d15c976``): ``rkv/compression/r1_kv.py`` ``R1KV.update_kv`` (lines
  43-82) with ``rkv/utils.py`` ``compute_attention_scores`` (``pooling="max"``, lines 8-39) and ``cal_similarity``
  (``threshold=0.5``, ``retain_direction="last"``, lines 42-94); the cached window queries of
  ``rkv/modeling.py`` (lines 100-124).
* **CurDKV** (``curdkv_original``; NVIDIA/kvpress at ``8bb29b9``): ``kvpress/presses/cur_press.py``
  ``CURPress.score`` (lines 34-67) and ``kvpress/presses/scorer_press.py`` ``ScorerPress.compress`` (top-k).

Both scores are probabilities of order ``1 / N``: the check's near-tie tolerance is relative to the largest finite
score with no floor, so a boundary gap of ``1e-4`` of it cannot swallow the redundancy term (R-KV) or the blocks
(CurDKV).
"""

from __future__ import annotations

import math

import torch

from vase.engine.policy import EvictionInputs

INF = float("inf")
KVPRESS_RANK = 20  # cur_press.py line 37: ``r = 20`` columns of the random projection


def rkv_original_rule(policy, inputs: EvictionInputs, noise=None) -> torch.Tensor:
    """R-KV's ``final_score`` of the candidates, per (row, KV head), by the letter of their code in float64.

    R-KV's cache ``key_states`` is the candidates then the ``window_size`` newest tokens (the engine stores them so);
    ``query_states`` are the ``window_size`` cached queries (the ring). No sinks (``first_tokens`` is unused by
    ``R1KV``): the harness's ``sinks`` option (0 by default) is protected on top.
    """
    window_size = policy.window
    b, h, n, d = inputs.keys.shape
    assert inputs.window_keys.shape[2] == window_size, "R-KV observes and protects the same window_size tokens"
    hq = inputs.queries.shape[1]
    group = hq // h
    lam, half, threshold = float(policy.rkv_lambda), policy.pool_kernel // 2, float(policy.similarity_threshold)
    out = torch.empty(b, h, n, dtype=torch.float64)
    for r in range(b):
        for kv in range(h):
            key_states = torch.cat([inputs.keys[r, kv], inputs.window_keys[r, kv]]).double()  # (L, D)
            query_states = inputs.queries[r, kv * group : (kv + 1) * group].double()  # (G, Wq, D): the group's heads
            # compute_attention_scores(pooling="max"): q·k / sqrt(head_dim), max over the group's query heads
            attn_weights = (query_states @ key_states.T / math.sqrt(d)).amax(0)  # (Wq, L)
            # r1_kv.py 51-59: softmax of the window queries over all keys but the window, mean over the queries
            attn_weights_sum = attn_weights[-window_size:, :-window_size].softmax(-1).mean(0)  # (N,)
            # r1_kv.py 62-67: max_pool1d(kernel_size, padding=kernel_size // 2, stride=1)
            attn_cache = torch.stack([attn_weights_sum[max(0, j - half) : j + half + 1].max() for j in range(n)])
            # cal_similarity: cosine of every cached key (the window too), diagonal zeroed, each row's newest key
            # above the threshold zeroed (index 0 when it has none), mean over the rows, softmax over every key
            k_norm = key_states / (key_states.norm(dim=-1, keepdim=True) + 1e-8)
            similarity_cos = k_norm @ k_norm.T
            similarity_cos.fill_diagonal_(0.0)
            length = similarity_cos.shape[0]
            indices = torch.where(similarity_cos > threshold, torch.arange(length), 0)
            similarity_retain = indices.max(-1).values
            similarity_cos[torch.arange(length), similarity_retain] = 0
            redundancy = similarity_cos.mean(0).softmax(-1)[:-window_size]  # r1_kv.py 69-73
            final_score = attn_cache * lam - redundancy * (1 - lam)  # r1_kv.py 75-77
            out[r, kv] = final_score
    return torch.where(inputs.positions < policy.sinks, INF, out)


def curdkv_original_rule(policy, inputs: EvictionInputs, noise=None) -> torch.Tensor:
    """kvpress ``CURPress.score`` on the candidates in storage order, float64.

    kvpress scores the whole cache it compresses; the scaffold hands the candidates (every held token with
    ``protect_recent=0``, else all but the protected window; they fill the first storage slots, the window behind
    them, so the blocks of ``local_window`` are the cache's first blocks whenever ``N`` is a multiple of it).
    ``use_random_leverage``: one ``G ∈ R^{D×20}`` with ``N(0, 1/20)`` entries per row, drawn as the policy draws
    (``inputs.randn(D, 20)`` first; kvpress draws one per layer call). kvpress's sinks (``scores[:, :, :num_sinks] =
    1.0``, above every normalised score) are its first storage slots, which hold the first ``sinks`` positions:
    protected here by position.
    """
    keys, values = inputs.keys.double(), inputs.values.double()
    b, h, n, d = keys.shape
    if policy.random_projection:  # cur_press.py 36-40
        g = inputs.randn(d, KVPRESS_RANK).double() / math.sqrt(KVPRESS_RANK)  # (B, D, r)
        keys, values = keys @ g[:, None], values @ g[:, None]
    k2, v2 = (keys**2).sum(-1), (values**2).sum(-1)  # (B, H, N), lines 42-43
    w = policy.local_window
    if w > 0:  # use_local_approximation, lines 45-51: each block of w tokens (the last one shorter) sums to 1
        for s in range(0, n, w):
            k2[..., s : s + w] = k2[..., s : s + w] / k2[..., s : s + w].sum(-1, keepdim=True)
            v2[..., s : s + w] = v2[..., s : s + w] / v2[..., s : s + w].sum(-1, keepdim=True)
    scores = {"key": k2, "value": v2, "kv_avg": (k2 + v2) / 2, "kv_product": k2 * v2}[policy.leverage]
    scores = scores / scores.sum(-1, keepdim=True)  # line 64
    return torch.where(inputs.positions < policy.sinks, INF, scores)  # line 65
