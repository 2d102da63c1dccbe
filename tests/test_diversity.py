"""Kept-set recording and the Jaccard diversity measures, against hand-computed values."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vase.analysis.diversity import diversity, diversity_from_run, jaccard, pairwise_jaccard
from vase.run.kept_sets import KeptEvent, KeptSetRecorder, kept_sets_path, load_kept_sets


def test_jaccard_by_hand():
    assert jaccard(np.array([1, 2, 3]), np.array([2, 3, 4])) == pytest.approx(2 / 4)
    assert jaccard(np.array([1, 2]), np.array([3, 4])) == 0.0
    assert jaccard(np.array([5, 1]), np.array([1, 5])) == 1.0
    sets = np.array([[1, 2, 3], [2, 3, 4], [7, 8, 9]])
    m = pairwise_jaccard(sets)
    for i in range(3):
        for j in range(3):
            assert m[i, j] == pytest.approx(jaccard(sets[i], sets[j]))


def two_layer_events() -> list[KeptEvent]:
    """Layers 0 and 1, one eviction (index 0), samples 0 and 1, two heads, three kept positions each."""
    layer0 = np.array([[[0, 1, 2], [0, 1, 3]], [[0, 1, 2], [4, 5, 6]]])
    layer1 = np.array([[[0, 1, 2], [0, 1, 2]], [[1, 2, 3], [4, 5, 6]]])
    return [KeptEvent("p", 0, 0, np.array([0, 1]), layer0), KeptEvent("p", 1, 0, np.array([0, 1]), layer1)]


def test_diversity_by_hand():
    d = diversity(two_layer_events())
    # heads, per (layer, row): L0r0 {012}v{013} = 2/4, L0r1 0, L1r0 1, L1r1 0
    assert d["heads"] == pytest.approx((0.5 + 0 + 1 + 0) / 4) and d["heads_pairs"] == 4
    # samples, per (layer, head): L0h0 1, L0h1 0, L1h0 {012}v{123} = 2/4, L1h1 0
    assert d["samples"] == pytest.approx((1 + 0 + 0.5 + 0) / 4)
    # layers, per (sample, head): s0h0 1, s0h1 {013}v{012} = 2/4, s1h0 2/4, s1h1 1
    assert d["layers"] == pytest.approx((1 + 0.5 + 0.5 + 1) / 4)
    assert d["events"] == 2


def test_layers_are_compared_at_the_same_eviction_only():
    a, b = two_layer_events()
    b.index = 1  # a different eviction: nothing to compare across layers
    d = diversity([a, b])
    assert np.isnan(d["layers"]) and d["layers_pairs"] == 0


def fake_cache(rows: int = 3):
    """What the recorder uses of a VaseCache: geometry, on_evict, row_ids kept in step by select_rows."""
    cache = SimpleNamespace(geometry=SimpleNamespace(rows=rows), on_evict=None, selected=[], row_ids=list(range(rows)))

    def select_rows(index):
        cache.selected.append(index.tolist())
        cache.row_ids = [cache.row_ids[i] for i in index.tolist()]

    cache.select_rows = select_rows
    return cache


def test_recorder_follows_rows_and_caps_memory(tmp_path: Path):
    cache = fake_cache(3)
    rec = KeptSetRecorder(every=2, max_events_per_layer=2)
    rec.attach(cache, problem_id="q/1", samples=[4, 5, 6])
    layer = SimpleNamespace(layer_idx=1, owner=cache)
    kept = torch.tensor([[[3, 1, 2]], [[0, 1, 2]], [[5, 6, 7]]])
    for _ in range(3):
        cache.on_evict(layer, None, kept)  # evictions 0, 1, 2 -> 0 and 2 recorded
    cache.select_rows(torch.tensor([0, 2]))  # sample 5 finished; the cache's own select_rows still runs
    assert cache.selected == [[0, 2]]
    for _ in range(2):
        cache.on_evict(layer, None, kept[[0, 2]])  # evictions 3, 4 -> 4 recorded; only the last 2 kept
    assert [e.index for e in rec.events] == [2, 4]
    assert rec.events[-1].samples.tolist() == [4, 6]
    assert rec.events[0].kept[0, 0].tolist() == [1, 2, 3]  # sorted, int32
    assert rec.events[0].kept.dtype == np.int32
    path = rec.dump(kept_sets_path(tmp_path, "q/1"))
    assert path == tmp_path / "kept_sets" / "q_1.npz"
    loaded = load_kept_sets(path)
    assert [(e.problem_id, e.layer, e.index) for e in loaded] == [("q/1", 1, 2), ("q/1", 1, 4)]
    np.testing.assert_array_equal(loaded[1].kept, rec.events[1].kept)
    assert diversity_from_run(tmp_path)["samples"] == pytest.approx((0.5 + 0 + 0 + 0) / 4)  # 3 pairs at 2, 1 at 4
    assert diversity_from_run(tmp_path / "nothing") is None


def test_recorder_reads_the_caches_row_ids():
    """The recorder labels rows with the cache's ``row_ids`` (kept in step by ``select_rows``), never wraps it."""
    cache = fake_cache(3)
    original = cache.select_rows
    rec = KeptSetRecorder()
    rec.attach(cache, samples=[7, 8, 9])
    assert cache.row_ids == [7, 8, 9] and cache.select_rows is original
    cache.row_ids = [7, 9]  # what the cache's select_rows([0, 2]) does
    cache.on_evict(SimpleNamespace(layer_idx=0, owner=cache), None, torch.zeros(2, 1, 3, dtype=torch.long))
    assert rec.events[0].samples.tolist() == [7, 9]


def test_recorder_bad_settings():
    with pytest.raises(ValueError, match="every"):
        KeptSetRecorder(every=0)
    with pytest.raises(ValueError, match="samples"):
        KeptSetRecorder().attach(fake_cache(2), samples=[0])


def test_recorder_on_a_real_generation(tmp_path: Path):
    """Through generate's on_cache hook on a tiny model: streaming keeps the same set in every head (overlap 1),
    random eviction does not."""
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    from vase.engine.decode import SamplingConfig, generate
    from vase.models import tiny_model

    model = tiny_model("qwen3")
    conf = Path(__file__).resolve().parents[1] / "conf" / "policy"
    results = {}
    for name in ("streaming", "random"):
        cfg = OmegaConf.load(conf / f"{name}.yaml")
        cfg.budget, cfg.window = 32, 16
        rec = KeptSetRecorder(max_events_per_layer=None)
        out = generate(
            model,
            list(range(1, 21)),
            instantiate(cfg),
            n_samples=2,
            sampling=SamplingConfig(),
            max_new_tokens=60,
            ignore_eos=True,
            on_cache=lambda c, r=rec: r.attach(c, problem_id="p0", samples=[0, 1]),
        )
        n_layers = model.config.num_hidden_layers
        assert len(rec.events) == out.stats["evictions"] > 0
        assert {e.layer for e in rec.events} == set(range(n_layers))
        for e in rec.events:
            assert e.kept.shape == (2, model.config.num_key_value_heads, 16)
        rec.dump(tmp_path / name / "kept_sets.npz")
        results[name] = diversity_from_run(tmp_path / name)
    assert results["streaming"]["heads"] == 1.0 and results["streaming"]["layers"] == 1.0
    assert results["random"]["heads"] < 1.0
