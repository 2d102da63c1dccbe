"""Cache diversity: record which tokens each eviction keeps, and measure how much the kept sets overlap.

Recording (opt-in, during a run: ``record_kept=true``; :mod:`vase.run.kept_sets`)::

    recorder = KeptSetRecorder(every=1, max_events_per_layer=1)        # the last eviction per (sample, layer)
    dec = Decoder(model, policy, ..., on_cache=recorder.attach)
    for fin in dec.run(requests):                                       # when a problem's last sample is done:
        recorder.dump(kept_sets_path(run_dir, fin.key), recorder.take(fin.key))  # <run_dir>/kept_sets/<id>.npz

At each eviction the cache calls ``cache.on_evict(layer, row_ids, keep, kept_positions)`` for the rows that evicted
together, with ``kept_positions (rows, H, budget - window)``: the absolute positions of the candidates kept, and
``row_ids`` naming each row ``(problem_id, sample)``. The recorder stores them as sorted int32 arrays with the layer
and the eviction index of that (problem, sample, layer) (a row's index does not depend on the other rows in flight),
and groups the rows of one (problem, layer, index) into one event. Only full-attention layers evict, so only they
appear, by the model's layer index (gpt-oss: the odd layers; a hybrid Qwen3.5: every fourth); "across layers"
compares those layers.

Analysis: the mean Jaccard overlap ``|A ∩ B| / |A ∪ B|`` of kept sets

* across heads: pairs of KV heads of the same (event, layer, row);
* across layers: pairs of layers of the same (problem, eviction index, sample, head);
* across samples: pairs of samples (rows) of the same (problem, eviction index, layer, head).

A deterministic policy keeps similar sets everywhere (high overlap); a stochastic one diversifies them.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from vase.run.kept_sets import KEPT_SETS_DIR, KEPT_SETS_FILE, KeptEvent, load_kept_sets

if TYPE_CHECKING:
    from vase.analysis.load import Tree

__all__ = ["diversity", "diversity_from_run", "diversity_table", "jaccard", "pairwise_jaccard"]

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


def diversity_table(tree: Tree) -> pd.DataFrame:
    """Per run with recorded kept sets: mean Jaccard across heads, layers and samples (see diversity)."""
    rows = []
    for _, run in tree.runs.iterrows():
        d = diversity_from_run(run["run_dir"])
        if d is None:
            continue
        rows.append(
            {
                "model": run["model"],
                "task": run["task"],
                "policy": run["policy"],
                "method": run["method"],
                "budget": run["budget"],
                **d,
            }
        )
    return pd.DataFrame(rows)
