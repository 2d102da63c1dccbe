"""Ports of the authors' selection rules (read from their code, written here), for the shared policy matrix.

Each rule maps ``(policy, inputs)`` to ``(B, H, N)`` float64 reference scores of the candidates, the protected ones
(sinks, H2O's recent share) at ``+inf``: the authors keep the ``n_keep`` highest. :func:`check_authors_rule` compares a
policy's ``keep()`` with them, allowing a different choice only at a near-tie of the reference (the policies score in
float32). A config with a rule here is checked by ``tests/test_policies.py`` on random inputs and by
``tests/test_family_matrix.py`` on every family's geometry, so a wrong rule fails the matrix, not only a unit test.

* **TriAttention** (WeianMao/triattention, ``triattention/methods/triattention.py``): per (layer, query head) the score
  on the RoPE-inverted keys (``tests/test_new_baselines.py``'s ``tri_reference``), z-scored over the candidates
  (population std), plus ``1e-6`` uniform noise; per-head mode (``_select_per_head_independent``): per (layer, KV
  head) the max over its query heads, then per KV head the mean over the layers; one top-k per KV head for every layer.
* **H2O** (FMInference/H2O, ``h2o_hf/utils_lm_eval/modify_llama.py``): each query's softmax over the keys up to its
  position, summed over the queries and the query heads of a KV head (the heavy-hitter score); the newest
  ``recent_ratio * budget - window`` candidates kept by recency, the rest by score.
* **KeyDiff** (kvpress ``KeyDiffPress``): minus the cosine of each key to the mean of the unit-normalised keys of every
  held token.
* **StreamingLLM** (mit-han-lab/streaming-llm ``StartRecentKVCache``): the sinks, then the newest.
* The stochastic VaSE-repo configs (VaSE-AttnV, SnapKV + sampling, VaSE-DKV, random):
  tests/authors_rules_vase_sampling.py.

A rule is ``rule(policy, inputs)``; a stochastic one draws from ``inputs`` what the policy draws (same calls, same
order), so its sampler gets the policy's random numbers.
"""

from __future__ import annotations

import torch

from baselines.triattention import geometric_offsets
from tests.authors_rules_originals import curdkv_original_rule, rkv_original_rule
from tests.authors_rules_vase import VASE_RULES
from tests.authors_rules_vase_sampling import VASE_SAMPLING_RULES
from vase.engine.policy import EvictionInputs

INF = float("inf")


def _unrope(keys: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Invert transformers' RoPE (rotate_half layout) in float64: ``keys (..., N, D)`` at ``pos (..., N)``."""
    angle = pos[..., None].double() * inv_freq.double()
    cos, sin = torch.cat([angle.cos()] * 2, -1), torch.cat([angle.sin()] * 2, -1)
    x = keys.double()
    d = x.shape[-1] // 2
    return x * cos - torch.cat([-x[..., d:], x[..., :d]], -1) * sin


def _tri_head(k_pre, pos, now, q_mean, q_abs, inv_freq, offsets) -> torch.Tensor:
    """The authors' ``score_keys_for_round`` for one query head (mean over offsets, trig and MLR terms): ``(N,)``."""
    f = k_pre.shape[-1] // 2
    kc = torch.complex(k_pre[..., :f], k_pre[..., f:])
    qm = q_mean.to(torch.complex128)
    amp, phi = qm.abs() * kc.abs(), torch.angle(qm * kc.conj())
    extra = ((q_abs.double() - qm.abs()) * kc.abs()).sum(-1)
    per = [(amp * torch.cos((now - pos.double() + o)[..., None] * inv_freq.double() + phi)).sum(-1) for o in offsets]
    return torch.stack(per).mean(0) + extra


def triattention_rule(policy, inputs: EvictionInputs, noise: torch.Tensor | None = None) -> torch.Tensor:
    """Per-head mode; ``noise``: ``(B, Hq, N)`` the tie-break draws, by default the policy's ``inputs.rand(Hq, N)``."""
    b, h, n, _ = inputs.keys.shape
    hq = policy._q_mean.shape[1]
    if noise is None:
        noise = inputs.rand(inputs.queries.shape[1] if inputs.queries is not None else 1, n)
    g = hq // h
    held = torch.cat([inputs.positions, inputs.window_positions], -1)
    offsets = geometric_offsets(policy.offset_max_length).tolist()
    inv_freq = policy._omega.double()
    per_row = inputs.layers_per_row
    out = torch.empty(b, h, n, dtype=torch.float64)
    for r in range(b // per_row):
        for kv in range(h):
            layer_max = []
            for li in range(per_row):
                row = r * per_row + li
                layer = int(inputs.layer_ids[row])
                pos = inputs.positions[row, kv]
                now = float(held[row].max()) + 1
                k_pre = _unrope(inputs.keys[row, kv], pos, inv_freq)
                heads = []
                for j in range(kv * g, (kv + 1) * g):
                    s = _tri_head(k_pre, pos, now, policy._q_mean[layer, j], policy._q_abs[layer, j], inv_freq,
                                  offsets)  # fmt: skip
                    s = (s - s.mean()) / s.std(unbiased=False).clamp_min(1e-6)
                    heads.append(s + 1e-6 * noise[row, j].double())
                layer_max.append(torch.stack(heads).amax(0))
            agg = torch.stack(layer_max).mean(0)
            for li in range(per_row):
                row = r * per_row + li
                out[row, kv] = torch.where(inputs.positions[row, kv] < policy.sinks, INF, agg)
    return out


def h2o_rule(policy, inputs: EvictionInputs, noise=None) -> torch.Tensor:
    """A first call (no stored state): every query of the ring is new; float64, one query at a time."""
    b, h, n, d = inputs.keys.shape
    hq, w = inputs.queries.shape[1], inputs.queries.shape[2]
    g = hq // h
    keys = torch.cat([inputs.keys, inputs.window_keys], 2).double()
    held = torch.cat([inputs.positions, inputs.window_positions], -1)
    out = torch.zeros(b, h, n, dtype=torch.float64)
    n_recent = min(max(0, round(policy.recent_ratio * policy.budget) - policy.window), inputs.n_keep)
    for r in range(b):
        for kv in range(h):
            acc = torch.zeros(held.shape[-1], dtype=torch.float64)
            for j in range(kv * g, (kv + 1) * g):
                for s in range(w):
                    qp = int(inputs.query_positions[r, s])
                    seen = held[r, kv] <= qp
                    logits = keys[r, kv, seen] @ inputs.queries[r, j, s].double() * inputs.scaling
                    acc[seen] += logits.softmax(-1)
            score = acc[:n].clone()
            pos = inputs.positions[r, kv]
            if n_recent:
                score[pos >= pos.topk(n_recent).values[-1]] = INF
            score[pos < policy.sinks] = INF
            out[r, kv] = score
    return out


def keydiff_rule(policy, inputs: EvictionInputs, noise=None) -> torch.Tensor:
    unit = torch.nn.functional.normalize(torch.cat([inputs.keys, inputs.window_keys], 2).double(), dim=-1)
    anchor = unit.mean(2, keepdim=True)
    k = torch.nn.functional.normalize(inputs.keys.double(), dim=-1)
    score = -(k * anchor).sum(-1) / anchor.norm(dim=-1)
    return torch.where(inputs.positions < policy.sinks, INF, score)


def streaming_rule(policy, inputs: EvictionInputs, noise=None) -> torch.Tensor:
    return torch.where(inputs.positions < policy.sinks, INF, inputs.positions.double())


#: config name -> its authors' rule
AUTHORS_RULES = {
    "triattention": triattention_rule,
    "h2o": h2o_rule,
    "keydiff": keydiff_rule,
    "streaming": streaming_rule,
    "rkv_original": rkv_original_rule,
    "curdkv_original": curdkv_original_rule,
    **VASE_SAMPLING_RULES,  # vase_attnv, snapkv_sample, vase_dkv, random, random_keep_prompt
    **VASE_RULES,  # tests/authors_rules_vase.py: snapkv, snapkv_protect, rkv, curdkv, evict_large_value
}


def check_authors_rule(policy, inputs: EvictionInputs, twin: EvictionInputs, name: str, tol: float = 1e-4) -> None:
    """``policy.keep(inputs)`` keeps the reference's ``n_keep`` highest per (row, KV head), or differs only where the
    reference's boundary gap is below ``tol`` (relative to its largest finite score). ``twin``: the same inputs,
    unused: the rule (``rule(policy, twin)``) draws from it what the policy draws, in the same order and shapes (the
    streams are counter-based, so its draws equal the policy's)."""
    b, h, n, _ = inputs.keys.shape
    ref = AUTHORS_RULES[name](policy, twin)
    keep = policy.keep(inputs)
    kept = torch.zeros(b, h, n, dtype=torch.bool).scatter_(-1, keep, True)
    order = ref.argsort(dim=-1, descending=True, stable=True)
    want = torch.zeros_like(kept).scatter_(-1, order[..., : inputs.n_keep], True)
    finite = ref[ref.isfinite()]
    scale = finite.abs().max().item() if finite.numel() else 1.0  # no floor: scores summing to 1 are all < 1
    for r in range(b):
        for kv in range(h):
            if torch.equal(kept[r, kv], want[r, kv]):
                continue
            s = ref[r, kv].sort(descending=True).values
            gap = (s[inputs.n_keep - 1] - s[inputs.n_keep]).item() if inputs.n_keep < n else INF
            assert gap <= tol * scale, f"{name}: row {r} KV head {kv} keeps another set than its authors' rule"


def rule_inputs(policy, h: int, hq: int, d: int, rows: int, layer_ids: list[int], seed: int = 0) -> EvictionInputs:
    """Random inputs of an eviction event as the engine folds it: ``rows`` sequences x ``len(layer_ids)`` layers (the
    layers of a sequence hold the same positions), the policy's protected recent tokens (possibly none) newer than
    every candidate, a full ring of ``policy.window`` queries, all new; distinct positions including the sinks."""
    g = torch.Generator().manual_seed(seed)
    per_row, w, ring = len(layer_ids), policy.protected_window, policy.window
    b, n = rows * per_row, 3 * policy.budget // 2
    positions = torch.empty(rows, h, n, dtype=torch.long)
    for r in range(rows):
        for kv in range(h):
            rest = torch.randperm(3 * n, generator=g)[: n - 4] + 4
            positions[r, kv] = torch.cat([torch.arange(4), rest])[torch.randperm(n, generator=g)]
    positions = positions.repeat_interleave(per_row, 0)
    newest = 4 * n + ring
    q_pos = torch.arange(newest - ring, newest)
    return EvictionInputs(
        keys=torch.randn(b, h, n, d, generator=g),
        values=torch.randn(b, h, n, d, generator=g),
        positions=positions,
        n_keep=policy.budget - w,
        layer_idx=None,
        layer_ids=torch.tensor(layer_ids).repeat(rows),
        layers_per_row=per_row,
        scaling=d**-0.5,
        generators=[torch.Generator().manual_seed(100 + i) for i in range(b)],
        queries=torch.randn(b, hq, ring, d, generator=g),
        window_keys=torch.randn(b, h, w, d, generator=g),
        window_positions=torch.arange(newest - w, newest).expand(b, h, w).clone(),
        query_positions=q_pos[(q_pos % ring).argsort()].expand(b, ring).clone(),
        n_new_queries=torch.full((b,), ring),
    )


def check_rule_on_geometry(policy, name: str, h: int, hq: int, d: int, layer_ids: list[int]) -> None:
    """:func:`check_authors_rule` on :func:`rule_inputs` of this geometry (two sequences), for a config with a rule."""
    make = lambda: rule_inputs(policy, h, hq, d, 2, layer_ids)  # noqa: E731
    check_authors_rule(policy, make(), make(), name)
