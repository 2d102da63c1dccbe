"""KeyDiff (Park et al., arXiv 2504.15364): keep the keys least similar to the mean key.

Per (row, KV head) the anchor is the mean of the L2-normalised held keys (the candidates and any protected recent
tokens, as the paper's block-wise eviction scores the cache together with the incoming block); a candidate's score is
minus its cosine similarity to the anchor, and the ``n_keep`` highest are kept (the ``sinks`` first tokens always).
No attention, no queries: the score needs only the keys, so it works with fused attention kernels, which is the
paper's point. kvpress's ``KeyDiffPress`` scores the same way and scores every key of the block: no recent token is
protected (``protect_recent=0``, the default here; ``protect_recent=null`` protects the engine's ``window``, the
harness's earlier variant).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from vase.engine.policy import EvictionInputs, EvictionPolicy
from vase.engine.scores import topk_with_protection


def keydiff_score(keys: torch.Tensor, anchor_keys: torch.Tensor | None = None) -> torch.Tensor:
    """Minus the cosine similarity of each key to the anchor (the mean normalised key).

    Args:
        keys: ``(B, H, N, D)`` candidate keys.
        anchor_keys: ``(B, H, M, D)`` further keys that count in the anchor (the recent window), or ``None``.

    Returns:
        ``(B, H, N)`` float32 in ``[-1, 1]``; higher = more distinctive (kept first).
    """
    k = F.normalize(keys.float(), dim=-1)
    pool = k if anchor_keys is None else torch.cat([k, F.normalize(anchor_keys.float(), dim=-1)], dim=2)
    anchor = pool.mean(dim=2, keepdim=True)  # (B, H, 1, D)
    return -F.cosine_similarity(k, anchor, dim=-1)


@dataclass
class KeyDiff(EvictionPolicy):
    """Keep the ``n_keep`` candidates whose keys are least similar to the mean key; ``sinks`` first (default 0); every
    held key a candidate (``protect_recent=0``, as kvpress)."""

    sinks: int = 0
    protect_recent: int | None = 0

    name: ClassVar[str] = "keydiff"
    display_name: ClassVar[str] = "KeyDiff"

    def keep(self, inputs: EvictionInputs) -> torch.Tensor:
        """``(B, H, n_keep)`` int64: the sinks, then by decreasing KeyDiff score."""
        score = keydiff_score(inputs.keys, inputs.window_keys)
        return topk_with_protection(score, inputs.n_keep, protected=inputs.positions < self.sinks)
