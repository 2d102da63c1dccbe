"""The stacked storage of the static cache: one tensor per kind for every layer, and the rows' policy state.

Every layer's K and V live in one tensor ``(rows, layers, H, capacity, D)`` (positions ``(rows, layers, H,
capacity)``, the query ring ``(rows, layers, Hq, window, D)``, each row's position at its last eviction call
``(rows, layers)``); layer ``l``'s :class:`~vase.engine.layer.VaseLayer` works on the views ``keys[:, l]`` etc.
(``(rows, H, capacity, D)``, the shapes a per-layer storage had), so the append and the attention are unchanged and
their addresses are static (the compiled step, :mod:`vase.engine.compiled`).

Why the row axis first: an eviction event (:mod:`vase.engine.evict`) folds the layer axis into the row axis, and
with rows first a contiguous run of rows ``[a, b)`` is ``keys[a:b].view((b - a) * layers, H, capacity, D)``: a view,
no copy (with layers first only the whole cache would fold without a copy). Each layer's view keeps every row's
``(H, capacity, D)`` block contiguous (the kernels read it as before, with a larger row stride).

Only the full-attention layers are in these tensors (``layers`` counts them; the eviction event and the policy see
them alone). Sliding-window layers (gpt-oss, OLMo-3) have a ring of their own, ``ring_keys`` / ``ring_values``
``(rows, sliding layers, H, window, D)`` and ``ring_positions`` ``(rows, sliding layers, H, window)``: the token of
position ``p`` sits in slot ``p % window``, its true position recorded (``-1``: the slot was never written), so the
ring holds exactly the window and a row's valid slots are ``[0, min(next position, window))``. A ring moves and is
cleared with its row and is never touched by a policy. A hybrid model's linear-attention layers hold no tokens: their
fixed per-row state (``linear``, :class:`~vase.engine.linear_state.LinearStates`) moves and is cleared with its row
too.

The policy state (:class:`RowState`): ``{key: (rows, layers, ...) tensor}`` and which keys each (row, layer) has. An
eviction event reads and writes all layers of its rows at once (folded, ``(R * layers, ...)``); a selection policy,
called per layer during the forward, one layer's slice.

This module imports nothing else of the engine: the cache (:mod:`vase.engine.cache`) owns one :class:`CacheStorage`,
the layers and the eviction event use it.
"""

from __future__ import annotations

import torch

#: ``last_call_pos`` of a (row, layer) that has not been evicted yet (every ring query is then new)
NEVER = -(2**62)


class CacheStorage:
    """K, V, positions and the query ring of every layer and row, allocated once (:meth:`allocate`).

    Attributes (``None`` until :meth:`allocate`; ``queries`` / ``last_call_pos`` only with ``window``):
        keys, values: ``(rows, L, H, capacity, D)``, zero filled (masked attention reads past a row's length, so
            those slots must never hold NaN or inf).
        positions: ``(rows, L, H, capacity)`` int64 absolute positions of the held tokens.
        queries: ``(rows, L, Hq, window, D)`` ring of post-RoPE queries (the query of position ``p`` in slot
            ``p % window``).
        last_call_pos: ``(rows, L)`` int64 each (row, layer)'s next position at its last eviction call
            (:data:`NEVER` before the first).
        state: the policies' per-(row, layer) state (:class:`RowState`).
    """

    def __init__(
        self,
        rows: int,
        layers: int,
        heads: int,
        q_heads: int,
        capacity: int,
        head_dim: int,
        window=None,
        ring_layers: int = 0,
        ring_slots: int = 0,
    ):
        self.rows, self.layers, self.heads, self.q_heads = rows, layers, heads, q_heads
        self.capacity, self.head_dim, self.window = capacity, head_dim, window
        self.ring_layers, self.ring_slots = ring_layers, ring_slots
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.positions: torch.Tensor | None = None
        self.queries: torch.Tensor | None = None
        self.last_call_pos: torch.Tensor | None = None
        self.ring_keys: torch.Tensor | None = None
        self.ring_values: torch.Tensor | None = None
        self.ring_positions: torch.Tensor | None = None
        self.state = RowState(rows, layers)
        self.linear = None  # a hybrid model's linear-attention states (vase.engine.linear_state.LinearStates)

    @property
    def allocated(self) -> bool:
        return self.keys is not None

    def allocate(self, dtype: torch.dtype, device: torch.device) -> None:
        """Allocate every tensor once (the first prefill's K/V give the dtype and device)."""
        shape = (self.rows, self.layers, self.heads, self.capacity, self.head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.positions = torch.zeros(shape[:4], dtype=torch.long, device=device)
        if self.window is not None:
            qshape = (self.rows, self.layers, self.q_heads, self.window, self.head_dim)
            self.queries = torch.zeros(qshape, dtype=dtype, device=device)
            self.last_call_pos = torch.full((self.rows, self.layers), NEVER, dtype=torch.long, device=device)
        if self.ring_layers:
            rshape = (self.rows, self.ring_layers, self.heads, self.ring_slots, self.head_dim)
            self.ring_keys = torch.zeros(rshape, dtype=dtype, device=device)
            self.ring_values = torch.zeros(rshape, dtype=dtype, device=device)
            self.ring_positions = torch.full(rshape[:4], -1, dtype=torch.long, device=device)

    def tensors(self) -> list[torch.Tensor]:
        """The stacked tensors that exist (static addresses of the compiled step)."""
        out = [
            t
            for t in (
                self.keys,
                self.values,
                self.positions,
                self.queries,
                self.last_call_pos,
                self.ring_keys,
                self.ring_values,
                self.ring_positions,
            )
            if t is not None
        ]
        return out + (self.linear.tensors() if self.linear is not None else [])

    def kv_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The K and V tensors per layer type (for the accounting: ``{type: [keys, values]}``; a hybrid model's
        ``linear_attention`` entry is its conv and recurrent states)."""
        out = {"full_attention": [self.keys, self.values]} if self.layers else {}
        if self.ring_layers:
            out["sliding_attention"] = [self.ring_keys, self.ring_values]
        if self.linear is not None:
            out["linear_attention"] = self.linear.tensors()
        return out

    def move_row(self, src: int, dst: int, length: int) -> None:
        """Copy row ``src`` (its ``length`` held tokens of every layer, ring, state and linear-attention state) into
        row ``dst``."""
        if self.allocated:
            self.keys[dst, :, :, :length] = self.keys[src, :, :, :length]
            self.values[dst, :, :, :length] = self.values[src, :, :, :length]
            self.positions[dst, :, :, :length] = self.positions[src, :, :, :length]
            if self.queries is not None:
                self.queries[dst] = self.queries[src]
                self.last_call_pos[dst] = self.last_call_pos[src]
            if self.ring_layers:
                self.ring_keys[dst] = self.ring_keys[src]
                self.ring_values[dst] = self.ring_values[src]
                self.ring_positions[dst] = self.ring_positions[src]
        if self.linear is not None:
            self.linear.move_row(src, dst)
        self.state.move_row(src, dst)

    def clear_row(self, slot: int, scrub: bool = False) -> None:
        """Forget row ``slot``'s policy state on every layer (and zero its linear-attention state); with ``scrub``,
        zero its storage (after NaN/inf)."""
        self.state.clear_row(slot)
        if self.linear is not None:
            self.linear.clear_row(slot)
        if self.last_call_pos is not None:
            self.last_call_pos[slot] = NEVER
        if scrub and self.allocated:
            self.keys[slot].zero_()
            self.values[slot].zero_()
            if self.queries is not None:
                self.queries[slot].zero_()
            if self.ring_layers:
                self.ring_keys[slot].zero_()
                self.ring_values[slot].zero_()


class RowState:
    """The policies' state per (row, layer): ``store[key]`` is ``(rows, L, ...)``; ``keys[l][r]`` the keys that
    (row ``r``, layer ``l``) has (an empty set: it never stored anything, e.g. a new sequence).

    ``layer=None`` in :meth:`get` / :meth:`put`: every layer of the rows at once, folded ``(R * L, ...)`` (row-major:
    folded row ``i`` is row ``i // L``, layer ``i % L``), as an eviction event hands them to the policy. An integer
    ``layer``: that layer's ``(R, ...)`` (a selection policy's call). ``idx``: the rows, a slice (views: a policy that
    updates them in place writes the store) or a device index tensor (copies, written back by :meth:`put`).
    """

    def __init__(self, rows: int, layers: int):
        self.rows, self.layers = rows, layers
        self.store: dict[str, torch.Tensor] = {}
        self.keys: list[list[frozenset]] = [[frozenset()] * rows for _ in range(layers)]

    def _rows(self, k: str, idx, layer: int | None) -> torch.Tensor:
        t = self.store[k]
        return t[idx] if layer is None else t[:, layer][idx]

    def get(self, keys: frozenset, idx, n: int, layer: int | None) -> dict:
        """The state of ``n`` rows ``idx`` that have ``keys``: ``{key: (n * L or n, ...)}``."""
        out = {}
        for k in keys:
            t = self._rows(k, idx, layer)
            out[k] = t.reshape(n * self.layers, *t.shape[2:]) if layer is None else t
        return out

    def put(self, slots: list[int], idx, state: dict, layer: int | None, name: str) -> None:
        """Store the state of rows ``slots`` (``idx``) after a policy call (no copy when it updated the views)."""
        n = len(slots)
        b = n * self.layers if layer is None else n
        for k, v in state.items():
            if not isinstance(v, torch.Tensor) or v.dim() == 0 or v.shape[0] != b:
                raise RuntimeError(
                    f"policy {name}: state[{k!r}] must be a tensor with the call's {b} rows first, got "
                    f"{type(v).__name__} {tuple(getattr(v, 'shape', ()))}"
                )
            store = self.store.get(k)
            if store is None:
                store = torch.zeros((self.rows, self.layers, *v.shape[1:]), dtype=v.dtype, device=v.device)
                self.store[k] = store
            elif store.shape[2:] != v.shape[1:] or store.dtype != v.dtype:
                raise RuntimeError(
                    f"policy {name}: state[{k!r}] changed its per-row shape or dtype from {tuple(store.shape[2:])} "
                    f"{store.dtype} to {tuple(v.shape[1:])} {v.dtype}; allocate it at its final size"
                )
            target = store if layer is None else store[:, layer]
            if layer is None:
                v = v.reshape(n, self.layers, *v.shape[1:])
            if isinstance(idx, slice):
                if v.data_ptr() != target[idx].data_ptr():
                    target[idx] = v
            else:
                target.index_copy_(0, idx, v.contiguous())
        keys = frozenset(state)
        for li in range(self.layers) if layer is None else (layer,):
            row_keys = self.keys[li]
            for r in slots:
                row_keys[r] = keys

    def layer_views(self, layer: int, n: int) -> dict[str, torch.Tensor]:
        """``{key: (n, ...) view}`` of rows ``[0, n)`` on ``layer`` for every key of the store (a selection policy's
        state at a decode step: every row has every key, made at its prefill)."""
        return {k: t[:n, layer] for k, t in self.store.items()}

    def fill(self, slots: list[int], idx, state: dict, layer: int, name: str) -> None:
        """Give rows ``slots`` (``idx``) on ``layer`` the state ``{key: (1, ...) tensor}`` (one prompt's, the same for
        each of its rows)."""
        n = len(slots)
        self.put(slots, idx, {k: v.expand(n, *v.shape[1:]) for k, v in state.items()}, layer, name)

    def move_row(self, src: int, dst: int) -> None:
        for t in self.store.values():
            t[dst] = t[src]
        for row_keys in self.keys:
            row_keys[dst] = row_keys[src]
            row_keys[src] = frozenset()

    def clear_row(self, slot: int) -> None:
        for row_keys in self.keys:
            row_keys[slot] = frozenset()

    def clear_layer(self, layer: int) -> None:
        self.keys[layer] = [frozenset()] * self.rows
