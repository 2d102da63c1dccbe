"""VaSE-DKV: CUR sketch scores with the Gaussian sketch redrawn at every eviction (method.md §3).

Score per candidate: ``‖k G‖² · ‖v G‖²`` normalised over the candidates (:func:`vase.engine.scores.cur_score`), with
``G ∈ R^{D×r}``, entries ``N(0, 1) / sqrt(r)``, one sketch per row shared by the layer's KV heads (as the authors'
code). The ``sinks`` are forced to the top; the rest is a deterministic top-k.

* ``resample_sketch=True`` (:class:`VaSEDKV`): a fresh sketch at every eviction; the randomness is the stochasticity
  and ``‖v G‖²`` the value awareness.
* ``resample_sketch=False`` (``baselines.curdkv.CurDKV``): one sketch per sequence and layer, drawn at the first
  eviction and reused (the authors draw it at the prefill; same distribution).

The sketch in use is stored as ``state["sketch"]`` ``(B, D, r)`` (batch-first, so finished rows drop out with the
batch). It is drawn through ``inputs.randn``, so a row's sketch depends only on that row's generator.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from vase.engine.policy import EvictionInputs, EvictionPolicy, _check
from vase.engine.scores import cur_score, topk_with_protection


@dataclass
class CurSketchEviction(EvictionPolicy):
    """Keep the sinks and the top-k CUR sketch scores.

    Attributes:
        sinks: the first ``sinks`` tokens (absolute positions), always kept.
        rank: sketch columns ``r``.
        resample_sketch: redraw the sketch at every eviction (True) or keep one per sequence and layer (False).
    """

    sinks: int = 4
    rank: int = 20
    resample_sketch: bool = False

    name: ClassVar[str] = "cur_sketch"

    def validate(self) -> None:
        super().validate()
        r = self.rank
        _check(
            isinstance(r, int) and not isinstance(r, bool) and r >= 1,
            "policy.rank",
            f"must be an integer >= 1, got {r!r}",
        )
        _check(
            isinstance(self.resample_sketch, bool),
            "policy.resample_sketch",
            f"must be true or false, got {self.resample_sketch!r}",
        )

    def sketch(self, inputs: EvictionInputs) -> torch.Tensor:
        """The ``(B, D, r)`` float32 sketch of this eviction (drawn now, or the stored one); kept in ``state``."""
        b, _, _, d = inputs.shape
        stored = inputs.state.get("sketch")
        if self.resample_sketch or stored is None or stored.shape[0] != b:
            stored = inputs.randn(d, self.rank) / math.sqrt(self.rank)
            inputs.state["sketch"] = stored
        return stored

    def score(self, inputs: EvictionInputs) -> torch.Tensor:
        """``(B, H, N)`` CUR score in ``inputs.score_dtype``, summing to 1 per (row, head)."""
        return cur_score(inputs.keys, inputs.values, self.sketch(inputs), dtype=inputs.score_dtype)

    def keep(self, inputs: EvictionInputs) -> torch.Tensor:
        """``(B, H, n_keep)`` int64: the sinks, then by decreasing CUR score."""
        return topk_with_protection(self.score(inputs), inputs.n_keep, protected=inputs.positions < self.sinks)


@dataclass
class VaSEDKV(CurSketchEviction):
    """VaSE-DKV: CUR scores with a fresh Gaussian sketch at every eviction (the authors' ``cur_resample_gauss``)."""

    resample_sketch: bool = True

    name: ClassVar[str] = "vase_dkv"
