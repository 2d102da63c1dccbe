"""Settings that used to change a run silently (issue 28, findings 8 and 13): the reference length behind ``ratio=``
for a model the task's table does not list, and a preset's default ``limit`` against explicit ``task.problem_ids``."""

from __future__ import annotations

import json
import logging

import pytest

from tests.conftest import compose
from vase.analysis.load import _ratio_derived
from vase.run import planning
from vase.run.planning import prepare

#: HumanEval's table: qwen2.5_coder_0.5b 256, default 1024; window 16, ratio 4
BASE = ["model=tiny", "task=humaneval", "logger=none", "ratio=4"]


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "vase.run.planning" and r.levelno >= logging.WARNING]


def test_a_model_the_task_does_not_list_says_which_reference_length_it_used(caplog):
    caplog.set_level(logging.INFO)
    planning._logged_fallbacks.clear()  # said once per process (run.py and the runner both prepare the run)
    prep = prepare(compose([*BASE, "model.key=my_local_model"]))
    assert prep.cfg.budget == 1024 // 4  # the task's default entry
    assert prep.reference == {"tokens": 1024, "source": "task.reference_output_tokens.default", "ratio": 4}
    (line,) = [m for m in _warnings(caplog) if "reference output length" in m]
    assert "\n" not in line
    assert "task humaneval, 1024 tokens" in line and "model.key 'my_local_model'" in line
    assert "listed: qwen2.5_coder_0.5b" in line and "model.reference_tokens=" in line


def test_model_reference_tokens_sets_the_budget_and_is_recorded(caplog):
    caplog.set_level(logging.INFO)
    prep = prepare(compose([*BASE, "model.key=my_local_model", "model.reference_tokens=256"]))
    assert prep.cfg.budget == 64 and prep.policy.budget == 64
    assert prep.reference == {"tokens": 256, "source": "model.reference_tokens", "ratio": 4}
    assert not [m for m in _warnings(caplog) if "reference output length" in m]
    # like ratio, it only sets the budget, which the protocol records: not a key of the protocol itself
    assert "reference_tokens" not in prep.protocol["model"] and prep.protocol["budget"] == 64
    # it wins over the task's entry for a listed key too
    listed = prepare(compose([*BASE, "model.key=qwen2.5_coder_0.5b", "model.reference_tokens=2048"]))
    assert listed.cfg.budget == 512 and listed.reference["source"] == "model.reference_tokens"


def test_a_listed_model_uses_its_entry_without_a_warning(caplog):
    caplog.set_level(logging.INFO)
    prep = prepare(compose([*BASE, "model.key=qwen2.5_coder_0.5b"]))
    assert prep.cfg.budget == 64 and prep.reference["source"] == "task.reference_output_tokens.qwen2.5_coder_0.5b"
    assert not _warnings(caplog)
    assert prepare(compose([*BASE, "budget=48"])).reference is None  # an explicit budget needs no reference


@pytest.mark.parametrize("value", ["0", "-5"])
def test_a_bad_reference_length_is_one_line(value):
    with pytest.raises(ValueError, match=r"^model\.reference_tokens: must be a positive number of tokens") as err:
        prepare(compose([*BASE, f"model.reference_tokens={value}"]))
    assert "\n" not in str(err.value)


def test_the_analysis_reads_a_ratio_budget_from_model_reference_tokens():
    config = {
        "budget": 64,
        "ratio": 4,
        "window": 16,
        "model": {"key": "mine", "reference_tokens": 256},
        "task": {"reference_output_tokens": {"default": 1024}},
    }
    assert _ratio_derived(config)
    assert not _ratio_derived({**config, "model": {"key": "mine"}})  # 1024 / 4 = 256, not 64


# ---- explicit problem ids against a preset's default limit ----------------------------------------------------------

IDS = [f"HumanEval/{i}" for i in range(32)]


def _ids(ids: list[str]) -> str:
    return "task.problem_ids=[" + ",".join(ids) + "]"


def test_explicit_problem_ids_are_never_cut_by_the_tasks_default_limit(caplog):
    caplog.set_level(logging.INFO)
    prep = prepare(compose([*BASE, _ids(IDS)]))  # humaneval's preset: limit 16
    assert prep.task.limit is None
    assert [p.id for p in prep.task.load()] == IDS
    (line,) = [r.getMessage() for r in caplog.records if "problem_ids" in r.getMessage()]
    assert "lists 32 problems" in line and "task.limit=16" in line and "limit=<n>" in line
    # without ids the preset's limit applies as before
    assert len(prepare(compose(BASE)).task.load()) == 16


def test_a_top_level_limit_with_problem_ids_keeps_the_first_n_listed():
    prep = prepare(compose([*BASE, _ids(list(reversed(IDS[:6]))), "limit=4"]))
    assert prep.task.limit == 4
    assert [p.id for p in prep.task.load()] == IDS[:4]  # the dataset's order, the first 4 of the listed ones


def test_a_short_id_list_under_the_limit_logs_nothing(caplog):
    caplog.set_level(logging.INFO)
    prep = prepare(compose([*BASE, _ids(IDS[:3])]))
    assert [p.id for p in prep.task.load()] == IDS[:3]
    assert not [r for r in caplog.records if "problem_ids" in r.getMessage()]


def test_a_run_records_the_reference_length_and_the_data_copy(finished_run):
    """The finished tiny run (explicit budget, generated problems): manifest.json and metrics.json say that no
    reference length was used, and resolved.json / manifest.json which copy of the data it read (none: generated)."""
    manifest = json.loads((finished_run / "manifest.json").read_text())
    metrics = json.loads((finished_run / "metrics.json").read_text())
    resolved = json.loads((finished_run / "resolved.json").read_text())
    assert manifest["budget_reference"] is None and manifest["data_copy"] == {"copy": "builtin", "files": {}}
    assert metrics["budget_source"] == "explicit" and metrics["reference_tokens"] is None
    assert metrics["reference_source"] is None and resolved["data_copy"] == manifest["data_copy"]
