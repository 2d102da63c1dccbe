"""StreamingLLM-style eviction: the first ``sinks`` tokens plus the most recent tokens.

No scoring at all: the floor of the cost of any eviction policy on the same static cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from vase.engine.policy import EvictionInputs, EvictionPolicy
from vase.engine.scores import topk_with_protection


@dataclass
class Streaming(EvictionPolicy):
    """Keep the ``sinks`` oldest tokens and the most recent candidates (by absolute position); ``sinks=4``."""

    name: ClassVar[str] = "streaming"

    def keep(self, inputs: EvictionInputs) -> torch.Tensor:
        """``positions (B, H, N)`` → ``(B, H, n_keep)`` int64: sinks first, then the newest candidates."""
        pos = inputs.positions
        return topk_with_protection(pos.double(), inputs.n_keep, protected=pos < self.sinks)
