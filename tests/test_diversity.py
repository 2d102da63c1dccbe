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


def fake_cache():
    """What the recorder uses of a VaseCache: its ``on_evict`` hook."""
    return SimpleNamespace(on_evict=None)


def test_recorder_follows_rows_and_caps_memory(tmp_path: Path):
    """Rows are named by the decoder's row ids; each row counts its own evictions; the cap applies per row."""
    cache = fake_cache()
    rec = KeptSetRecorder(every=2, max_events_per_layer=2)
    rec.attach(cache)
    layer = SimpleNamespace(layer_idx=1)
    kept = torch.tensor([[[3, 1, 2]], [[0, 1, 2]], [[5, 6, 7]]])
    rows = [("q/1", 4), ("q/1", 5), ("q/1", 6)]
    for _ in range(3):
        cache.on_evict(layer, rows, None, kept)  # evictions 0, 1, 2 -> 0 and 2 recorded
    # sample 5 finished; a row of another problem now evicts in the same call
    for _ in range(2):
        cache.on_evict(layer, [rows[0], ("other", 0), rows[2]], None, kept)  # q/1 evictions 3, 4 -> 4 recorded
    mine = [e for e in rec.events if e.problem_id == "q/1"]
    assert [e.index for e in mine] == [0, 2, 4]  # sample 5 keeps its last two (0, 2); samples 4 and 6: (2, 4)
    assert [e.samples.tolist() for e in mine] == [[5], [4, 5, 6], [4, 6]]
    assert [e.index for e in rec.events if e.problem_id == "other"] == [0]  # its own count, not q/1's
    assert mine[1].kept[0, 0].tolist() == [1, 2, 3]  # sorted, int32
    assert mine[1].kept.dtype == np.int32
    taken = rec.take("q/1")
    assert [e.index for e in taken] == [0, 2, 4] and all(e.problem_id == "other" for e in rec.events)
    path = rec.dump(kept_sets_path(tmp_path, "q/1"), taken)
    assert path == tmp_path / "kept_sets" / "q_1.npz"
    loaded = load_kept_sets(path)
    assert [(e.problem_id, e.layer, e.index) for e in loaded] == [("q/1", 1, 0), ("q/1", 1, 2), ("q/1", 1, 4)]
    np.testing.assert_array_equal(loaded[1].kept, taken[1].kept)
    # across samples: 3 pairs at index 2 (4-5: {123}v{012} = 2/4, 4-6: 0, 5-6: 0) and 1 at index 4 (4-6: 0)
    assert diversity_from_run(tmp_path)["samples"] == pytest.approx((0.5 + 0 + 0 + 0) / 4)
    assert diversity_from_run(tmp_path / "nothing") is None


def test_recorder_names_bare_sample_rows_with_the_attached_problem():
    """``generate`` names rows by their sample index: the recorder labels them with the problem it was given."""
    cache = fake_cache()
    rec = KeptSetRecorder()
    rec.attach(cache, problem_id="p7")
    cache.on_evict(SimpleNamespace(layer_idx=0), [7, 9], None, torch.zeros(2, 1, 3, dtype=torch.long))
    assert rec.events[0].samples.tolist() == [7, 9] and rec.events[0].problem_id == "p7"


def test_recorder_bad_settings():
    with pytest.raises(ValueError, match="every"):
        KeptSetRecorder(every=0)
    with pytest.raises(ValueError, match="max_events_per_layer"):
        KeptSetRecorder(max_events_per_layer=0)


def test_recorder_on_a_real_generation(tmp_path: Path):
    """Through generate's on_cache hook on a tiny model: streaming keeps the same set in every head (overlap 1),
    random eviction does not."""
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    from vase.engine import SamplingConfig, generate
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
            on_cache=lambda c, r=rec: r.attach(c, problem_id="p0"),
        )
        n_layers = model.config.num_hidden_layers
        # the two rows evict together: one grouped event per (layer, eviction); stats count per row
        assert 2 * len(rec.events) == out.stats["evictions"] > 0
        assert {e.layer for e in rec.events} == set(range(n_layers))
        for e in rec.events:
            assert e.kept.shape == (2, model.config.num_key_value_heads, 16)
        rec.dump(tmp_path / name / "kept_sets.npz")
        results[name] = diversity_from_run(tmp_path / name)
    assert results["streaming"]["heads"] == 1.0 and results["streaming"]["layers"] == 1.0
    assert results["random"]["heads"] < 1.0


@pytest.mark.parametrize("arch", ["gpt_oss", "qwen3_5"])
def test_recorder_sees_only_the_full_attention_layers_by_their_model_index(arch, tmp_path: Path):
    """Tiny gpt_oss (sliding, full, sliding, full) and tiny qwen3_5 (linear, full, linear, full): the evictions are
    recorded in layers 1 and 3, the model's indices of its full-attention layers (not 0 and 1, their index among
    the full layers), with one kept set of ``budget - window`` positions per row and KV head, within the sequence;
    the dump round-trips, the diversity compares those two layers; naming a layer that never evicts is refused."""
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    from vase.engine import SamplingConfig, generate
    from vase.models import tiny_model

    model = tiny_model(arch, num_hidden_layers=4)
    cfg = OmegaConf.load(Path(__file__).resolve().parents[1] / "conf" / "policy" / "random.yaml")
    cfg.budget, cfg.window = 32, 16
    rec = KeptSetRecorder(max_events_per_layer=None)
    out = generate(
        model,
        list(range(1, 21)),
        instantiate(cfg),
        n_samples=2,
        sampling=SamplingConfig(),
        max_new_tokens=40,
        ignore_eos=True,
        on_cache=lambda c: rec.attach(c, problem_id="p0"),
    )
    assert {e.layer for e in rec.events} == {1, 3} and 2 * len(rec.events) == out.stats["evictions"] > 0
    for e in rec.events:
        assert e.kept.shape == (2, model.config.num_key_value_heads, 16) and e.samples.tolist() == [0, 1]
        assert (e.kept >= 0).all() and (e.kept < 20 + 40).all()
    path = rec.dump(tmp_path / "kept_sets.npz")
    assert [(e.layer, e.index) for e in load_kept_sets(path)] == [(e.layer, e.index) for e in rec.events]
    assert diversity_from_run(tmp_path)["layers_pairs"] > 0
    with pytest.raises(ValueError, match=r"^record_kept\.layers: \[0\] never evict .* layers: \[1, 3\]"):
        generate(
            model,
            list(range(1, 21)),
            instantiate(cfg),
            n_samples=1,
            sampling=SamplingConfig(),
            max_new_tokens=2,
            on_cache=lambda c: KeptSetRecorder(layers=[0, 1]).attach(c),
        )
