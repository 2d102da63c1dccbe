"""Random eviction: keep a uniformly random subset of the candidates (sinks protected when ``sinks > 0``)."""

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
