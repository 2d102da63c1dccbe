"""The static-budget KV cache: the only code in the project that touches transformers' cache internals.

One :class:`VaseCache` serves a whole decode (many problems, continuous batching). Per layer it preallocates, once,
K and V storage of shape ``(rows, num_key_value_heads, capacity, head_dim)`` (never repeated per query head), zero
filled, with

* ``capacity = min(P + max_new_tokens, max(P, budget) + window)`` for eviction policies,
* ``capacity = P + max_new_tokens`` for the full cache and selection policies,

where ``P`` is the longest prompt the cache will hold (:func:`cache_capacity`). Beside it: the absolute position of
every held token ``(rows, H, capacity)`` and, only for policies that declare ``needs_queries``, a ring buffer of the
last ``window`` post-RoPE queries of every row ``(rows, Hq, window, head_dim)`` (a query of position ``p`` sits in
slot ``p % window``).

Rows. Row ``r`` is a slot of the storage; rows ``[0, n_live)`` are live and decode together (the decode loop keeps
them contiguous: a finished row's slot is given to the next pending sample, or the last live row moves into it). Each
row has its own held length, next absolute position, eviction generator and policy state; its length is known on the
host (so deciding to evict never synchronises with the device) and mirrored in a device tensor (for attention masks
and FlashAttention's ``cache_seqlens``). A prompt is prefilled once (batch 1) into the rows of its samples.

The eviction scaffold (``../shared/docs/method.md`` §2), per row: after a decode step, when a row holds more than
``budget`` tokens and its count is a multiple of ``window``, its candidates are all held tokens but the ``window`` most
recent; the policy picks ``budget - window`` of them per KV head; the engine gathers them to the front of the row's
storage and moves the recent window behind them, in place. Rows that evict at the same step with the same held length
(and the same kind of policy state) are handed to the policy in one call.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from vase.engine.policy import EvictionInputs, Policy, SelectionInputs

logger = logging.getLogger(__name__)


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
    """Token slots per (layer, row, KV head) that a sequence of ``prompt_len + max_new_tokens`` can ever need."""
    full = prompt_len + max_new_tokens
    if policy.kind != "eviction":
        return full
    return min(full, max(prompt_len, policy.budget) + policy.window)


def aux_bytes_per_row(geometry: CacheGeometry, policy: Policy) -> int:
    """Bytes of one row's side buffers: positions (int64 per held slot) and the query ring (if the policy needs it)."""
    g = geometry
    itemsize = torch.empty((), dtype=g.dtype).element_size()
    total = g.num_layers * g.num_kv_heads * g.capacity * 8
    if policy.needs_queries:
        total += g.num_layers * g.num_q_heads * policy.window * g.head_dim * itemsize
    return total


def _span(slots: Sequence[int]) -> slice | None:
    """``slice(a, b)`` when ``slots`` is the contiguous run ``a, a+1, ..., b-1``, else ``None``."""
    a = slots[0]
    return slice(a, a + len(slots)) if list(slots) == list(range(a, a + len(slots))) else None


class VaseLayer(CacheLayerMixin):
    """One layer of the static cache (see the module docstring).

    Storage (allocated at the first :meth:`update`, i.e. the first prefill):
        keys, values: ``(rows, H, capacity, D)``; row ``r`` holds its tokens in slots ``[0, owner.lengths[r])``.
        positions: ``(rows, H, capacity)`` int64 absolute positions of the held tokens.
        queries: ``(rows, Hq, window, D)`` ring buffer of post-RoPE queries, or ``None``.
        store: the policy's state, ``{key: (rows, ...) tensor}``; ``state_keys[r]`` are the keys row ``r`` has.
    """

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, layer_idx: int, owner: VaseCache):
        super().__init__()
        self.layer_idx = layer_idx
        self.owner = owner
        self.positions: torch.Tensor | None = None
        self.queries: torch.Tensor | None = None
        self.store: dict[str, torch.Tensor] = {}
        self.state_keys: list[frozenset] = [frozenset()] * owner.geometry.rows
        self.counters = LayerCounters()

    # ---- transformers' CacheLayerMixin API -------------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        g = self.owner.geometry
        shape = (g.rows, g.num_kv_heads, g.capacity, g.head_dim)
        # Zero filled: a row's slots past its length are read (and multiplied by a zero weight) by masked attention,
        # so they must never hold NaN or inf.
        self.keys = torch.zeros(shape, dtype=key_states.dtype, device=key_states.device)
        self.values = torch.zeros(shape, dtype=value_states.dtype, device=value_states.device)
        self.positions = torch.zeros(shape[:3], dtype=torch.long, device=key_states.device)
        if self.owner.policy.needs_queries:
            w = self.owner.policy.window
            self.queries = torch.zeros(
                (g.rows, g.num_q_heads, w, g.head_dim), dtype=key_states.dtype, device=key_states.device
            )
        self.device = key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append the new keys/values in place; return what the attention runs over.

        Prefill (``owner.prefilling``): ``(1, H, P, D)`` written to slots ``[0, P)`` of every row being admitted;
        returns the prompt's own keys/values (batch 1), so the prefill attention runs once for all its samples.
        Decode: ``(n, H, 1, D)``, one token per live row at the row's own length; returns the live views
        ``(n, H, L, D)`` with ``L`` the longest row's length (shorter rows are masked by the attention).
        """
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        owner = self.owner
        if owner.prefilling is not None:
            slots, n_new = owner.prefilling, key_states.shape[-2]
            span = _span(slots)
            pos = torch.arange(n_new, device=self.positions.device)
            if span is not None:
                self.keys[span, :, :n_new] = key_states
                self.values[span, :, :n_new] = value_states
                self.positions[span, :, :n_new] = pos
            else:
                idx = torch.tensor(slots, device=self.keys.device)
                k = len(slots)
                self.keys[:, :, :n_new].index_copy_(0, idx, key_states.expand(k, -1, -1, -1).contiguous())
                self.values[:, :, :n_new].index_copy_(0, idx, value_states.expand(k, -1, -1, -1).contiguous())
                self.positions[:, :, :n_new].index_copy_(
                    0, idx, pos.expand(k, self.positions.shape[1], -1).contiguous()
                )
            return key_states, value_states
        n = owner.n_live
        rows, slot = owner.row_index[:n], owner.lengths_t[:n]  # slot: where each row's new token goes
        self.keys[rows, :, slot] = key_states[:, :, 0]
        self.values[rows, :, slot] = value_states[:, :, 0]
        self.positions[rows, :, slot] = owner.pos_t[:n, None]
        length = owner.max_length_after_append
        self.counters.held = length
        return self.keys[:n, :, :length], self.values[:n, :, :length]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.max_length_after_append if self.owner.prefilling is None else query_length, 0

    def get_seq_length(self) -> int:
        return self.owner.length

    def get_max_length(self) -> int:
        return self.owner.geometry.capacity

    def reset(self) -> None:
        self.store = {}
        self.state_keys = [frozenset()] * self.owner.geometry.rows

    # ---- compatibility views (tests, analyses) ---------------------------------------------------------------
    @property
    def n_rows(self) -> int:
        """Live rows."""
        return self.owner.n_live

    @property
    def length(self) -> int:
        """The longest live row's held length (every row's, when the rows are in step)."""
        return self.owner.length

    # ---- attention-side hooks ------------------------------------------------------------------------------
    def record_queries(self, query: torch.Tensor) -> None:
        """Write queries into the ring (no-op if unused): the prompt's last ``window`` (prefill) or each row's one."""
        if self.queries is None:
            return
        owner, w = self.owner, self.queries.shape[2]
        if owner.prefilling is not None:
            slots, t = owner.prefilling, query.shape[2]
            take = min(t, w)
            ring = torch.arange(t - take, t, device=query.device) % w
            q = query[:, :, t - take :]  # (1, Hq, take, D)
            for r in slots:
                self.queries[r].index_copy_(1, ring, q[0])
            return
        n = owner.n_live
        self.queries[owner.row_index[:n], :, owner.pos_t[:n] % w] = query[:, :, 0]

    def selection_mask(self, query: torch.Tensor) -> torch.Tensor | None:
        """Ask a selection policy which held tokens this decode step attends to: ``(n, H, L)`` bool, or ``None``.

        ``query``: ``(n, Hq, 1, D)`` the step's post-RoPE queries (decode steps only; the prefill attends to all).
        """
        owner = self.owner
        policy = owner.policy
        if policy.kind != "selection":
            return None
        n, length = owner.n_live, owner.max_length_after_append
        masks: list[tuple[list[int], torch.Tensor | None]] = []
        for slots in self._groups(list(range(n))):
            span = _span(slots)
            idx = span if span is not None else torch.tensor(slots, device=query.device)
            state = self._state_for(slots, idx)
            lengths_host = [owner.lengths[r] + 1 for r in slots]  # after this step's append
            mask = policy.select(
                SelectionInputs(
                    query=query[idx],
                    keys=self.keys[idx, :, :length],
                    length=length,
                    lengths=owner.lengths_t[idx] + 1,
                    lengths_host=lengths_host,
                    capacity=self.keys.shape[2],
                    n_new=1,
                    layer_idx=self.layer_idx,
                    state=state,
                )
            )
            self._put_state(slots, idx, state)
            masks.append((slots, mask))
        if all(m is None for _, m in masks):
            owner.add_attended(None, self.keys.shape[1])
            return None
        full = torch.ones((n, self.keys.shape[1], length), dtype=torch.bool, device=query.device)
        for slots, mask in masks:
            if mask is not None:
                span = _span(slots)
                full[span if span is not None else torch.tensor(slots, device=query.device)] = mask
        held = owner.length_mask(n, length)
        if held is not None:
            full &= held[:, None, :]
        owner.add_attended(full, self.keys.shape[1])
        return full

    # ---- policy state ----------------------------------------------------------------------------------------
    def _groups(self, slots: list[int], key=None) -> list[list[int]]:
        """Split ``slots`` into groups of rows with the same state keys (and the same ``key(row)``), order kept."""
        groups: dict[Any, list[int]] = {}
        for r in slots:
            groups.setdefault((self.state_keys[r], None if key is None else key(r)), []).append(r)
        return list(groups.values())

    def _state_for(self, slots: list[int], idx) -> dict:
        """The rows' state dict: views of the store for a contiguous run of rows, copies otherwise."""
        return {k: self.store[k][idx] for k in self.state_keys[slots[0]]}

    def _put_state(self, slots: list[int], idx, state: dict) -> None:
        """Store the rows' state after a policy call (no copy when the policy updated the views in place)."""
        name = self.owner.policy.name
        b = len(slots)
        for k, v in state.items():
            if not isinstance(v, torch.Tensor) or v.dim() == 0 or v.shape[0] != b:
                raise RuntimeError(
                    f"policy {name}: state[{k!r}] must be a tensor with the call's {b} rows first, got "
                    f"{type(v).__name__} {tuple(getattr(v, 'shape', ()))}"
                )
            store = self.store.get(k)
            if store is None:
                store = torch.zeros((self.owner.geometry.rows, *v.shape[1:]), dtype=v.dtype, device=v.device)
                self.store[k] = store
            elif store.shape[1:] != v.shape[1:] or store.dtype != v.dtype:
                raise RuntimeError(
                    f"policy {name}: state[{k!r}] changed its per-row shape or dtype from {tuple(store.shape[1:])} "
                    f"{store.dtype} to {tuple(v.shape[1:])} {v.dtype}; allocate it at its final size"
                )
            if isinstance(idx, slice):
                if v.data_ptr() != store[idx].data_ptr():
                    store[idx] = v
            else:
                store.index_copy_(0, idx, v)
        keys = frozenset(state)
        for r in slots:
            self.state_keys[r] = keys

    # ---- eviction ------------------------------------------------------------------------------------------
    def evict_rows(self, slots: list[int]) -> None:
        """Evict rows ``slots`` (each due: held > budget, held % window == 0): they then hold ``budget`` tokens."""
        owner = self.owner
        for group in self._groups(slots, key=lambda r: owner.lengths[r]):
            self._evict_group(group, owner.lengths[group[0]])

    def _evict_group(self, slots: list[int], length: int) -> None:
        owner, policy = self.owner, self.owner.policy
        window = policy.window
        n_cand, n_keep = length - window, policy.budget - window
        sync = owner.sync_timing and self.keys.is_cuda
        if sync:
            torch.cuda.synchronize(self.keys.device)
        t0 = time.perf_counter()
        span = _span(slots)
        rows = len(slots)
        if span is not None:  # views of the storage: edited in place
            idx = span
            keys, values, positions = self.keys[span], self.values[span], self.positions[span]
        else:  # copies of the rows, written back below
            idx = torch.tensor(slots, device=self.keys.device)
            keys, values = self.keys.index_select(0, idx), self.values.index_select(0, idx)
            positions = self.positions.index_select(0, idx)
        queries = None if self.queries is None else self.queries[idx]
        state = self._state_for(slots, idx)
        inputs = EvictionInputs(
            keys=keys[:, :, :n_cand],
            values=values[:, :, :n_cand],
            positions=positions[:, :, :n_cand],
            n_keep=n_keep,
            layer_idx=self.layer_idx,
            scaling=owner.scaling,
            generators=[owner.evict_generators[r] for r in slots],
            state=state,
            queries=queries,
        )
        keep = policy.keep(inputs)
        if owner.check_policy_output:
            _check_keep(keep, rows, keys.shape[1], n_keep, n_cand, policy.name)
        self._put_state(slots, idx, state)
        flat = _flat_index(keep, keys.shape[2])
        kept_k = _take_tokens(keys, flat, n_keep)
        kept_v = _take_tokens(values, flat, n_keep)
        kept_p = positions.reshape(-1).index_select(0, flat).view(rows, -1, n_keep)
        keys[:, :, :n_keep] = kept_k
        values[:, :, :n_keep] = kept_v
        positions[:, :, :n_keep] = kept_p
        # The recent window moves from [n_cand, length) to [n_keep, budget): disjoint since n_cand - n_keep >= window.
        keys[:, :, n_keep : policy.budget] = keys[:, :, n_cand:length]
        values[:, :, n_keep : policy.budget] = values[:, :, n_cand:length]
        positions[:, :, n_keep : policy.budget] = positions[:, :, n_cand:length]
        if span is None:
            self.keys.index_copy_(0, idx, keys)
            self.values.index_copy_(0, idx, values)
            self.positions.index_copy_(0, idx, positions)
        if sync:
            torch.cuda.synchronize(self.keys.device)
        seconds = time.perf_counter() - t0
        self.counters.evictions += rows
        self.counters.eviction_seconds += seconds
        owner.record_eviction(slots, seconds)
        if owner.on_evict is not None:
            owner.on_evict(self, [owner.row_ids[r] for r in slots], keep, kept_p)

    # ---- rows ----------------------------------------------------------------------------------------------
    def move_row(self, src: int, dst: int, length: int) -> None:
        """Copy row ``src`` (its ``length`` held tokens, query ring and state) into row ``dst``."""
        if not self.is_initialized:
            return
        self.keys[dst, :, :length] = self.keys[src, :, :length]
        self.values[dst, :, :length] = self.values[src, :, :length]
        self.positions[dst, :, :length] = self.positions[src, :, :length]
        if self.queries is not None:
            self.queries[dst] = self.queries[src]
        for k in self.state_keys[src]:
            self.store[k][dst] = self.store[k][src]
        self.state_keys[dst] = self.state_keys[src]
        self.state_keys[src] = frozenset()

    def clear_row(self, slot: int, scrub: bool = False) -> None:
        """Forget row ``slot``'s policy state; with ``scrub``, also zero its storage (after a numerical failure)."""
        self.state_keys[slot] = frozenset()
        if scrub and self.is_initialized:
            self.keys[slot].zero_()
            self.values[slot].zero_()
            if self.queries is not None:
                self.queries[slot].zero_()


def _flat_index(idx: torch.Tensor, capacity: int) -> torch.Tensor:
    """``idx (R, H, K)`` token indices → ``(R*H*K,)`` row indices into the ``(R*H*capacity, ...)`` flattened storage."""
    r, h, _ = idx.shape
    base = torch.arange(0, r * h * capacity, capacity, device=idx.device).view(r, h, 1)
    return (idx + base).reshape(-1)


def _take_tokens(buf: torch.Tensor, flat: torch.Tensor, k: int) -> torch.Tensor:
    """``buf (R, H, capacity, D)`` (contiguous) → the ``(R, H, k, D)`` tokens at ``flat`` (see :func:`_flat_index`).

    Equal to ``buf.gather(2, idx[..., None].expand(..., D))``; copying whole ``D``-vectors with ``index_select`` is
    ~13x faster than an element-wise gather on CPU (16 rows x 2 heads x 2K tokens: 1.8 ms instead of 23 ms).
    """
    r, h, c, d = buf.shape
    return buf.reshape(r * h * c, d).index_select(0, flat).view(r, h, k, d)


def _check_keep(idx: torch.Tensor, rows: int, heads: int, n_keep: int, n_cand: int, name: str) -> None:
    """Validate a policy's answer (debug aid; syncs with the device)."""
    if tuple(idx.shape) != (rows, heads, n_keep) or idx.dtype != torch.long:
        raise RuntimeError(
            f"policy {name}: keep() returned {tuple(idx.shape)} {idx.dtype}, expected ({rows}, {heads}, {n_keep}) int64"
        )
    if idx.numel() and (idx.min() < 0 or idx.max() >= n_cand):
        raise RuntimeError(f"policy {name}: keep() returned indices outside [0, {n_cand})")
    s = idx.sort(dim=-1).values
    if n_keep > 1 and (s[..., 1:] == s[..., :-1]).any():
        raise RuntimeError(f"policy {name}: keep() returned duplicate indices")


class VaseCache(Cache):
    """The static cache handed to the model as ``cache=`` (and as ``vase_cache=`` to the attention function).

    Args:
        geometry: static shapes (see :class:`CacheGeometry`); ``geometry.rows`` rows are allocated once.
        policy: the eviction / selection policy.
        scaling: the model's attention softmax scale.
        attn_backend: ``"sdpa"``, ``"eager"`` or ``"flash_attn"`` (see :func:`vase.engine.attention.resolve_backend`).
        sync_timing: synchronise CUDA around evictions so their timing is exact (evictions only, never per step).
        check_policy_output: validate every ``keep()`` answer (shape, range, uniqueness); costs a sync per eviction.

    The decode loop drives it: :meth:`begin_prefill` / :meth:`end_prefill` around a prompt's forward, :meth:`advance`
    after each decode forward, :meth:`evict_due`, :meth:`move_row` / :meth:`release` when rows finish.
    """

    def __init__(
        self,
        geometry: CacheGeometry,
        policy: Policy,
        scaling: float,
        attn_backend: str = "sdpa",
        sync_timing: bool = True,
        check_policy_output: bool = False,
    ):
        self.geometry = geometry
        self.policy = policy
        self.scaling = scaling
        self.attn_backend = attn_backend
        self.sync_timing = sync_timing
        self.check_policy_output = check_policy_output
        rows, device = geometry.rows, geometry.device
        self.n_live = 0
        self.lengths = [0] * rows  # held tokens per row (host); every layer holds the same count
        self.next_pos = [0] * rows  # absolute position of each row's next token (true positions)
        self.lengths_t = torch.zeros(rows, dtype=torch.long, device=device)
        self.pos_t = torch.zeros(rows, dtype=torch.long, device=device)
        self.row_index = torch.arange(rows, device=device)
        self.evict_generators: list[torch.Generator | None] = [None] * rows
        self.row_ids: list[Any] = [None] * rows  # the caller's id of each row (e.g. (problem, sample))
        self.row_evictions = [0] * rows  # eviction calls of the row, summed over layers
        self.row_eviction_seconds = [0.0] * rows
        self.attended = torch.zeros(rows, dtype=torch.long, device=device) if policy.kind == "selection" else None
        self.prefilling: list[int] | None = None  # rows being admitted by the current forward
        self.max_length_after_append = 0
        self._mask: tuple[int, int, torch.Tensor] | None = None  # (n, L, (n, L) bool) for the current step
        self._seqlens: torch.Tensor | None = None
        self.on_evict = None  # optional callback(layer, row_ids, keep_idx, kept_positions) for analyses
        super().__init__(layers=[VaseLayer(i, self) for i in range(geometry.num_layers)])

    # ---- admission and decode steps ----------------------------------------------------------------------------
    def begin_prefill(self, slots: Sequence[int], generators: Sequence[torch.Generator], row_ids: Sequence) -> None:
        """The next forward is the prompt of new rows ``slots`` (free slots), with their eviction generators."""
        for r, g, rid in zip(slots, generators, row_ids, strict=True):
            self.evict_generators[r] = g
            self.row_ids[r] = rid
            self.row_evictions[r] = 0
            self.row_eviction_seconds[r] = 0.0
            for layer in self.layers:
                layer.clear_row(r)
        if self.attended is not None:
            self.attended[list(slots)] = 0
        self.prefilling = list(slots)

    def end_prefill(self, prompt_len: int) -> None:
        """The prompt's forward is done: its rows hold ``prompt_len`` tokens."""
        for r in self.prefilling:
            self.lengths[r] = prompt_len
            self.next_pos[r] = prompt_len
        idx = torch.tensor(self.prefilling, device=self.lengths_t.device)
        self.lengths_t[idx] = prompt_len
        self.pos_t[idx] = prompt_len
        self.prefilling = None

    def prepare_step(self, n_live: int) -> None:
        """Before a decode forward over rows ``[0, n_live)``: one token is appended to each."""
        if n_live > self.geometry.rows:
            raise RuntimeError(f"{n_live} live rows for a cache of {self.geometry.rows}")
        self.n_live = n_live
        self.max_length_after_append = max(self.lengths[:n_live]) + 1
        if self.max_length_after_append > self.geometry.capacity:
            raise RuntimeError(
                f"cache capacity {self.geometry.capacity} exceeded (a row would hold {self.max_length_after_append}); "
                "this is an engine bug: the eviction trigger should have fired"
            )
        self._mask = None
        self._seqlens = None

    def seqlens_i32(self) -> torch.Tensor:
        """``(n_live,)`` int32 tokens each live row holds after this step's append (FlashAttention's cache_seqlens)."""
        if self._seqlens is None:
            self._seqlens = (self.lengths_t[: self.n_live] + 1).to(torch.int32)
        return self._seqlens

    def advance(self) -> None:
        """After a decode forward: every live row holds one more token and moves one position on."""
        n = self.n_live
        for r in range(n):
            self.lengths[r] += 1
            self.next_pos[r] += 1
        self.lengths_t[:n] += 1
        self.pos_t[:n] += 1

    def length_mask(self, n: int, length: int) -> torch.Tensor | None:
        """``(n, length)`` bool: slot ``j`` of row ``r`` holds a token of the row (``j < lengths[r]`` after the append).

        ``None`` when every row holds ``length`` tokens (no masking needed). Built once per decode step.
        """
        if self._mask is not None and self._mask[:2] == (n, length):
            return self._mask[2]
        if min(self.lengths[:n]) + 1 == length:
            mask = None
        else:
            ar = torch.arange(length, device=self.lengths_t.device)
            mask = ar[None, :] <= self.lengths_t[:n, None]  # lengths_t is the count before this step's append
        self._mask = (n, length, mask)
        return mask

    def due_rows(self) -> list[int]:
        """Live rows whose eviction trigger fires now (held > budget and held % window == 0)."""
        p = self.policy
        if p.kind != "eviction":
            return []
        return [r for r in range(self.n_live) if self.lengths[r] > p.budget and self.lengths[r] % p.window == 0]

    def evict_due(self) -> list[int]:
        """Run the eviction trigger on every row after a decode step; return the rows that evicted."""
        due = self.due_rows()
        if not due:
            return due
        for layer in self.layers:
            layer.evict_rows(due)
        budget = self.policy.budget
        for r in due:
            self.lengths[r] = budget
        idx = torch.tensor(due, device=self.lengths_t.device)
        self.lengths_t[idx] = budget
        return due

    def record_eviction(self, slots: Sequence[int], seconds: float) -> None:
        share = seconds / len(slots)
        for r in slots:
            self.row_evictions[r] += 1
            self.row_eviction_seconds[r] += share

    def add_attended(self, mask: torch.Tensor | None, heads: int) -> None:
        """Selection policies: add this step's attended tokens per row (``mask (n, H, L)``, or all held tokens)."""
        n = self.n_live
        if mask is None:
            self.attended[:n] += heads * (self.lengths_t[:n] + 1)
        else:
            self.attended[:n] += mask.sum(dim=(1, 2))

    # ---- rows ----------------------------------------------------------------------------------------------------
    def move_row(self, src: int, dst: int) -> None:
        """Move live row ``src`` into the free row ``dst`` (keeps the live rows contiguous)."""
        length = self.lengths[src]
        for layer in self.layers:
            layer.move_row(src, dst, length)
        for lst in (
            self.lengths,
            self.next_pos,
            self.evict_generators,
            self.row_ids,
            self.row_evictions,
            self.row_eviction_seconds,
        ):
            lst[dst] = lst[src]
        for t in (self.lengths_t, self.pos_t, self.attended):
            if t is not None:
                t[dst] = t[src]
        self.release(src)

    def release(self, slot: int, scrub: bool = False) -> None:
        """Row ``slot`` is free (its sample finished). With ``scrub``, zero its storage (after NaN/inf).

        Its storage and length stay readable until the slot is reused (analyses inspect a cache after a decode).
        """
        self.evict_generators[slot] = None
        self.row_ids[slot] = None
        for layer in self.layers:
            layer.clear_row(slot, scrub=scrub)

    def row_stats(self, slot: int) -> dict:
        """What a finished row reports: eviction calls (summed over layers), their seconds, attended tokens."""
        return {
            "evictions": self.row_evictions[slot],
            "eviction_seconds": self.row_eviction_seconds[slot],
            "attended_tokens_sum": None if self.attended is None else int(self.attended[slot].item()),
        }

    # ---- measurements --------------------------------------------------------------------------------------
    @property
    def n_rows(self) -> int:
        """Live rows."""
        return self.n_live

    @property
    def length(self) -> int:
        """The longest live row's held length (every row's, when the rows are in step)."""
        return max(self.lengths[: self.n_live], default=0)

    def kv_bytes(self) -> int:
        """Bytes of K and V storage actually allocated (the static footprint)."""
        return sum(layer.keys.nbytes + layer.values.nbytes for layer in self.layers if layer.is_initialized)

    def aux_bytes(self) -> int:
        """Bytes of the side buffers: positions and the query ring."""
        total = 0
        for layer in self.layers:
            if layer.positions is not None:
                total += layer.positions.nbytes
            if layer.queries is not None:
                total += layer.queries.nbytes
        return total

    def evictions(self) -> int:
        """Eviction calls summed over layers and rows."""
        return sum(layer.counters.evictions for layer in self.layers)

    def eviction_seconds(self) -> float:
        return sum(layer.counters.eviction_seconds for layer in self.layers)

    def counters(self) -> list[LayerCounters]:
        return [layer.counters for layer in self.layers]


@dataclass
class CacheStats:
    """What a finished generation reports about its cache."""

    kv_cache_bytes: int
    aux_bytes: int
    capacity: int
    evictions: int
    eviction_seconds: float
    attended_tokens: int | None
    per_layer: list[dict] = field(default_factory=list)
