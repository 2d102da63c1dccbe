"""StreamingLLM-style eviction (a variant of Xiao et al., ICLR 2024): the first ``sinks`` tokens plus the most recent.

StreamingLLM as its authors run it (mit-han-lab/streaming-llm, ``StartRecentKVCache``) keeps ``start_size`` sinks
and ``recent_size`` recent tokens, evicts every step, and assigns positions within the cache (its Llama patch
re-rotates the keys at their cache positions each step). This variant keeps the same set but neither shifts positions
(the engine stores post-RoPE keys at their true positions, as every other policy here) nor evicts every step unless
asked (``evict_every=1``; by default every ``window`` steps, so the cache oscillates between ``budget`` and
``budget + window`` like the others). Hence its display name "StreamingLLM-style" (docs/policies.md).

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
    display_name: ClassVar[str] = "StreamingLLM-style"

    def keep(self, inputs: EvictionInputs) -> torch.Tensor:
        """``positions (B, H, N)`` → ``(B, H, n_keep)`` int64: sinks first, then the newest candidates."""
        pos = inputs.positions
        return topk_with_protection(pos.double(), inputs.n_keep, protected=pos < self.sinks)
