"""The authors' eviction scores, step by step in the cache's dtype, as a reference for ``protocol.score_dtype``.

terarachang/VaSE at bfa2692, ``eval/reasoning_tasks/modified/transformers/cache_utils.py``
(``EvictLayer._run_eviction``) computes every score in the KV cache's dtype (bf16 in the paper) with plain tensor
operations, each of which returns a bf16 tensor and therefore rounds once. Written here from that description, one
operation per line, in their order and on their shapes (no chunking, no algebraic shortcut), so that
``vase.engine.scores`` with ``dtype=torch.bfloat16`` can be checked against it bit for bit:

* attention (their ``compute_attention_scores``, lines 143-168): ``(q @ kᵀ) / (sqrt(D)·T)`` on ``(B, H, G, Wq, N)``;
  softmax computed in float32 and cast back; mean over the window queries; ``avg_pool1d`` (kernel 5, padding 2) per
  query head; mean over the group;
* value magnitude (lines 194-201): ``max - min`` / ``var`` / ``norm`` over the head dim;
* redundancy (their ``cal_redundancy``, lines 170-177): normalised keys, the full cosine matrix, zeroed diagonal,
  mean over dim 2, softmax;
* R-KV mixture (line 208): ``attn·λ - sim·(1-λ)``;
* CUR (lines 229-239): ``k @ G``, ``v @ G``, squares summed, product, divided by its sum.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def attention(queries: torch.Tensor, keys: torch.Tensor, temperature: float = 1.0, smooth: bool = True) -> torch.Tensor:
    """``queries (B, Hq, Wq, D)``, ``keys (B, H, N, D)``, both in the cache dtype -> ``(B, H, N)`` in that dtype."""
    b, hq, wq, d = queries.shape
    h = keys.shape[1]
    g = hq // h
    q = queries.view(b, h, g, wq, d)
    k = keys.unsqueeze(2)
    logits = torch.matmul(q, k.transpose(3, 4)) / (math.sqrt(d) * temperature)
    probs = F.softmax(logits, dim=-1, dtype=torch.float32).to(queries.dtype)
    scores = probs.mean(-2)  # (B, H, G, N)
    if smooth:
        shape = scores.shape
        scores = F.avg_pool1d(scores.view(b, hq, -1), kernel_size=5, padding=2, stride=1).view(shape)
    return scores.mean(2)


def value_magnitude(values: torch.Tensor, stat: str) -> torch.Tensor:
    """``(B, H, N, D)`` -> ``(B, H, N)`` in the values' dtype (``range`` | ``var`` | ``l2``)."""
    if stat == "range":
        return values.amax(-1) - values.amin(-1)
    if stat == "var":
        return values.var(dim=-1)
    if stat == "l2":
        return values.norm(dim=-1)
    raise ValueError(stat)


def redundancy(keys: torch.Tensor) -> torch.Tensor:
    """``(B, H, N, D)`` -> ``(B, H, N)``: the full ``(B, H, N, N)`` similarity matrix, in the keys' dtype."""
    k_norm = keys / (keys.norm(dim=-1, keepdim=True) + 1e-8)
    sim = torch.matmul(k_norm, k_norm.transpose(-1, -2))
    eye = torch.eye(keys.size(2), dtype=torch.bool)
    sim.masked_fill_(eye.unsqueeze(0).unsqueeze(0), 0.0)
    return sim.mean(dim=2).softmax(dim=-1)


def rkv(attn: torch.Tensor, sim: torch.Tensor, lam: float) -> torch.Tensor:
    """R-KV's mixture, in the operands' dtype."""
    return attn * lam - sim * (1 - lam)


def cur(keys: torch.Tensor, values: torch.Tensor, sketch: torch.Tensor) -> torch.Tensor:
    """``keys, values (B, H, N, D)`` in the cache dtype, ``sketch (B, D, r)`` float32 -> ``(B, H, N)``."""
    g = sketch.unsqueeze(1).to(keys.dtype)  # their G: (B, 1, D, r), cast to the cache dtype
    k = keys @ g
    v = values @ g
    k2 = (k**2).sum(dim=-1)
    v2 = (v**2).sum(dim=-1)
    scores = k2 * v2
    scores /= scores.sum(dim=-1, keepdim=True)
    return scores
