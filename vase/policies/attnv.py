"""VaSE-AttnV: protect the large value states, sample the rest by windowed attention (method.md §3).

:class:`WindowedAttentionEviction` is the one implementation of the attention-scored family:

* score: the windowed attention score (:func:`vase.engine.scores.windowed_attention_score`);
* protection: the ``sinks`` plus the candidates with the largest value statistic, ``n_protect`` slots in all;
* the remaining ``n_keep - n_protect`` slots: deterministic top-k of the score, or (``sample``) drawn without
  replacement with probability proportional to it.

Its subclasses only change defaults: :class:`VaSEAttnV` (protection + sampling, 4 sinks), ``baselines.snapkv.SnapKV``
(neither), and the ablations ``snapkv_sample`` / ``snapkv_protect`` are SnapKV configs. ``baselines.rkv.RKV`` swaps
the score.

Order of the returned indices. The engine gathers the kept candidates to the front of the storage in the order
:meth:`~WindowedAttentionEviction.keep` returns them, and the default smoothing pools along that storage axis, as the
authors' code does (it never re-sorts kept tokens by position). We return them in the authors' order: protected
first (sinks, then by decreasing value statistic), then by decreasing score (deterministic) or in draw order
(sampling), so a run reproduces the authors' cache layout. ``smooth_along="position"`` pools along the text instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from vase.engine.policy import EvictionInputs, EvictionPolicy, _check
from vase.engine.scores import (
    SMOOTH_ALONG,
    VALUE_STATS,
    protect_largest,
    sample_without_replacement,
    topk_with_protection,
    value_statistic,
    windowed_attention_score,
)


def resolve_n_protect(n_protect: int | float | None, budget: int) -> int:
    """``None`` → ``budget // 4``; a float in (0, 1) → ``int(n_protect * budget)``; an int → itself."""
    if n_protect is None:
        return budget // 4
    if isinstance(n_protect, float):
        return int(n_protect * budget)
    return n_protect


@dataclass
class WindowedAttentionEviction(EvictionPolicy):
    """Keep candidates by windowed attention, optionally protecting large values and sampling.

    Attributes:
        sinks: the first ``sinks`` tokens (absolute positions) are always kept; they count towards ``n_protect``.
        n_protect: protected slots (sinks + largest-value candidates): an int, a float in (0, 1) (fraction of
            ``budget``) or ``None`` (``budget // 4``). 0 = no value protection. Fewer than ``sinks`` still keeps the
            sinks.
        value_stat: value statistic ranked for protection: ``range`` | ``l2`` | ``absmax`` | ``variance``.
        sample: fill the unprotected slots by sampling without replacement proportional to the score (True) or by
            deterministic top-k (False).
        attn_temperature: ``T_attn`` dividing the attention logits (> 0).
        smooth_kernel: average-pool kernel smoothing the score (odd; 0 or 1 = off).
        smooth_along: ``storage`` (the cache's order, as the authors' code) or ``position`` (the text's order).
    """

    sinks: int = 0
    n_protect: int | float | None = 0
    value_stat: str = "range"
    sample: bool = False
    attn_temperature: float = 1.0
    smooth_kernel: int = 5
    smooth_along: str = "storage"

    name: ClassVar[str] = "windowed_attention"
    needs_queries: ClassVar[bool] = True

    def validate(self) -> None:
        super().validate()
        n = self.n_protect
        ok_type = n is None or (isinstance(n, (int, float)) and not isinstance(n, bool))
        _check(ok_type, "policy.n_protect", f"must be an int, a float in (0, 1) or null, got {n!r}")
        if isinstance(n, float):
            _check(0 < n < 1, "policy.n_protect", f"a float is a fraction of the budget and must be in (0, 1), got {n}")
        elif isinstance(n, int):
            _check(n >= 0, "policy.n_protect", f"must be >= 0, got {n}")
        _check(
            self.protect_count <= self.n_keep,
            "policy.n_protect",
            f"must be <= budget - window = {self.n_keep}, got {self.protect_count}"
            + ("" if isinstance(n, int) else f" (from n_protect={n!r})"),
        )
        _check(
            self.value_stat in VALUE_STATS,
            "policy.value_stat",
            f"must be one of {', '.join(VALUE_STATS)}, got {self.value_stat!r}",
        )
        _check(isinstance(self.sample, bool), "policy.sample", f"must be true or false, got {self.sample!r}")
        _check(
            isinstance(self.attn_temperature, (int, float)) and 1e-6 <= self.attn_temperature < float("inf"),
            "policy.attn_temperature",
            f"must be a finite number >= 1e-6 (a smaller one overflows the float32 attention logits), got "
            f"{self.attn_temperature!r}; e.g. policy.attn_temperature=1.0",
        )
        k = self.smooth_kernel
        _check(
            isinstance(k, int) and not isinstance(k, bool) and (k in (0, 1) or (k > 1 and k % 2 == 1)),
            "policy.smooth_kernel",
            f"must be an odd integer (0 or 1 = no smoothing), got {k!r}",
        )
        _check(
            self.smooth_along in SMOOTH_ALONG,
            "policy.smooth_along",
            f"must be one of {', '.join(SMOOTH_ALONG)}, got {self.smooth_along!r}",
        )

    @property
    def protect_count(self) -> int:
        """Protected slots per (row, KV head): ``n_protect`` resolved, and at least ``sinks``."""
        return max(resolve_n_protect(self.n_protect, self.budget), self.sinks)

    def min_keep(self, prompt_len: int) -> int:
        """With ``keep_prompt``, the protected slots are taken among the generated candidates: room for all of them."""
        return max(super().min_keep(prompt_len), self.protect_count)

    def score(self, inputs: EvictionInputs) -> torch.Tensor:
        """``(B, H, N)`` windowed attention score of the candidates (non-negative), in ``inputs.score_dtype``."""
        if inputs.queries is None:
            raise ValueError(f"policy {self.name}: needs the window queries (needs_queries=True) but got none")
        return windowed_attention_score(
            inputs.queries,
            inputs.keys,
            inputs.scaling,
            temperature=self.attn_temperature,
            smooth_kernel=self.smooth_kernel,
            positions=inputs.positions if self.smooth_along == "position" else None,
            dtype=inputs.score_dtype,
        )

    def keep(self, inputs: EvictionInputs) -> torch.Tensor:
        """``(B, H, n_keep)`` int64: protected candidates, then the best (or sampled) of the rest."""
        sinks = inputs.positions < self.sinks  # (B, H, N)
        n_prot = self.protect_count
        score = self.score(inputs)
        if n_prot == 0:
            protected_idx, protected = None, None
        else:
            stat = value_statistic(inputs.values, self.value_stat, dtype=inputs.score_dtype)
            protected_idx, protected = protect_largest(stat, n_prot, sinks)
        n_rest = inputs.n_keep - n_prot
        if self.sample:
            b, h, n, _ = inputs.shape
            rest = sample_without_replacement(score, n_rest, inputs.rand(h, n), excluded=protected)
        else:
            rest = topk_with_protection(score, n_rest, excluded=protected)
        return rest if protected_idx is None else torch.cat([protected_idx, rest], dim=-1)


@dataclass
class VaSEAttnV(WindowedAttentionEviction):
    """VaSE-AttnV: the 4 sinks and the largest-range values protected (``budget // 4`` slots), the rest sampled.

    The authors' ``range_sink_sample_attn`` mode with ``n_large = budget / 4`` and ``--smooth``.
    """

    sinks: int = 4
    n_protect: int | float | None = None
    sample: bool = True

    name: ClassVar[str] = "vase_attnv"
