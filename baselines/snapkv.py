"""SnapKV during decoding: keep the deterministic top-k of the windowed attention score, and its ablations.

The score (method.md §2) is :func:`~vase.engine.scores.windowed_attention_score`:
the last ``window`` queries' softmax over the
candidates, averaged, smoothed by a kernel-5 average pool, averaged over the query heads of the group.

Sinks: none by default, as the authors' ``attn`` mode (and SnapKV itself) protects nothing.

The paper's ablation ladder from SnapKV to VaSE-AttnV, as named variants (same code, other defaults, own names so
runs record which one they were):

* :class:`SnapKVSample` (``snapkv_sample``): sampling, no protection (the authors' ``attn_sample``);
* :class:`SnapKVProtect` (``snapkv_protect``): protection of the ``budget // 4`` largest-range values, deterministic
  (the authors' ``range_attn``; their GSM8K pilot sweeps ``n_protect`` in {16, 32, 64, 256});
* both, plus 4 sinks: :class:`vase.policies.attnv.VaSEAttnV`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from vase.policies.attnv import WindowedAttentionEviction


@dataclass
class SnapKV(WindowedAttentionEviction):
    """Top-k of the windowed attention score; fields as :class:`~vase.policies.attnv.WindowedAttentionEviction`.

    Defaults: ``sinks=0``, ``n_protect=0``, ``sample=False``, ``value_stat="range"``, ``attn_temperature=1.0``,
    ``smooth_kernel=5``, ``smooth_along="storage"``.
    """

    name: ClassVar[str] = "snapkv"


@dataclass
class SnapKVSample(SnapKV):
    """SnapKV + sampling only: every kept candidate drawn without replacement proportional to the score."""

    sample: bool = True

    name: ClassVar[str] = "snapkv_sample"


@dataclass
class SnapKVProtect(SnapKV):
    """SnapKV + value protection only: the ``n_protect`` (default ``budget // 4``) largest values, then top-k."""

    n_protect: int | float | None = None

    name: ClassVar[str] = "snapkv_protect"
