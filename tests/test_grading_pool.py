"""Grading off the decode loop (issue 22): worker processes grade with the task's own functions, the same lines as
inline grading, one fsynced line per graded sample, and a kill -9 while samples are being graded loses none."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import compose as _compose
from tests.conftest import sample_metrics
from vase.run import grading_pool
from vase.run.grading_pool import Grader, auto_workers
from vase.run.results import kill_point, read_jsonl_tolerant

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
ENV = {
    **os.environ,
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "WANDB_MODE": "disabled",
    "TOKENIZERS_PARALLELISM": "false",
    "OMP_NUM_THREADS": "1",
}
TINY = [
    "model=tiny",
    "task=gsm_symbolic",
    "logger=none",
    "limit=2",
    "n_samples=2",
    "budget=32",
    "window=16",
    "generation.max_length=120",
    "progress=false",
]


def _samples(run_dir: Path) -> list[dict]:
    rows = read_jsonl_tolerant(run_dir / "samples.jsonl")
    stripped = [{k: v for k, v in r.items() if k != "eviction_seconds"} for r in rows]
    return sorted(stripped, key=lambda r: (r["problem_id"], r["sample"]))


def _metrics(run_dir: Path) -> dict:
    return sample_metrics(run_dir)


def _run(results: Path, workers: int) -> Path:
    from vase.run.runner import run

    metrics = run(_compose([*TINY, f"generation.grade_workers={workers}", f"results_dir={results}"]), progress=False)
    return Path(metrics["run_dir"])


# --------------------------------------------------------------------------------------------------------------------
# the grader itself: the task's functions, in a worker process


def _outputs(task, problems):
    """A right, a wrong and an unanswered output per problem."""
    out = []
    for p in problems:
        out += [(p, f"so the answer is \\boxed{{{p.answer}}}"), (p, "\\boxed{-12345}"), (p, "I do not know")]
    return out


def test_a_worker_process_grades_exactly_as_the_decode_loop_does(tmp_path):
    from hydra.utils import instantiate

    task = instantiate(_compose(["task=gsm_symbolic", "limit=2"]).task)
    problems = task.load()
    items = _outputs(task, problems)
    graded: dict[str, list[dict]] = {}
    for mode, workers in (("inline", 0), ("background", 1)):
        path = tmp_path / f"{mode}.jsonl"
        grader = Grader(task, False, path, workers)
        assert grader.mode == mode
        for i, (problem, text) in enumerate(items):
            grader.submit(problem, text, lambda g, i=i, pid=problem.id: {"i": i, "pid": pid, **g.__dict__})
        grader.close()
        assert grader.written == len(items) and grader.in_flight == 0
        graded[mode] = sorted(read_jsonl_tolerant(path), key=lambda r: r["i"])
    assert graded["inline"] == graded["background"]
    assert [r["correct"] for r in graded["background"]] == [True, False, False] * len(problems)
    assert [r["detail"] for r in graded["background"][:3]] == ["", "wrong_answer", "no_box"]


def test_a_sample_not_decoded_to_the_end_is_written_ungraded(tmp_path):
    grader = Grader(object(), False, tmp_path / "s.jsonl", 0)
    grader.submit(None, "", lambda g: {"grade": g}, grade=False)
    assert read_jsonl_tolerant(tmp_path / "s.jsonl") == [{"grade": None}]


def test_the_pool_is_sized_to_the_cores_the_decode_leaves(monkeypatch):
    monkeypatch.setattr(grading_pool, "available_cores", lambda: 16)
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    assert auto_workers("cuda", 16)[0] == 15  # the GPU's host thread takes one core
    assert auto_workers("cpu", 16)[0] == 0  # a CPU decode on every core: grade inline
    assert "graded inline" in auto_workers("cpu", 16)[1]
    assert auto_workers("cpu", 4)[0] == 12
    assert auto_workers("cuda", 1, local_ranks=8)[0] == 1  # 8 ranks share the 16 cores: 2 each
    monkeypatch.setattr(grading_pool, "available_cores", lambda: 4)  # bound to 4 cores (SLURM --cpus-per-task=4)
    assert auto_workers("cuda", 1, local_ranks=8)[0] == 3
    monkeypatch.setattr(grading_pool, "available_cores", lambda: 200)
    monkeypatch.setattr(os, "cpu_count", lambda: 200)
    assert auto_workers("cuda", 1)[0] == grading_pool.MAX_AUTO_WORKERS


def test_the_kill_hook_names_its_event_count_rank_and_signal(monkeypatch):
    """One hook for every kill point (vase.run.results.kill_point): events counted per process, an optional rank and
    signal; a malformed value is one line naming the variable."""
    import signal as signals
    from collections import Counter

    from vase.run import results

    sent = []
    monkeypatch.setattr(results.os, "kill", lambda pid, sig: sent.append(sig))
    monkeypatch.setattr(results.logging, "shutdown", lambda: None)
    monkeypatch.setattr(results, "_events", Counter())
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("VASE_TEST_KILL_AT", "rank1:written:1")
    kill_point("written")  # another rank's: nothing happens
    assert sent == []
    monkeypatch.setenv("VASE_TEST_KILL_AT", "written:3")
    kill_point("written")  # the 2nd written line
    kill_point("submitted")
    assert sent == []
    kill_point("written")  # the 3rd
    assert sent == [signals.SIGKILL]
    monkeypatch.setenv("VASE_TEST_KILL_AT", "rank0:submitted:2:INT")
    kill_point("submitted")
    assert sent == [signals.SIGKILL, signals.SIGINT]
    monkeypatch.setenv("VASE_TEST_KILL_AT", "after:3")
    with pytest.raises(ValueError, match=r"VASE_TEST_KILL_AT='after:3': write \[rank<r>:\]<event>:<n>"):
        kill_point("written")


def test_grade_workers_is_checked_before_anything_runs():
    from vase.run.checks import check_settings

    for bad in ("-1", "many", "1.5"):
        with pytest.raises(ValueError, match="generation.grade_workers: must be auto or an integer >= 0"):
            check_settings(_compose(["model=tiny", f"generation.grade_workers={bad}"]))
    check_settings(_compose(["model=tiny", "generation.grade_workers=0"]))


# --------------------------------------------------------------------------------------------------------------------
# end to end


@pytest.mark.slow  # the kill -9 resume test stays
def test_inline_and_background_grading_give_the_same_run(tmp_path):
    inline = _run(tmp_path / "inline", 0)
    background = _run(tmp_path / "background", 1)
    assert _samples(inline) == _samples(background) and len(_samples(inline)) == 4
    assert _metrics(inline) == _metrics(background)
    grading = json.loads((background / "manifest.json").read_text())["grading"]
    assert grading["mode"] == "background" and grading["workers"] == 1
    assert json.loads((inline / "manifest.json").read_text())["grading"]["mode"] == "inline"


def test_kill_9_while_samples_are_graded_resumes_without_losing_or_duplicating_one(tmp_path):
    """SIGKILL right after the 3rd finished sample is handed to the worker (its line is not written): the relaunch
    decodes only what ``samples.jsonl`` lacks, and every sample is there once (that a background line equals the
    inline one is the test above)."""
    args = [sys.executable, "run.py", *TINY, "generation.grade_workers=1", f"results_dir={tmp_path / 'bg'}"]
    killed = subprocess.run(
        args, cwd=ROOT, env={**ENV, "VASE_TEST_KILL_AT": "submitted:3"}, capture_output=True, text=True
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    # the run directory from its protocol.json (written when the run opened): samples.jsonl may not exist yet, when
    # no grade had come back from the worker before the kill (on a loaded machine)
    (protocol,) = (tmp_path / "bg").rglob("protocol.json")
    samples = protocol.parent / "samples.jsonl"
    before = read_jsonl_tolerant(samples)  # [] when absent
    assert len(before) < 3  # the 3rd sample was being graded: not written
    again = subprocess.run(args, cwd=ROOT, env=ENV, capture_output=True, text=True)
    assert again.returncode == 0, again.stderr[-2000:]
    assert f"{len(before)} samples done" in again.stderr
    rows = read_jsonl_tolerant(samples)
    assert len({(r["problem_id"], r["sample"]) for r in rows}) == len(rows) == 4  # every sample once
    assert rows[: len(before)] == before  # what was written stays as it was
    metrics = json.loads((samples.parent / "metrics.json").read_text())
    assert metrics["complete"] and metrics["samples"] == 4
