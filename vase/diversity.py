"""Cache diversity: record which tokens each eviction keeps, and measure how much the kept sets overlap.

Recording (opt-in, during a run)::

    recorder = KeptSetRecorder(every=1, max_events_per_layer=1)        # the last eviction per layer
    out = generate(model, ids, policy, n_samples=n, ...,
                   on_cache=lambda cache: recorder.attach(cache, problem_id=problem.id, samples=missing))
    recorder.dump(kept_sets_path(run_dir, problem.id))                  # <run_dir>/kept_sets/<problem>.npz
    recorder.clear()

At each eviction the cache calls ``cache.on_evict(layer, idx, kept_positions)`` with ``kept_positions
(rows, H, budget - window)``: the absolute positions of the candidates kept. The recorder stores them as sorted int32
arrays together with the layer, the layer's eviction index (all layers evict at the same decode steps, so equal
indices are simultaneous) and the sample index of each live row (rows that finish leave the batch: the recorder
reads ``cache.row_ids``, which the cache keeps in step with ``select_rows``).

Analysis: the mean Jaccard overlap ``|A ∩ B| / |A ∪ B|`` of kept sets

* across heads: pairs of KV heads of the same (event, layer, row);
* across layers: pairs of layers of the same (problem, eviction index, sample, head);
* across samples: pairs of samples (rows) of the same (problem, eviction index, layer, head).

A deterministic policy keeps similar sets everywhere (high overlap); a stochastic one diversifies them.
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
    """Record the kept positions at evictions (attach to a :class:`vase.cache.VaseCache`).

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
            cache: a freshly built :class:`vase.cache.VaseCache` (use generate's ``on_cache`` hook).
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


# ------------------------------------------------------------------------------------------------- Jaccard


def jaccard(a: np.ndarray, b: np.ndarray) -> float:
    """``|A ∩ B| / |A ∪ B|`` of two sets of positions (1.0 for two empty sets)."""
    sa, sb = set(np.asarray(a).ravel().tolist()), set(np.asarray(b).ravel().tolist())
    union = len(sa | sb)
    return len(sa & sb) / union if union else 1.0


def pairwise_jaccard(sets: np.ndarray) -> np.ndarray:
    """Jaccard of every pair of the ``n`` sets in ``sets (n, K)`` (unique positions per row): ``(n, n)``.

    Vectorised through a membership matrix: ``|A ∩ B|`` is a matrix product, ``|A ∪ B| = |A| + |B| - |A ∩ B|``.
    """
    sets = np.asarray(sets)
    n = sets.shape[0]
    if n == 0:
        return np.zeros((0, 0))
    universe, inverse = np.unique(sets, return_inverse=True)
    member = np.zeros((n, len(universe)), dtype=np.float32)
    member[np.repeat(np.arange(n), sets.shape[1]), inverse.ravel()] = 1.0
    inter = member @ member.T
    size = member.sum(axis=1)
    union = size[:, None] + size[None, :] - inter
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(union > 0, inter / np.maximum(union, 1), 1.0)


def _mean_offdiag(sets: np.ndarray) -> tuple[float, int]:
    """Sum of the pairwise Jaccard over pairs ``i < j`` and the number of pairs."""
    n = sets.shape[0]
    if n < 2:
        return 0.0, 0
    m = pairwise_jaccard(sets)
    iu = np.triu_indices(n, k=1)
    return float(m[iu].sum()), len(iu[0])


def diversity(events: Sequence[KeptEvent]) -> dict[str, float]:
    """Mean Jaccard across heads, layers and samples of a list of events (see the module docstring).

    Returns:
        ``{"heads", "layers", "samples"}`` means (NaN when there is no pair), ``{"heads_pairs", ...}`` pair counts,
        and ``events``.
    """
    sums = {"heads": [0.0, 0], "layers": [0.0, 0], "samples": [0.0, 0]}

    def add(kind: str, sets: np.ndarray) -> None:
        s, n = _mean_offdiag(sets)
        sums[kind][0] += s
        sums[kind][1] += n

    for e in events:  # across heads: same event, same row
        for r in range(e.kept.shape[0]):
            add("heads", e.kept[r])
    by_time: dict[tuple[str, int], list[KeptEvent]] = defaultdict(list)
    for e in events:
        by_time[(e.problem_id, e.index)].append(e)
    for group in by_time.values():
        # across samples: same event (problem, index, layer), same head
        for e in group:
            for h in range(e.kept.shape[1]):
                add("samples", e.kept[:, h])
        # across layers: same (problem, index), same sample and head
        per_sample: dict[int, list[tuple[int, np.ndarray]]] = defaultdict(list)
        for e in group:
            for r, s in enumerate(e.samples.tolist()):
                per_sample[s].append((e.layer, e.kept[r]))
        for items in per_sample.values():
            if len(items) < 2:
                continue
            stack = np.stack([k for _, k in sorted(items, key=lambda t: t[0])])  # (L, H, K)
            if len({k.shape for _, k in items}) != 1:
                continue
            for h in range(stack.shape[1]):
                add("layers", stack[:, h])
    out: dict[str, float] = {"events": float(len(events))}
    for kind, (s, n) in sums.items():
        out[kind] = s / n if n else float("nan")
        out[f"{kind}_pairs"] = float(n)
    return out


def diversity_from_run(run_dir: str | Path) -> dict[str, float] | None:
    """:func:`diversity` of every kept set a run recorded (``kept_sets.npz`` and/or ``kept_sets/*.npz``), or None."""
    run_dir = Path(run_dir)
    files = sorted((run_dir / KEPT_SETS_DIR).glob("*.npz")) if (run_dir / KEPT_SETS_DIR).is_dir() else []
    if (run_dir / KEPT_SETS_FILE).exists():
        files.append(run_dir / KEPT_SETS_FILE)
    if not files:
        return None
    events = [e for f in files for e in load_kept_sets(f)]
    return diversity(events)
