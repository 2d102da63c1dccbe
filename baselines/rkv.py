"""R-KV: keep the deterministic top-k of ``λ·attention − (1 − λ)·redundancy``.

``attention`` is the windowed attention score (as SnapKV, smoothed) and ``redundancy`` R-KV's key redundancy
(:func:`~vase.engine.scores.redundancy_score`): the softmax over candidates of each key's mean cosine similarity to
the other
candidate keys. The redundancy is defined by the ``(B, H, N, N)`` pairwise similarity matrix, which is quadratic in
the candidates (R-KV's and the authors' code build it: ``O(N²·D)`` time and ``O(N²)`` memory per eviction). Only its
row means are used, so :func:`redundancy_score` gets the same numbers in ``O(N·D)`` without building it;
the windowed attention score stays ``O(Hq·W·N·D)``.

λ = 0.5 as in the VaSE paper (the R-KV paper used 0.1). Sinks: none by default, as the authors' ``attn_rkv`` mode.

This is **VaSE's version** of R-KV (the authors' ``attn_rkv`` mode in terarachang/VaSE), the one the VaSE paper's
tables report. The original (Zefan-Cai/R-KV) is ``baselines/rkv_original.py`` (``policy=rkv_original``); it differs
in: the attention (max over a group's query heads before the softmax, then a max-pool of kernel 7, where VaSE's
averages the heads' softmaxes and average-pools with kernel 5), the redundancy (over every held key, the recent window
included, with each key's newest similar key (cosine > 0.5) spared, where VaSE's averages over the candidates only),
λ (0.1 in the R-KV paper, 0.07 in its code), its window (8), and its schedule (every 128 steps, and at the prefill,
where VaSE's evicts every ``window`` steps and never at the prefill).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from vase.engine.policy import EvictionInputs, _check
from vase.engine.scores import redundancy_score
from vase.policies.attnv import WindowedAttentionEviction


@dataclass
class RKV(WindowedAttentionEviction):
    """R-KV; fields as :class:`~vase.policies.attnv.WindowedAttentionEviction` plus ``rkv_lambda``.

    Attributes:
        rkv_lambda: weight of the attention score, in [0, 1]; ``1 - rkv_lambda`` weighs the redundancy.

    ``sample`` must stay False: the combined score can be negative, so sampling proportional to it is undefined.
    Value protection (``n_protect``) works as in SnapKV (the authors' ``range_attn_rkv`` ablation).
    """

    rkv_lambda: float = 0.5

    name: ClassVar[str] = "rkv"

    def validate(self) -> None:
        super().validate()
        lam = self.rkv_lambda
        _check(isinstance(lam, (int, float)) and 0 <= lam <= 1, "policy.rkv_lambda", f"must be in [0, 1], got {lam!r}")
        _check(
            not self.sample,
            "policy.sample",
            "must be false for R-KV: its score can be negative, so sampling proportional to it is undefined",
        )

    def score(self, inputs: EvictionInputs) -> torch.Tensor:
        """``(B, H, N)`` ``λ·attn − (1 − λ)·redundancy`` in ``inputs.score_dtype`` (each operation rounds in it)."""
        attn = super().score(inputs)
        return self.rkv_lambda * attn - (1 - self.rkv_lambda) * redundancy_score(inputs.keys, dtype=inputs.score_dtype)
