"""Random eviction: keep a uniformly random subset of the candidates (sinks protected when ``sinks > 0``).

:class:`RandomKeepPrompt` is the prompt-keeping random baseline of "Random Attention: Rethinking KV Cache Eviction for
Efficient Reasoning" (arXiv 2609.03430, 2026-09): the prompt is never evicted (the engine's ``keep_prompt``: it is
pinned and counts towards the budget) and the generated tokens are evicted uniformly at random, independently per
KV head, with no score. Here it runs in VaSE's scaffold (the recent window kept, an eviction every ``window`` steps),
like every other eviction policy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from vase.engine.policy import EvictionInputs, EvictionPolicy
from vase.engine.scores import topk_with_protection


@dataclass
class RandomEviction(EvictionPolicy):
    """Keep ``n_keep`` candidates uniformly at random per (row, KV head); the ``sinks`` first tokens always (0)."""

    name: ClassVar[str] = "random"
    sinks: int = 0

    def keep(self, inputs: EvictionInputs) -> torch.Tensor:
        """Uniform noise per candidate from the row's generator, sinks forced first: ``(B, H, n_keep)`` int64."""
        _, h, n, _ = inputs.shape
        return topk_with_protection(inputs.rand(h, n), inputs.n_keep, protected=inputs.positions < self.sinks)


@dataclass
class RandomKeepPrompt(RandomEviction):
    """Random eviction among the generated tokens, the prompt kept (``keep_prompt=True``, ``sinks=0``)."""

    keep_prompt: bool = True

    name: ClassVar[str] = "random_keep_prompt"
