"""Per-token policy state that follows the tokens through evictions, keyed by their absolute positions.

An eviction policy's ``inputs.state`` holds row-first tensors of a fixed per-row shape, while the number of
candidates ``N`` changes from call to call (the prompt plus the steps so far at a row's first eviction, ``budget -
window + E`` after it) and the engine reorders the kept tokens (the storage-order rule, ``docs/policies.md``). A
value per token (H2O's accumulated attention, a running mean, a counter) is therefore stored as pairs
``(position, value)`` of a fixed size and looked up by position at the next call:

.. code-block:: python

    acc = TokenState("h2o")                              # stores state["h2o.pos"], state["h2o.val"]
    held = torch.cat([inputs.positions, inputs.window_positions], dim=-1)   # (B, H, N + window)
    score = acc.read(inputs, held) + new_score           # 0 for tokens never stored
    idx = ...                                            # (B, H, n_keep) the candidates kept
    acc.write_kept(inputs, idx, score)                   # the kept candidates' and the window's values

Positions are unique per (row, KV head) and never reused, so a lookup is exact; no host synchronisation (sort +
``searchsorted``, shapes fixed by the inputs).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vase.engine.policy import EvictionInputs


def lookup(
    stored_pos: torch.Tensor, stored_val: torch.Tensor, positions: torch.Tensor, fill: float = 0.0
) -> torch.Tensor:
    """The stored value of each position, ``fill`` where the position is not stored.

    Args:
        stored_pos: ``(B, H, C)`` int64 stored positions (``-1`` = an empty slot).
        stored_val: ``(B, H, C)`` their values.
        positions: ``(B, H, N)`` int64 positions to look up (``>= 0``).
        fill: the value of a position that is not stored.

    Returns:
        ``(B, H, N)`` in ``stored_val``'s dtype.
    """
    sorted_pos, order = stored_pos.sort(dim=-1)
    sorted_val = stored_val.gather(-1, order)
    at = torch.searchsorted(sorted_pos, positions.contiguous()).clamp(max=stored_pos.shape[-1] - 1)
    hit = sorted_pos.gather(-1, at) == positions
    return torch.where(hit, sorted_val.gather(-1, at), torch.full_like(sorted_val[..., :1], fill))


@dataclass(frozen=True)
class TokenState:
    """A value per held token, carried in ``inputs.state`` from one eviction call to the next.

    Attributes:
        key: prefix of the two state entries, ``f"{key}.pos"`` (int64) and ``f"{key}.val"``, both ``(B, H, C)``.
        fill: the value of a token that was never stored (new since the last call, or the row's first call).
    """

    key: str
    fill: float = 0.0

    def read(self, inputs: EvictionInputs, positions: torch.Tensor) -> torch.Tensor:
        """``(B, H, N)`` float32 stored values of the tokens at ``positions`` ``(B, H, N)`` (``fill`` if unknown)."""
        pos = inputs.state.get(f"{self.key}.pos")
        if pos is None:
            return torch.full(positions.shape, self.fill, dtype=torch.float32, device=positions.device)
        return lookup(pos, inputs.state[f"{self.key}.val"], positions, self.fill)

    def write(self, inputs: EvictionInputs, positions: torch.Tensor, values: torch.Tensor) -> None:
        """Store ``values`` ``(B, H, C)`` at ``positions`` ``(B, H, C)``; ``C`` is fixed for a row's life (padded to
        ``inputs.capacity`` when the engine gives it: the same for every call of the run)."""
        inputs.state.update(self.initial(positions, values, inputs.capacity))

    def initial(self, positions: torch.Tensor, values: torch.Tensor, capacity: int | None = None) -> dict:
        """The state entries for ``values`` ``(B, H, C)`` at ``positions``, padded to ``capacity`` slots (empty slots:
        position ``-1``, never looked up) when given; e.g. a policy's :meth:`prefill_state`."""
        positions, values = positions.to(torch.long), values.to(torch.float32)
        pad = 0 if capacity is None else capacity - positions.shape[-1]
        if pad > 0:
            positions = torch.nn.functional.pad(positions, (0, pad), value=-1)
            values = torch.nn.functional.pad(values, (0, pad))
        return {f"{self.key}.pos": positions, f"{self.key}.val": values}

    def write_kept(self, inputs: EvictionInputs, keep: torch.Tensor, values: torch.Tensor) -> None:
        """Store the values of the tokens the row holds after this eviction: the kept candidates and the window.

        Args:
            inputs: this call's inputs (``positions`` and ``window_positions`` are read).
            keep: ``(B, H, n_keep)`` the indices :meth:`~vase.engine.policy.EvictionPolicy.keep` returns.
            values: ``(B, H, N + window)``, the candidates' values then the window's (the order of
                ``torch.cat([inputs.positions, inputs.window_positions], -1)``).
        """
        n = inputs.positions.shape[-1]
        pos = torch.cat([inputs.positions.gather(-1, keep), inputs.window_positions], dim=-1)
        val = torch.cat([values[..., :n].gather(-1, keep), values[..., n:]], dim=-1)
        self.write(inputs, pos, val)
