"""Record which tokens each eviction keeps (opt-in during a run: ``record_kept=true``).

The analysis of the recorded sets (Jaccard overlap across heads, layers and samples) is
:mod:`vase.analysis.diversity`; this module is the recording side used by the runner.

Layers: only the full-attention layers evict (``VaseCache.evicting_layers``), so only they are recorded; a
sliding-window layer (gpt-oss, OLMo-3) keeps its ring and a linear-attention layer (Qwen3.5, Qwen3-Next) its state,
never evicted. Every recorded ``layer`` is the model's layer index (``VaseLayer.layer_idx``, as in
``model.model.layers[i]``), not the layer's index among the full-attention layers (``store_idx``): on a tiny
gpt_oss of 4 layers (sliding, full, sliding, full) the events are of layers 1 and 3.
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
        layer: the model's layer index of the full-attention layer that evicted (``VaseLayer.layer_idx``; not its
            index among the full-attention layers).
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

    At each eviction the cache calls ``cache.on_evict(layer, row_ids, keep, kept_positions)`` for the rows that
    evicted together (``kept_positions (rows, H, budget - window)``: the absolute positions of the candidates kept;
    ``row_ids``: the decoder's name of each row, ``(problem_id, sample)``, or a bare sample index for
    :func:`vase.engine.decode.generate`). The recorder counts evictions per (problem, sample, layer), so a row's
    ``index`` does not depend on which other rows shared the batch, and groups rows of the same (problem, layer,
    index) into one :class:`KeptEvent`.

    Args:
        every: record each row's evictions ``0, every, 2*every, ...`` of a layer only.
        max_events_per_layer: keep at most the last ``n`` recorded events per (problem, sample, layer) (``None`` =
            all); the default 1 keeps only the last eviction: one kept set per (layer, row, head).
        layers: record only these layers, by the model's layer index (``None`` = every full-attention layer); a
            layer that does not evict (sliding-window, linear-attention) is refused when the recorder is attached.
    """

    def __init__(self, every: int = 1, max_events_per_layer: int | None = 1, layers: Sequence[int] | None = None):
        if every < 1:
            raise ValueError(f"record_kept.every: must be >= 1, got {every}")
        if max_events_per_layer is not None and max_events_per_layer < 1:
            raise ValueError(f"record_kept.max_events_per_layer: must be >= 1 or None, got {max_events_per_layer}")
        self.every = every
        self.max_events_per_layer = max_events_per_layer
        self.layers = None if layers is None else {int(x) for x in layers}
        self._problem = ""
        self._counts: dict[tuple[str, int, int], int] = defaultdict(int)
        self._rows: dict[tuple[str, int, int], list[tuple[int, np.ndarray]]] = defaultdict(list)

    def attach(self, cache, problem_id: str = "") -> None:
        """Start recording ``cache``'s evictions (sets ``cache.on_evict``); ``problem_id`` names bare-sample rows.
        One-line ``ValueError`` when :attr:`layers` names a layer that never evicts (not full attention)."""
        evicting = [int(x.layer_idx) for x in getattr(cache, "evicting_layers", ())]
        other = sorted(self.layers - set(evicting)) if self.layers is not None and evicting else []
        if other:
            raise ValueError(
                f"record_kept.layers: {other} never evict (not full-attention layers); the model's full-attention "
                f"layers: {evicting}"
            )
        self._problem = str(problem_id)
        cache.on_evict = self._on_evict

    def _on_evict(self, layer, row_ids, keep, kept_positions) -> None:
        li = int(layer.layer_idx)
        kept = None
        for j, rid in enumerate(row_ids):
            problem, sample = rid if isinstance(rid, tuple) else (self._problem, rid)
            key = (str(problem), int(sample), li)
            count = self._counts[key]
            self._counts[key] += 1
            if (self.layers is not None and li not in self.layers) or count % self.every:
                continue
            if kept is None:
                kept = np.sort(kept_positions.detach().to("cpu").numpy().astype(np.int32), axis=-1)
            events = self._rows[key]
            events.append((count, kept[j]))
            if self.max_events_per_layer is not None:
                del events[: -self.max_events_per_layer]

    @property
    def events(self) -> list[KeptEvent]:
        """The recorded events, rows of the same (problem, layer, index) grouped, sorted by problem, layer, index."""
        return _group(self._rows)

    def take(self, problem_id: str) -> list[KeptEvent]:
        """The events of one problem, forgotten by the recorder (dump them when the problem is complete)."""
        problem = str(problem_id)
        mine = {k: v for k, v in self._rows.items() if k[0] == problem}
        for k in mine:
            del self._rows[k]
        for k in [k for k in self._counts if k[0] == problem]:
            del self._counts[k]
        return _group(mine)

    def nbytes(self) -> int:
        """Memory held by the recorded kept sets."""
        return sum(kept.nbytes for events in self._rows.values() for _, kept in events)

    def clear(self) -> None:
        """Forget every recorded event."""
        self._rows.clear()
        self._counts.clear()

    def dump(self, path: str | Path, events: list[KeptEvent] | None = None) -> Path:
        """Write ``events`` (default: all recorded) to an ``.npz`` (see :func:`load_kept_sets`); return the path."""
        events = self.events if events is None else events
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        arrays: dict[str, np.ndarray] = {
            "problem_id": np.array([e.problem_id for e in events], dtype=str),
            "layer": np.array([e.layer for e in events], dtype=np.int32),
            "index": np.array([e.index for e in events], dtype=np.int32),
        }
        for i, e in enumerate(events):
            arrays[f"kept_{i}"] = e.kept
            arrays[f"samples_{i}"] = e.samples
        tmp = path.with_name(path.name + ".tmp.npz")
        np.savez_compressed(tmp, **arrays)
        tmp.replace(path)
        size = sum(e.kept.nbytes for e in events)
        logger.info("kept sets: %d events (%.1f MiB) -> %s", len(events), size / 2**20, path)
        return path


def _group(rows: dict[tuple[str, int, int], list[tuple[int, np.ndarray]]]) -> list[KeptEvent]:
    """Per-row events → one :class:`KeptEvent` per (problem, layer, index), its samples in increasing order."""
    groups: dict[tuple[str, int, int], list[tuple[int, np.ndarray]]] = defaultdict(list)
    for (problem, sample, layer), events in rows.items():
        for index, kept in events:
            groups[(problem, layer, index)].append((sample, kept))
    out = []
    for (problem, layer, index), items in sorted(groups.items()):
        items.sort(key=lambda t: t[0])
        samples = np.array([s for s, _ in items], dtype=np.int32)
        out.append(KeptEvent(problem, layer, index, samples, np.stack([k for _, k in items])))
    return out


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
