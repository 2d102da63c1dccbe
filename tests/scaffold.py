"""The engine's eviction scaffold, step by step in plain tensors: ``keep()`` called repeatedly with its state carried.

:func:`run_scaffold` appends one token per step to each row, evicts on the policy's schedule (held > budget and the
sequence length a multiple of ``E``) and builds each call's :class:`EvictionInputs` as ``vase.engine.layer`` does:
candidates = the held tokens but the pinned prompt and the ``window`` newest, the query ring (slot ``p % window``),
its positions, the number of queries new since the last call, the window's keys and positions. The kept candidates
then go to the front in the order ``keep()`` returned them, the window behind them (the storage-order rule).
Every token's key, value and query comes from its row's own generator, so a row run alone sees the same data.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from vase.engine.policy import EvictionInputs
from vase.engine.rng import EVICT_SALT, RowRNG, row_keys


@dataclass
class Call:
    inputs: EvictionInputs
    keep: torch.Tensor
    held_after: torch.Tensor  # (B, H, budget) positions in storage order after the eviction
    state_shapes: dict = field(default_factory=dict)


@dataclass
class RowData:
    keys: torch.Tensor  # (B, H, T, D)
    values: torch.Tensor  # (B, H, T, D)
    queries: torch.Tensor  # (B, Hq, T, D)


def row_data(seeds: list[int], h: int, hq: int, total: int, dim: int) -> RowData:
    """Per-position keys, values and queries of each row, from a generator seeded by the row's seed alone."""
    ks, vs, qs = [], [], []
    for s in seeds:
        g = torch.Generator().manual_seed(1000 + s)
        ks.append(torch.randn(h, total, dim, generator=g))
        v = torch.randn(h, total, dim, generator=g)
        v[:, ::7] *= 6.0  # a few large value states
        vs.append(v)
        qs.append(torch.randn(hq, total, dim, generator=g))
    return RowData(torch.stack(ks), torch.stack(vs), torch.stack(qs))


def _take(buf: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """``buf (B, H, T, D)`` at ``pos (B, H, N)`` → ``(B, H, N, D)``."""
    return buf.gather(2, pos[..., None].expand(*pos.shape, buf.shape[-1]))


def run_scaffold(
    policy, seeds: list[int], h: int, hq: int, calls: int = 4, prompt: int = 24, dim: int = 16
) -> list[Call]:
    """Drive ``policy.keep`` through ``calls`` evictions of rows ``seeds`` (prompts of ``prompt`` tokens)."""
    b, w, budget, every = len(seeds), policy.window, policy.budget, policy.eviction_period
    pinned = prompt if policy.keep_prompt else 0
    total = prompt + budget + (calls + 2) * max(every, w) + 8
    data = row_data(seeds, h, hq, total, dim)
    keys = torch.tensor(row_keys(seeds, EVICT_SALT), dtype=torch.long)
    held = torch.arange(prompt).expand(b, h, prompt).clone()
    pos, last, state, out = prompt, None, {}, []
    while len(out) < calls:
        held = torch.cat([held, torch.full((b, h, 1), pos)], dim=-1)  # a decode step appends position pos
        pos += 1
        if not (held.shape[-1] > budget and pos % every == 0):
            continue
        cand, win = held[..., pinned:-w], held[..., -w:]
        newest = pos - 1
        ring = newest - (newest - torch.arange(w)) % w  # (W,): slot s holds the newest p with p % W == s
        n_new = w if last is None else min(pos - last, w)
        last = pos
        inputs = EvictionInputs(
            keys=_take(data.keys, cand),
            values=_take(data.values, cand),
            positions=cand,
            n_keep=budget - w - pinned,
            layer_idx=0,
            scaling=dim**-0.5,
            rng=RowRNG(keys, torch.full((b,), pos), stream=0),
            state=state,
            queries=data.queries[:, :, ring] if policy.needs_queries else None,
            window_keys=_take(data.keys, win),
            window_positions=win,
            query_positions=ring.expand(b, w).clone() if policy.needs_queries else None,
            n_new_queries=torch.full((b,), n_new) if policy.needs_queries else None,
        )
        idx = policy.keep(inputs)
        held = torch.cat([held[..., :pinned], cand.gather(-1, idx), win], dim=-1)
        shapes = {k: (tuple(v.shape), v.dtype) for k, v in state.items()}
        out.append(Call(inputs, idx, held.clone(), shapes))
    return out
