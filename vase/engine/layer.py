"""One layer of the static cache: its views of the stacked storage, the per-row append, the query ring, selection.

See :mod:`vase.engine.cache` for the whole picture; this module holds what happens inside one layer during a
forward: the prefill write (one prompt into the rows of its samples), the decode append (one token per live row at
the row's own length), the query ring and the call to a selection policy (Quest, SeerAttention-R). The storage of
every layer is one tensor per kind (:mod:`vase.engine.storage`); eviction runs once for all layers
(:mod:`vase.engine.evict`). The layer knows its cache only as ``owner`` (duck-typed: no import of the cache module).

A layer is of a type (``kind``): ``full_attention`` (the eviction cache, the policy's budget) or
``sliding_attention`` (a ring of the model's window per row, :mod:`vase.engine.storage`: the token of position ``p``
in slot ``p % window``; never scored, evicted or selected in; its queries are not recorded).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import CacheLayerMixin

from vase.engine.geometry import LayerCounters, span_of
from vase.engine.policy import SelectionInputs

#: the layer's views of the stacked storage (:class:`~vase.engine.storage.CacheStorage`), by the storage's name
VIEWS = ("keys", "values", "positions", "queries", "last_call_pos")
#: a sliding layer's views: of its ring (no query ring, no eviction calls)
RING_OF = {"keys": "ring_keys", "values": "ring_values", "positions": "ring_positions"}


def storage_view(name: str) -> property:
    """A layer's view ``storage.<name>[:, store_idx]`` (``(rows, ...)``), ``None`` before :meth:`VaseLayer.bind` or
    where the storage has no such tensor.

    Eager: the view taken once by ``bind`` (no op per access). Inside a compiled step (``torch.compiler
    .is_compiling()``): indexed from the stacked tensor *in the graph*, so the graph's inputs are the stacked tensors
    alone. Were the per-layer views lifted as inputs, the graph would mutate several inputs that share one storage:
    AOTAutograd then merges them into a synthetic base whose metadata has no static inputs, and cudagraph trees skip
    the capture ("mutated inputs", ``docs/architecture.md``, "CUDA graphs").
    """

    def get(self) -> torch.Tensor | None:
        if torch.compiler.is_compiling():
            return self._view(name)
        return self._views[name]

    def set(self, value) -> None:  # transformers' CacheLayerMixin.__init__ sets keys / values to None
        if value is not None:
            raise AttributeError(f"{name}: a view of the stacked storage; write into it, never rebind it")

    return property(get, set, doc=f"``storage.{name}[:, store_idx]`` (see :func:`storage_view`)")


class VaseLayer(CacheLayerMixin):
    """One layer of the static cache (see the module docstring).

    Storage: views of the stacked storage ``owner.storage`` at this layer (set for every layer when the first
    :meth:`update`, i.e. the first prefill, allocates it):
        keys, values: ``(rows, H, capacity, D)``; row ``r`` holds its tokens in slots ``[0, owner.lengths[r])``.
        positions: ``(rows, H, capacity)`` int64 absolute positions of the held tokens.
        queries: ``(rows, Hq, window, D)`` ring buffer of post-RoPE queries, or ``None``.
        last_call_pos: ``(rows,)`` int64 each row's position at its last eviction call, or ``None``.
    The policy's state per (row, layer) lives in ``owner.storage.state`` (:class:`~vase.engine.storage.RowState`).
    """

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, layer_idx: int, owner: Any, kind: str = "full_attention", store_idx: int | None = None):
        super().__init__()
        self.layer_idx = layer_idx
        self.owner = owner  # the VaseCache
        self.kind = kind
        self.is_sliding = kind == "sliding_attention"
        self.window: int | None = owner.geometry.sliding_window if self.is_sliding else None
        self.store_idx = layer_idx if store_idx is None else store_idx  # index in its storage (full or ring)
        self._views: dict[str, torch.Tensor | None] = dict.fromkeys(VIEWS)  # eager: taken once by bind()
        self.counters = LayerCounters()

    # ---- transformers' CacheLayerMixin API -------------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Allocate the stacked storage of every layer (the first prefill) and take this layer's views."""
        owner = self.owner
        if not owner.storage.allocated:
            owner.storage.allocate(key_states.dtype, key_states.device)
            for layer in owner.attention_layers:
                layer.bind()
        self.bind()

    def bind(self) -> None:
        """Take this layer's views of the (allocated) stacked storage (what eager steps read: :func:`storage_view`)."""
        st = self.owner.storage
        self.device = st.keys.device
        self.is_initialized = True
        for name in VIEWS:
            self._views[name] = self._view(name)

    def _view(self, name: str) -> torch.Tensor | None:
        """``storage.<name>[:, store_idx]`` (a sliding layer: its ring's), ``None`` where the storage has none."""
        base = getattr(self.owner.storage, (RING_OF.get(name, "") if self.is_sliding else name) or "", None)
        return None if base is None else base[:, self.store_idx]

    keys = storage_view("keys")
    values = storage_view("values")
    positions = storage_view("positions")
    queries = storage_view("queries")
    last_call_pos = storage_view("last_call_pos")

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append the new keys/values in place; return what the attention runs over.

        Prefill (``owner.prefilling``): ``(1, H, P, D)`` written to slots ``[0, P)`` of every row being admitted;
        returns the prompt's own keys/values (batch 1), so the prefill attention runs once for all its samples.
        Decode: ``(b, H, 1, D)``, one token per row of the step (``b = owner.step_rows``) at the row's own length;
        returns the views ``(b, H, S, D)`` of rows ``[0, b)``, ``S = owner.step_length``: the smallest key-length
        bucket that holds the longest row (:func:`~vase.engine.cache.key_buckets`; compiled, one graph per row bucket
        and key bucket); each row is masked to its own tokens by the attention (``docs/architecture.md``, "Static
        decode shapes", "Bytes read per step").
        """
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.is_sliding:
            return self._update_ring(key_states, value_states)
        owner = self.owner
        if owner.prefilling is not None:
            slots, n_new = owner.prefilling, key_states.shape[-2]
            span = span_of(slots)
            pos = torch.arange(n_new, device=self.positions.device)
            if span is not None:
                self.keys[span, :, :n_new] = key_states
                self.values[span, :, :n_new] = value_states
                self.positions[span, :, :n_new] = pos
            else:
                idx = owner.index(slots)
                k = len(slots)
                self.keys[:, :, :n_new].index_copy_(0, idx, key_states.expand(k, -1, -1, -1).contiguous())
                self.values[:, :, :n_new].index_copy_(0, idx, value_states.expand(k, -1, -1, -1).contiguous())
                self.positions[:, :, :n_new].index_copy_(
                    0, idx, pos.expand(k, self.positions.shape[1], -1).contiguous()
                )
            return key_states, value_states
        b = owner.step_rows
        rows = owner.row_index[:b]
        k_new, v_new, p_new = key_states[:, :, 0], value_states[:, :, 0], owner.pos_t[:b, None]
        if owner.bucketed:  # padding rows (free slots) write back what their slot holds: nothing changes there
            slot, live = owner.write_slot[:b], owner.live_t[:b, None]
            k_new = torch.where(live[..., None], k_new, self.keys[rows, :, slot])
            v_new = torch.where(live[..., None], v_new, self.values[rows, :, slot])
            p_new = torch.where(live, p_new, self.positions[rows, :, slot])
        else:
            slot = owner.lengths_t[:b]  # where each row's new token goes
        self.keys[rows, :, slot] = k_new
        self.values[rows, :, slot] = v_new
        self.positions[rows, :, slot] = p_new
        length = owner.step_length
        return self.keys[:b, :, :length], self.values[:b, :, :length]

    def _update_ring(self, key_states: torch.Tensor, value_states: torch.Tensor):
        """A sliding layer's :meth:`update`: the ring of the window.

        Prefill ``(1, H, P, D)``: the prompt's last ``min(P, window)`` tokens go to slots ``p % window`` of every
        admitted row (the other slots zero, position ``-1``); returns the prompt's own keys/values (the prefill
        attends over the prompt with the window band). Decode ``(b, H, 1, D)``: each row's token to slot
        ``position % window`` (``owner.ring_slot``, built by ``prepare_step``); returns the rings ``(b, H, window,
        D)``, masked by the attention to the valid slots (:meth:`key_bias`).
        """
        owner, w = self.owner, self.window
        if owner.prefilling is not None:
            slots, p = owner.prefilling, key_states.shape[-2]
            take = min(p, w)
            pos = torch.arange(p - take, p, device=key_states.device)
            ring = pos % w
            rk = key_states.new_zeros((1, *self.keys.shape[1:]))
            rv = value_states.new_zeros((1, *self.values.shape[1:]))
            rp = torch.full((1, *self.positions.shape[1:]), -1, dtype=torch.long, device=key_states.device)
            rk[:, :, ring] = key_states[:, :, p - take :]
            rv[:, :, ring] = value_states[:, :, p - take :]
            rp[:, :, ring] = pos
            span = span_of(slots)
            if span is not None:
                self.keys[span], self.values[span], self.positions[span] = rk, rv, rp
            else:
                idx, k = owner.index(slots), len(slots)
                self.keys.index_copy_(0, idx, rk.expand(k, -1, -1, -1).contiguous())
                self.values.index_copy_(0, idx, rv.expand(k, -1, -1, -1).contiguous())
                self.positions.index_copy_(0, idx, rp.expand(k, -1, -1).contiguous())
            return key_states, value_states
        b = owner.step_rows
        rows, slot = owner.row_index[:b], owner.ring_slot[:b]
        k_new, v_new, p_new = key_states[:, :, 0], value_states[:, :, 0], owner.pos_t[:b, None]
        if owner.bucketed:  # padding rows (free slots) write back what their slot holds
            live = owner.live_t[:b, None]
            k_new = torch.where(live[..., None], k_new, self.keys[rows, :, slot])
            v_new = torch.where(live[..., None], v_new, self.values[rows, :, slot])
            p_new = torch.where(live, p_new, self.positions[rows, :, slot])
        self.keys[rows, :, slot] = k_new
        self.values[rows, :, slot] = v_new
        self.positions[rows, :, slot] = p_new
        return self.keys[:b], self.values[:b]

    def key_mask(self, n: int, length: int) -> torch.Tensor:
        """``(n, length)`` bool: the slots a decode step's query of each row attends to (its held tokens; a sliding
        layer: its ring's valid slots, ``owner.ring_mask``)."""
        return self.owner.ring_mask[:n] if self.is_sliding else self.owner.length_mask(n, length)

    def key_bias(self, n: int, length: int, dtype: torch.dtype) -> torch.Tensor:
        """:meth:`key_mask` as SDPA's fused kernels take it: ``(n, 1, 1, length)`` additive in ``dtype``."""
        if not self.is_sliding:
            return self.owner.length_bias(n, length, dtype)
        if dtype == self.owner.ring_bias.dtype:
            return self.owner.ring_bias[:n]
        return torch.zeros((n, 1, 1, length), dtype=dtype, device=self.device).masked_fill_(
            ~self.key_mask(n, length)[:, None, None], float("-inf")
        )

    def seqlens_i32(self) -> torch.Tensor:
        """``(step_rows,)`` int32: the slots each row's query attends to, a prefix of its storage (FlashAttention's
        ``cache_seqlens``): the held tokens after this step's append, or a ring's valid slots."""
        owner = self.owner
        return owner.ring_seqlens[: owner.step_rows] if self.is_sliding else owner.seqlens_i32()

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """Decode: the slots the views :meth:`update` returns span (``owner.step_length``, a sliding layer's window);
        prefill: the prompt."""
        if self.owner.prefilling is not None:
            return query_length, 0
        return (self.window if self.is_sliding else self.owner.step_length), 0

    def get_seq_length(self) -> int:
        """The cache's :meth:`~vase.engine.cache.VaseCache.seq_length` (the span of a decode step's views)."""
        return self.owner.seq_length()

    def get_max_length(self) -> int:
        return self.window if self.is_sliding else self.owner.geometry.capacity

    def reset(self) -> None:
        if not self.is_sliding:
            self.owner.storage.state.clear_layer(self.store_idx)

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
            q = query[:, :, t - take :]  # (1, Hq, take, D): the same queries for every row of the prompt
            idx = owner.index(slots)
            rows = owner.row_index[idx]
            self.queries[rows[:, None], :, ring[None, :]] = q.transpose(1, 2).expand(len(slots), -1, -1, -1)
            return
        b = owner.step_rows
        rows, ring, q = owner.row_index[:b], owner.pos_t[:b] % w, query[:, :, 0]
        if owner.bucketed:  # padding rows keep their ring
            q = torch.where(owner.live_t[:b, None, None], q, self.queries[rows, :, ring])
        self.queries[rows, :, ring] = q

    def selection_mask(self, query: torch.Tensor) -> torch.Tensor | None:
        """Ask a selection policy which held tokens this decode step attends to, or ``None`` for all of them.

        ``query``: ``(n, Hq, 1, D)`` the step's post-RoPE queries (decode steps only; the prefill attends to all).
        Returns ``(n, H, L)`` (per KV head) or ``(n, Hq, L)`` (per query head) bool, as the policy chose (see
        :class:`~vase.engine.policy.SelectionPolicy`), with each row's length mask applied.

        One call for the step's rows ``[0, n)`` (``n = owner.step_rows``): every row has the same state keys (made at
        its prefill, :meth:`init_selection_state`), so no rows are grouped on the host; the inputs are the rows'
        device lengths and views of the storage and state store (static addresses), and the call reads no per-row host
        state, so the compiled step (:mod:`vase.engine.compiled`) traces it once per row bucket.
        """
        owner = self.owner
        policy = owner.policy
        if policy.kind != "selection" or self.is_sliding:  # selection applies to full-attention layers only
            return None
        n, length = owner.step_rows, owner.step_length  # the span of every row's view this step
        n_kv, n_q = self.keys.shape[1], query.shape[1]
        views = owner.storage.state.layer_views(self.store_idx, n)
        state = dict(views)
        mask = policy.select(
            SelectionInputs(
                query=query,
                keys=self.keys[:n, :, :length],
                length=length,
                # after this step's append; a padding row of a bucket (a free slot) may hold anything up to the span
                lengths=torch.clamp(owner.lengths_t[:n] + 1, max=length),
                capacity=self.keys.shape[2],
                n_new=1,
                layer_idx=self.layer_idx,
                state=state,
                positions=self.positions[:n, :, :length],
            )
        )
        if not torch.compiler.is_compiling():
            self._check_state(views, state)
        if mask is None:
            owner.add_attended(None, n_q)
            return None
        if mask.dim() != 3 or mask.shape[0] != n or mask.shape[1] not in (n_kv, n_q) or mask.shape[2] != length:
            raise RuntimeError(
                f"policy {policy.name}: select() returned {tuple(mask.shape)}, expected ({n}, {n_kv} or {n_q}, "
                f"{length})"
            )
        mask = mask & owner.length_mask(n, length)[:, None, :]
        owner.add_attended(mask, n_q)
        return mask

    # ---- policy state (selection policies, per layer) ----------------------------------------------------------
    def init_selection_state(self, slots: list[int], prompt_len: int) -> None:
        """After a prompt's prefill into rows ``slots``: the selection policy's state of those rows on this layer
        (:meth:`~vase.engine.policy.SelectionPolicy.init_state` of the prompt's keys, once, batch 1; every row of the
        prompt holds the same), written into the state store. Eager, outside any decode forward."""
        owner = self.owner
        r = slots[0]
        keys, positions = self.keys[r : r + 1, :, :prompt_len], self.positions[r : r + 1, :, :prompt_len]
        state = owner.policy.init_state(keys, positions, [prompt_len], self.layer_idx, self.keys.shape[2])
        if state:
            owner.storage.state.fill(slots, owner.index(slots), state, self.store_idx, owner.policy.name)

    def _check_state(self, views: dict, state: dict) -> None:
        """A policy's ``select`` updates its state in place: a key it added or a tensor it replaced is an error (eager
        steps check; the compiled step traces the same code)."""
        name = self.owner.policy.name
        added = sorted(set(state) - set(views))
        if added:
            raise RuntimeError(
                f"policy {name}: select() added state[{added[0]!r}]; create per-row state in init_state() (the engine "
                "calls it at each row's prefill)"
            )
        replaced = [k for k in views if state.get(k) is not views[k]]
        if replaced:
            raise RuntimeError(
                f"policy {name}: select() replaced state[{replaced[0]!r}]; update the state tensors in place"
            )
