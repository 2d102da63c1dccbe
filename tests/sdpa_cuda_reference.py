"""Which kernel CUDA's ``F.scaled_dot_product_attention`` would run a call on: torch's dispatch rules, in Python.

A reference for CPU tests (like ``flash_attn_reference.py`` for flash-attn): it restates the rules of
``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp`` / ``sdp_utils_cpp.h`` and ``attention.cpp`` (read on
pytorch/pytorch main, late 2025) that decide between FlashAttention-2, the memory-efficient (xformers/CUTLASS)
kernel, cuDNN and the math fallback for the calls this engine makes (dense inputs, inference, no dropout), and the
documented limit of torch 2.13 (``F.scaled_dot_product_attention``'s docstring: GQA "works only for Flash_attention
and math kernel on CUDA"; the memory-efficient kernel is taken to need equal head counts, which is conservative).

* flash: no mask; fp16/bf16 on sm80..sm121; equal head dims <= 256; ``is_causal`` only with ``L_q == L_k``; equal
  batch; equal heads, or ``enable_gqa`` with ``Hq % Hk == 0``; last dims contiguous.
* memory-efficient: any 4-D broadcastable mask (bool or the query's dtype; a bool mask is converted with ``where``,
  a mask whose strides are not multiples of 8 is padded: both copies); fp16/bf16/fp32 on sm80+; head dims a multiple
  of 8 (fp16/bf16) or 4 (fp32) on sm80+; q/k/v storage offsets aligned to 16 bytes; equal heads.
* cuDNN: tried first on sm90/sm100 with cuDNN > 9.15 (else after math, i.e. never); fp16/bf16; mask shape
  ``check_attn_mask_shape``; head dim a multiple of 8, <= 128 (256 on sm90/sm100 with a recent cuDNN); ``L_k != 1``;
  GQA allowed.
* math: everything else — K and V cast to fp32 and, with GQA, repeated to every query head.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Gpu:
    """The device the rules are evaluated for."""

    sm: tuple[int, int] = (8, 0)
    cudnn_preferred: bool = False  # sm90/sm100 with cuDNN > 9.15
    cudnn_d256: bool = False


A100 = Gpu((8, 0))
H100 = Gpu((9, 0), cudnn_preferred=True, cudnn_d256=True)
HALF = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class Call:
    """What decides the kernel: the call's tensors (shapes, strides, offsets) and flags, with a dtype override."""

    q: tuple
    k: tuple
    q_strides: tuple
    k_strides: tuple
    v_strides: tuple
    offsets: tuple  # storage offsets of q, k, v (elements)
    mask: tuple | None  # shape
    mask_strides: tuple | None
    mask_dtype: torch.dtype | None
    is_causal: bool
    enable_gqa: bool
    dtype: torch.dtype

    @classmethod
    def of(cls, q, k, v, attn_mask=None, is_causal=False, enable_gqa=False, dtype=None) -> Call:
        m = attn_mask
        return cls(
            tuple(q.shape),
            tuple(k.shape),
            q.stride(),
            k.stride(),
            v.stride(),
            (q.storage_offset(), k.storage_offset(), v.storage_offset()),
            None if m is None else tuple(m.shape),
            None if m is None else m.stride(),
            None if m is None else m.dtype,
            bool(is_causal),
            bool(enable_gqa),
            dtype or q.dtype,
        )

    def with_dtype(self, dtype: torch.dtype) -> Call:
        """The same call in another dtype (a floating mask follows the query's dtype, as the engine builds it)."""
        mask_dtype = self.mask_dtype if self.mask_dtype in (None, torch.bool) else dtype
        return Call(**{**self.__dict__, "dtype": dtype, "mask_dtype": mask_dtype})


def _heads_ok(c: Call, gqa_supported: bool) -> bool:
    hq, hk = c.q[1], c.k[1]
    if c.q[0] != c.k[0]:
        return False
    if hq == hk:
        return True
    return gqa_supported and c.enable_gqa and hq % hk == 0


def _last_stride_one(c: Call) -> bool:
    return c.q_strides[-1] == 1 and c.k_strides[-1] == 1 and c.v_strides[-1] == 1


def can_use_flash(c: Call, gpu: Gpu) -> bool:
    if c.mask is not None or c.dtype not in HALF or gpu.sm < (8, 0):
        return False
    if c.q[-1] != c.k[-1] or c.q[-1] > 256:
        return False
    if c.is_causal and c.q[2] != c.k[2]:
        return False
    return _heads_ok(c, gqa_supported=True) and _last_stride_one(c) and c.q[2] > 0 and c.k[2] > 0


def can_use_efficient(c: Call, gpu: Gpu) -> bool:
    if c.dtype not in (*HALF, torch.float32) or (gpu.sm < (8, 0) and c.dtype == torch.bfloat16):
        return False
    align = 8 if c.dtype in HALF else (4 if gpu.sm >= (8, 0) else 1)
    if c.q[-1] != c.k[-1] or c.q[-1] % align:
        return False
    item = 2 if c.dtype in HALF else 4
    if gpu.sm >= (8, 0) and any((o * item) % (align * item) for o in c.offsets):
        return False
    if c.mask is not None and len(c.mask) not in (2, 4):
        return False
    return _heads_ok(c, gqa_supported=False) and _last_stride_one(c) and c.q[2] > 0 and c.k[2] > 0


def _mask_shape_ok(c: Call) -> bool:
    """``check_attn_mask_shape`` (cuDNN)."""
    if c.mask is None:
        return True
    m = c.mask
    if m[-2] not in (c.q[2], 1) or m[-1] not in (c.k[2], 1):
        return False
    if len(m) == 2:
        return True
    return len(m) == 4 and m[0] in (1, c.q[0]) and m[1] in (1, c.q[1])


def can_use_cudnn(c: Call, gpu: Gpu) -> bool:
    if c.dtype not in HALF or gpu.sm < (8, 0) or not _mask_shape_ok(c):
        return False
    limit = 256 if gpu.cudnn_d256 else 128
    if c.q[-1] % 8 or c.q[-1] > limit or c.k[2] == 1:
        return False
    return _heads_ok(c, gqa_supported=True) and _last_stride_one(c)


def cuda_kernel(c: Call, gpu: Gpu = A100) -> str:
    """``"flash"`` / ``"efficient"`` / ``"cudnn"`` / ``"math"``: what SDPA's default dispatch picks."""
    # torch's default priority: flash, efficient, math, cudnn (math is always possible, so cuDNN is only reached
    # where it is preferred: sm90/sm100 with cuDNN > 9.15 put it first)
    order = ["cudnn", "flash", "efficient"] if gpu.cudnn_preferred else ["flash", "efficient"]
    checks = {"flash": can_use_flash, "efficient": can_use_efficient, "cudnn": can_use_cudnn}
    for name in order:
        if checks[name](c, gpu):
            return name
    return "math"


def mask_copied(c: Call) -> list[str]:
    """The copies torch makes of the mask before the memory-efficient kernel (``[]``: it takes it as it is)."""
    copies = []
    if c.mask is None:
        return copies
    if c.mask_dtype == torch.bool:
        copies.append("bool -> additive (where)")
    elif c.mask_dtype != c.dtype:
        copies.append(f"dtype {c.mask_dtype} != query dtype {c.dtype}")
    if c.mask_strides[-1] != 1 or any(s % 8 for s in c.mask_strides[:-1]):
        copies.append(f"strides {c.mask_strides} not multiples of 8 (pad_bias)")
    return copies
