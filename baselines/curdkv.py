"""CurDKV: CUR sketch scores with one fixed Gaussian sketch per sequence and layer (the authors' ``cur_fixed_gauss``).

Same code as VaSE-DKV (:mod:`vase.policies.dkv`) with ``resample_sketch=False``: the only difference between the two is
whether the sketch is redrawn at every eviction.

This is **VaSE's version** of CurDKV (the authors' ``cur_fixed_gauss`` mode in terarachang/VaSE), the one the VaSE
paper's tables report. kvpress's CurDKV (``CURPress``) is ``baselines/curdkv_original.py``
(``policy=curdkv_original``): no random projection (``‖k‖²·‖v‖²`` of the raw vectors), and each factor normalised
within blocks of 16 tokens before the product, where VaSE's projects on a Gaussian sketch (r = 20) and normalises over
all candidates at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from vase.policies.dkv import CurSketchEviction


@dataclass
class CurDKV(CurSketchEviction):
    """CurDKV; defaults ``sinks=4``, ``rank=20``, ``resample_sketch=False``."""

    name: ClassVar[str] = "curdkv"
