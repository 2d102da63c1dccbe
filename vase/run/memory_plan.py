"""The memory plan of a run: weights + cache + linear / sliding state + a workspace reserve against one device.

Pure arithmetic on numbers the preflight measures before anything loads (:func:`vase.run.preflight.check_memory`):
the weights per rank (:func:`vase.parallel.weight_bytes`, counted from the config on the meta device; under tensor
parallelism a rank holds its slice of the split parameters and the whole of the replicated ones), one row's cache
(every layer type: full-attention K/V and positions, the sliding layers' ring, a hybrid model's linear-attention
state; :func:`vase.engine.memory.row_bytes`), the rows in flight and the device's free memory. A plan that cannot fit
is a one-line ``ValueError`` with the numbers and the options; ``scripts/memory_table.py`` prints the presets' table
(docs/scaling.md) from the same functions.
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 2**30
#: the workspace kept free beside weights and cache on a GPU: activations of a prefill, the allocator's slack,
#: CUDA context and kernels' workspaces (a fraction of the device, at least RESERVE_MIN)
RESERVE_FRACTION = 0.08
RESERVE_MIN = 2 * GIB


def reserve_bytes(device_bytes: int, gpu: bool = True) -> int:
    """The workspace reserve of a device of ``device_bytes``: :data:`RESERVE_FRACTION` of it, at least
    :data:`RESERVE_MIN`, on a GPU; 0 on the CPU (host memory is not carved up ahead of time)."""
    return max(RESERVE_MIN, int(device_bytes * RESERVE_FRACTION)) if gpu else 0


@dataclass(frozen=True)
class MemoryPlan:
    """What one rank holds (bytes): ``weights`` + ``rows`` x ``row`` (cache and state per row) + ``reserve``,
    against ``free``."""

    weights: int
    row: int
    rows: int
    reserve: int
    free: int
    tensor: int = 1

    @property
    def total(self) -> int:
        return self.weights + self.rows * self.row + self.reserve

    @property
    def max_rows(self) -> int:
        """Rows that fit beside the weights and the reserve (0: not even one)."""
        room = self.free - self.weights - self.reserve
        return max(0, room // self.row) if self.row > 0 else 0


def _g(n: float) -> str:
    return f"{n / GIB:.1f} GiB"


def plan_memory(
    weights: int, row: int, rows: int, free: int, reserve: int, tensor: int = 1, rows_setting: str = "max_rows"
) -> MemoryPlan:
    """The plan of one rank, or a one-line ``ValueError`` when it cannot fit ``free``.

    Args:
        weights: the weights this rank holds (bytes).
        row: one row's cache and state on this rank (bytes).
        rows: rows in flight (``generation.max_rows``; 1 for ``auto``, which sizes itself after loading).
        free: the device's free memory (bytes).
        reserve: the workspace kept free (:func:`reserve_bytes`).
        tensor: ``parallel.tensor`` (for the options the message names).
        rows_setting: how the rows were set (named in the message).
    """
    plan = MemoryPlan(weights, row, rows, reserve, free, tensor)
    if plan.total <= free:
        return plan
    more = f"a larger parallel.tensor (now {tensor}) or a quantised checkpoint"
    if weights + reserve > free:
        raise ValueError(
            f"memory plan: the weights alone are {_g(weights)} per rank (+ {_g(reserve)} workspace reserve) on a "
            f"device with {_g(free)} free; use {more}"
        )
    fit = plan.max_rows
    raise ValueError(
        f"memory plan: {_g(weights)} of weights + {rows} rows x {_g(row)} of cache ({rows_setting}) + {_g(reserve)} "
        f"reserve = {_g(plan.total)} per rank, more than the {_g(free)} free; "
        + (f"use at most generation.max_rows={fit}, " if fit else "")
        + f"a higher ratio (a smaller budget), {more}"
    )
