"""CurDKV: CUR sketch scores with one fixed Gaussian sketch per sequence and layer (the authors' ``cur_fixed_gauss``).

Same code as VaSE-DKV (:mod:`vase.policies.dkv`) with ``resample_sketch=False``: the only difference between the two is
whether the sketch is redrawn at every eviction.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from vase.policies.dkv import CurSketchEviction


@dataclass
class CurDKV(CurSketchEviction):
    """CurDKV; defaults ``sinks=4``, ``rank=20``, ``resample_sketch=False``."""

    name: ClassVar[str] = "curdkv"
