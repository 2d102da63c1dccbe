"""Ports of the VaSE authors' deterministic eviction modes (read from their code, written here), for the shared policy
matrix of ``tests/authors_rules.py`` (registered in its ``AUTHORS_RULES``; same contract: ``(policy, inputs, noise)``
-> ``(B, H, N)`` float64 reference scores, the authors keep the ``n_keep`` highest).

Source: terarachang/VaSE, ``eval/reasoning_tasks/modified/transformers/cache_utils.py``, ``EvictLayer._run_eviction``
(its ``compute_attention_scores``, ``cal_redundancy``, ``select_remaining_based_on_scores``), with the flags their run
scripts pass (``eval/reasoning_tasks/myscripts/*/eval_*.sh``, ``run_gsm8k.sh``; defaults in ``my_utils.py``):

* **snapkv** — mode ``attn`` with ``--smooth`` (every ``eval_attn.sh``), ``temperature`` 1.0 (the default): top-k of
  the windowed attention score, no sinks.
* **snapkv_protect** — mode ``range_attn`` with ``--smooth``: the ``n_large`` largest value ranges, then top-k of the
  attention score among the rest. ``n_large = budget // 4``: no script of theirs runs ``range_attn``; their VaSE runs
  pass ``budget / 4`` (1024 of 4096 on AIME, 256 of 1024 on MATH) and ``benchmark/throughput.py`` sets
  ``token_budget // 4``.
* **rkv** — mode ``attn_rkv`` with ``--smooth --rkv_lambda 0.5`` (every ``eval_rkv.sh``): top-k of
  ``λ·attention − (1 − λ)·redundancy``, no sinks.
* **curdkv** — mode ``cur_fixed_gauss`` (no flags): ``‖k G‖²·‖v G‖²`` normalised, one Gaussian sketch
  ``G ~ N(0, 1) / sqrt(20)`` of shape ``(D, 20)`` per row and layer (shared by its KV heads) drawn at the layer's first
  eviction and kept (their ``self.G``), 4 sinks at score 1.0 (here ``+inf``), top-k.
* **evict_large_value** — mode ``evict_large_range``: the ``K`` smallest value ranges, no sinks.

The flags are constants here, not read from the policy: a config whose defaults differ from the authors' runs fails.

Their attention score (``compute_attention_scores``): per query head, the window queries' logits ``q·k / (sqrt(D)·T)``
and a softmax over the **candidate keys only** (``k_cache[:, :cur_len - residual]``: the recent window's keys are not
in it), the mean over the window queries, the average pool ``F.avg_pool1d(kernel 5, stride 1, padding 2)`` (the zero
padding counted: the two candidates at each end are divided by 5 too) per query head, then the mean over the query
heads of the KV head's group. The harness multiplies the logits by ``inputs.scaling``, which the engine sets to
``head_dim ** -0.5`` (:mod:`vase.engine.decode`), their ``1 / sqrt(D)``, as :func:`tests.authors_rules.rule_inputs`.

**Storage order** (what the smoothing pools along): the candidate axis ``N`` of :class:`~vase.engine.policy.
EvictionInputs` is the order of the row's storage slots (the engine hands slots ``[pinned, pinned + N)`` in slot order,
:mod:`vase.engine.evict`), as theirs is the order of ``k_cache``'s slots. Both caches hold the prompt and the generated
tokens in position order until the first eviction, then put the kept candidates first in the order the rule returns
them (protected, then by decreasing score) and the recent window behind them, so after an eviction slot order is not
position order. The ports pool along ``N`` as given, never sorted by position: :func:`~tests.authors_rules.rule_inputs`
shuffles the positions over the slots, so a policy that pools along the text (``smooth_along=position``) fails.

**Sinks**: only ``cur_fixed_gauss`` has them (``scores[:, :, :4] = 1.0``, storage slots 0-3). In their cache those slots
always hold positions 0-3: the prompt is stored in position order and each eviction puts the four score-1.0 sinks first
(every other score is below 1, the scores summing to 1). On inputs whose slots are shuffled the port therefore marks
positions 0-3, the tokens their slots 0-3 hold (the engine keeps them in its slots 0-3 too: its sinks come back
first). The ``attn`` modes have no sinks (``'sink'`` is not in their names).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from vase.engine.policy import EvictionInputs

INF = float("inf")
SMOOTH_KERNEL = 5  # compute_attention_scores: kernel_size = 5
RKV_LAMBDA = 0.5  # every eval_rkv.sh: --rkv_lambda 0.5
TEMPERATURE = 1.0  # my_utils.py's default; no script passes another
CUR_RANK = 20  # cur_fixed_gauss: r = 20
N_SINK = 4  # EvictLayer.n_sink


def avg_pool(scores: torch.Tensor, kernel: int = SMOOTH_KERNEL) -> torch.Tensor:
    """``F.avg_pool1d(kernel, stride=1, padding=kernel // 2)`` along the last (storage) axis, written out: each slot's
    mean over the ``kernel`` slots centred on it, slots past either end counting as 0. ``(..., N)`` -> ``(..., N)``."""
    n, half = scores.shape[-1], kernel // 2
    padded = F.pad(scores, (half, half))
    return sum(padded[..., i : i + n] for i in range(kernel)) / kernel


def authors_attention(inputs: EvictionInputs, smooth: bool = True, temperature: float = TEMPERATURE) -> torch.Tensor:
    """Their ``compute_attention_scores(self.queries, k_candidates)`` in float64: ``(B, H, N)``.

    ``inputs.queries (B, Hq, W, D)`` (query head ``j`` of KV head ``j // (Hq / H)``), ``inputs.keys (B, H, N, D)``."""
    b, hq, w, d = inputs.queries.shape
    h = inputs.keys.shape[1]
    q = inputs.queries.double().view(b, h, hq // h, w, d)
    k = inputs.keys.double().unsqueeze(2)  # (B, H, 1, N, D)
    logits = q @ k.transpose(3, 4) / (math.sqrt(d) * temperature)  # (B, H, G, W, N)
    scores = logits.softmax(dim=-1).mean(dim=-2)  # softmax over the N candidates; mean over the window: (B, H, G, N)
    if smooth:
        scores = avg_pool(scores)  # per query head, along the storage axis
    return scores.mean(dim=2)  # the group's query heads


def authors_redundancy(keys: torch.Tensor) -> torch.Tensor:
    """Their ``cal_redundancy(k_candidates)`` in float64: the ``(N, N)`` cosine matrix of the candidate keys (norms
    ``+ 1e-8``), its diagonal zeroed, the mean over its first axis (``/ N``), a softmax. ``(B, H, N, D)`` ->
    ``(B, H, N)``."""
    k = keys.double()
    k_norm = k / (k.norm(dim=-1, keepdim=True) + 1e-8)
    cos = k_norm @ k_norm.transpose(-1, -2)
    cos = cos.masked_fill(torch.eye(k.shape[2], dtype=torch.bool), 0.0)
    return cos.mean(dim=2).softmax(dim=-1)


def value_range(values: torch.Tensor) -> torch.Tensor:
    """Their ``v_magnitude`` of the ``range`` modes: ``amax(-1) - amin(-1)``. ``(B, H, N, D)`` -> ``(B, H, N)``."""
    v = values.double()
    return v.amax(-1) - v.amin(-1)


def snapkv_rule(policy, inputs: EvictionInputs, noise=None) -> torch.Tensor:
    """Mode ``attn`` (``--smooth``): ``attn_scores.topk(K)``."""
    return authors_attention(inputs)


def snapkv_protect_rule(policy, inputs: EvictionInputs, noise=None) -> torch.Tensor:
    """Mode ``range_attn`` (``--smooth``, ``n_large = budget // 4``): ``ids_large`` = the ``n_large`` largest value
    ranges (here ``+inf``), then ``select_remaining_based_on_scores``: the attention top-k of the rest."""
    n_large = policy.budget // 4
    scores = authors_attention(inputs)
    ids_large = value_range(inputs.values).topk(n_large, dim=-1).indices
    return scores.scatter(-1, ids_large, INF)


def rkv_rule(policy, inputs: EvictionInputs, noise=None) -> torch.Tensor:
    """Mode ``attn_rkv`` (``--smooth --rkv_lambda 0.5``): ``attn * λ - redundancy * (1 - λ)``, top-k."""
    return authors_attention(inputs) * RKV_LAMBDA - authors_redundancy(inputs.keys) * (1 - RKV_LAMBDA)


def curdkv_rule(policy, inputs: EvictionInputs, noise=None) -> torch.Tensor:
    """Mode ``cur_fixed_gauss``: ``G`` is this row and layer's sketch of an earlier eviction (``inputs.state``), else
    drawn now from the rows' streams as the policy draws it (``inputs.randn(D, r) / sqrt(r)``, one per row, shared by
    its KV heads) and stored there (their ``self.G``). ``noise``: unused."""
    d = inputs.keys.shape[-1]
    if "sketch" not in inputs.state:
        inputs.state["sketch"] = inputs.randn(d, CUR_RANK) / math.sqrt(CUR_RANK)
    g = inputs.state["sketch"].double().unsqueeze(1)  # (B, 1, D, r): their G
    k2 = (inputs.keys.double() @ g).square().sum(dim=-1)
    v2 = (inputs.values.double() @ g).square().sum(dim=-1)
    scores = k2 * v2
    scores = scores / scores.sum(dim=-1, keepdim=True)
    return scores.masked_fill(inputs.positions < N_SINK, INF)  # their slots [:4] at 1.0 (module docstring: Sinks)


def evict_large_range_rule(policy, inputs: EvictionInputs, noise=None) -> torch.Tensor:
    """Mode ``evict_large_range``: ``v_magnitude.topk(K, largest=False)``, i.e. the ``K`` highest of ``-range``."""
    return -value_range(inputs.values)


def authors_storage_key(name: str, policy, inputs: EvictionInputs) -> torch.Tensor:
    """``(B, H, N)`` float64 whose descending order is their ``ids_to_keep``'s order, the slot order of the kept
    candidates after the eviction (their ``topk`` calls sort): the rule's scores, except at its ``+inf``:
    ``range_attn``'s protected block is ordered by decreasing value range (``ids_large``) before the attention top-k
    (``ids_remain``); ``cur_fixed_gauss``'s sinks score their 1.0 (first, in any order among themselves)."""
    ref = VASE_RULES[name](policy, inputs)
    if name == "snapkv_protect":
        return torch.where(ref.isinf(), 1e6 + value_range(inputs.values), ref)  # attention scores are <= 1
    return ref.masked_fill(ref.isinf(), 1.0)  # curdkv's sinks (the other rules have no +inf)


#: config name -> its authors' rule (VaSE's deterministic modes)
VASE_RULES = {
    "snapkv": snapkv_rule,
    "snapkv_protect": snapkv_protect_rule,
    "rkv": rkv_rule,
    "curdkv": curdkv_rule,
    "evict_large_value": evict_large_range_rule,
}
