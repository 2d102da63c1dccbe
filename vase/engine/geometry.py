"""Static shapes of the cache: per-row capacity, bytes per token and per row (no tensors).

``capacity = min(P + max_new_tokens, max(P, budget) + E)`` token slots per (layer, row, KV head) for eviction
policies (``E`` = the policy's eviction period, ``window`` by default; ``max(P, budget + E)`` when the prompt is
compressed at the prefill) and ``P + max_new_tokens`` for the full cache and selection policies, ``P`` being the
longest prompt the cache will hold (method.md §2: nothing grows during decoding).

Layer types (``CacheGeometry.layer_types``, from the config's ``layer_types``): ``full_attention`` layers hold the
eviction cache above (the policy's budget applies to them); ``sliding_attention`` layers a static ring of the
model's window per row (``sliding_window`` slots, never scored or evicted); ``linear_attention`` layers of a hybrid
model (Qwen3.5, Qwen3-Next) a fixed conv and recurrent state per row (``CacheGeometry.linear``, no tokens).
:attr:`CacheGeometry.kv_bytes_by_type` accounts them apart, in a dict keyed by layer type.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from vase.engine.linear_state import LINEAR, LinearShape, text_config
from vase.engine.policy import Policy

#: the layer types the cache knows (transformers' ``config.layer_types`` names)
LAYER_TYPES = ("full_attention", "sliding_attention", LINEAR)


@dataclass
class LayerCounters:
    """Per-layer counters: eviction calls (one per row that evicted), seconds spent in them, tokens held (max row)."""

    evictions: int = 0
    eviction_seconds: float = 0.0
    held: int = 0


@dataclass(frozen=True)
class HeadShard:
    """The KV heads one rank of a tensor-parallel group holds: ``count`` heads from the model's head ``offset``, of
    ``total``; ``group`` is the process group of the ``ranks`` ranks that hold the others (for the one collective an
    eviction event or a sample's statistics need), ``None`` when the heads are not sharded."""

    offset: int
    count: int
    total: int
    ranks: int = 1
    group: object = None

    def __post_init__(self) -> None:
        if not (0 <= self.offset and 0 < self.count and self.offset + self.count <= self.total):
            raise ValueError(f"HeadShard: heads [{self.offset}, {self.offset + self.count}) of {self.total}")


def head_shard(model) -> HeadShard | None:
    """Which KV heads this rank holds when transformers' tensor-parallel plan split the model over the ranks of
    ``model.vase_tensor_mesh`` (:func:`vase.parallel.shard_tensor_parallel`): ``count`` heads from ``count x`` the
    rank's coordinate. ``None`` without tensor parallelism, or when the plan keeps every head on every rank (a
    gathered or replicated ``k_proj``: gpt-oss, OLMo 3)."""
    from transformers.distributed.tensor_parallel import get_kv_heads_per_rank

    mesh = getattr(model, "vase_tensor_mesh", None)
    if mesh is None or mesh.size() == 1:
        return None
    cfg = text_config(model.config)
    total = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    count = get_kv_heads_per_rank(dict(model.tp_plan), total, mesh.size())
    if count == total:  # the plan gathers the projection's output (or keeps it whole): every head on every rank
        return None
    if count is None:
        raise ValueError(
            f"parallel.tensor={mesh.size()}: the model's {total} KV heads do not split evenly over the ranks; use a "
            "parallel.tensor that divides the KV heads"
        )
    return HeadShard(mesh.get_local_rank() * count, count, total, mesh.size(), mesh.get_group())


@dataclass
class CacheGeometry:
    """Static shape of a cache.

    Attributes:
        num_layers, num_kv_heads, num_q_heads, head_dim: from the model config.
        rows: rows (sequences) the storage holds at once.
        capacity: token slots per (layer, row, KV head).
        dtype, device: of the storage.
        prompt_len: the longest prompt the capacity was sized for (informational).
        layer_types: each layer's type (``full_attention`` / ``sliding_attention`` / ``linear_attention``), ``None``:
            all full attention.
        sliding_window: the sliding layers' window (their ring's slots), ``None`` without sliding layers.
        linear: a hybrid model's linear-attention layers (:class:`~vase.engine.linear_state.LinearShape`: a fixed
            state per row, no K and V), ``None`` without any.
        heads: under tensor parallelism (``parallel.tensor``), which slice of the model's KV heads this rank holds
            (:class:`HeadShard`; ``num_kv_heads`` / ``num_q_heads`` are then the local counts); ``None``: all of them.
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
    layer_types: tuple[str, ...] | None = None
    sliding_window: int | None = None
    linear: LinearShape | None = None
    heads: HeadShard | None = None

    def __post_init__(self) -> None:
        types = self.types
        if len(types) != self.num_layers or set(types) - set(LAYER_TYPES):
            raise ValueError(f"CacheGeometry: layer_types {types} for {self.num_layers} layers; known: {LAYER_TYPES}")
        if ("sliding_attention" in types) != (self.sliding_window is not None):
            raise ValueError(f"CacheGeometry: sliding_window={self.sliding_window} with layer_types {set(types)}")
        if self.linear is not None and tuple(self.linear.layer_ids) != tuple(self.layers_of(LINEAR)):
            raise ValueError(f"CacheGeometry: linear layers {self.linear.layer_ids} with layer_types {types}")
        if self.linear is None and LINEAR in types:
            raise ValueError(f"CacheGeometry: layer_types {types} have linear-attention layers but no linear shape")

    def whole(self) -> CacheGeometry:
        """The geometry of the whole model (every KV head), as one process holds it: what a sample's K/V bytes are
        accounted with, whatever the tensor parallelism (a rank's own storage is :attr:`kv_bytes`)."""
        if self.heads is None:
            return self
        group = self.num_q_heads // self.num_kv_heads
        return replace(self, num_kv_heads=self.heads.total, num_q_heads=self.heads.total * group, heads=None)

    @property
    def types(self) -> tuple[str, ...]:
        """Each layer's type (all ``full_attention`` when :attr:`layer_types` is ``None``)."""
        return tuple(self.layer_types) if self.layer_types is not None else ("full_attention",) * self.num_layers

    def layers_of(self, kind: str) -> list[int]:
        """The model's layer indices of type ``kind``, in order."""
        return [i for i, t in enumerate(self.types) if t == kind]

    @property
    def full_layers(self) -> list[int]:
        """The full-attention layers: the ones a policy evicts from (or selects in)."""
        return self.layers_of("full_attention")

    @property
    def bytes_per_token_of_layer(self) -> int:
        """K and V bytes of one token of one layer (all its KV heads)."""
        return 2 * self.num_kv_heads * self.head_dim * torch.empty((), dtype=self.dtype).element_size()

    @property
    def bytes_per_token(self) -> int:
        """K and V bytes of one held token over the full-attention layers (those whose cache the policy sizes)."""
        return len(self.full_layers) * self.bytes_per_token_of_layer

    def slots_of(self, kind: str) -> int:
        """Token slots per row of one layer of type ``kind``: the capacity, the sliding window (its ring), or 0 (a
        linear-attention layer holds no tokens)."""
        if kind == LINEAR:
            return 0
        return self.sliding_window if kind == "sliding_attention" else self.capacity

    @property
    def linear_bytes_per_row(self) -> int:
        """State bytes of one row over the linear-attention layers (0 for a model without any)."""
        return 0 if self.linear is None else self.linear.bytes_per_row(self.dtype)

    @property
    def kv_bytes_by_type(self) -> dict[str, int]:
        """Static cache bytes of one row per layer type: ``{type: layers of it x slots x bytes per token}``; the
        ``linear_attention`` entry is the linear layers' conv and recurrent state (:attr:`linear_bytes_per_row`)."""
        return {
            kind: self.linear_bytes_per_row
            if kind == LINEAR
            else len(self.layers_of(kind)) * self.slots_of(kind) * self.bytes_per_token_of_layer
            for kind in LAYER_TYPES
            if kind in self.types
        }

    def held_bytes_by_type(self, held: float, seq_len: float) -> dict[str, float]:
        """K and V bytes one row holds per layer type when its full-attention layers hold ``held`` tokens of a
        sequence of ``seq_len``: a sliding layer holds ``min(seq_len, window)`` (its ring), a linear-attention layer
        its fixed state whatever the length."""
        per_layer = self.bytes_per_token_of_layer
        out = {}
        for kind in LAYER_TYPES:
            n = len(self.layers_of(kind))
            if n and kind == LINEAR:
                out[kind] = float(self.linear_bytes_per_row)
            elif n:
                tokens = min(seq_len, self.sliding_window) if kind == "sliding_attention" else held
                out[kind] = n * tokens * per_layer
        return out

    @property
    def kv_bytes_per_row(self) -> int:
        """Bytes of K and V storage of one row over every layer type (:attr:`kv_bytes_by_type`)."""
        return sum(self.kv_bytes_by_type.values())

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
    """Bytes of one row's side buffers: positions (int64 per held slot, every layer type) and the query ring of the
    full-attention layers (if the policy needs it)."""
    g = geometry
    itemsize = torch.empty((), dtype=g.dtype).element_size()
    total = sum(len(g.layers_of(k)) * g.slots_of(k) for k in set(g.types)) * g.num_kv_heads * 8
    if policy.needs_queries:
        total += len(g.full_layers) * g.num_q_heads * policy.window * g.head_dim * itemsize
    return total


def span_of(slots: Sequence[int]) -> slice | None:
    """``slice(a, b)`` when ``slots`` is the contiguous run ``a, a+1, ..., b-1``, else ``None``."""
    a = slots[0]
    return slice(a, a + len(slots)) if list(slots) == list(range(a, a + len(slots))) else None


def model_geometry(model, rows: int, capacity: int, prompt_len: int = 0) -> CacheGeometry:
    """The cache geometry of ``model`` for ``rows`` rows of ``capacity`` slots (dtype and device of its weights)."""
    param = next(model.parameters())
    g = config_geometry(model.config, rows, capacity, param.dtype, param.device, prompt_len)
    shard = head_shard(model)
    if shard is None:
        return g
    group = g.num_q_heads // g.num_kv_heads
    return replace(g, num_kv_heads=shard.count, num_q_heads=shard.count * group, heads=shard)


def config_geometry(
    config, rows: int, capacity: int, dtype: torch.dtype, device: torch.device, prompt_len: int = 0
) -> CacheGeometry:
    """The cache geometry of a model from its config alone (no weights: the preflight's memory check sizes a row
    with it; a multimodal checkpoint's language model): every layer with its type (:func:`config_layer_types`), a
    hybrid model's linear-attention layers' state shape in ``linear``."""
    cfg = text_config(config)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    types, window = config_layer_types(cfg)
    return CacheGeometry(
        num_layers=cfg.num_hidden_layers,
        num_kv_heads=getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
        num_q_heads=cfg.num_attention_heads,
        head_dim=head_dim,
        rows=rows,
        capacity=capacity,
        dtype=dtype,
        device=torch.device(device),
        prompt_len=prompt_len,
        layer_types=types,
        sliding_window=window,
        linear=LinearShape.of(cfg),
    )


def config_layer_types(config) -> tuple[tuple[str, ...], int | None]:
    """``(layer types, sliding window)`` of a transformers config: its ``layer_types`` (every layer
    ``full_attention`` when it has none and no window is in force; every layer ``sliding_attention`` when it has a
    window in force but no ``layer_types``, as Mistral and Phi-3 apply it) and the window (``None`` without sliding
    layers). Qwen-style configs switch the window with ``use_sliding_window``."""
    n = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    if not getattr(config, "use_sliding_window", True):
        window = None
    types = tuple(getattr(config, "layer_types", None) or ())
    if not types:
        types = ("sliding_attention" if window is not None else "full_attention",) * n
    if "sliding_attention" not in types:
        window = None
    return types, window


def has_attention_sinks(model) -> bool:
    """Whether the model's attention layers carry learned sink logits (gpt-oss's ``self_attn.sinks``)."""
    return any(name.endswith("self_attn.sinks") for name, _ in model.named_parameters())


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
