"""Attention sinks: the correction that turns a sink-free attention output into the output with sinks.

gpt-oss adds one learned logit per query head (``s_aux``) to every softmax's denominator, with no value: the
probabilities of the real keys sum to ``Z / (Z + exp(s))``, ``Z = sum_j exp(l_j)``. The engine runs its fused SDPA
kernel as without sinks and multiplies the output by ``sigmoid(logsumexp(l) - s)`` (exact); only the logsumexp is
computed here, in float32 (float64 for a float64 model: :func:`softmax_dtype`), from ``q @ k^T`` (no softmax, no
``@ V``), with static shapes and no host sync. :mod:`vase.engine.attention` calls it on every SDPA path (decode and
prefill); its eager reference appends the sink logit to the softmax instead.
"""

from __future__ import annotations

import torch

#: the sink correction's logits are computed in chunks of at most this many elements (prefill: queries x keys)
SINK_CHUNK_ELEMENTS = 1 << 24


def softmax_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the reference softmax and of the sink correction for inputs of ``dtype``: float32, or float64
    for a float64 model (whose rounding then stays at float64's, e.g. in the eviction = masking proofs)."""
    return torch.promote_types(dtype, torch.float32)


def _sink_scale(lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """``sigmoid(lse - sink)``: the share of the softmax mass a sink logit leaves to the real keys."""
    return torch.sigmoid(lse - sinks.to(lse.dtype))


def decode_sink_factor(
    query: torch.Tensor, key: torch.Tensor, scaling: float, bias: torch.Tensor | None, sinks: torch.Tensor
) -> torch.Tensor:
    """A decode step's sink correction (see :func:`prefill_sink_factor` for the idea).

    Args:
        query: ``(n, H, G, D)`` (packed as :func:`decode_attention` packs it); key: ``(n, H, L, D)``.
        bias: additive mask broadcastable to ``(n, H, G, L)`` (``-inf`` hides a slot), or ``None``.
        sinks: ``(Hq,)``, query head ``h * G + g``'s sink logit.

    Returns:
        ``(n, H, G, 1)`` in :func:`softmax_dtype` (float32).
    """
    logits = torch.matmul(query, key.transpose(2, 3)).to(softmax_dtype(query.dtype)) * scaling
    if bias is not None:
        logits = logits + bias
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)
    return _sink_scale(lse, sinks.view(1, key.shape[1], -1, 1))


def prefill_sink_factor(
    query: torch.Tensor, key: torch.Tensor, scaling: float, sinks: torch.Tensor, window: int | None = None
) -> torch.Tensor:
    """How much of each query's softmax mass attention sinks leave to the real keys: ``sigmoid(lse - sink)``.

    With a sink logit ``s`` the softmax over the keys becomes ``exp(l_j) / (Z + exp(s))``, ``Z = sum_j exp(l_j)``:
    the sink-free attention output times ``Z / (Z + exp(s)) = sigmoid(logsumexp(l) - s)``. So the engine runs its
    fused SDPA kernel as without sinks and rescales the output by this factor; only the logsumexp is computed here,
    in float32 from ``q @ k^T`` (no softmax, no ``@ V``), in chunks of queries of at most
    :data:`SINK_CHUNK_ELEMENTS` logits (static shapes, no host sync).

    Args:
        query: ``(1, Hq, T, D)`` the prompt's queries (causal: query ``i`` is key ``L - T + i``); key ``(1, H, L, D)``.
        sinks: ``(Hq,)``.
        window: a sliding window (query ``i`` sees keys ``(i - window, i]``), or ``None``.

    Returns:
        ``(1, Hq, T, 1)`` in :func:`softmax_dtype` (float32).
    """
    _, hq, t, d = query.shape
    h, length = key.shape[1], key.shape[2]
    g = hq // h
    q = query.view(1, h, g, t, d)
    k = key.unsqueeze(2)  # (1, H, 1, L, D)
    keys = torch.arange(length, device=query.device)
    step = max(1, SINK_CHUNK_ELEMENTS // max(1, hq * length))
    work = softmax_dtype(query.dtype)
    parts = []
    for a in range(0, t, step):
        rows = torch.arange(a, min(t, a + step), device=query.device)[:, None] + (length - t)  # absolute query index
        hidden = keys[None, :] > rows
        if window is not None:
            hidden |= keys[None, :] <= rows - window
        logits = torch.matmul(q[:, :, :, a : a + step], k.transpose(-1, -2)).to(work) * scaling  # (1, H, G, c, L)
        logits = logits.masked_fill(hidden, float("-inf"))
        parts.append(torch.logsumexp(logits, dim=-1, keepdim=True))
    lse = (parts[0] if len(parts) == 1 else torch.cat(parts, dim=3)).view(1, hq, t, 1)
    return _sink_scale(lse, sinks.view(1, hq, 1, 1))
