"""The attention function the engine registers with transformers (``attn_implementation="vase"``).

Registered through transformers' public extension points: :class:`~transformers.AttentionInterface` for the
attention itself and :class:`~transformers.masking_utils.AttentionMaskInterface` under the same name (the standard
SDPA mask), so a model set to ``"vase"`` still works with an ordinary cache (the call then falls back to SDPA).

With a :class:`~vase.engine.cache.VaseCache` passed as the ``vase_cache`` keyword of the model call, the function

1. records the layer's post-RoPE queries in the cache's ring buffer (only for policies that need them),
2. asks a selection policy for the tokens this step attends to (Quest),
3. runs the main attention without materialising the attention matrix, each row over its own held tokens:

   * SDPA (``enable_gqa``: KV heads never repeated) over the live rows' storage up to the longest row, with a
     ``(rows, 1, 1, L)`` boolean key mask when the rows hold different lengths;
   * FlashAttention-2 (``flash_attn_with_kvcache`` on the preallocated storage with per-row ``cache_seqlens``) when
     ``flash_attn`` is importable on CUDA;
   * ``eager`` (explicit float32 softmax), kept as a reference for tests.

Causality: the prefill (one prompt, batch 1) is causal; a decode step attends to every held token of its row (they
are all in its past).
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

logger = logging.getLogger(__name__)

ATTN_NAME = "vase"
BACKENDS = ("auto", "sdpa", "eager", "flash_attn")


def flash_attn_available() -> bool:
    """Whether the ``flash_attn`` package is importable (it needs CUDA to build)."""
    return importlib.util.find_spec("flash_attn") is not None


def resolve_backend(backend: str, device: torch.device) -> str:
    """Resolve ``"auto"``: FlashAttention-2 on CUDA when ``flash_attn`` is importable, SDPA otherwise."""
    if backend not in BACKENDS:
        raise ValueError(f"generation.attn_backend: unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if backend == "auto":
        return "flash_attn" if device.type == "cuda" and flash_attn_available() else "sdpa"
    if backend == "flash_attn":
        if device.type != "cuda":
            raise ValueError(
                "generation.attn_backend=flash_attn needs a CUDA device; use attn_backend=sdpa (or auto) on CPU"
            )
        if not flash_attn_available():
            raise ValueError(
                "generation.attn_backend=flash_attn: the flash_attn package is not installed (pip install '.[gpu]')"
            )
    return backend


def _repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """``(B, H, L, D)`` → ``(B, H * groups, L, D)`` (each KV head repeated for its query heads)."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def selection_key_mask(selected: torch.Tensor, num_q_heads: int) -> torch.Tensor:
    """A selection policy's mask as the decode step's key mask: ``(n, H, L)`` (per KV head, repeated over the group's
    query heads) or ``(n, Hq, L)`` (per query head) → ``(n, Hq, 1, L)`` bool."""
    if selected.shape[1] != num_q_heads:
        selected = selected.repeat_interleave(num_q_heads // selected.shape[1], dim=1)
    return selected.unsqueeze(2)


def eager_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scaling: float,
    causal: bool,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference attention with an explicit softmax (float32).

    Args:
        query: ``(B, Hq, T, D)``; key, value: ``(B, H, L, D)`` with ``Hq % H == 0``.
        causal: queries are the last ``T`` of the ``L`` keys (bottom-right aligned causal mask).
        mask: optional bool, True = attend, broadcastable to ``(B, Hq, T, L)``.

    Returns:
        ``(B, Hq, T, D)``.
    """
    groups = query.shape[1] // key.shape[1]
    k, v = _repeat_kv(key, groups), _repeat_kv(value, groups)
    logits = torch.matmul(query, k.transpose(2, 3)).float() * scaling
    t, length = query.shape[2], key.shape[2]
    if causal and t > 1:
        allowed = torch.ones(t, length, dtype=torch.bool, device=query.device).tril(length - t)
        logits = logits.masked_fill(~allowed, float("-inf"))
    if mask is not None:
        logits = logits.masked_fill(~mask, float("-inf"))
    probs = logits.softmax(dim=-1).to(value.dtype)
    return torch.matmul(probs, v)


def _sdpa(query, key, value, scaling, causal, mask):
    groups = query.shape[1] // key.shape[1]
    return F.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=mask,
        is_causal=causal and query.shape[2] > 1 and mask is None,
        scale=scaling,
        enable_gqa=groups > 1,
    )


def _flash_prefill(query, key, value, scaling):
    from flash_attn import flash_attn_func  # optional dependency (the [gpu] extra)

    out = flash_attn_func(
        query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), softmax_scale=scaling, causal=True
    )
    return out.transpose(1, 2)


def _flash_decode(query, layer, scaling):
    """``flash_attn_with_kvcache`` over the static storage: row ``r`` attends to its ``cache_seqlens[r]`` tokens."""
    from flash_attn import flash_attn_with_kvcache  # optional dependency (the [gpu] extra)

    owner = layer.owner
    n = owner.n_live
    k_cache = layer.keys[:n].transpose(1, 2)  # (n, capacity, H, D) view: the last dim stays contiguous
    v_cache = layer.values[:n].transpose(1, 2)
    out = flash_attn_with_kvcache(
        query.transpose(1, 2), k_cache, v_cache, cache_seqlens=owner.seqlens_i32(), softmax_scale=scaling, causal=True
    )
    return out.transpose(1, 2)


def vase_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The registered attention function.

    Args:
        query: ``(B, Hq, T, D)`` post-RoPE queries; key, value: what the cache's ``update`` returned,
            ``(B, H, L, D)`` (at a decode step: the live rows' storage up to the longest row).

    Returns:
        ``((B, T, Hq, D), None)`` as transformers expects; attention weights are never materialised.
    """
    cache = kwargs.get("vase_cache")
    if cache is None:  # an ordinary cache (or none): behave exactly like SDPA
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    layer = cache.layers[module.layer_idx]
    scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
    layer.record_queries(query)
    backend = cache.attn_backend
    if cache.prefilling is not None:  # one prompt, batch 1, causal
        if backend == "flash_attn":
            out = _flash_prefill(query, key, value, scaling)
        elif backend == "eager":
            out = eager_attention(query, key, value, scaling, causal=True)
        else:
            out = _sdpa(query, key, value, scaling, True, None)
        return out.transpose(1, 2).contiguous(), None
    # A decode step: a selection policy picks tokens (Quest); otherwise each row attends to all it holds.
    selected = layer.selection_mask(query)  # (n, H, L) or (n, Hq, L) with the length mask applied, or None
    if selected is not None:
        mask = selection_key_mask(selected, query.shape[1])  # (n, Hq, 1, L)
    else:
        mask = cache.length_mask(query.shape[0], key.shape[2])
        if mask is not None:
            mask = mask[:, None, None, :]  # (n, 1, 1, L)
    if backend == "flash_attn" and selected is None:
        out = _flash_decode(query, layer, scaling)
    elif backend == "eager":
        out = eager_attention(query, key, value, scaling, causal=False, mask=mask)
    else:  # sdpa, or flash_attn with a per-head token subset (a boolean mask)
        out = _sdpa(query, key, value, scaling, False, mask)
    return out.transpose(1, 2).contiguous(), None


@contextlib.contextmanager
def vase_attention(model):
    """Temporarily switch ``model`` to the ``"vase"`` attention implementation."""
    previous = model.config._attn_implementation
    model.set_attn_implementation(ATTN_NAME)
    try:
        yield model
    finally:
        model.set_attn_implementation(previous)


def register() -> None:
    """Register the ``"vase"`` attention and its mask function with transformers (idempotent)."""
    AttentionInterface.register(ATTN_NAME, vase_attention_forward)
    AttentionMaskInterface.register(ATTN_NAME, sdpa_mask)


register()
