"""The attention function the engine registers with transformers (``attn_implementation="vase"``).

Registered through transformers' public extension points: :class:`~transformers.AttentionInterface` for the
attention itself and :class:`~transformers.masking_utils.AttentionMaskInterface` under the same name (the standard
SDPA mask), so a model set to ``"vase"`` still works with an ordinary cache (the call then falls back to SDPA).

With a :class:`~vase.engine.cache.VaseCache` passed as the ``vase_cache`` keyword of the model call, the function

1. records the layer's post-RoPE queries in the cache's ring buffer (only for policies that need them),
2. asks a selection policy for the tokens this step attends to (Quest),
3. runs the main attention without materialising the attention matrix, each row over its own held tokens:

   * SDPA (:func:`decode_attention`): each KV group's query heads packed into the query-length axis, ``(n, H, G, D)``
     queries against the ``(n, H, L, D)`` storage views (``L`` the step's fixed span, see
     :meth:`vase.engine.cache.VaseCache.prepare_step`), with an additive ``(n, 1, 1, L)`` row mask, always (a
     ``(n, H, 1, L)`` / ``(n, H, G, L)`` one with a selection): never
     ``enable_gqa`` together with a mask, so CUDA runs it on a fused kernel (memory-efficient or cuDNN with a mask,
     FlashAttention without) and never on the math kernel (``docs/architecture.md``, "Attention kernels");
   * FlashAttention-2 (``flash_attn_with_kvcache`` on the preallocated storage with per-row ``cache_seqlens``) when
     ``flash_attn.flash_attn_interface`` imports and the model is fp16/bf16 on CUDA, through the custom operator
     ``vase::flash_decode`` (:func:`flash_decode`: a fake implementation for tracing, so the compiled step runs it; a
     CPU kernel that is an exact per-row reference, :func:`flash_decode_reference`);
   * ``eager`` (explicit float32 softmax; float64 for a float64 model), kept as a reference for tests.

Causality: the prefill (one prompt, batch 1) is causal; a decode step attends to every held token of its row (they
are all in its past). A sliding-window layer (``sliding_window=`` from the model) attends over the window: the
prefill with a band mask, a decode step over its ring's valid slots (:mod:`vase.engine.layer`).

Attention sinks (gpt-oss's ``s_aux=``: one learned logit per query head added to every softmax's denominator): the
eager reference appends it to the softmax; SDPA runs its fused kernel unchanged and rescales the output by
``sigmoid(logsumexp - sink)`` (:func:`decode_sink_factor`, :func:`prefill_sink_factor`), exact, with static shapes;
FlashAttention-2 takes no sinks: ``auto`` falls back to SDPA (:func:`backend_choice`), ``flash_attn`` is refused.

Long module: every attention path the engine registers (SDPA, FlashAttention-2, the eager reference; full and
sliding-window layers, sinks) with its masks, and the kernel probe the manifest records, are read together.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import platform

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from vase.engine.evict import seed_prefill
from vase.engine.sinks import decode_sink_factor, prefill_sink_factor, softmax_dtype

logger = logging.getLogger(__name__)

ATTN_NAME = "vase"
BACKENDS = ("auto", "sdpa", "eager", "flash_attn")
FLASH_DTYPES = (torch.float16, torch.bfloat16)
#: strides of an additive mask are multiples of this (elements): CUDA's memory-efficient kernel then takes it as is
#: (torch pads / copies a mask whose strides are not multiples of 8; 16 also covers older releases)
MASK_ALIGN = 16


def flash_attn_import_error() -> str | None:
    """``None`` when ``flash_attn.flash_attn_interface`` imports, else why not (one line).

    A real import, not ``find_spec``: a flash-attn wheel built for another torch is found but fails to import.
    """
    try:
        importlib.import_module("flash_attn.flash_attn_interface")
    except Exception as exc:  # ImportError, OSError (undefined symbol), RuntimeError ...
        return f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
    return None


def flash_attn_available() -> bool:
    """Whether ``flash_attn.flash_attn_interface`` imports (see :func:`flash_attn_import_error`)."""
    return flash_attn_import_error() is None


def backend_choice(
    backend: str, device: torch.device, dtype: torch.dtype | None = None, sinks: bool = False
) -> tuple[str, str]:
    """``(backend, why)``: resolve ``"auto"``; refuse an explicit ``flash_attn`` that cannot run.

    ``auto`` is FlashAttention-2 only on CUDA, with an fp16/bf16 model without attention sinks (``sinks``: the model
    has learned sink logits, gpt-oss) and ``flash_attn.flash_attn_interface`` importable; SDPA otherwise. Raises a
    one-line ``ValueError`` naming ``generation.attn_backend``.
    """
    setting = "generation.attn_backend"
    if backend not in BACKENDS:
        raise ValueError(f"{setting}: unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if backend in ("sdpa", "eager"):
        return backend, "set explicitly"
    half = dtype is None or dtype in FLASH_DTYPES
    if sinks:
        why = NO_FLASH_SINKS
    elif device.type != "cuda":
        why = f"flash_attn needs a CUDA device, the model is on {device}"
    elif not half:
        why = f"flash_attn needs fp16 or bf16, the model is {str(dtype).replace('torch.', '')}"
    else:
        error = flash_attn_import_error()
        why = None if error is None else f"flash_attn.flash_attn_interface does not import ({error})"
    if backend == "auto":
        if why is None:
            return "flash_attn", "auto: flash_attn imports and the model is fp16/bf16 on CUDA"
        return "sdpa", f"auto: {why}"
    if why is not None:  # explicit flash_attn that cannot run
        fix = "use attn_backend=auto" + ("" if half else ", or model.dtype=bfloat16")
        raise ValueError(f"{setting}=flash_attn: {why}; {fix}")
    return "flash_attn", "set explicitly"


def resolve_backend(backend: str, device: torch.device, dtype: torch.dtype | None = None, sinks: bool = False) -> str:
    """The backend a decoder uses (see :func:`backend_choice`); logs one line saying which and why."""
    chosen, why = backend_choice(backend, device, dtype, sinks)
    logger.info("attention backend: %s (%s)", chosen, why)
    return chosen


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
    sinks: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Reference attention with an explicit softmax (float32; float64 for a float64 model: ``softmax_dtype``).

    Args:
        query: ``(B, Hq, T, D)``; key, value: ``(B, H, L, D)`` with ``Hq % H == 0``.
        causal: queries are the last ``T`` of the ``L`` keys (bottom-right aligned causal mask).
        mask: optional bool, True = attend, broadcastable to ``(B, Hq, T, L)``.
        sinks: optional ``(Hq,)`` learned sink logits (gpt-oss): one more logit per head in the softmax's
            denominator, with no value (the probabilities of the real keys sum to less than 1).
        window: with ``causal``, a sliding window: query ``i`` sees keys ``(i - window, i]`` only.

    Returns:
        ``(B, Hq, T, D)``.
    """
    groups = query.shape[1] // key.shape[1]
    k, v = _repeat_kv(key, groups), _repeat_kv(value, groups)
    logits = torch.matmul(query, k.transpose(2, 3)).to(softmax_dtype(query.dtype)) * scaling
    t, length = query.shape[2], key.shape[2]
    if causal and (t > 1 or window is not None):
        allowed = torch.ones(t, length, dtype=torch.bool, device=query.device).tril(length - t)
        if window is not None:
            allowed &= ~torch.ones_like(allowed).tril(length - t - window)
        logits = logits.masked_fill(~allowed, float("-inf"))
    if mask is not None:
        logits = logits.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        sink = sinks.to(logits.dtype).view(1, -1, 1, 1).expand(logits.shape[0], -1, t, 1)
        probs = torch.cat((logits, sink), dim=-1).softmax(dim=-1)[..., :-1].to(value.dtype)
    else:
        probs = logits.softmax(dim=-1).to(value.dtype)
    return torch.matmul(probs, v)


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean key mask as SDPA's fused CUDA kernels take it without a copy: ``0`` / ``-inf`` in ``dtype``.

    Args:
        mask: ``(B, M, L)`` bool, True = attend (``M`` = 1, the KV heads or the query heads).

    Returns:
        ``(B, M, 1, L)`` in ``dtype``, a view of a buffer whose last dimension is padded to :data:`MASK_ALIGN`, so
        every stride but the last (1) is a multiple of it: the memory-efficient kernel needs the query's dtype
        (torch converts a boolean mask with ``where``) and aligned strides (torch pads an unaligned mask), and gets
        both. Built once per decode step for the row-length mask, once per layer for a selection.
    """
    b, m, length = mask.shape
    padded = -(-length // MASK_ALIGN) * MASK_ALIGN
    bias = torch.zeros((b, m, 1, padded), dtype=dtype, device=mask.device)[..., :length]
    return bias.masked_fill_(~mask.unsqueeze(2), float("-inf"))


def decode_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scaling: float,
    bias: torch.Tensor | None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """One decode step's attention with each KV group's query heads packed into the query-length axis.

    ``query (n, Hq, 1, D)`` is viewed as ``(n, H, G, D)`` (query head ``h * G + g`` is row ``g`` of KV head ``h``,
    transformers' GQA layout) and attends to ``key/value (n, H, L, D)``: a plain multi-head call with ``G`` queries,
    no ``enable_gqa`` and no repeated K/V, which every fused SDPA kernel accepts, mask or not.

    Args:
        bias: additive mask (:func:`additive_mask`), broadcastable to ``(n, H, G, L)``: ``(n, 1, 1, L)`` (rows of
            different lengths), ``(n, H, 1, L)`` (a selection per KV head, broadcast over its query heads) or
            ``(n, H, G, L)`` (a selection per query head); ``None`` when every row attends to all ``L`` slots.
        sinks: ``(Hq,)`` attention-sink logits (gpt-oss), or ``None``: the fused kernel's output is rescaled by
            :func:`decode_sink_factor`.

    Returns:
        ``(n, Hq, 1, D)``.
    """
    n, hq, t, d = query.shape
    h = key.shape[1]
    if t != 1 or hq % h:
        raise ValueError(f"decode_attention: one query per row and Hq % H == 0 expected, got {tuple(query.shape)}")
    q = query.reshape(n, h, hq // h, d)
    out = F.scaled_dot_product_attention(q, key, value, attn_mask=bias, scale=scaling)
    if sinks is not None:
        factor = decode_sink_factor(q, key, scaling, bias, sinks)
        out = (out.to(factor.dtype) * factor).to(out.dtype)
    return out.view(n, hq, 1, d)


def _prefill_gqa_native(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether SDPA's own GQA (``enable_gqa=True``, no mask) runs fused for this causal prefill.

    On CPU the flash kernel (``_scaled_dot_product_flash_attention_for_cpu``) takes GQA itself; on CUDA torch
    documents GQA for its flash kernel only, so ask torch's own dispatch rule (fp16/bf16, sm80+); elsewhere the
    prefill repeats K/V over the group (batch 1: a copy the size of the query) and any fused kernel runs it.
    """
    if query.device.type != "cuda":
        return True
    try:
        from torch.backends.cuda import SDPAParams, can_use_flash_attention

        return bool(can_use_flash_attention(SDPAParams(query, key, value, None, 0.0, True, True)))
    except (RuntimeError, TypeError):  # a build without the CUDA kernels, or another SDPAParams signature
        return False


def prefill_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scaling: float,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of one prompt: ``query (1, Hq, P, D)``, ``key/value (1, H, P, D)`` → ``(1, Hq, P, D)``.

    ``window``: a sliding-window layer's window (query ``i`` sees keys ``(i - window, i]``; a boolean band mask and
    K/V repeated over the group, batch 1); ``sinks``: ``(Hq,)`` attention-sink logits (the output rescaled by
    :func:`prefill_sink_factor`).
    """
    groups = query.shape[1] // key.shape[1]
    t = query.shape[2]
    if window is not None and window < key.shape[2]:
        q_abs = torch.arange(key.shape[2] - t, key.shape[2], device=query.device)[:, None]
        k_idx = torch.arange(key.shape[2], device=query.device)[None, :]
        band = (k_idx <= q_abs) & (k_idx > q_abs - window)  # (P, L)
        k, v = _repeat_kv(key, groups), _repeat_kv(value, groups)
        out = F.scaled_dot_product_attention(query, k, v, attn_mask=band, scale=scaling)
    else:
        k, v = key, value
        if groups > 1 and not _prefill_gqa_native(query, key, value):
            k, v = _repeat_kv(key, groups), _repeat_kv(value, groups)
        out = F.scaled_dot_product_attention(
            query, k, v, is_causal=t > 1, scale=scaling, enable_gqa=k.shape[1] != query.shape[1]
        )
    if sinks is not None:
        factor = prefill_sink_factor(query, key, scaling, sinks, window)
        out = (out.to(factor.dtype) * factor).to(out.dtype)
    return out


def sdpa_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scaling: float,
    causal: bool,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """SDPA the engine's way, for any call: ``query (B, Hq, T, D)``, ``key/value (B, H, L, D)`` → ``(B, Hq, T, D)``.

    ``mask``: bool (True = attend) or additive, broadcastable to ``(B, Hq, T, L)``. A single query per row
    (``T == 1``, not causal) goes to :func:`decode_attention` (a ``(B, Hq, 1, L)`` mask is viewed per group); a
    causal call without a mask to :func:`prefill_attention`; anything else repeats K/V over the group. No call
    passes a mask together with ``enable_gqa``.
    """
    b, hq, t, d = query.shape
    h = key.shape[1]
    if mask is not None and mask.dtype == torch.bool:
        mask = torch.where(mask, 0.0, float("-inf")).to(query.dtype)
    if t == 1 and not causal:
        if mask is not None:
            mask = mask.expand(mask.shape[0], mask.shape[1], 1, mask.shape[-1])
            if mask.shape[1] == hq and hq != h:
                mask = mask.reshape(mask.shape[0], h, hq // h, mask.shape[-1])
        return decode_attention(query, key, value, scaling, mask)
    if mask is None and causal:
        return prefill_attention(query, key, value, scaling)
    k, v = _repeat_kv(key, hq // h), _repeat_kv(value, hq // h)
    return F.scaled_dot_product_attention(query, k, v, attn_mask=mask, is_causal=causal and mask is None, scale=scaling)


_sdpa = sdpa_attention  # the name vase/bench/attention_check.py uses


def _flash_prefill(query, key, value, scaling, window=None):
    from flash_attn import flash_attn_func  # optional dependency (the [gpu] extra)

    out = flash_attn_func(
        query.transpose(1, 2),
        key.transpose(1, 2),
        value.transpose(1, 2),
        softmax_scale=scaling,
        causal=True,
        window_size=(-1, -1) if window is None else (window - 1, 0),  # keys (i - window, i]
    )
    return out.transpose(1, 2)


def flash_decode_reference(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cache_seqlens: torch.Tensor, scale: float
) -> torch.Tensor:
    """``flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=..., softmax_scale=scale, causal=True)`` for one
    query per row, exactly and in plain torch: the CPU kernel of :func:`flash_decode`.

    Args:
        q: ``(b, 1, Hq, D)``; k_cache, v_cache: ``(b, S, H, D)`` (flash-attn's layout; any strides but the last);
        cache_seqlens: ``(b,)`` int32, row ``r`` attends to slots ``[0, cache_seqlens[r])``, ``1 <= len <= S``.

    Returns:
        ``(b, 1, Hq, D)`` contiguous. Row ``r`` reads only its first ``cache_seqlens[r]`` slots (sliced per row on
        the host: what the slots beyond hold, NaN included, never reaches the output), softmax in float32
        (:func:`eager_attention`).
    """
    b, t, hq, d = q.shape
    if t != 1 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.shape[0] != b:
        raise ValueError(f"flash_decode: q {tuple(q.shape)}, k/v {tuple(k_cache.shape)}: one query per row expected")
    if cache_seqlens.dtype != torch.int32 or tuple(cache_seqlens.shape) != (b,):
        raise ValueError(f"flash_decode: cache_seqlens must be int32 ({b},), got {cache_seqlens.dtype}")
    lengths = cache_seqlens.tolist()
    if min(lengths) < 1 or max(lengths) > k_cache.shape[1]:
        raise ValueError(f"flash_decode: cache_seqlens {lengths} outside [1, {k_cache.shape[1]}]")
    out = q.new_empty(q.shape)
    for r, length in enumerate(lengths):
        k = k_cache[r : r + 1, :length].transpose(1, 2)  # (1, H, length, D)
        v = v_cache[r : r + 1, :length].transpose(1, 2)
        out[r : r + 1] = eager_attention(q[r : r + 1].transpose(1, 2), k, v, scale, causal=True).transpose(1, 2)
    return out


@torch.library.custom_op("vase::flash_decode", mutates_args=())
def flash_decode(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cache_seqlens: torch.Tensor, scale: float
) -> torch.Tensor:
    """One decode step's FlashAttention-2 as an operator dynamo traces (``torch.compile(fullgraph=True)`` keeps it in
    the graph; inductor calls it as an extern kernel, CUDA-graph capturable: ``cache_seqlens`` is a device tensor).

    Shapes as :func:`flash_decode_reference` (its CPU kernel); the CUDA kernel is flash-attn's
    ``flash_attn_with_kvcache`` (causal, one query per row: every slot below ``cache_seqlens[r]``).
    """
    return flash_decode_reference(q, k_cache, v_cache, cache_seqlens, scale)


@flash_decode.register_kernel("cuda")
def _flash_decode_cuda(q, k_cache, v_cache, cache_seqlens, scale):
    from flash_attn import flash_attn_with_kvcache  # optional dependency (the [gpu] extra)

    return flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=cache_seqlens, softmax_scale=scale, causal=True)


@flash_decode.register_fake
def _flash_decode_fake(q, k_cache, v_cache, cache_seqlens, scale):
    return q.new_empty(q.shape)  # contiguous, as flash-attn returns it


def _flash_decode(query, layer, scaling):
    """:func:`flash_decode` over the static storage: row ``r`` attends to its ``cache_seqlens[r]`` tokens."""
    n = layer.owner.step_rows
    k_cache = layer.keys[:n].transpose(1, 2)  # (n, capacity, H, D) view: the last dim stays contiguous
    v_cache = layer.values[:n].transpose(1, 2)
    # a sliding layer's ring holds its valid slots first (slot s is written once the row reaches position s), and a
    # single query attends to every valid slot: the ring's order does not matter
    out = torch.ops.vase.flash_decode(query.transpose(1, 2), k_cache, v_cache, layer.seqlens_i32(), scaling)
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
            ``(B, H, L, D)`` (at a decode step: the rows' storage over the step's fixed span ``cache.step_length``).

    Returns:
        ``((B, T, Hq, D), None)`` as transformers expects; attention weights are never materialised.
    """
    on_query = kwargs.get("vase_on_query")
    if on_query is not None:  # a reader of the post-RoPE queries (e.g. a policy's calibration pass)
        on_query(module.layer_idx, query)
    cache = kwargs.get("vase_cache")
    if cache is None:  # an ordinary cache (or none): behave exactly like SDPA (with sinks: the eager reference)
        sinks = _sinks_of(kwargs)
        if sinks is None:
            return sdpa_attention_forward(
                module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
            )
        scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
        if attention_mask is None:  # transformers skipped the mask: plain causal (the window, if any, applied here)
            out = eager_attention(
                query, key, value, scaling, causal=True, sinks=sinks, window=kwargs.get("sliding_window")
            )
        else:
            mask = attention_mask if attention_mask.dtype == torch.bool else attention_mask > float("-inf")
            out = eager_attention(query, key, value, scaling, causal=False, mask=mask, sinks=sinks)
        return out.transpose(1, 2).contiguous(), None
    layer = cache.layers[module.layer_idx]
    window, sinks = kwargs.get("sliding_window"), _sinks_of(kwargs)
    if window != layer.window:  # the cache's layer types come from the config (vase.models.layer_types)
        raise ValueError(
            f"model: layer {module.layer_idx} passes sliding_window={window} to the attention, the cache built it as "
            f"{layer.kind} (window {layer.window}): the config's layer_types and the model disagree"
        )
    scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
    layer.record_queries(query)
    policy = cache.policy
    if cache.prefilling is not None and not layer.is_sliding and policy.kind == "eviction" and policy.accumulates:
        seed_prefill(cache, layer, query, key, scaling)  # H2O counts every prompt query (vase.engine.evict)
    backend = cache.attn_backend
    if sinks is not None and backend == "flash_attn":  # backend_choice refuses it first; this guards a bypass
        raise ValueError(f"generation.attn_backend=flash_attn: {NO_FLASH_SINKS}; use attn_backend=auto or sdpa")
    if cache.prefilling is not None:  # one prompt, batch 1, causal
        if backend == "flash_attn":
            out = _flash_prefill(query, key, value, scaling, window)
        elif backend == "eager":
            out = eager_attention(query, key, value, scaling, causal=True, sinks=sinks, window=window)
        else:
            out = prefill_attention(query, key, value, scaling, window, sinks)
        return out.transpose(1, 2).contiguous(), None
    # A decode step: a selection policy picks tokens (Quest) on full-attention layers; otherwise each row attends to
    # all it holds (a sliding layer: its ring's valid slots).
    selected = layer.selection_mask(query)  # (n, H or Hq, L) with the length mask applied, or None
    if backend == "flash_attn" and selected is None:
        out = _flash_decode(query, layer, scaling)
    elif backend == "eager":
        mask = _eager_mask(layer, query, key, selected)
        out = eager_attention(query, key, value, scaling, causal=False, mask=mask, sinks=sinks)
    else:  # sdpa, or flash_attn with a token subset (FlashAttention takes no mask)
        if selected is None:
            bias = layer.key_bias(query.shape[0], key.shape[2], query.dtype)
        else:
            bias = _group_view(additive_mask(selected, query.dtype), key.shape[1])
        out = decode_attention(query, key, value, scaling, bias, sinks)
    return out.transpose(1, 2).contiguous(), None


#: why FlashAttention-2 cannot run a model with attention sinks
NO_FLASH_SINKS = "flash_attn_with_kvcache takes no attention-sink logits (the model's learned per-head sinks)"


def _sinks_of(kwargs: dict) -> torch.Tensor | None:
    """The attention-sink logits a model passes (gpt-oss: ``s_aux=``; some ports: ``sinks=``), ``(Hq,)`` or ``None``."""
    sinks = kwargs.get("s_aux")
    return kwargs.get("sinks") if sinks is None else sinks


def _group_view(bias: torch.Tensor, heads: int) -> torch.Tensor:
    """``(n, M, 1, L)`` → broadcastable to ``(n, H, G, L)``: a per-query-head mask ``M = Hq`` is viewed per group."""
    n, m, _, length = bias.shape
    return bias if m in (1, heads) else bias.view(n, heads, m // heads, length)


def _eager_mask(layer, query: torch.Tensor, key: torch.Tensor, selected: torch.Tensor | None) -> torch.Tensor | None:
    """The eager reference's bool mask, broadcastable to ``(n, Hq, 1, L)``."""
    if selected is None:
        return layer.key_mask(query.shape[0], key.shape[2])[:, None, None, :]
    groups = query.shape[1] // selected.shape[1]
    return _repeat_kv(selected, groups).unsqueeze(2)


#: SDPA's kernels, by the aten op a ``scaled_dot_product_attention`` call lowers to (none of them: the math kernel)
SDPA_KERNELS = (
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_fused_attention_overrideable",
)


def decompose_composite(mode: TorchDispatchMode, func, args: tuple, kwargs: dict):
    """Run a composite op (one with a ``CompositeImplicitAutograd`` kernel) as its decomposition under ``mode``, so
    that the mode sees the ops that really run; ``NotImplemented`` for any other op (the caller runs ``func``)."""
    if torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), torch._C.DispatchKey.CompositeImplicitAutograd):
        with mode:
            return func.decompose(*args, **kwargs)
    return NotImplemented


class _OpNames(TorchDispatchMode):
    """Records the name of every aten op that runs (``func.overloadpacket.__name__``).

    Composite ops are decomposed under the mode, so what is recorded is what runs even under ``inference_mode``
    (which otherwise hands the mode ``scaled_dot_product_attention`` itself, not the kernel it picks).
    """

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = decompose_composite(self, func, args, kwargs)
        if out is not NotImplemented:
            return out
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **kwargs)


def sdpa_kernel_of(fn) -> str:
    """The SDPA kernel that ``fn()`` runs: ``"aten.<op>"`` of :data:`SDPA_KERNELS`, or ``"math"`` (none of them)."""
    with _OpNames() as rec:
        fn()
    fused = [op for op in rec.ops if op in SDPA_KERNELS]
    return f"aten.{fused[0]}" if fused else "math"


def probe_kernels(
    num_q_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device, length: int = 80
) -> dict[str, str]:
    """The kernel each SDPA call of the engine lowers to on ``device`` for this head geometry and dtype.

    Runs one representative call of each kind on small tensors laid out as the static storage (views of a longer
    buffer): a decode step of two rows holding different lengths (the additive row mask), a decode step of rows in
    step (no mask), a decode step with a per-KV-head selection mask, and a causal prefill. Constant inputs: the
    global RNG is not touched.
    """
    h, hq, d, n = num_kv_heads, num_q_heads, head_dim, 2
    store = torch.full((n, h, 2 * length, d), 0.01, dtype=dtype, device=device)
    k = v = store[:, :, :length]
    q = torch.full((n, hq, 1, d), 0.01, dtype=dtype, device=device)
    held = torch.arange(length, device=device)[None, :] < torch.tensor([length, length // 2], device=device)[:, None]
    rows = additive_mask(held[:, None, :], dtype)
    selection = additive_mask(
        held[:, None, :].expand(n, h, length) & (torch.arange(length, device=device) % 3 > 0), dtype
    )
    qp = torch.full((1, hq, length, d), 0.01, dtype=dtype, device=device)
    scale = d**-0.5
    return {
        "decode_rows_of_different_lengths": sdpa_kernel_of(lambda: decode_attention(q, k, v, scale, rows)),
        "decode_rows_in_step": sdpa_kernel_of(lambda: decode_attention(q, k, v, scale, None)),
        "decode_selection": sdpa_kernel_of(lambda: decode_attention(q, k, v, scale, selection)),
        "prefill": sdpa_kernel_of(lambda: prefill_attention(qp, k[:1], v[:1], scale)),
    }


def attention_report(backend: str, why: str, geometry, device: torch.device) -> dict:
    """What a decoder's attention runs on (the run's manifest): the backend and why, the aten SDPA kernel each kind of
    call lowers to on ``device`` for the model's heads and dtype (:func:`probe_kernels`), the name of the device in
    use, and the CUDA and cuDNN versions. ``geometry``: a :class:`vase.engine.geometry.CacheGeometry`."""
    g = geometry
    cuda = device.type == "cuda"
    return {
        "backend": backend,
        "backend_choice": why,
        "sdpa_kernels": probe_kernels(g.num_q_heads, g.num_kv_heads, g.head_dim, g.dtype, device),
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if cuda else platform.processor() or "cpu",
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
    }


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
