"""Static shapes of the cache: per-row capacity, bytes per token and per row (no tensors).

``capacity = min(P + max_new_tokens, max(P, budget) + E)`` token slots per (layer, row, KV head) for eviction
policies (``E`` = the policy's eviction period, ``window`` by default; ``max(P, budget + E)`` when the prompt is
compressed at the prefill) and ``P + max_new_tokens`` for the full cache and selection policies, ``P`` being the
longest prompt the cache will hold (method.md §2: nothing grows during decoding).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from vase.engine.linear_state import LinearShape, attention_layer_ids, text_config
from vase.engine.policy import Policy


@dataclass
class LayerCounters:
    """Per-layer counters: eviction calls (one per row that evicted), seconds spent in them, tokens held (max row)."""

    evictions: int = 0
    eviction_seconds: float = 0.0
    held: int = 0


@dataclass
class CacheGeometry:
    """Static shape of a cache.

    Attributes:
        num_layers, num_kv_heads, num_q_heads, head_dim: from the model config.
        rows: rows (sequences) the storage holds at once.
        capacity: token slots per (layer, row, KV head).
        dtype, device: of the storage.
        prompt_len: the longest prompt the capacity was sized for (informational).
        linear: a hybrid model's linear-attention layers (:class:`~vase.engine.linear_state.LinearShape`: a fixed
            state per row, no KV), else ``None``; ``num_layers`` then counts the KV (full-attention) layers only.
        layer_types: each model layer's type (``config.layer_types``), with ``linear``.
    """

    num_layers: int
    num_kv_heads: int
    num_q_heads: int
    head_dim: int
    rows: int
    capacity: int
    dtype: torch.dtype
    device: torch.device
    prompt_len: int = 0
    linear: LinearShape | None = None
    layer_types: tuple[str, ...] | None = None

    @property
    def linear_bytes_per_row(self) -> int:
        """State bytes of one row over the linear-attention layers (0 for a model without any)."""
        return 0 if self.linear is None else self.linear.bytes_per_row(self.dtype)

    @property
    def bytes_per_token(self) -> int:
        """K and V bytes of one token over all layers and KV heads."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize

    @property
    def kv_bytes_per_row(self) -> int:
        """Bytes of K and V storage of one row: ``2 * layers * H * capacity * D * itemsize``."""
        return self.bytes_per_token * self.capacity

    @property
    def kv_bytes(self) -> int:
        """Bytes of K and V storage over all layers and rows."""
        return self.rows * self.kv_bytes_per_row


def cache_capacity(policy: Policy, prompt_len: int, max_new_tokens: int) -> int:
    """Token slots per (layer, row, KV head) that a sequence of ``prompt_len + max_new_tokens`` can ever need.

    Eviction: a row evicts, at the latest, ``E`` steps after it first holds more than ``budget`` (its sequence length
    passes a multiple of ``E``), so it never holds more than ``max(P, budget) + E`` after a step's append; with
    ``compress_prefill`` it starts from ``min(P, budget)``, and the prompt itself needs ``P`` slots at the prefill.
    """
    full = prompt_len + max_new_tokens
    if policy.kind != "eviction":
        return full
    every = policy.eviction_period
    if policy.compress_prefill:
        return min(full, max(prompt_len, policy.budget + every))
    return min(full, max(prompt_len, policy.budget) + every)


def aux_bytes_per_row(geometry: CacheGeometry, policy: Policy) -> int:
    """Bytes of one row's side buffers: positions (int64 per held slot) and the query ring (if the policy needs it)."""
    g = geometry
    itemsize = torch.empty((), dtype=g.dtype).element_size()
    total = g.num_layers * g.num_kv_heads * g.capacity * 8
    if policy.needs_queries:
        total += g.num_layers * g.num_q_heads * policy.window * g.head_dim * itemsize
    return total


def span_of(slots: Sequence[int]) -> slice | None:
    """``slice(a, b)`` when ``slots`` is the contiguous run ``a, a+1, ..., b-1``, else ``None``."""
    a = slots[0]
    return slice(a, a + len(slots)) if list(slots) == list(range(a, a + len(slots))) else None


def model_geometry(model, rows: int, capacity: int, prompt_len: int = 0) -> CacheGeometry:
    """The cache geometry of ``model`` for ``rows`` rows of ``capacity`` slots (dtype and device of its weights)."""
    param = next(model.parameters())
    return config_geometry(model.config, rows, capacity, param.dtype, param.device, prompt_len)


def config_geometry(
    config, rows: int, capacity: int, dtype: torch.dtype, device: torch.device, prompt_len: int = 0
) -> CacheGeometry:
    """The cache geometry of a model from its config alone (no weights; a multimodal checkpoint's language model): a
    hybrid model's KV layers are its full-attention ones, its linear-attention layers are ``linear``."""
    cfg = text_config(config)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    linear = LinearShape.of(cfg)
    return CacheGeometry(
        num_layers=len(attention_layer_ids(cfg)),
        num_kv_heads=getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
        num_q_heads=cfg.num_attention_heads,
        head_dim=head_dim,
        rows=rows,
        capacity=capacity,
        dtype=dtype,
        device=torch.device(device),
        prompt_len=prompt_len,
        linear=linear,
        layer_types=None if linear is None else tuple(cfg.layer_types),
    )


def partial_rope(config) -> str | None:
    """Why RoPE does not rotate the whole head dim of every layer (``None`` when it does): NoPE layers (SmolLM3's
    ``no_rope_layers``) or a ``partial_rotary_factor`` below 1 (Phi-4-mini). For the policies that undo or model RoPE
    over the full head dim (TriAttention, SeerAttention-R), which refuse such a model for now."""
    nope = [i for i, rope in enumerate(getattr(config, "no_rope_layers", None) or ()) if not rope]
    if nope:
        return f"NoPE layers (no rotary embedding): {', '.join(map(str, nope))}"
    rope = getattr(config, "rope_parameters", None) or {}
    factor = rope.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
    if factor is not None and float(factor) < 1.0:
        return f"RoPE rotates {factor:g} of the head dim (partial_rotary_factor)"
    return None
