"""An eviction event: the rows that evict together, every layer at once.

The cache (:mod:`vase.engine.cache`) decides which rows are due after a decode step; :func:`evict_rows` groups them
(the same held length, the same pinned prompt length with ``keep_prompt``, the same kind of policy state) and runs
one event per group for all layers: the layer axis is folded into the row axis of the stacked storage
(:mod:`vase.engine.storage`, rows first, so a contiguous run of ``R`` rows is a ``(R * L, H, capacity, D)`` view),
the policy's :meth:`~vase.engine.policy.EvictionPolicy.keep` is called once on the ``R * L`` folded rows (folded row
``i`` is row ``slots[i // L]`` on layer ``i % L``; ``EvictionInputs.layer_ids`` says which), and one gather and one
scatter per buffer (K, V, positions) compact every layer of every row: the kept candidates to slots
``[pinned, budget - window)``, the recent window behind them (``window`` here is the policy's
:attr:`~vase.engine.policy.EvictionPolicy.protected_window`: ``window`` unless it declares ``protect_recent``).

Randomness: one draw per policy call for all folded rows, row ``i`` keyed by its row's eviction key, its position
and its layer as stream (:class:`~vase.engine.rng.RowRNG` with a stream tensor): the same numbers a per-layer call
drew, so a row's draws still never depend on its batch-mates.

On a CPU the gather and scatter run in pieces of whole folded rows of about :data:`CPU_MOVE_BYTES` (each folded
row's source and destination slots lie in its own line of the storage, so pieces are independent): one gather of an
event's every layer is a working set of the whole cache (150 MB at Qwen3-4B's KV geometry and 4 rows), which runs at
DRAM speed, where a cache-sized piece is read back from the CPU's cache by its scatter. On CUDA it stays one call.

No host synchronisation: the row groups come from host lists, the index tensors from :meth:`VaseCache.index` (one
upload per group and step), everything else is device math. The cache is passed in (duck-typed); this module imports
no other engine module but the policy interface and the RNG.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from vase.engine.policy import EvictionInputs
from vase.engine.rng import RowRNG

#: bytes of one buffer's gathered tokens moved per piece on a CPU (see the module docstring); CUDA moves all at once
CPU_MOVE_BYTES = 4 << 20


def evict_rows(cache: Any, slots: list[int], observe: bool = False) -> None:
    """Evict rows ``slots`` of ``cache`` (a :class:`~vase.engine.cache.VaseCache`; each row due) on every layer.

    Rows are handed to the policy together when they hold the same length, pin the same number of leading slots
    (their prompt with ``keep_prompt``, else none) and have the same state keys. ``observe``: an accumulating
    policy's observation instead (``keep()`` with ``n_keep`` = every candidate; nothing moves, nothing is counted as
    an eviction).
    """
    keep_prompt = cache.policy.keep_prompt
    state_keys = cache.storage.state.keys[0]  # every layer of a row evicts together: the same keys on all
    groups: dict[tuple, list[int]] = {}
    for r in slots:
        pinned = cache.prompt_lens[r] if keep_prompt else 0
        groups.setdefault((state_keys[r], cache.lengths[r], pinned), []).append(r)
    for (keys, length, pinned), group in groups.items():
        _evict_group(cache, group, keys, length, pinned, observe)


def _evict_group(
    cache: Any, slots: list[int], state_keys: frozenset, length: int, pinned: int, observe: bool = False
) -> None:
    """One event: rows ``slots``, each holding ``length`` tokens of which the first ``pinned`` are never candidates
    (``observe``: the policy sees every candidate kept and nothing moves)."""
    policy, st = cache.policy, cache.storage
    n_layers, heads, cap = st.layers, st.heads, st.capacity
    # the recent tokens the engine protects: ``window``, or fewer when the policy declares ``protect_recent`` (the query
    # ring below keeps ``policy.window``)
    window, budget = policy.protected_window, policy.budget
    n_cand, n_keep = length - window - pinned, budget - window - pinned
    if observe:
        n_keep = n_cand
    start = cache.clock.start()
    idx = cache.index(slots)  # a slice (contiguous rows) or a device tensor built once per step
    n = len(slots)
    rows = n * n_layers  # folded: row i is slots[i // L] on layer i % L

    def fold(t: torch.Tensor | None) -> torch.Tensor | None:
        """``(rows_total, L, ...)`` → ``(R * L, ...)`` of these rows: a view for a slice, else a copy."""
        if t is None:
            return None
        sub = t[idx] if isinstance(idx, slice) else t.index_select(0, idx)
        return sub.view(rows, *t.shape[2:])

    keys, values, positions = fold(st.keys), fold(st.values), fold(st.positions)
    layer_ids = cache.fold_layer_ids[:rows]  # (R * L,) int64: the model's index of full layer i % L
    pos = cache.pos_t[idx]  # (R,)
    pos_rows = pos[:, None].expand(n, n_layers).reshape(rows)
    key_rows = cache.evict_key[idx][:, None].expand(n, n_layers, 2).reshape(rows, 2)
    queries = fold(st.queries)
    query_positions = n_new = None
    if queries is not None:  # positions of the ring's slots and the queries new since the last call (no sync)
        query_positions, n_new = ring_positions(pos_rows, fold(st.last_call_pos), policy.window)
        st.last_call_pos[idx] = pos[:, None]
    state = st.state.get(state_keys, idx, n, None)
    cand = slice(pinned, pinned + n_cand)
    inputs = EvictionInputs(
        keys=keys[:, :, cand],
        values=values[:, :, cand],
        positions=positions[:, :, cand],
        n_keep=n_keep,
        layer_idx=None,
        layer_ids=layer_ids,
        layers_per_row=n_layers,
        capacity=cap,
        scaling=cache.scaling,
        # noise keyed by (row's eviction key, row's position now, layer): never by its batch-mates
        rng=RowRNG(key_rows, pos_rows, stream=layer_ids),
        state=state,
        queries=queries,
        score_dtype=cache.score_dtype,
        window_keys=keys[:, :, length - window : length],
        window_positions=positions[:, :, length - window : length],
        query_positions=query_positions,
        n_new_queries=n_new,
        head_span=None if cache.geometry.heads is None else (cache.geometry.heads.offset, cache.geometry.heads.total),
    )
    keep = policy.keep(inputs)
    if cache.check_policy_output:
        check_keep(keep, rows, heads, n_keep, n_cand, policy.name)
    st.state.put(slots, idx, state, None, policy.name)
    if observe:
        cache.clock.stop(start, functools.partial(_credit, cache, list(slots)))
        return
    # Every layer of every row at once, in the storage flattened to (rows_total * L * H * capacity, ...): slots
    # [pinned, budget) take the kept candidates, then the recent window [length - window, length). The source is
    # gathered (copied) before the scatter, so the ranges may overlap (an eviction of fewer than ``window`` tokens).
    dev = keep.device
    folded = fold_rows(cache, idx, n)  # (R * L,) rows of the storage folded (rows_total * L)
    base = (folded[:, None] * heads + torch.arange(heads, device=dev)).mul_(cap)  # (R * L, H)
    recent = torch.arange(length - window, length, device=dev).expand(rows, heads, window)
    src = torch.cat((keep + pinned if pinned else keep, recent), dim=2).add_(base[:, :, None]).view(-1)
    dst = (base[:, :, None] + torch.arange(pinned, budget, device=dev)).view(-1)
    line = heads * (budget - pinned)  # tokens moved per folded row
    for buf in (st.keys, st.values, st.positions):
        flat = buf.view(-1, buf.shape[-1]) if buf.dim() == 5 else buf.view(-1)
        piece = rows
        if dev.type == "cpu":  # whole folded rows per piece, about CPU_MOVE_BYTES (module docstring)
            piece = max(1, CPU_MOVE_BYTES // (line * flat[:1].numel() * flat.element_size()))
        for a in range(0, rows, piece):
            part = slice(a * line, (a + piece) * line)
            flat.index_copy_(0, dst[part], flat.index_select(0, src[part]))
    for layer in cache.evicting_layers:  # the full-attention layers (sliding layers are never evicted)
        layer.counters.evictions += n
    cache.record_eviction(slots, n_layers)
    cache.clock.stop(start, functools.partial(_credit, cache, list(slots)))
    if cache.on_evict is not None:  # per layer, as the analyses expect; the kept positions, now in slots dst
        kept_p = st.positions.view(-1).index_select(0, dst).view(n, n_layers, heads, budget - pinned)[..., :n_keep]
        per_layer = keep.view(n, n_layers, heads, n_keep)
        shard = cache.geometry.heads
        if shard is not None:  # tensor parallelism: every head of the model, as one process records (one collective)
            kept_p, per_layer = (gather_heads(t, shard.group, shard.ranks) for t in (kept_p, per_layer))
        row_ids = [cache.row_ids[r] for r in slots]
        for li, layer in enumerate(cache.evicting_layers):
            cache.on_evict(layer, row_ids, per_layer[:, li], kept_p[:, li])


def gather_heads(t: torch.Tensor, group: Any, ranks: int) -> torch.Tensor:
    """``(n, L, H, K)`` of this rank's heads → ``(n, L, ranks * H, K)`` of the model's every head (ranks in head
    order): one all-gather over the tensor-parallel ``group``."""
    import torch.distributed as dist

    parts = [torch.empty_like(t) for _ in range(ranks)]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=2)


def _credit(cache: Any, slots: list[int], seconds: float) -> None:
    """An event's ``seconds``: shared evenly by its layers' counters and by its rows (:meth:`credit_seconds`)."""
    share = seconds / len(cache.evicting_layers)
    for layer in cache.evicting_layers:
        layer.counters.eviction_seconds += share
    cache.credit_seconds(slots, seconds)


def fold_rows(cache: Any, idx, n: int) -> torch.Tensor:
    """``(n * L,)`` int64: the folded storage rows ``slot * L + layer`` of rows ``idx`` (a slice: a view)."""
    n_layers = cache.storage.layers
    if isinstance(idx, slice):
        return cache.fold_row_ids[idx.start * n_layers : (idx.start + n) * n_layers]
    return (idx[:, None] * n_layers + cache.fold_local_ids[:n_layers]).view(-1)


def seed_prefill(cache: Any, layer: Any, query: torch.Tensor, key: torch.Tensor, scaling: float) -> None:
    """An accumulating policy's state of ``layer`` (full attention) from the prefill: every prompt query's attention.

    ``query``: ``(1, Hq, P, D)`` the prompt's post-RoPE queries; ``key``: ``(1, H, P, D)`` its keys. The causal
    softmax column sums (:func:`prefill_column_sums`) go to the policy's :meth:`prefill_state`, whose state every row
    of the prompt starts with; the rows' last call is set to the prompt's end, so the query ring's prompt queries are
    not counted again at the first call.
    """
    policy, st = cache.policy, cache.storage
    slots, p = cache.prefilling, key.shape[2]
    attention = prefill_column_sums(query, key, scaling)
    positions = torch.arange(p, device=key.device).expand(1, key.shape[1], p)
    state = policy.prefill_state(positions, attention, st.capacity)
    idx = cache.index(slots)
    st.state.fill(list(slots), idx, state, layer.store_idx, policy.name)
    if layer.last_call_pos is not None:
        layer.last_call_pos[idx] = p


#: elements of one chunk of prefill attention probabilities (:func:`prefill_column_sums`)
PREFILL_CHUNK_ELEMS = 1 << 24


def prefill_column_sums(query: torch.Tensor, key: torch.Tensor, scaling: float) -> torch.Tensor:
    """The attention each key receives from every query of a causal pass, summed over the queries and the query heads
    of its KV head, in chunks of queries (at most :data:`PREFILL_CHUNK_ELEMS` probabilities at a time; the ``P x P``
    matrix is never materialised).

    Args:
        query: ``(1, Hq, T, D)`` the queries of the last ``T`` of the ``P`` positions; key: ``(1, H, P, D)``.

    Returns:
        ``(1, H, P)`` float32 (float64 for float64 inputs).
    """
    _, hq, t, d = query.shape
    h, p = key.shape[1], key.shape[2]
    dt = torch.promote_types(query.dtype, torch.float32)
    q, k = query[0].to(dt).view(h, hq // h, t, d), key[0].to(dt)
    out = torch.zeros(h, p, dtype=dt, device=key.device)
    chunk = max(1, PREFILL_CHUNK_ELEMS // (hq * p))
    cols = torch.arange(p, device=key.device)
    for a in range(0, t, chunk):
        b = min(t, a + chunk)
        logits = torch.einsum("hgtd,hpd->hgtp", q[:, :, a:b], k) * scaling
        future = cols[None, :] > torch.arange(p - t + a, p - t + b, device=key.device)[:, None]
        out += logits.masked_fill(future, float("-inf")).softmax(dim=-1).sum(dim=(1, 2))
    return out[None]


def ring_positions(pos: torch.Tensor, last: torch.Tensor, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ring's query positions and the number of new queries, from each row's next position.

    Args:
        pos: ``(B,)`` int64 next position of each row (its sequence length; the newest query is at ``pos - 1``).
        last: ``(B,)`` int64 ``pos`` at the row's previous call on this layer (:data:`~vase.engine.storage.NEVER`
            before the first).
        window: the ring's size.

    Returns:
        ``(B, window)`` int64: slot ``s`` holds the query of the newest position ``p < pos`` with ``p % window == s``;
        ``(B,)`` int64: ``min(pos - last, window)``.
    """
    newest = (pos - 1)[:, None]
    slots = torch.arange(window, device=pos.device)
    return newest - (newest - slots) % window, (pos - last).clamp(max=window)


def check_keep(idx: torch.Tensor, rows: int, heads: int, n_keep: int, n_cand: int, name: str) -> None:
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
