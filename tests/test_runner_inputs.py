"""The runner on inputs that used to slip through (issue 12, rows B2, B3, B8, B9, B10): every one is either refused
before any file is written or weights load, or handled per sample without losing what was computed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from vase.run.results import read_jsonl_tolerant
from vase.run.runner import prepare, run

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
TINY = [
    "model=tiny",
    "task=gsm_symbolic",
    "logger=none",
    "n_samples=2",
    "budget=32",
    "window=16",
    "generation.max_length=120",
    "progress=false",
]
DETERMINISTIC = (
    "accuracy",
    "samples",
    "problems",
    "complete",
    "evictions",
    "mean_output_tokens",
    "loop_rate",
    "truncation_rate",
    "kv_held_bytes_mean",
    "kv_full_bytes_mean",
    "compression_ratio",
)


def _compose(overrides: list[str]):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="config", overrides=overrides)


@pytest.fixture
def no_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    from vase.models import ModelSpec

    def forbidden(*_args, **_kwargs):
        raise AssertionError("weights loaded before the inputs were checked")

    monkeypatch.setattr(ModelSpec, "load", forbidden)


def _prompt_lengths(overrides: list[str]) -> dict[str, int]:
    prep = prepare(_compose(overrides))
    tok = prep.model_spec.load_tokenizer()
    return {
        p.id: len(tok(prep.task.render(p, tok, enable_thinking=prep.thinking), add_special_tokens=False)["input_ids"])
        for p in prep.task.load()
    }


def test_b2_max_length_below_every_prompt_is_refused_before_anything(tmp_path, no_weights):
    results = tmp_path / "results"
    with pytest.raises(ValueError, match=r"^generation\.max_length: 10 leaves no room") as err:
        run(_compose([*TINY, "limit=2", "generation.max_length=10", f"results_dir={results}"]), progress=False)
    assert "\n" not in str(err.value)
    assert not results.exists()


def test_b2_a_prompt_longer_than_max_length_is_recorded_and_the_run_goes_on(tmp_path):
    base = [*TINY, "limit=4", f"results_dir={tmp_path}"]
    lengths = _prompt_lengths(base)
    assert len(set(lengths.values())) > 1, "the fixture needs prompts of different lengths"
    cut = sorted(set(lengths.values()))[-1]  # the longest prompt(s) leave no room; the others get a few tokens
    metrics = run(_compose([*base, f"generation.max_length={cut}"]), progress=False)
    rows = read_jsonl_tolerant(Path(metrics["run_dir"]) / "samples.jsonl")
    too_long = [r for r in rows if r["finish_reason"] == "prompt_too_long"]
    assert too_long and all(lengths[r["problem_id"]] >= cut for r in too_long)
    assert all(r["error"] and "generation.max_length" in r["error"] and not r["correct"] for r in too_long)
    assert any(r["finish_reason"] != "prompt_too_long" for r in rows)  # the others were decoded
    assert metrics["complete"] and metrics["prompt_too_long_samples"] == len(too_long)
    assert metrics["loop_rate"] == 0 or all(r["loop_class"] != "loop" for r in too_long)


def test_b3_a_data_dir_without_the_file_writes_nothing(tmp_path, no_weights):
    empty = tmp_path / "data"
    empty.mkdir()
    results = tmp_path / "results"
    with pytest.raises(ValueError, match="data_dir"):
        run(_compose([*TINY, "task=math500", f"task.data_dir={empty}", f"results_dir={results}"]), progress=False)
    assert not results.exists()


def _strip(m: dict) -> dict:
    return {k: m.get(k) for k in DETERMINISTIC}


def test_b8_a_torn_last_line_then_rerun_gives_the_uninterrupted_metrics(tmp_path):
    clean = run(_compose([*TINY, "limit=2", f"results_dir={tmp_path / 'clean'}"]), progress=False)
    torn_dir = tmp_path / "torn"
    first = run(_compose([*TINY, "limit=2", f"results_dir={torn_dir}"]), progress=False)
    samples = Path(first["run_dir"]) / "samples.jsonl"
    lines = samples.read_bytes().splitlines(keepends=True)
    samples.write_bytes(b"".join(lines[:-1]) + lines[-1][: len(lines[-1]) // 2])  # killed mid-write
    again = run(_compose([*TINY, "limit=2", f"results_dir={torn_dir}"]), progress=False)
    assert _strip(again) == _strip(clean)
    assert len(read_jsonl_tolerant(samples)) == clean["samples"]


def test_b9_a_smaller_limit_on_a_finished_run_still_describes_the_whole_directory(tmp_path):
    full = run(_compose([*TINY, "limit=3", f"results_dir={tmp_path}"]), progress=False)
    smaller = run(_compose([*TINY, "limit=1", f"results_dir={tmp_path}"]), progress=False)
    assert smaller["problems"] == full["problems"] == 3 and smaller["samples"] == full["samples"] == 6
    assert smaller["complete"] and _strip(smaller) == _strip(full)
    on_disk = json.loads((Path(full["run_dir"]) / "metrics.json").read_text())
    assert on_disk["samples"] == len(read_jsonl_tolerant(Path(full["run_dir"]) / "samples.jsonl"))


@pytest.mark.parametrize("where", ["q_proj", "v_proj", "lm_head"])
def test_b10_nan_in_the_model_is_a_numerical_failure_not_a_loop(tmp_path, monkeypatch, where):
    from vase.models import ModelSpec

    load = ModelSpec.load

    def poisoned(self):
        model, tok = load(self)
        with torch.no_grad():
            if where == "lm_head":
                model.lm_head.weight[7] = float("nan")  # one row: every logit vector gets a NaN
            else:
                getattr(model.model.layers[0].self_attn, where).weight[0, 0] = float("nan")
        return model, tok

    monkeypatch.setattr(ModelSpec, "load", poisoned)
    metrics = run(_compose([*TINY, "limit=2", f"results_dir={tmp_path}"]), progress=False)
    rows = read_jsonl_tolerant(Path(metrics["run_dir"]) / "samples.jsonl")
    assert len(rows) == 4 and all(r["finish_reason"] == "nonfinite" for r in rows)
    assert all(r["loop_class"] == "nonfinite" and r["error"] and not r["correct"] for r in rows)
    assert metrics["complete"] and metrics["nonfinite_samples"] == 4 and metrics["loop_rate"] == 0


def test_unknown_problem_id_is_refused_before_anything(tmp_path, no_weights):
    results = tmp_path / "results"
    with pytest.raises(ValueError, match=r"^task\.problem_ids: no problem '42-999' in task gsm_symbolic") as err:
        run(_compose([*TINY, "task.problem_ids=[42-1,42-999]", f"results_dir={results}"]), progress=False)
    assert "\n" not in str(err.value)
    assert not results.exists()
    prep = prepare(_compose([*TINY, "task.problem_ids=[42-3,42-1]", f"results_dir={results}"]))
    assert [p.id for p in prep.task.load()] == ["42-1", "42-3"]
    assert "problem_ids" not in prep.protocol["task"]  # like limit: which problems, not how each is decoded
