"""Ports of the authors' rules of the stochastic VaSE-repo configs, for the matrix of tests/authors_rules.py.

Read from terarachang/VaSE, ``eval/reasoning_tasks/modified/transformers/cache_utils.py`` (``EvictLayer._run_eviction``,
its ``compute_attention_scores`` and ``multinomial_sample``), with the flags their run scripts pass
(``eval/reasoning_tasks/myscripts/*/eval_*.sh``, ``run_gsm8k.sh``): ``--smooth`` for every attention mode,
``--n_large`` = a quarter of ``--token_budget`` (MATH 256 of 1024, GPQA/LiveCodeBench 512 of 2048, AIME/HMMT 1024 of
4096), ``--temperature`` never passed (1.0), ``r = 20`` and ``n_sink = 4`` fixed in the code. Written here in float64.

* **VaSE-AttnV** (mode ``range_sink_sample_attn``): the value range ``max - min`` over the head dim, the 4 sinks set to
  ``+inf``; its ``n_large`` largest are kept; the attention scores of those set to 0; the remaining ``K - n_large``
  drawn by ``torch.multinomial(scores, K - n_large, replacement=False)``.
* **SnapKV + sampling** (mode ``attn_sample``): all ``K`` drawn by ``torch.multinomial`` from the attention scores;
  no sinks, no protection.
* **VaSE-DKV** (mode ``cur_resample_gauss``): a fresh sketch ``G = randn(B, 1, D, r) / sqrt(r)`` per (row, layer) at
  every eviction, shared by the KV heads; score ``‖kG‖² · ‖vG‖²`` normalised over the candidates, the 4 sinks set to
  1.0; the top ``K``.
* **Random** (``random``; method.md §3 "random eviction": no mode in their code): a uniformly random ``K``-subset of
  the candidates, no sinks, drawn as their ``attn_random`` mode draws a random subset (``torch.rand(B, H, N).topk``).
  **random_keep_prompt** (Random Attention, arXiv 2609.03430): the same among the generated tokens (the engine pins
  the prompt, ``keep_prompt``: never a candidate).

Their attention scores (``compute_attention_scores``): per query head, the window queries' logits
``q·k / (sqrt(D) · T)`` over the candidates only (the cache but its ``residual_length`` newest), softmax over them,
mean over the window queries, an average pool (kernel 5, padding 2, stride 1, zero padding counted) along the
storage axis per query head, then the mean over the query heads of a KV head's group.

Sinks: their code marks the first 4 *storage slots*; they hold positions 0..3 at every eviction (in position order
before the first, kept first after it), so a port marks ``positions < 4`` (the matrix's inputs shuffle the storage).

How a sampled rule is checked: ``torch.multinomial(p, k, replacement=False)`` is, in torch's own implementation
(``aten/src/ATen/native/Distributions.cpp``, ``multinomial_out``), the top ``k`` of ``p / q`` with ``q ~ Exp(1)``
i.i.d. — the exponential race, equal in law to ``k`` successive draws proportional to ``p`` among the items left. A
port takes the uniforms ``u`` the policy draws (``inputs.rand``, the same call in the same order on a twin of its
inputs), makes ``q = -log(u)`` and returns the race's keys in the log domain (``log p - log q``, the same order);
``torch.randn``'s sketch is the policy's ``inputs.randn`` draw. ``tests/test_vase_sampling_rules.py`` checks
separately that the policies' draws have the law of ``torch.multinomial`` (and of a uniform subset) on small cases
against exact enumeration.
"""

from __future__ import annotations

import math

import torch

from vase.engine.policy import EvictionInputs

INF = float("inf")
#: ``EvictLayer.n_sink``
N_SINK = 4
#: the sketch rank of their ``cur_*`` modes
CUR_RANK = 20
#: their ``avg_pool1d`` kernel (``--smooth``)
SMOOTH_KERNEL = 5


def _avg_pool_zero_padded(x: torch.Tensor, kernel: int) -> torch.Tensor:
    """``F.avg_pool1d(x, kernel, stride=1, padding=kernel // 2)`` along the last axis, written out: the mean of the
    ``kernel`` neighbours, the missing ones at the ends counted as zeros. ``(..., N)`` -> ``(..., N)``."""
    half = kernel // 2
    padded = torch.nn.functional.pad(x, (half, half))
    n = x.shape[-1]
    return sum(padded[..., i : i + n] for i in range(kernel)) / kernel


def authors_attention_scores(queries: torch.Tensor, keys: torch.Tensor, temperature: float = 1.0,
                             smooth: bool = True) -> torch.Tensor:  # fmt: skip
    """Their ``compute_attention_scores`` in float64: ``queries (B, Hq, W, D)``, candidate ``keys (B, H, N, D)`` ->
    ``(B, H, N)`` (query head ``j`` of KV head ``j // (Hq / H)``)."""
    b, hq, w, d = queries.shape
    h = keys.shape[1]
    q = queries.double().view(b, h, hq // h, w, d)
    logits = q @ keys.double().unsqueeze(2).transpose(-1, -2) / (math.sqrt(d) * temperature)  # (B, H, G, W, N)
    scores = logits.softmax(-1).mean(-2)  # (B, H, G, N): mean over the window's queries
    if smooth:
        scores = _avg_pool_zero_padded(scores, SMOOTH_KERNEL)  # per query head, along the storage axis
    return scores.mean(2)  # the group's query heads


def _exponential_race(weights: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """The keys whose top ``k`` is ``torch.multinomial(weights, k, replacement=False)``: ``weights / q`` with
    ``q = -log(u) ~ Exp(1)``, as ``log(weights) - log(q)`` (the same order). ``(..., N)`` -> ``(..., N)``."""
    return weights.double().log() - torch.log(-torch.log(uniform.double()))


def vase_attnv_rule(policy, inputs: EvictionInputs) -> torch.Tensor:
    """``range_sink_sample_attn``: the sinks and the ``budget / 4`` largest value ranges (``+inf``), the rest the
    exponential race's keys on the attention scores; the policy's one draw ``inputs.rand(H, N)``."""
    b, h, n, _ = inputs.keys.shape
    n_large = policy.budget // 4
    v = inputs.values.double()
    v_magnitude = v.amax(-1) - v.amin(-1)
    v_magnitude = v_magnitude.masked_fill(inputs.positions < N_SINK, INF)
    ids_large = v_magnitude.topk(n_large, dim=-1).indices
    attn = authors_attention_scores(inputs.queries, inputs.keys).scatter(-1, ids_large, 0.0)
    key = _exponential_race(attn, inputs.rand(h, n))
    return key.scatter(-1, ids_large, INF)


def snapkv_sample_rule(policy, inputs: EvictionInputs) -> torch.Tensor:
    """``attn_sample``: every kept candidate drawn from the attention scores (the policy's ``inputs.rand(H, N)``)."""
    b, h, n, _ = inputs.keys.shape
    return _exponential_race(authors_attention_scores(inputs.queries, inputs.keys), inputs.rand(h, n))


def vase_dkv_rule(policy, inputs: EvictionInputs) -> torch.Tensor:
    """``cur_resample_gauss``: the sketch from the policy's ``inputs.randn(D, r)`` (one per row, every KV head)."""
    b, h, n, d = inputs.keys.shape
    g = (inputs.randn(d, CUR_RANK).double() / math.sqrt(CUR_RANK)).unsqueeze(1)  # (B, 1, D, r)
    k2 = (inputs.keys.double() @ g).square().sum(-1)
    v2 = (inputs.values.double() @ g).square().sum(-1)
    scores = k2 * v2
    scores = scores / scores.sum(-1, keepdim=True)
    return scores.masked_fill(inputs.positions < N_SINK, 1.0)


def random_rule(policy, inputs: EvictionInputs) -> torch.Tensor:
    """A uniform ``K``-subset: the top ``K`` of i.i.d. uniforms (the policy's ``inputs.rand(H, N)``), no sinks."""
    b, h, n, _ = inputs.keys.shape
    return inputs.rand(h, n).double()


#: config name -> its authors' rule (registered in tests/authors_rules.py's AUTHORS_RULES)
VASE_SAMPLING_RULES = {
    "vase_attnv": vase_attnv_rule,
    "snapkv_sample": snapkv_sample_rule,
    "vase_dkv": vase_dkv_rule,
    "random": random_rule,
    "random_keep_prompt": random_rule,
}
