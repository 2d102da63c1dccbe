"""H2O (Zhang et al., NeurIPS 2023, arXiv 2306.14048; code: FMInference/H2O): heavy hitters plus the recent tokens.

Every query adds the attention it pays each held token to that token's score (summed over queries, never reset);
at an eviction the recent tokens are kept and, of the others, those with the highest accumulated score (the heavy
hitters). H2O's published setting splits the cache evenly between the two (``--heavy_ratio 0.1 --recent_ratio 0.1``:
``recent_ratio=0.5`` of the budget here, the engine's ``window`` included) and evicts one token per step
(``evict_every=1``). Scores are per KV head: the attention of every query head of the group is summed.

What the engine gives: every query counts, from the prompt on, as in H2O. The prefill's attention (each prompt
token's causal softmax column sum over every prompt query, computed in chunks) seeds the state (``accumulates``:
:meth:`H2O.prefill_state`); before a row's first eviction the engine shows :meth:`H2O.keep` the query ring each time
it holds ``window`` new queries (an observation: every candidate kept); from then on each call counts the ring's
queries new since the last one (``inputs.new_queries()``), exactly (the keys a query attended to are the held ones up
to its position: nothing was evicted since). With ``evict_every > window`` the engine also shows it the ring every
``window`` steps after the first eviction, so no query is missed. With ``keep_prompt`` the pinned prompt is not among
the keys, so each decode query's softmax runs over the candidates and the window only.

The walkthrough of ``docs/policies.md`` builds this file step by step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from vase.engine.policy import EvictionInputs, EvictionPolicy, _check
from vase.engine.scores import topk_with_protection
from vase.engine.token_state import TokenState


def new_attention(inputs: EvictionInputs, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The attention the ring's new queries paid each key, summed over those queries and the group's query heads.

    Args:
        inputs: the call's inputs (``queries (B, Hq, W, D)``, ``query_positions (B, W)``, ``new_queries()``).
        keys: ``(B, H, M, D)`` every held key; positions: ``(B, H, M)`` their positions.

    Returns:
        ``(B, H, M)`` float32: each query's causal softmax (keys up to its position) over ``keys``.
    """
    b, hq, w, d = inputs.queries.shape
    h = keys.shape[1]
    q = inputs.queries.float().view(b, h, hq // h, w, d)  # query head j uses KV head j // (Hq // H)
    logits = torch.einsum("bhgwd,bhmd->bhgwm", q, keys.float()) * inputs.scaling
    future = positions[:, :, None, None, :] > inputs.query_positions[:, None, None, :, None]
    probs = logits.masked_fill(future, float("-inf")).softmax(dim=-1)
    return (probs * inputs.new_queries()[:, None, None, :, None]).sum(dim=(2, 3))


@dataclass
class H2O(EvictionPolicy):
    """Keep the recent tokens and the heavy hitters (highest accumulated attention).

    Attributes:
        recent_ratio: the share of the budget kept by recency, the window included (H2O: 0.5).
        sinks: first tokens always kept (H2O: none).
    """

    sinks: int = 0
    recent_ratio: float = 0.5
    evict_every: int | None = 1

    name: ClassVar[str] = "h2o"
    display_name: ClassVar[str] = "H2O"
    needs_queries: ClassVar[bool] = True
    accumulates: ClassVar[bool] = True

    def validate(self) -> None:
        super().validate()
        r = self.recent_ratio
        _check(isinstance(r, (int, float)) and 0 <= r <= 1, "policy.recent_ratio", f"must be in [0, 1], got {r!r}")

    def prefill_state(self, positions: torch.Tensor, attention: torch.Tensor, capacity: int) -> dict:
        """The prompt's accumulated attention (``(1, H, P)``, every prompt query counted) as the state to start from."""
        return TokenState("h2o").initial(positions, attention, capacity)

    def keep(self, inputs: EvictionInputs) -> torch.Tensor:
        """``(B, H, n_keep)`` int64: the sinks and recent candidates, then by decreasing accumulated attention."""
        acc = TokenState("h2o")  # the accumulated attention, carried from call to call by position
        held = torch.cat([inputs.positions, inputs.window_positions], dim=-1)  # (B, H, N + window)
        keys = torch.cat([inputs.keys, inputs.window_keys], dim=2)
        score = acc.read(inputs, held) + new_attention(inputs, keys, held)
        n = inputs.positions.shape[-1]
        n_recent = min(max(0, round(self.recent_ratio * self.budget) - self.window), inputs.n_keep)
        recent = inputs.positions >= inputs.positions.topk(max(n_recent, 1), dim=-1).values[..., -1:]
        protected = (recent if n_recent else torch.zeros_like(recent)) | (inputs.positions < self.sinks)
        keep = topk_with_protection(score[..., :n], inputs.n_keep, protected=protected)
        acc.write_kept(inputs, keep, score)
        return keep
