"""Record which tokens each eviction keeps (opt-in during a run: ``record_kept=true``).

The analysis of the recorded sets (Jaccard overlap across heads, layers and samples) is
:mod:`vase.analysis.diversity`; this module is the recording side used by the runner.
"""

from __future__ import annotations

import logging
import re
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

logger = logging.getLogger(__name__)

KEPT_SETS_DIR = "kept_sets"
KEPT_SETS_FILE = "kept_sets.npz"


@dataclass
class KeptEvent:
    """One recorded eviction of one layer.

    Attributes:
        problem_id: the problem being decoded.
        layer: layer index.
        index: the layer's eviction count at this event (0 = first eviction).
        samples: ``(rows,)`` sample index of each live row.
        kept: ``(rows, H, K)`` int32 kept absolute positions, sorted along the last axis.
    """

    problem_id: str
    layer: int
    index: int
    samples: np.ndarray
    kept: np.ndarray


class KeptSetRecorder:
    """Record the kept positions at evictions (attach to a :class:`vase.engine.cache.VaseCache`).

    Args:
        every: record the layer's evictions ``0, every, 2*every, ...`` only.
        max_events_per_layer: keep at most the last ``n`` recorded events per (problem, layer) (``None`` = all);
            the default 1 keeps only the last eviction, which caps memory at one kept set per (layer, row, head).
        layers: record only these layers (``None`` = all).
    """

    def __init__(self, every: int = 1, max_events_per_layer: int | None = 1, layers: Sequence[int] | None = None):
        if every < 1:
            raise ValueError(f"record_kept.every: must be >= 1, got {every}")
        if max_events_per_layer is not None and max_events_per_layer < 1:
            raise ValueError(f"record_kept.max_events_per_layer: must be >= 1 or None, got {max_events_per_layer}")
        self.every = every
        self.max_events_per_layer = max_events_per_layer
        self.layers = None if layers is None else {int(x) for x in layers}
        self.events: list[KeptEvent] = []
        self._problem = ""
        self._rows: list[int] = []
        self._counts: dict[int, int] = defaultdict(int)

    def attach(self, cache, problem_id: str = "", samples: Sequence[int] | None = None) -> None:
        """Start recording ``cache``'s evictions (sets ``cache.on_evict``).

        Rows that finish leave the batch: the sample index of each live row is read from ``cache.row_ids`` (set here
        to ``samples``; the cache keeps it in step with ``select_rows``). No reference to the cache is kept.

        Args:
            cache: a freshly built :class:`vase.engine.cache.VaseCache` (use generate's ``on_cache`` hook).
            problem_id: recorded with every event.
            samples: the sample index of each row (default ``0..rows-1``).
        """
        self._problem = str(problem_id)
        self._rows = list(samples) if samples is not None else list(range(cache.geometry.rows))
        if len(self._rows) != cache.geometry.rows:
            raise ValueError(f"samples: {len(self._rows)} sample ids for a cache of {cache.geometry.rows} rows")
        self._counts = defaultdict(int)
        cache.on_evict = self._on_evict
        cache.row_ids = list(self._rows)  # the cache keeps it in step with select_rows

    def _on_evict(self, layer, idx, kept_positions) -> None:
        li = int(layer.layer_idx)
        count = self._counts[li]
        self._counts[li] += 1
        if (self.layers is not None and li not in self.layers) or count % self.every:
            return
        kept = np.sort(kept_positions.detach().to("cpu").numpy().astype(np.int32), axis=-1)
        samples = np.asarray(layer.owner.row_ids[: kept.shape[0]], dtype=np.int32)
        self.events.append(KeptEvent(self._problem, li, count, samples, kept))
        if self.max_events_per_layer is not None:
            mine = [i for i, e in enumerate(self.events) if e.problem_id == self._problem and e.layer == li]
            for i in reversed(mine[: -self.max_events_per_layer]):
                del self.events[i]

    def nbytes(self) -> int:
        """Memory held by the recorded kept sets."""
        return sum(e.kept.nbytes + e.samples.nbytes for e in self.events)

    def clear(self) -> None:
        """Forget the recorded events (e.g. after :meth:`dump` of a problem)."""
        self.events = []

    def dump(self, path: str | Path) -> Path:
        """Write the recorded events to an ``.npz`` (see :func:`load_kept_sets`); return the path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        arrays: dict[str, np.ndarray] = {
            "problem_id": np.array([e.problem_id for e in self.events], dtype=str),
            "layer": np.array([e.layer for e in self.events], dtype=np.int32),
            "index": np.array([e.index for e in self.events], dtype=np.int32),
        }
        for i, e in enumerate(self.events):
            arrays[f"kept_{i}"] = e.kept
            arrays[f"samples_{i}"] = e.samples
        tmp = path.with_name(path.name + ".tmp.npz")
        np.savez_compressed(tmp, **arrays)
        tmp.replace(path)
        logger.info("kept sets: %d events (%.1f MiB) -> %s", len(self.events), self.nbytes() / 2**20, path)
        return path


def kept_sets_path(run_dir: str | Path, problem_id: str) -> Path:
    """Where a run stores one problem's kept sets: ``<run_dir>/kept_sets/<problem_id>.npz`` (id made file-safe)."""
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", str(problem_id)) or "problem"
    return Path(run_dir) / KEPT_SETS_DIR / f"{safe}.npz"


def load_kept_sets(path: str | Path) -> list[KeptEvent]:
    """The events of one ``.npz`` written by :meth:`KeptSetRecorder.dump`."""
    with np.load(path) as z:
        n = len(z["layer"])
        return [
            KeptEvent(
                str(z["problem_id"][i]), int(z["layer"][i]), int(z["index"][i]), z[f"samples_{i}"], z[f"kept_{i}"]
            )
            for i in range(n)
        ]
