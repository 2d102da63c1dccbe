"""One layer of the static cache: storage, the per-row append, the query ring, selection and eviction.

See :mod:`vase.engine.cache` for the whole picture; this module holds what happens inside one layer: the prefill
write (one prompt into the rows of its samples), the decode append (one token per live row at the row's own length),
the query ring, the call to a selection policy (Quest) and, at an eviction event, the call to an eviction policy for
the rows that evict together and the in-place compaction of their storage.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import torch
from transformers.cache_utils import CacheLayerMixin

from vase.engine.geometry import LayerCounters, span_of
from vase.engine.policy import EvictionInputs, SelectionInputs
from vase.engine.rng import RowRNG

if TYPE_CHECKING:
    from vase.engine.cache import VaseCache


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
        self.last_call_pos: torch.Tensor | None = None  # (rows,) int64: each row's position at its last eviction call
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
            self.last_call_pos = torch.full((g.rows,), _NEVER, dtype=torch.long, device=key_states.device)
        self.device = key_states.device
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
        """Evict rows ``slots`` (each due, see :meth:`VaseCache.due_rows`): they then hold ``budget`` tokens.

        Rows are handed to the policy together when they hold the same length and pin the same number of leading
        slots (their prompt with ``keep_prompt``, else none).
        """
        owner = self.owner
        pinned = (lambda r: owner.prompt_lens[r]) if owner.policy.keep_prompt else (lambda r: 0)
        for group in self._groups(slots, key=lambda r: (owner.lengths[r], pinned(r))):
            self._evict_group(group, owner.lengths[group[0]], pinned(group[0]))

    def _evict_group(self, slots: list[int], length: int, pinned: int = 0) -> None:
        """Evict rows ``slots``, each holding ``length`` tokens of which the first ``pinned`` are never candidates."""
        owner, policy = self.owner, self.owner.policy
        window = policy.window
        n_cand, n_keep = length - window - pinned, policy.budget - window - pinned
        start = owner.clock.start()
        idx = owner.index(slots)  # a slice (contiguous rows) or a device tensor built once for every layer
        rows = len(slots)
        if isinstance(idx, slice):  # views of the storage: edited in place
            keys, values, positions = self.keys[idx], self.values[idx], self.positions[idx]
        else:  # copies of the rows, written back below
            keys, values = self.keys.index_select(0, idx), self.values.index_select(0, idx)
            positions = self.positions.index_select(0, idx)
        queries = None if self.queries is None else self.queries[idx]
        query_positions = n_new = None
        if queries is not None:  # positions of the ring's slots and the queries new since the last call (no sync)
            query_positions, n_new = _ring_positions(owner.pos_t[idx], self.last_call_pos[idx], window)
            self.last_call_pos[idx] = owner.pos_t[idx]
        state = self._state_for(slots, idx)
        cand = slice(pinned, pinned + n_cand)
        inputs = EvictionInputs(
            keys=keys[:, :, cand],
            values=values[:, :, cand],
            positions=positions[:, :, cand],
            n_keep=n_keep,
            layer_idx=self.layer_idx,
            scaling=owner.scaling,
            # noise keyed by (row's eviction key, row's position now, layer): never by its batch-mates
            rng=RowRNG(owner.evict_key[idx], owner.pos_t[idx], stream=self.layer_idx),
            state=state,
            queries=queries,
            score_dtype=owner.score_dtype,
            window_keys=keys[:, :, length - window : length],
            window_positions=positions[:, :, length - window : length],
            query_positions=query_positions,
            n_new_queries=n_new,
        )
        keep = policy.keep(inputs)
        if owner.check_policy_output:
            _check_keep(keep, rows, keys.shape[1], n_keep, n_cand, policy.name)
        self._put_state(slots, idx, state)
        flat = _flat_index(keep + pinned if pinned else keep, keys.shape[2])
        kept_k = _take_tokens(keys, flat, n_keep)
        kept_v = _take_tokens(values, flat, n_keep)
        kept_p = positions.reshape(-1).index_select(0, flat).view(rows, -1, n_keep)
        kept = slice(pinned, pinned + n_keep)
        keys[:, :, kept] = kept_k
        values[:, :, kept] = kept_v
        positions[:, :, kept] = kept_p
        # The recent window moves from [length - window, length) to [budget - window, budget). The ranges overlap when
        # the row evicts fewer than ``window`` tokens (an ``evict_every`` below the window, or after a prefill
        # compression): the source is then copied first.
        src, dst = slice(length - window, length), slice(policy.budget - window, policy.budget)
        overlap = length - policy.budget < window
        for buf in (keys, values, positions):
            buf[:, :, dst] = buf[:, :, src].clone() if overlap else buf[:, :, src]
        if not isinstance(idx, slice):
            self.keys.index_copy_(0, idx, keys)
            self.values.index_copy_(0, idx, values)
            self.positions.index_copy_(0, idx, positions)
        self.counters.evictions += rows
        owner.record_eviction(slots)
        owner.clock.stop(start, functools.partial(self._credit_seconds, list(slots)))
        if owner.on_evict is not None:
            owner.on_evict(self, [owner.row_ids[r] for r in slots], keep, kept_p)

    def _credit_seconds(self, slots: list[int], seconds: float) -> None:
        self.counters.eviction_seconds += seconds
        self.owner.credit_seconds(slots, seconds)

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
            self.last_call_pos[dst] = self.last_call_pos[src]
        for k in self.state_keys[src]:
            self.store[k][dst] = self.store[k][src]
        self.state_keys[dst] = self.state_keys[src]
        self.state_keys[src] = frozenset()

    def clear_row(self, slot: int, scrub: bool = False) -> None:
        """Forget row ``slot``'s policy state; with ``scrub``, also zero its storage (after a numerical failure)."""
        self.state_keys[slot] = frozenset()
        if self.last_call_pos is not None:
            self.last_call_pos[slot] = _NEVER
        if scrub and self.is_initialized:
            self.keys[slot].zero_()
            self.values[slot].zero_()
            if self.queries is not None:
                self.queries[slot].zero_()


#: ``last_call_pos`` of a row that has not been evicted on this layer yet (every ring query is then new)
_NEVER = -(2**62)


def _ring_positions(pos: torch.Tensor, last: torch.Tensor, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ring's query positions and the number of new queries, from each row's next position.

    Args:
        pos: ``(B,)`` int64 next position of each row (its sequence length; the newest query is at ``pos - 1``).
        last: ``(B,)`` int64 ``pos`` at the row's previous call on this layer (:data:`_NEVER` before the first).
        window: the ring's size.

    Returns:
        ``(B, window)`` int64: slot ``s`` holds the query of the newest position ``p < pos`` with ``p % window == s``;
        ``(B,)`` int64: ``min(pos - last, window)``.
    """
    newest = (pos - 1)[:, None]
    slots = torch.arange(window, device=pos.device)
    return newest - (newest - slots) % window, (pos - last).clamp(max=window)


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
