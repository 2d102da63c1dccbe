"""The results-tree validator (issue 40): one line per planned (problem, sample), a type and a range for every figure,
bounded nesting, a field only newer lines carry never averaged over a subset, an older run named in a tree that is
still reported. Every damaged copy is a one-line error naming the file and the line, or the right number.

The table test (:data:`DAMAGED`) feeds 40+ damaged lines to :func:`vase.run.results.read_samples`; the issue's cases
run on a copy of the session's finished run (``finished_run``) through the metrics, the resume, the report and the
scripts. On main before this change, each issue case gave the wrong number or a traceback (noted per test).
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import pytest

from tests.conftest import TINY_RUN, compose, copy_run, snapshot

ROOT = Path(__file__).resolve().parents[1]

#: a line of samples.jsonl as vase writes it (every field of vase.run.records.sample_row)
GOOD = {
    "problem_id": "p0",
    "sample": 1,
    "seed": 3741031834564003009,
    "output": "The answer is \\boxed{4}.",
    "grader": "strict",
    "extracted": "4",
    "correct": True,
    "grade_detail": "ok",
    "finish_reason": "eos",
    "error": None,
    "cut_by_limit": False,
    "cut_in_thinking": False,
    "loop_class": "ok",
    "prompt_tokens": 41,
    "output_tokens": 59,
    "budget": 320,
    "held_tokens_end": 100,
    "held_tokens_mean": 70.5,
    "held_tokens_max": 99,
    "compression_ratio": 1.0,
    "compression_ratio_full_layers": 1.0,
    "kv_held_bytes_end": 25600,
    "kv_full_bytes_end": 25600,
    "kv_held_bytes_end_by_type": {"full_attention": 25600},
    "kv_retained_bytes_mean": 18048.0,
    "kv_retained_bytes_peak": 25344.0,
    "decode_steps": 58,
    "evictions": 0,
    "eviction_seconds": 0.0,
    "attended_tokens": None,
    "meta": {"year": 2024},
}

DEEP = "[" * 100_000 + "]" * 100_000
BIG = "1" + "0" * 30  # an integer of 31 digits: 1e30 as a count

# (case id, the damaged line's JSON text, what the one-line error says after "samples.jsonl: line 2")
DAMAGED: list[tuple[str, str, str]] = []


def _with(**fields) -> str:
    row = dict(GOOD)
    raw = {}
    for k, v in fields.items():
        if isinstance(v, Raw):
            row[k], raw[k] = f"@{k}@", v.text
        elif v is DELETE:
            row.pop(k)
        else:
            row[k] = v
    text = json.dumps(row)
    for k, t in raw.items():
        text = text.replace(f'"@{k}@"', t)
    return text


class Raw:
    def __init__(self, text: str):
        self.text = text


DELETE = object()


def _add(case: str, says: str, **fields) -> None:
    DAMAGED.append((case, _with(**fields), says))


# counts: type and range
for _f in ("sample", "prompt_tokens", "output_tokens", "held_tokens_end", "decode_steps", "evictions"):
    _add(f"{_f}-1e30", f": field {_f} must be an integer >= 0 and <= 1,000,000,000", **{_f: Raw(BIG)})
    _add(f"{_f}-negative", f": field {_f} must be an integer >= 0", **{_f: -1})
_add("output_tokens-float", ": field output_tokens must be an integer >= 0", output_tokens=12.5)
_add("output_tokens-string", ": field output_tokens must be an integer >= 0", output_tokens="12")
_add("output_tokens-true", ": field output_tokens must be an integer >= 0", output_tokens=True)
_add("output_tokens-1e30-float", ": field output_tokens must be an integer", output_tokens=Raw("1e30"))
_add("held_tokens_max-huge", ": field held_tokens_max must be an integer >= 0", held_tokens_max=Raw(BIG))
_add("budget-negative", ": field budget must be an integer >= 0", budget=-32)
# bytes
_add(
    "kv_held_bytes-huge", ": field kv_held_bytes_end must be an integer >= 0 and <= 1,125,899", kv_held_bytes_end=2**60
)
_add("kv_full_bytes-float", ": field kv_full_bytes_end must be an integer >= 0", kv_full_bytes_end=1.5)
_add("kv_retained_mean-huge", ": field kv_retained_bytes_mean must be a finite number", kv_retained_bytes_mean=1e300)
_add(
    "kv_retained_peak-negative",
    ": field kv_retained_bytes_peak must be a finite number >= 0",
    kv_retained_bytes_peak=-1,
)
_add(
    "by_type-list",
    ": field kv_held_bytes_end_by_type must be an object of layer type -> bytes",
    kv_held_bytes_end_by_type=[1],
)
_add("by_type-string", ": field kv_held_bytes_end_by_type must be an object", kv_held_bytes_end_by_type="25600")
_add("by_type-negative", ": field kv_held_bytes_end_by_type must be an object", kv_held_bytes_end_by_type={"full": -1})
_add("by_type-float", ": field kv_held_bytes_end_by_type must be an object", kv_held_bytes_end_by_type={"full": 0.5})
# ratios, seconds, means
_add("compression-zero", ": field compression_ratio must be a finite number > 0", compression_ratio=0)
_add("compression-negative", ": field compression_ratio must be a finite number > 0", compression_ratio=-2.0)
_add("compression-huge", ": field compression_ratio must be a finite number > 0", compression_ratio=1e30)
_add("compression-full-zero", ": field compression_ratio_full_layers must be", compression_ratio_full_layers=0.0)
_add("eviction_seconds-negative", ": field eviction_seconds must be a finite number >= 0", eviction_seconds=-0.1)
_add("eviction_seconds-century", ": field eviction_seconds must be a finite number >= 0", eviction_seconds=3.2e9)
_add("held_mean-huge", ": field held_tokens_mean must be a finite number >= 0", held_tokens_mean=1e12)
_add("attended-negative", ": field attended_tokens must be a finite number >= 0", attended_tokens=-3)
_add("seed-huge", ": field seed must be a 64-bit integer or null", seed=Raw("1" + "0" * 25))
_add("seed-float", ": field seed must be a 64-bit integer or null", seed=1.5)
# non-finite anywhere
_add("nan", ": field held_tokens_mean is not a finite number", held_tokens_mean=Raw("NaN"))
_add("inf", ": field eviction_seconds is not a finite number", eviction_seconds=Raw("Infinity"))
_add("meta-nan", ": field meta.year is not a finite number", meta=Raw('{"year": NaN}'))
_add("unknown-field-inf", ": field newer_field is not a finite number", newer_field=Raw("-Infinity"))
# strings from a closed set, booleans
_add("finish_reason-unknown", ": field finish_reason must be one of eos, stop", finish_reason="crashed")
_add("finish_reason-null", ": field finish_reason must be one of", finish_reason=None)
_add("loop_class-unknown", ": field loop_class must be one of loop, garbage", loop_class="weird")
_add("correct-string", ": field correct must be true or false", correct="true")
_add("correct-int", ": field correct must be true or false", correct=1)
_add("correct_rule-string", ": field correct_strict must be true or false", correct_strict="no")
_add("cut_by_limit-null", ": field cut_by_limit must be true or false", cut_by_limit=None)
_add("problem_id-int", ": field problem_id must be a string", problem_id=7)
_add("extracted-list", ": field extracted must be a string, a number or null", extracted=[4])
_add("meta-list", ": field meta must be an object", meta=[2024])
# shape
_add("no-correct", " is not a sample (an object without correct", correct=DELETE)
_add("no-problem", " is not a sample (an object without problem_id", problem_id=DELETE)
DAMAGED += [
    ("array", "[1, 2, 3]", " is not a sample (a JSON list"),
    ("number", "17", " is not a sample (a JSON int"),
    ("string", '"sample"', " is not a sample (a JSON str"),
    ("null", "null", " is not a sample (a JSON NoneType"),
    ("deep-100000", DEEP, " is not a line vase writes (arrays or objects nested more than 32 deep"),
    ("deep-40-in-meta", _with(meta=Raw('{"x": ' + "[" * 40 + "]" * 40 + "}")), " is not a line vase writes (arrays"),
    ("digits-5000", _with(output_tokens=Raw("9" * 5000)), " is not a line vase writes (a number beyond any count"),
    ("not-json", '{"problem_id": "p0", "sample": 1,,}', "corrupt line 2 (not the last line, so not a torn write)"),
]
# against the protocol: n_samples=4 (protocol.json), line 1 is (p0, 1)
_add("sample-beyond-n", ": sample 4 of problem 'p0' is beyond the run's n_samples=4", sample=4)
_add("sample-9-of-4", ": sample 9 of problem 'p0' is beyond the run's n_samples=4", sample=9)
_add("duplicate-other-content", ": sample 1 of problem 'p0' again, with other content than", correct=False)
_add("duplicate-other-tokens", ": sample 1 of problem 'p0' again, with other content than", output_tokens=60)


def _tree_with(tmp_path: Path, second: str, third: str | None = None) -> Path:
    """A run directory whose ``samples.jsonl`` is GOOD, then ``second`` (then ``third``); ``n_samples=4``."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "protocol.json").write_text(json.dumps({"n_samples": 4, "policy": {"name": "full"}}))
    lines = [json.dumps(GOOD), second] + ([third] if third is not None else [])
    (run_dir / "samples.jsonl").write_text("\n".join(lines) + "\n")
    return run_dir


def test_the_table_has_forty_damaged_lines():
    assert len(DAMAGED) >= 40 and len({c for c, _, _ in DAMAGED}) == len(DAMAGED)


@pytest.mark.parametrize("case, line, says", DAMAGED, ids=[c for c, _, _ in DAMAGED])
def test_a_damaged_line_is_one_line_naming_the_file_and_the_line(tmp_path, case, line, says):
    """Each damaged line (followed by a good one, so a torn last line cannot excuse it) is refused by the one reader
    of sample lines with a one-line error naming the file and the line; no file changes (``repair`` included)."""
    from vase.run.results import read_samples

    other = dict(GOOD, sample=2)
    run_dir = _tree_with(tmp_path, line, json.dumps(other))
    before = snapshot(run_dir)
    for repair in (False, True):
        with pytest.raises(ValueError) as err:
            read_samples(run_dir, repair=repair, for_metrics=True)
        msg = str(err.value)
        assert "\n" not in msg and len(msg) < 700, msg
        where = f"{run_dir / 'samples.jsonl'}: " + (says if says.startswith("corrupt") else f"line 2{says}")
        assert msg.startswith(where), msg
    assert snapshot(run_dir) == before


def test_the_same_line_twice_is_one_sample(tmp_path):
    """An exact duplicate (what a fold or merge killed between appending and deleting a part leaves) counts once."""
    from vase.run.results import read_samples

    run_dir = _tree_with(tmp_path, json.dumps(GOOD), json.dumps(dict(GOOD, sample=2)))
    rows = read_samples(run_dir, for_metrics=True)
    assert [(r["problem_id"], r["sample"]) for r in rows] == [("p0", 1), ("p0", 2)]


def test_the_same_sample_in_a_rank_part_with_other_content_names_both_files(tmp_path):
    from vase.run.results import part_path, read_samples

    run_dir = _tree_with(tmp_path, json.dumps(dict(GOOD, sample=2)))
    part = part_path(run_dir, 1, "samples.jsonl")
    part.parent.mkdir()
    part.write_text(json.dumps(dict(GOOD, correct=False)) + "\n")
    with pytest.raises(ValueError, match=r"rank1\.samples\.jsonl: line 1: sample 1 of problem 'p0' again, with other "):
        read_samples(run_dir)


# --------------------------------------------------------------------------------------------------------------------
# the issue's cases, on a copy of a real finished run (3 problems x n_samples=2)


def _append(path: Path, *rows: dict) -> None:
    with open(path, "a") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def _lines(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "samples.jsonl").read_text().splitlines()]


def _refused(call) -> str:
    with pytest.raises(ValueError) as err:
        call()
    assert "\n" not in str(err.value)
    return str(err.value)


def _paths(run_dir: Path, results: Path):
    """Every reader of a results tree: the metrics, the report's loader, a shard merge, the resume."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from merge_shards import merge

    from vase.analysis.load import load_tree
    from vase.run.records import compute_metrics
    from vase.run.runner import run

    return {
        "metrics": lambda: compute_metrics(run_dir, ["x"], 2, {}, [1]),
        "report": lambda: load_tree(results),
        "resume": lambda: run(compose([*TINY_RUN, "limit=3", f"results_dir={results}"]), progress=False),
        "merge": lambda: merge(results / "shards" / "r"),
    }


def _with_shard(run_dir: Path, results: Path) -> None:
    import shutil

    shutil.copytree(run_dir, results / "shards" / "r-shard0of1")


def test_issue_1_two_different_lines_for_one_sample_are_refused(finished_run, tmp_path):
    """Issue 40, case 1 (main: the first line won silently, accuracy 0.0625 where it is 0)."""
    results = tmp_path / "results"
    run_dir = copy_run(finished_run, results)
    first = _lines(run_dir)[0]
    _append(run_dir / "samples.jsonl", dict(first, correct=not first["correct"]))
    _with_shard(run_dir, results)
    before = snapshot(tmp_path)
    for name, call in _paths(run_dir, results).items():
        msg = _refused(call)
        where = run_dir if name != "merge" else results / "shards" / "r-shard0of1"
        assert msg.startswith(f"{where / 'samples.jsonl'}: line 7: sample {first['sample']} of problem "), (name, msg)
        assert f"again, with other content than {where / 'samples.jsonl'}: line 1" in msg, (name, msg)
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("sample", [2, 9])
def test_issue_2_a_sample_beyond_n_samples_is_refused(finished_run, tmp_path, sample):
    """Issue 40, case 2 (main: exit 0, the extra sample counted, rates over all of them)."""
    results = tmp_path / "results"
    run_dir = copy_run(finished_run, results)
    _append(run_dir / "samples.jsonl", dict(_lines(run_dir)[0], sample=sample))
    _with_shard(run_dir, results)
    before = snapshot(tmp_path)
    for name, call in _paths(run_dir, results).items():
        msg = _refused(call)
        assert f"samples.jsonl: line 7: sample {sample} of problem " in msg, (name, msg)
        assert "is beyond the run's n_samples=2 (protocol.json: samples 0 to 1)" in msg, (name, msg)
    assert snapshot(tmp_path) == before


def test_issue_2_a_problem_the_task_does_not_have_is_refused_by_the_resume(finished_run, tmp_path):
    """Issue 40, case 2 (main: counted, 7 samples). The resume knows the task: a problem it does not have is one line;
    a problem of the task past this invocation's ``limit`` (an earlier, larger limit wrote it) is a sample."""
    from vase.run.runner import run

    results = tmp_path / "results"
    run_dir = copy_run(finished_run, results)
    line = _lines(run_dir)[0]
    _append(run_dir / "samples.jsonl", dict(line, problem_id="not-a-problem"))
    before = snapshot(tmp_path)
    msg = _refused(lambda: run(compose([*TINY_RUN, "limit=3", f"results_dir={results}"]), progress=False))
    assert msg.startswith(
        f"{run_dir / 'samples.jsonl'}: line 7: problem 'not-a-problem' is not a problem of task gsm_symbolic"
    ), msg
    assert snapshot(tmp_path) == before


def test_a_problem_past_the_limit_is_one_of_the_task(finished_run, tmp_path):
    from vase.run.results import read_samples
    from vase.run.validate import planned_for
    from vase.schema import BadSample

    cfg = compose([*TINY_RUN, "limit=2"])
    from hydra.utils import instantiate

    task = instantiate(cfg.task, limit=2)
    problems = task.load()
    run_dir = copy_run(finished_run, tmp_path / "results")  # 3 problems: the third is past limit=2
    planned = planned_for(task, problems, 2)
    assert len(read_samples(run_dir, planned=planned)) == 6
    _append(run_dir / "samples.jsonl", dict(_lines(run_dir)[0], problem_id="nope"))
    with pytest.raises(BadSample, match="line 7: problem 'nope' is not a problem of task gsm_symbolic"):
        read_samples(run_dir, planned=planned)


def test_issue_3_a_count_of_1e30_is_refused(finished_run, tmp_path):
    """Issue 40, case 3 (main: passed the type check, mean_output_tokens 6.25e28)."""
    results = tmp_path / "results"
    run_dir = copy_run(finished_run, results)
    text = (run_dir / "samples.jsonl").read_text().splitlines(keepends=True)
    row = json.loads(text[1])
    text[1] = json.dumps(dict(row, output_tokens="@")).replace('"@"', BIG) + "\n"
    (run_dir / "samples.jsonl").write_text("".join(text))
    _with_shard(run_dir, results)
    for name, call in _paths(run_dir, results).items():
        msg = _refused(call)
        assert "samples.jsonl: line 2: field output_tokens must be an integer >= 0 and <= 1,000,000,000" in msg, name


def _as_older_release(run_dir: Path, lines: range, fields: tuple[str, ...]) -> None:
    """The lines ``lines`` (0-based) of ``run_dir/samples.jsonl`` without ``fields``, as a release before them wrote."""
    rows = _lines(run_dir)
    for i in lines:
        for f in fields:
            rows[i].pop(f, None)
    (run_dir / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


#: what the release f922a8b did not write yet (vase/run/records.py there)
NEWER = (
    "held_tokens_max",
    "kv_retained_bytes_mean",
    "kv_retained_bytes_peak",
    "compression_ratio_full_layers",
    "kv_held_bytes_end_by_type",
)


def test_issue_4_a_field_only_the_newer_lines_carry_is_never_averaged_over_a_subset(finished_run, tmp_path, caplog):
    """Issue 40, case 4 (main: ``kv_retained_bytes_mean`` averaged over the new lines only, 71,071.75 against
    74,449.86): the metrics and the report show it missing, naming the field and how many lines lack it; every figure
    both layouts carry is the one of the whole run."""
    from vase.analysis.load import load_tree
    from vase.run.records import compute_metrics

    results = tmp_path / "results"
    run_dir = copy_run(finished_run, results)
    whole = compute_metrics(run_dir, [], 2, {}, [1])
    assert whole["kv_retained_bytes_mean"] is not None and "fields_missing" not in whole
    _as_older_release(run_dir, range(3), NEWER)  # a half-finished older run, resumed by this release
    m = compute_metrics(run_dir, [], 2, {}, [1])
    for key in ("kv_retained_bytes_mean", "kv_retained_bytes_peak", "compression_ratio_full_layers"):
        assert m[key] is None, key
    assert m["kv_held_bytes_mean_by_type"] is None
    assert m["fields_missing"]["kv_retained_bytes_mean"].startswith("absent from 3 of 6 samples")
    for key in ("accuracy", "samples", "mean_output_tokens", "kv_held_bytes_mean", "held_tokens", "compression_ratio"):
        assert m[key] == whole[key], key
    with caplog.at_level(logging.WARNING):
        tree = load_tree(results)
    assert tree.samples["kv_retained_bytes_mean"].isna().all()  # not the mean of the 3 new lines
    assert "kv_retained_bytes_mean (3 of 6)" in caplog.text
    assert "kv_retained_bytes_mean" in tree.runs.loc[0, "fields_missing"]


def test_the_resume_of_an_older_run_reports_the_missing_field_not_a_subset_mean(finished_run, tmp_path):
    """The resume itself (``run.py`` on the older run's directory): the metrics it writes say the field is missing."""
    from vase.run.runner import run

    results = tmp_path / "results"
    run_dir = copy_run(finished_run, results)
    _as_older_release(run_dir, range(3), NEWER)
    rows = _lines(run_dir)[:4]  # the run was stopped after 4 samples: 3 of the older release, 1 of this one
    (run_dir / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    metrics = run(compose([*TINY_RUN, "limit=3", f"results_dir={results}"]), progress=False)
    assert metrics["samples"] == 6 and metrics["complete"]
    assert metrics["kv_retained_bytes_mean"] is None
    assert metrics["fields_missing"]["kv_retained_bytes_mean"].startswith("absent from 3 of 6 samples")
    assert json.loads((run_dir / "metrics.json").read_text())["kv_retained_bytes_mean"] is None


def test_by_type_as_a_list_is_one_line(finished_run, tmp_path):
    """Issue 40 (main: a TypeError naming no file)."""
    from vase.run.records import compute_metrics

    run_dir = copy_run(finished_run, tmp_path / "results")
    rows = _lines(run_dir)
    rows[3]["kv_held_bytes_end_by_type"] = [25600]
    (run_dir / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    msg = _refused(lambda: compute_metrics(run_dir, [], 2, {}, [1]))
    assert msg.startswith(f"{run_dir / 'samples.jsonl'}: line 4: field kv_held_bytes_end_by_type must be an object")


def test_a_line_nested_100000_deep_is_one_line_everywhere(finished_run, tmp_path, capsys):
    """Issue 40 (main: RecursionError): in samples.jsonl (every reader, the last line too), throughput.jsonl, a
    rank's part, protocol.json (one line) and metrics.json (ignored with a warning, recomputed from the samples)."""
    from vase.analysis.load import load_tree
    from vase.bench.runs import read_run
    from vase.run.results import read_json, read_samples, read_throughput

    results = tmp_path / "results"
    run_dir = copy_run(finished_run, results)
    _append(run_dir / "samples.jsonl")
    with open(run_dir / "samples.jsonl", "a") as f:
        f.write(DEEP + "\n")  # the last line: not a torn write either
    for call in (lambda: read_samples(run_dir), lambda: load_tree(results), lambda: read_run(results)):
        assert _refused(call).startswith(f"{run_dir / 'samples.jsonl'}: line 7 is not a line vase writes (arrays")
    (run_dir / "samples.jsonl").write_text((finished_run / "samples.jsonl").read_text())
    with open(run_dir / "throughput.jsonl", "a") as f:
        f.write(DEEP + "\n")
    assert f"{run_dir / 'throughput.jsonl'}: line " in _refused(lambda: read_throughput(run_dir))
    (run_dir / "throughput.jsonl").write_text((finished_run / "throughput.jsonl").read_text())
    (run_dir / "metrics.json").write_text('{"a": ' + DEEP + "}")
    tree = load_tree(results)  # metrics.json ignored, the run recomputed from its samples
    assert len(tree.samples) == 6
    (run_dir / "protocol.json").write_text(DEEP)
    assert _refused(lambda: read_json(run_dir / "protocol.json")).startswith(f"{run_dir / 'protocol.json'}: damaged")


def test_a_damaged_throughput_line_is_one_line(finished_run, tmp_path):
    from vase.run.records import compute_metrics

    run_dir = copy_run(finished_run, tmp_path / "results")
    lines = (run_dir / "throughput.jsonl").read_text().splitlines()
    for field, value, says in (
        ("decode_seconds", -1.0, "field decode_seconds must be a finite number >= 0"),
        ("tokens", "12", "field tokens must be an integer >= 0"),
        ("peak_memory_bytes", 1e30, "field peak_memory_bytes must be a finite number >= 0"),
        ("rows", 2.5, "field rows must be an integer >= 0"),
    ):
        bad = dict(json.loads(lines[0]), **{field: value})
        (run_dir / "throughput.jsonl").write_text("\n".join([json.dumps(bad), *lines[1:]]) + "\n")
        msg = _refused(lambda: compute_metrics(run_dir, [], 2, {}, [1]))
        assert msg.startswith(f"{run_dir / 'throughput.jsonl'}: line 1: {says}"), msg


def test_a_metrics_json_out_of_range_is_ignored_and_recomputed(finished_run, tmp_path, caplog):
    from vase.analysis.load import load_tree

    results = tmp_path / "results"
    run_dir = copy_run(finished_run, results)
    m = json.loads((run_dir / "metrics.json").read_text())
    (run_dir / "metrics.json").write_text(json.dumps(dict(m, accuracy=1.7)))
    with caplog.at_level(logging.WARNING):
        tree = load_tree(results)
    assert "key accuracy must be a finite number >= 0 and <= 1" in caplog.text
    assert tree.metrics == {} and len(tree.samples) == 6


def test_an_older_run_in_a_tree_is_named_with_a_fix_and_the_others_are_reported(finished_run, tmp_path, capsys):
    """Issue 40 (main: one run of an older layout made the whole report refuse, with a hint to fix a line): the report
    covers the other runs, names the old one and the command that reruns it."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import report as report_script

    from vase.analysis.load import load_tree

    results = tmp_path / "results"
    copy_run(finished_run, results)
    old = results / "older" / finished_run.name
    import shutil

    shutil.copytree(finished_run, old)
    _as_older_release(old, range(6), ("kv_held_bytes_end", "kv_full_bytes_end", *NEWER))  # before d2edd19
    tree = load_tree(results)
    assert len(tree.runs) == 1 and len(tree.samples) == 6
    ((name, why),) = tree.skipped
    assert name == str(old)
    assert why.startswith(f"{old}: written by an older release of vase (6 of 6 lines, from {old / 'samples.jsonl'}")
    assert f"python run.py --config-path {old.resolve()} --config-name config run_dir={old}-rerun" in why
    out = tmp_path / "report"
    assert report_script.main([str(results), "--out", str(out), "--wandb", "disabled", "--formats", "png", "-q"]) == 0
    assert f"skipped {old}" in capsys.readouterr().out
    # a resume of the older run says the same, in one line, and writes nothing
    before = snapshot(tmp_path / "results")
    from vase.run.runner import run

    cfg = compose([*TINY_RUN, "limit=3", f"run_dir={old}"])
    assert "written by an older release of vase" in _refused(lambda: run(cfg, progress=False))
    assert snapshot(tmp_path / "results") == before


def test_the_fix_the_older_run_is_named_with_applies(finished_run, tmp_path):
    """The command the older run is named with reruns it from its own config.yaml into a new directory."""
    import subprocess

    old = tmp_path / "results" / "old"
    import shutil

    shutil.copytree(finished_run, old)
    _as_older_release(old, range(6), ("kv_held_bytes_end",))
    from vase.run.results import read_samples

    msg = _refused(lambda: read_samples(old, for_metrics=True))
    command = msg.split("(python ", 1)[1].split("), or move", 1)[0]
    env = {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "disabled"}
    import os

    done = subprocess.run(
        [sys.executable, *command.split()[0:1], *command.split()[1:]],
        cwd=ROOT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    rerun = Path(f"{old}-rerun")
    assert len(read_samples(rerun, for_metrics=True)) == 6
