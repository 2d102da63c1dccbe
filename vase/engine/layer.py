"""One layer of the static cache: its views of the stacked storage, the per-row append, the query ring, selection.

See :mod:`vase.engine.cache` for the whole picture; this module holds what happens inside one layer during a
forward: the prefill write (one prompt into the rows of its samples), the decode append (one token per live row at
the row's own length), the query ring and the call to a selection policy (Quest, SeerAttention-R). The storage of
every layer is one tensor per kind (:mod:`vase.engine.storage`); eviction runs once for all layers
(:mod:`vase.engine.evict`). The layer knows its cache only as ``owner`` (duck-typed: no import of the cache module).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import CacheLayerMixin

from vase.engine.geometry import LayerCounters, span_of
from vase.engine.policy import SelectionInputs


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

    def __init__(self, layer_idx: int, owner: Any):
        super().__init__()
        self.layer_idx = layer_idx
        self.owner = owner  # the VaseCache
        self.positions: torch.Tensor | None = None
        self.queries: torch.Tensor | None = None
        self.last_call_pos: torch.Tensor | None = None
        self.counters = LayerCounters()

    # ---- transformers' CacheLayerMixin API -------------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Allocate the stacked storage of every layer (the first prefill) and take this layer's views."""
        owner = self.owner
        if not owner.storage.allocated:
            owner.storage.allocate(key_states.dtype, key_states.device)
            for layer in owner.kv_layers:
                layer.bind()
        self.bind()

    def bind(self) -> None:
        """Take this layer's views of the (allocated) stacked storage."""
        st, i = self.owner.storage, self.layer_idx
        self.keys, self.values, self.positions = st.keys[:, i], st.values[:, i], st.positions[:, i]
        if st.queries is not None:
            self.queries, self.last_call_pos = st.queries[:, i], st.last_call_pos[:, i]
        self.device = st.keys.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append the new keys/values in place; return what the attention runs over.

        Prefill (``owner.prefilling``): ``(1, H, P, D)`` written to slots ``[0, P)`` of every row being admitted;
        returns the prompt's own keys/values (batch 1), so the prefill attention runs once for all its samples.
        Decode: ``(b, H, 1, D)``, one token per row of the step (``b = owner.step_rows``) at the row's own length;
        returns the views ``(b, H, S, D)`` of rows ``[0, b)``, ``S = owner.step_length``: the capacity when the step
        is compiled (the same shapes and storage at every step of a row bucket), else the longest row rounded up to
        :data:`~vase.engine.cache.LENGTH_BUCKET`; each row is masked to its own tokens by the attention
        (``docs/architecture.md``, "Static decode shapes").
        """
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
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

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """Decode: the slots the views :meth:`update` returns span (``owner.step_length``); prefill: the prompt."""
        return self.owner.step_length if self.owner.prefilling is None else query_length, 0

    def get_seq_length(self) -> int:
        """The longest live row's held length; during a decode forward the span of the views
        (``owner.step_length``), so a compiled step never reads the rows' host lengths."""
        return self.owner.step_length if self.owner.stepping else self.owner.length

    def get_max_length(self) -> int:
        return self.owner.geometry.capacity

    def reset(self) -> None:
        self.owner.storage.state.clear_layer(self.layer_idx)

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
        """
        owner = self.owner
        policy = owner.policy
        if policy.kind != "selection":
            return None
        n, length = owner.step_rows, owner.step_length  # the span of every row's view this step
        n_kv, n_q = self.keys.shape[1], query.shape[1]
        masks: list[tuple[list[int], torch.Tensor | None]] = []
        for slots in self._groups(list(range(n))):
            idx = owner.index(slots)
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
                    positions=self.positions[idx, :, :length],
                )
            )
            self._put_state(slots, idx, state)
            if mask is not None and (mask.dim() != 3 or mask.shape[1] not in (n_kv, n_q) or mask.shape[2] != length):
                raise RuntimeError(
                    f"policy {policy.name}: select() returned {tuple(mask.shape)}, expected ({len(slots)}, {n_kv} or "
                    f"{n_q}, {length})"
                )
            masks.append((slots, mask))
        if all(m is None for _, m in masks):
            owner.add_attended(None, n_q)
            return None
        # One head axis for the whole step: per query head if any group's mask is (a KV-head mask is then repeated).
        heads = n_q if any(m is not None and m.shape[1] == n_q for _, m in masks) else n_kv
        full = torch.ones((n, heads, length), dtype=torch.bool, device=query.device)
        for slots, mask in masks:
            if mask is not None:
                if mask.shape[1] != heads:
                    mask = mask.repeat_interleave(heads // mask.shape[1], dim=1)
                full[owner.index(slots)] = mask
        full &= owner.length_mask(n, length)[:, None, :]
        owner.add_attended(full, n_q)
        return full

    # ---- policy state (selection policies, per layer) ----------------------------------------------------------
    def _groups(self, slots: list[int]) -> list[list[int]]:
        """Split ``slots`` into groups of rows with the same state keys on this layer, order kept."""
        keys = self.owner.storage.state.keys[self.layer_idx]
        groups: dict[Any, list[int]] = {}
        for r in slots:
            groups.setdefault(keys[r], []).append(r)
        return list(groups.values())

    def _state_for(self, slots: list[int], idx) -> dict:
        """The rows' state dict on this layer: views of the store for a contiguous run of rows, copies otherwise."""
        state = self.owner.storage.state
        return state.get(state.keys[self.layer_idx][slots[0]], idx, len(slots), self.layer_idx)

    def _put_state(self, slots: list[int], idx, state: dict) -> None:
        """Store the rows' state on this layer after a policy call (no copy when the policy updated the views)."""
        self.owner.storage.state.put(slots, idx, state, self.layer_idx, self.owner.policy.name)
