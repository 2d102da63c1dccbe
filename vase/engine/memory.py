"""How many rows decode together, and in which dtype: derived from the policy's per-row cache size and the machine.

* :func:`row_bytes` — the static bytes one row of the cache costs (K and V over all layers, plus positions and the
  query ring), from which a KV-memory budget gives the rows: at equal memory a policy that compresses 4x runs ~4x
  the rows of the full cache.
* :func:`plan_rows` — ``max_rows`` (an integer or ``"auto"``) and/or ``kv_memory`` (bytes) → rows in flight.
  ``auto``: on CUDA, as many rows as fit in the free device memory after the weights (less a reserve for
  activations); on CPU :data:`AUTO_CPU_ROWS`, the fastest row count measured on the project's 2-core CPU
  (``scripts/BENCHMARKS.md``, "tok/s against rows").
* :func:`auto_dtype` — ``model.dtype=auto``: bf16 on CUDA; on CPU bf16 where the CPU computes it natively (AMX or
  AVX512-BF16) or when few rows decode together (the weights' bytes dominate), float32 otherwise (on an AVX2-only
  CPU bf16 matmuls are emulated and do not get faster with more rows; float32's do).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from vase.engine.cache import CacheGeometry, aux_bytes_per_row
from vase.engine.policy import Policy

logger = logging.getLogger(__name__)

#: rows in flight for ``max_rows=auto`` on a CPU: the fastest measured on the project's 2-core AVX2 CPU (float32:
#: 45 tok/s at 64 rows, 56 at 96, 67 at 128; scripts/BENCHMARKS.md, "tok/s against rows")
AUTO_CPU_ROWS = 128
#: from this many rows on, float32 beats bf16 on a CPU without native bf16 (measured on the project's AVX2 CPU:
#: bf16 15.7 vs float32 13.7 tok/s at 8 rows, 16.1 vs 26.6 at 16)
CPU_FLOAT32_MIN_ROWS = 12
#: device memory kept free for activations, logits and the prefill's transients (``auto`` rows on CUDA)
CUDA_RESERVE_FRACTION = 0.10
CUDA_RESERVE_MIN_BYTES = 2 * 2**30
#: never plan more rows than this without an explicit ``max_rows``
MAX_AUTO_ROWS = 1024


def row_bytes(geometry: CacheGeometry, policy: Policy) -> int:
    """Static bytes of one row: the cache over every layer type (:attr:`CacheGeometry.kv_bytes_by_type`: K/V, rings,
    a hybrid model's linear-attention state) plus positions and the query ring."""
    return geometry.kv_bytes_per_row + aux_bytes_per_row(geometry, policy)


@dataclass
class RowPlan:
    """The rows a decode runs and why (recorded in the manifest)."""

    rows: int
    reason: str
    row_bytes: int


def plan_rows(
    geometry: CacheGeometry,
    policy: Policy,
    *,
    max_rows: int | str = "auto",
    kv_memory: int | None = None,
    samples: int | None = None,
    device: torch.device | None = None,
) -> RowPlan:
    """Rows in flight for ``geometry``'s capacity (its ``rows`` field is ignored).

    Args:
        max_rows: an integer, or ``"auto"`` (see the module docstring).
        kv_memory: bytes the cache may use; the rows are then ``kv_memory // row_bytes`` (capped by an integer
            ``max_rows``).
        samples: samples left to decode (the rows never exceed it).
        device: where the cache lives (``auto`` rows on CUDA read its free memory).
    """
    per_row = row_bytes(geometry, policy)
    device = device or geometry.device
    if kv_memory is not None:
        rows = kv_memory // per_row
        if rows < 1:
            raise ValueError(
                f"generation.kv_memory: {kv_memory} bytes hold no row of {per_row} bytes (capacity "
                f"{geometry.capacity} tokens); raise it or lower the budget / max_length"
            )
        reason = f"kv_memory {kv_memory} B / {per_row} B per row"
        if isinstance(max_rows, int):
            rows, reason = min(rows, max_rows), reason + f", capped by max_rows={max_rows}"
    elif isinstance(max_rows, int):
        rows, reason = max_rows, "max_rows"
    elif device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = free - max(CUDA_RESERVE_MIN_BYTES, int(CUDA_RESERVE_FRACTION * total))
        rows = max(1, min(MAX_AUTO_ROWS, budget // per_row))
        reason = f"auto: {max(budget, 0)} B free on {device} after a reserve / {per_row} B per row"
    else:
        rows, reason = AUTO_CPU_ROWS, f"auto: {AUTO_CPU_ROWS} rows on CPU (fastest measured)"
    if samples is not None and rows > samples:
        rows, reason = max(1, samples), reason + f", capped by the {samples} samples to decode"
    return RowPlan(rows=int(rows), reason=reason, row_bytes=per_row)


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bf16 matmuls natively (AMX-BF16 or AVX512-BF16)."""
    try:
        caps = torch.cpu.get_capabilities()
        return bool(caps.get("amx_bf16") or caps.get("avx512_bf16"))
    except (AttributeError, RuntimeError):  # older torch: fall back to the coarse capability string
        return "AMX" in str(torch.backends.cpu.get_cpu_capability()).upper()


def auto_dtype(device: torch.device, rows: int) -> tuple[str, str]:
    """``(dtype name, reason)`` for ``model.dtype=auto`` (see the module docstring)."""
    if device.type == "cuda":
        return "bfloat16", "auto: bf16 on CUDA"
    capability = torch.backends.cpu.get_cpu_capability()
    if cpu_has_native_bf16():
        return "bfloat16", f"auto: CPU {capability} with native bf16"
    if rows < CPU_FLOAT32_MIN_ROWS:
        return "bfloat16", f"auto: CPU {capability} without native bf16, {rows} rows (< {CPU_FLOAT32_MIN_ROWS}: bf16)"
    return "float32", f"auto: CPU {capability} without native bf16, {rows} rows (float32 GEMMs scale with rows)"
