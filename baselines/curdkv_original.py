"""CurDKV as kvpress implements it (NVIDIA/kvpress ``CURPress``), beside VaSE's version (``baselines/curdkv.py``).

Read from github.com/NVIDIA/kvpress at ``8bb29b9`` (``kvpress/presses/cur_press.py``, added in ``ddcbdc8``; last
changed in ``50c2ae5``). The score (``CURPress.score``, lines 34-67), with its defaults (lines 28-32):

* ``use_random_leverage=False``: **no random projection** (with it, keys and values are multiplied by a fresh
  ``G ∈ R^{D×20}``, entries ``N(0, 1/20)``, at every call: lines 36-40);
* ``k2 = ‖k‖²``, ``v2 = ‖v‖²`` per token (lines 42-43);
* ``use_local_approximation=True``, ``local_window_size=16``: ``k2`` and ``v2`` are each **normalised within
  consecutive blocks of 16 tokens** along the cache axis, the last block zero-padded (lines 45-51);
* ``leverage_type="kv_product"``: ``score = k2·v2`` (line 60), normalised over the tokens (line 64);
* ``num_sinks=4``: the first 4 tokens get score 1.0, above every other (line 65); ``ScorerPress.compress`` keeps the
  top-k by score (``scorer_press.py`` lines 93-100), stored in decreasing score order.

VaSE's CurDKV (``curdkv``) instead projects keys and values with one Gaussian sketch (r = 20) per sequence and layer
and normalises over all candidates at once (no blocks).

How it runs here: kvpress applies the press to the prefill (or, wrapped in its ``DecodingPress``, to the whole cache
every ``compression_interval`` steps). We apply the score in VaSE's eviction scaffold (candidates = all but the recent
window, every ``window`` steps), as the paper does for every baseline, so that only the score differs from
``curdkv``. The blocks of 16 follow the candidates' storage order, as kvpress's follow its cache's order (after a
compression, also the decreasing-score order). The sinks are protected by position (the first ``sinks`` tokens of the
sequence); kvpress protects the first storage slots, which hold the same tokens since the sinks, scored 1.0, are
stored first at every compression.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from vase.engine.original_scores import LEVERAGE_TYPES, kvpress_cur_score
from vase.engine.policy import EvictionInputs, EvictionPolicy, _check
from vase.engine.scores import topk_with_protection

KVPRESS_RANK = 20  # the projection's columns when random_projection is on (cur_press.py line 37)


@dataclass
class CurDKVOriginal(EvictionPolicy):
    """kvpress's CurDKV score in VaSE's scaffold (see the module docstring).

    Attributes:
        sinks: the first ``sinks`` tokens (absolute positions), always kept (4).
        local_window: block length of the local normalisation (16); 0 = normalise over all candidates.
        leverage: ``key`` | ``value`` | ``kv_avg`` | ``kv_product`` (``kv_product``).
        random_projection: project keys and values with a fresh Gaussian ``D × 20`` sketch at every eviction (False),
            drawn per row from the row's generator.
    """

    sinks: int = 4
    local_window: int = 16
    leverage: str = "kv_product"
    random_projection: bool = False

    name: ClassVar[str] = "curdkv_original"

    def validate(self) -> None:
        super().validate()
        w = self.local_window
        _check(
            isinstance(w, int) and not isinstance(w, bool) and w >= 0,
            "policy.local_window",
            f"must be an integer >= 0 (0 = one normalisation over all candidates), got {w!r}",
        )
        _check(
            self.leverage in LEVERAGE_TYPES,
            "policy.leverage",
            f"must be one of {', '.join(LEVERAGE_TYPES)}, got {self.leverage!r}",
        )
        _check(
            isinstance(self.random_projection, bool),
            "policy.random_projection",
            f"must be true or false, got {self.random_projection!r}",
        )

    def score(self, inputs: EvictionInputs) -> torch.Tensor:
        """``(B, H, N)`` float32 leverage score, summing to 1 per (row, head)."""
        sketch = None
        if self.random_projection:
            sketch = inputs.randn(inputs.shape[3], KVPRESS_RANK) / math.sqrt(KVPRESS_RANK)  # (B, D, r)
        return kvpress_cur_score(
            inputs.keys, inputs.values, self.local_window, self.leverage, sketch, dtype=inputs.score_dtype
        )

    def keep(self, inputs: EvictionInputs) -> torch.Tensor:
        """``(B, H, n_keep)`` int64: the sinks, then by decreasing score."""
        return topk_with_protection(self.score(inputs), inputs.n_keep, protected=inputs.positions < self.sinks)
