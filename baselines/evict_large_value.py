"""The paper's "catastrophic failure" ablation: keep the smallest-magnitude values, i.e. evict the large ones.

The authors' ``evict_large_range`` mode: deterministic top-k of ``-range(v)``, no sinks (sink tokens have small value
ranges anyway, the "value-state drain"). On GSM8K (Qwen3-4B, B = 512) it drops accuracy to 14.3 (full cache 88.0,
random eviction 53.2).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from vase.engine.policy import EvictionInputs, EvictionPolicy, _check
from vase.engine.scores import VALUE_STATS, topk_with_protection, value_statistic


@dataclass
class EvictLargeValue(EvictionPolicy):
    """Keep the ``n_keep`` candidates with the smallest value statistic (plus the sinks, if any).

    Attributes:
        sinks: the first ``sinks`` tokens (absolute positions), always kept (0 by default, as the authors).
        value_stat: ``range`` | ``l2`` | ``absmax`` | ``variance``.
    """

    sinks: int = 0
    value_stat: str = "range"

    name: ClassVar[str] = "evict_large_value"

    def validate(self) -> None:
        super().validate()
        _check(
            self.value_stat in VALUE_STATS,
            "policy.value_stat",
            f"must be one of {', '.join(VALUE_STATS)}, got {self.value_stat!r}",
        )

    def keep(self, inputs: EvictionInputs) -> torch.Tensor:
        """``(B, H, n_keep)`` int64: the sinks, then by increasing value statistic."""
        stat = value_statistic(inputs.values, self.value_stat, dtype=inputs.score_dtype)
        return topk_with_protection(-stat, inputs.n_keep, protected=inputs.positions < self.sinks)
