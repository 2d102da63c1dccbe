# baselines/my_policy.py
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from vase.engine.policy import EvictionInputs, EvictionPolicy


@dataclass
class MyPolicy(EvictionPolicy):
    """Keep the candidates whose keys point most like the newest key (cosine), the first ``sinks`` tokens always."""

    name: ClassVar[str] = "my_policy"
    display_name: ClassVar[str] = "MyPolicy"  # how tables and figures name it

    def keep(self, inputs: EvictionInputs) -> torch.Tensor:
        """``(B, H, n_keep)`` int64 indices into the candidate axis, the sinks first."""
        newest = inputs.window_keys[:, :, -1:].float()  # (B, H, 1, D): the newest token's key
        score = F.cosine_similarity(inputs.keys.float(), newest, dim=-1)  # (B, H, N)
        score = score.masked_fill(inputs.positions < self.sinks, float("inf"))
        return score.topk(inputs.n_keep, dim=-1).indices
