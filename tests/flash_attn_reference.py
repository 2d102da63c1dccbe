"""A small reference of the ``flash_attn`` 2.x contract, in plain torch, for CPU tests of the FlashAttention-2 path.

It implements ``flash_attn_func`` and ``flash_attn_with_kvcache`` as documented by the flash-attn package
(github.com/Dao-AILab/flash-attention, ``flash_attn_interface.py``) and checks their inputs as strictly as the CUDA
kernels do, so layout and length bugs show up before the code first runs on a GPU:

* every tensor is ``(batch, seqlen, nheads, headdim)`` with a contiguous last dimension (other strides free: a
  transposed view of a ``(batch, nheads, seqlen, headdim)`` buffer is fine);
* ``nheads`` of q is a multiple of ``nheads_k`` (GQA/MQA), head dims match, q/k/v share a dtype and device;
* ``cache_seqlens`` is an int32 tensor ``(batch,)`` (or an int); row ``b`` attends to cache slots
  ``[0, cache_seqlens[b])`` only, and every length fits the cache;
* ``causal`` aligns the mask to the bottom-right (query ``i`` of ``seqlen_q`` sees keys ``<= seqlen_k - seqlen_q + i``).

The real kernels also require fp16/bf16 on CUDA; this reference accepts float32 so CPU tests can be exact.
"""

from __future__ import annotations

import sys
import types

import torch

calls: list[dict] = []  # what the engine passed (tests inspect it)


def install(monkeypatch) -> None:
    """Make ``import flash_attn`` give this reference and let the engine pick FlashAttention-2 on the CPU (for the
    test only: ``monkeypatch`` undoes both)."""
    module = types.ModuleType("flash_attn")
    module.flash_attn_func = flash_attn_func
    module.flash_attn_with_kvcache = flash_attn_with_kvcache
    monkeypatch.setitem(sys.modules, "flash_attn", module)
    monkeypatch.setattr(
        "vase.engine.decode.backend_choice", lambda backend, device, dtype=None, sinks=False: (backend, "test")
    )


def _check_bshd(name: str, x: torch.Tensor) -> None:
    if x.dim() != 4:
        raise ValueError(f"{name} must be (batch, seqlen, nheads, headdim), got shape {tuple(x.shape)}")
    if x.stride(-1) != 1:
        raise ValueError(f"{name} must have contiguous last dimension, got strides {x.stride()}")


def _attend(q, k, v, scale, causal, lengths=None):
    """``q (B, Sq, Hq, D)``, ``k/v (B, Sk, Hk, D)`` → ``(B, Sq, Hq, D)``; row b sees keys ``[0, lengths[b])``."""
    b, sq, hq, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    g = hq // hk
    qf = q.float().permute(0, 2, 1, 3)  # (B, Hq, Sq, D)
    kf = k.float().permute(0, 2, 1, 3).repeat_interleave(g, dim=1)
    vf = v.float().permute(0, 2, 1, 3).repeat_interleave(g, dim=1)
    logits = qf @ kf.transpose(-1, -2) * scale  # (B, Hq, Sq, Sk)
    lengths = torch.full((b,), sk) if lengths is None else lengths.to("cpu").long()
    key_idx = torch.arange(sk)
    allowed = key_idx[None, :] < lengths[:, None]  # (B, Sk)
    allowed = allowed[:, None, None, :].expand(b, 1, sq, sk)
    if causal:
        q_idx = torch.arange(sq)
        limit = lengths[:, None] - sq + q_idx[None, :]  # (B, Sq): last key each query may see
        allowed = allowed & (key_idx[None, None, :] <= limit[:, :, None])[:, None]
    logits = logits.masked_fill(~allowed.to(logits.device), float("-inf"))
    out = logits.softmax(-1) @ vf  # (B, Hq, Sq, D)
    return out.permute(0, 2, 1, 3).to(q.dtype).contiguous()


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, **kwargs):
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_bshd(name, x)
    if dropout_p:
        raise ValueError("dropout is not part of inference")
    if k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q {tuple(q.shape)} / k {tuple(k.shape)} / v {tuple(v.shape)} do not match")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"nheads {q.shape[2]} is not a multiple of nheads_k {k.shape[2]}")
    calls.append({"fn": "flash_attn_func", "q": tuple(q.shape), "k": tuple(k.shape), "causal": causal})
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    return _attend(q, k, v, scale, causal)


def flash_attn_with_kvcache(
    q, k_cache, v_cache, k=None, v=None, cache_seqlens=None, cache_batch_idx=None, softmax_scale=None, causal=False,
    **kwargs,
):  # fmt: skip
    for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        _check_bshd(name, x)
    if k is not None or v is not None:
        raise ValueError("this reference does not append k/v (the engine writes its cache itself)")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} != v_cache {tuple(v_cache.shape)}")
    b, _, hq, d = q.shape
    if cache_batch_idx is None and k_cache.shape[0] != b:
        raise ValueError(f"k_cache batch {k_cache.shape[0]} != q batch {b} (and no cache_batch_idx)")
    if k_cache.shape[-1] != d or hq % k_cache.shape[2]:
        raise ValueError(f"q {tuple(q.shape)} does not fit k_cache {tuple(k_cache.shape)}")
    if q.dtype != k_cache.dtype or q.device != k_cache.device:
        raise ValueError("q and the cache must share dtype and device")
    if isinstance(cache_seqlens, int):
        cache_seqlens = torch.full((b,), cache_seqlens, dtype=torch.int32, device=q.device)
    if cache_seqlens is None:
        cache_seqlens = torch.full((b,), k_cache.shape[1], dtype=torch.int32, device=q.device)
    if cache_seqlens.dtype != torch.int32 or tuple(cache_seqlens.shape) != (b,):
        raise ValueError(
            f"cache_seqlens must be int32 of shape ({b},), got {cache_seqlens.dtype} {tuple(cache_seqlens.shape)}"
        )  # noqa: E501
    if int(cache_seqlens.max()) > k_cache.shape[1] or int(cache_seqlens.min()) < 0:
        raise ValueError(f"cache_seqlens {cache_seqlens.tolist()} outside the cache of {k_cache.shape[1]} slots")
    kc, vc = k_cache, v_cache
    if cache_batch_idx is not None:
        kc, vc = k_cache[cache_batch_idx.long()], v_cache[cache_batch_idx.long()]
    calls.append({"fn": "flash_attn_with_kvcache", "q": tuple(q.shape), "seqlens": cache_seqlens.tolist()})
    scale = d**-0.5 if softmax_scale is None else softmax_scale
    return _attend(q, kc, vc, scale, causal, lengths=cache_seqlens)
