"""Every class of bad input and fault the harness handles, what the user sees, and the test that shows it.

:data:`CASES` is the registry: it renders ``docs/reliability.md`` (:func:`render`; regenerate with ``make
reliability-doc`` or ``python scripts/reliability_table.py``) and every row names the test that shows it; the tests
here check that each named test exists, that the committed table is the rendered one (so neither can drift), run the
refusals of :data:`REFUSALS` themselves, and run every destructive path against a directory of finished samples,
comparing its bytes before and after.
"""

from __future__ import annotations

import ast
import json
import shutil
import sys
from pathlib import Path

import pytest

from tests.conftest import TINY_RUN, compose, copy_run, snapshot
from tests.reliability_registry import Case, Refusal
from tests.test_preflight_refusals import PREFLIGHT_CASES, PREFLIGHT_REFUSALS
from tests.test_reliability_hostile import HOSTILE_AREAS, HOSTILE_CASES, HOSTILE_REFUSALS
from vase.run.results import read_samples
from vase.run.rundir import lock_run_dir
from vase.run.runner import run

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "reliability.md"


ROW = b'{"problem": "1+1?", "answer": "2", "unique_id": "a"}\n'
REFUSALS = [
    Refusal("setting", "Settings", "a bad value of a setting (`ratio=0`)", ("ratio=0",), "ratio: must be > 0, got 0; "),
    Refusal(
        "policy-range",
        "Settings",
        "a policy field out of range (`policy.n_protect=-1`)",
        ("policy.n_protect=-1",),
        "policy.n_protect: must be >= 0, got -1",
    ),
    Refusal(
        "policy-key",
        "Settings",
        "a field the policy does not have (`+policy.smooth=3`)",
        ("+policy.smooth=3",),
        "policy.smooth: not a setting of vase.policies.attnv.VaSEAttnV (did you mean",
    ),
    Refusal(
        "task-type",
        "Settings",
        "a task field of the wrong type (`task.size=many`)",
        ("task.size=many",),
        "task.size: must be an integer, got 'many'",
    ),
    Refusal(
        "sandbox-nan",
        "Sandbox",
        "a sandbox limit the OS cannot take (`task.timeout_s=nan`, `inf`, `task.memory_mb=0.5`)",
        ("task=humaneval", "task.timeout_s=nan"),
        "task.timeout_s: must be a finite number, got nan",
    ),
    Refusal(
        "sandbox-too-small",
        "Sandbox",
        "limits under which not even an empty program runs (`task.memory_mb=2`)",
        ("task=humaneval", "task.memory_mb=2"),
        "task.memory_mb: the sandbox cannot run even an empty program under these limits",
    ),
    Refusal(
        "model-name",
        "Model and memory",
        "a model name that does not exist (offline: not in the cache)",
        ("model.name=no-such-org/no-such-model",),
        "model: cannot resolve no-such-org/no-such-model@main",
    ),
    Refusal(
        "tiny-field",
        "Model and memory",
        "tiny-model fields that make no working model (`+model.tiny.num_attention_heads=3`)",
        ("+model.tiny.num_attention_heads=3",),
        "model.tiny: model.tiny.num_hidden_layers=2, model.tiny.num_attention_heads=3 do not make a working",
    ),
    Refusal(
        "context",
        "Model and memory",
        "a `max_length` beyond the model's context window",
        ("generation.max_length=100000",),
        "generation.max_length: 100000 tokens exceed the context window of tiny:qwen3 (max_position_embeddings=4096)",
    ),
    Refusal(
        "kv-memory",
        "Model and memory",
        "a `generation.kv_memory` too small for one row",
        ("generation.kv_memory=1000",),
        "generation.kv_memory: 1000 bytes hold no row of the cache",
    ),
    Refusal(
        "huge-cache",
        "Model and memory",
        "a `max_length` whose full cache does not fit the machine (256 GB)",
        ("policy=full", "+model.tiny.max_position_embeddings=1000000000000", "generation.max_length=100000000000"),
        "generation.max_length: one row of the cache needs ",
    ),
    Refusal(
        "empty-data",
        "Data",
        "an empty data file",
        ("task=math500", "task.data_dir={data}"),
        "task.data_dir: {data}/math500.jsonl holds no problems (the file is empty)",
        b"",
    ),
    Refusal(
        "not-utf8",
        "Data",
        "a data file that is not UTF-8",
        ("task=math500", "task.data_dir={data}"),
        "{data}/math500.jsonl:2: not UTF-8 text (byte 0xe9 at column 17); save the file as UTF-8",
        ROW + '{"problem": "caf\u00e9", "answer": "1"}\n'.encode("latin-1"),
    ),
    Refusal(
        "not-object",
        "Data",
        "a data line that is not a JSON object",
        ("task=math500", "task.data_dir={data}"),
        "{data}/math500.jsonl:2: a JSON list, not an object",
        ROW + b"[1, 2]\n",
    ),
    Refusal(
        "missing-field",
        "Data",
        "a data row without a field the task needs",
        ("task=math500", "task.data_dir={data}"),
        "{data}/math500.jsonl:2: missing field answer (task math500 needs problem, answer on every line)",
        ROW + b'{"problem": "2+2?"}\n',
    ),
    Refusal(
        "no-problems",
        "Data",
        "a problem set with no problem (`limit=0`, a shard with none)",
        ("limit=0",),
        "limit: 0 selects no problems, so there is nothing to run",
    ),
    Refusal(
        "foreign-dir",
        "Run directory",
        "`run_dir=` a directory that is not a vase run (`run_dir=conf`)",
        ("run_dir={tmp}/conf",),
        "run_dir: {tmp}/conf is not a vase run directory (it holds ",
    ),
    Refusal(
        "dev-null",
        "Run directory",
        "`results_dir=/dev/null`, or a path under a file",
        ("results_dir=/dev/null",),
        "results_dir: /dev/null/gsm_symbolic/tiny/",
    ),
]


def _t(name: str, file: str = "tests/test_runner_inputs.py") -> str:
    return f"{file}::{name}"


CASES = [
    # command line
    Case(
        "Command line",
        "a typo in a setting or group (`polcy=full`, `policy=vase_dkvv`)",
        "`error: polcy=full: unknown setting polcy (did you mean policy=full?) ...`",
        "2",
        _t("test_typo_or_bad_value_is_one_line_exit_2_and_writes_nothing", "tests/test_cli.py"),
    ),
    Case(
        "Command line",
        "an override Hydra cannot parse, `+` on an existing key, a sweep value without `-m`",
        "`error: <override>: cannot parse it (...); write key=value ...` and the like",
        "2",
        _t("test_check_overrides_messages", "tests/test_cli.py"),
    ),
    Case(
        "Settings",
        "a bad value of any top-level, `generation`, `model` or `task` setting",
        "`error: <setting>: <what is wrong>, got <value>; <fix>`",
        "2",
        _t("test_bad_setting_is_one_line_before_anything_loads_or_is_written", "tests/test_checks.py"),
    ),
    Case(
        "Settings",
        "`model.reference_tokens` (the reference length behind `ratio=`) not a positive number",
        "`error: model.reference_tokens: must be a positive number of tokens or null, got 0; e.g. ...`",
        "2",
        _t("test_a_bad_reference_length_is_one_line", "tests/test_run_settings.py"),
    ),
    Case(
        "Settings",
        "a bad policy, task or logger field (type, unknown key, range), before Hydra writes anything",
        "`error: policy.n_protect: must be >= 0, got -1`",
        "2",
        _t("test_i11_refused_before_hydra_writes_anything"),
    ),
    Case(
        "Settings",
        "a package the run needs is not installed (`reasoning_gym`)",
        "`error: task gsm_symbolic: needs the Python package 'reasoning_gym', which is not installed; pip install ...`",
        "2",
        _t("test_i11_refused_before_hydra_writes_anything"),
    ),
    Case(
        "Sweeps",
        "a bad value in one cell of a multirun (the sweep file's cells included)",
        "`error: job #1 (policy.n_protect=-1): policy.n_protect: must be >= 0, got -1`; no job starts",
        "2",
        _t("test_i4_every_cell_of_a_sweep_is_checked_before_the_first_job", "tests/test_checks.py"),
    ),
    Case(
        "Sweeps",
        "a job that fails while the sweep runs (its directory busy, the machine)",
        "its one line on the terminal; the other jobs run; `sweep: N jobs, k ok, m failed; summary in "
        "<sweep dir>/sweep_summary.json`",
        "1",
        _t("test_i4_a_failed_job_is_recorded_and_the_sweep_goes_on"),
    ),
    Case(
        "Sandbox",
        "a sandbox that cannot start a program while grading (its own setup fails)",
        "`error: sandbox: could not run a program at all (...); this is not the program's fault, so nothing was "
        "graded ...`; never a wrong answer",
        "2",
        _t("test_i3_a_sandbox_setup_failure_is_never_a_grade", "tests/test_checks.py"),
    ),
    Case(
        "Sandbox",
        "a program that fakes the sandbox's setup-error line",
        "graded as a failing program (the launcher reports on a pipe the program never holds)",
        "-",
        _t("test_i3_a_sandbox_setup_failure_is_never_a_grade", "tests/test_checks.py"),
    ),
    Case(
        "Sandbox",
        "hostile programs: infinite loops, fork bombs, memory hogs, 1 GB of output, writes outside, network, "
        "killing the parent, reading secrets",
        "graded `timeout` / `output_limit` / wrong; the harness and the machine are untouched",
        "-",
        _t("test_hostile_fork_bomb", "tests/test_sandbox.py"),
    ),
    Case(
        "Model and memory",
        "`model.device=cuda` on a machine without CUDA",
        "`error: model.device: cuda, but torch sees no CUDA device on this machine (...); use model.device=auto ...`",
        "2",
        _t("test_i8_failures_that_wrote_protocol_json_now_write_nothing"),
    ),
    Case(
        "Model and memory",
        "a `max_length` no prompt fits under",
        "`error: generation.max_length: 10 leaves no room for output (...); raise generation.max_length`",
        "2",
        _t("test_b2_max_length_below_every_prompt_is_refused_before_anything"),
    ),
    Case(
        "Model and memory",
        "a prompt longer than `max_length` (others fit)",
        "that problem's samples are recorded `prompt_too_long` with an error; the run goes on",
        "0",
        _t("test_b2_a_prompt_longer_than_max_length_is_recorded_and_the_run_goes_on"),
    ),
    Case(
        "Model and memory",
        "any of the above, then the corrected command",
        "the corrected command runs (nothing was written, so it is not refused as another protocol)",
        "0",
        _t("test_i8_the_corrected_command_runs_after_a_refusal"),
    ),
    Case(
        "Data",
        "a `task.data_dir` without the task's file",
        "`error: task.data_dir: <dir> has no math500.jsonl for task math500`",
        "2",
        _t("test_b3_a_data_dir_without_the_file_writes_nothing"),
    ),
    Case(
        "Data",
        "`protocol=paper` with a `task.data_dir` file that is not the authors' (its sha256)",
        "`error: task.data_dir: <dir>/math500.jsonl is not the authors' copy (sha256 ..., theirs ...: "
        "terarachang/VaSE@bfa2692 <path>); ... or run this copy with protocol.require_authors_data=false`",
        "2",
        _t("test_paper_refuses_a_local_copy_that_is_not_the_authors_before_anything", "tests/test_protocol.py"),
    ),
    Case(
        "Data",
        "a data line that is not JSON",
        "`error: <file>:<line>: invalid JSON (...); fix or remove that line ...`",
        "2",
        _t("test_i6_i9_i10_a_bad_data_file_is_one_line_naming_it_before_anything"),
    ),
    Case(
        "Data",
        "the data changed since the run started (a file's sha256, a hub commit)",
        "`error: run_dir <dir> holds a run made from other data or weights (<what changed>); ...`",
        "2",
        _t("test_changed_local_data_refuses_a_resume_and_a_moved_copy_does_not", "tests/test_hub.py"),
    ),
    Case(
        "Data",
        "the hub unreachable and nothing cached",
        "`error: task aime25: cannot load dataset math-ai/aime25 (offline or unreachable: ...); point task.data_dir "
        "...`",
        "2",
        _t("test_unreachable_hub_switches_to_offline_and_fails_at_once", "tests/test_hub.py"),
    ),
    Case(
        "Run directory",
        "`results_dir` on a read-only disk",
        "`error: results_dir (Hydra's output directory): <dir> cannot be created (<dir> is not writable); ...`",
        "2",
        _t("test_i9_a_read_only_results_dir_is_one_line_exit_2"),
    ),
    Case(
        "Run directory",
        "`run_dir=` a run with another protocol (another seed, sampling, budget...)",
        "`error: run_dir <dir> holds a run with a different protocol (seed: 0 -> 1); ...`; nothing changes",
        "2",
        _t("test_destructive_paths_leave_the_finished_samples_as_they_were", "tests/test_reliability.py"),
    ),
    Case(
        "Run directory",
        "a second run writing the same run directory at once",
        "`error: run_dir <dir> is being written by another run (pid <pid> on <host>, since <time>); wait for it ...`",
        "2",
        _t("test_i5_run_py_refuses_a_directory_another_process_writes"),
    ),
    Case(
        "Run directory",
        "a truncated or edited `protocol.json` / `resolved.json`",
        "`error: <dir>/protocol.json: damaged (...); restore it from a copy, or move <dir> aside ...`",
        "2",
        _t("test_i10_a_truncated_protocol_or_resolved_json_is_named_with_the_fix"),
    ),
    Case(
        "Run directory",
        "a valid JSON line in `samples.jsonl` that is not a sample",
        "`error: <dir>/samples.jsonl: line 7 is not a sample (an object without problem_id, sample, correct; ...)`",
        "2",
        _t("test_i9_a_json_line_that_is_not_a_sample_is_one_line"),
    ),
    Case(
        "Run directory",
        "a corrupt line in the middle of `samples.jsonl`",
        "`error: <file>: corrupt line 2 (not the last line, so not a torn write); fix or delete that line ...`",
        "2",
        _t("test_torn_last_line_is_tolerated_and_repaired", "tests/test_runner.py"),
    ),
    Case(
        "Run directory",
        "a rerun with a smaller `limit` on a finished run",
        "nothing decoded, nothing rewritten; the metrics describe the whole directory",
        "0",
        _t("test_destructive_paths_leave_the_finished_samples_as_they_were", "tests/test_reliability.py"),
    ),
    Case(
        "Run directory",
        "a rerun with a larger `limit`",
        "the run is extended: the samples already there stay byte for byte, the new problems are appended",
        "0",
        _t("test_destructive_paths_leave_the_finished_samples_as_they_were", "tests/test_reliability.py"),
    ),
    Case(
        "While running",
        "`kill -9` mid-run, then the same command",
        "every sample exactly once; the lock died with the process",
        "0",
        _t("test_sigkill_midway_then_relaunch_gives_every_sample_once", "tests/test_runner.py"),
    ),
    Case(
        "While running",
        "a torn last line (killed mid-write), then the same command",
        "the torn line is cut, the run resumes; metrics equal an uninterrupted run's",
        "0",
        _t("test_b8_a_torn_last_line_then_rerun_gives_the_uninterrupted_metrics"),
    ),
    Case(
        "While running",
        "Ctrl-C",
        "`interrupted: every finished sample is saved; rerun the same command to resume: python run.py ...`",
        "130",
        _t("test_ctrl_c_exits_130_with_the_resume_command_and_keeps_every_finished_sample"),
    ),
    Case(
        "While running",
        "the disk fills up (or a permission is lost) while writing",
        "`error: <file>: No space left on device; fix the disk or permissions, then rerun the same command to "
        "resume ...`",
        "1",
        _t("test_a_full_disk_mid_run_is_one_line_and_the_rerun_resumes"),
    ),
    Case(
        "Numerics",
        "NaN / inf in the model's logits",
        "the sample is recorded `finish_reason: nonfinite` with an error, never graded as a loop; "
        "`nonfinite_samples` in the metrics",
        "0",
        _t("test_b10_nan_in_the_model_is_a_numerical_failure_not_a_loop"),
    ),
    Case(
        "Numerics",
        "a temperature so small that the logits would overflow (`generation.temperature=1e-300`)",
        "sampling stays finite: the greedy tokens (no `!!!!` garbage)",
        "0",
        _t("test_i7_a_tiny_temperature_samples_the_greedy_tokens_without_overflow"),
    ),
    Case(
        "Numerics",
        "a policy whose `keep()` returns duplicate or out-of-range indices (a new policy under development)",
        "with `generation.check_policy_output=true`: `policy <name>: keep() returned duplicate indices` at that "
        "eviction (off by default: one host sync per eviction)",
        "-",
        _t("test_check_policy_output_refuses_duplicate_indices", "tests/test_policy_authoring.py"),
    ),
    Case(
        "Model and memory",
        "TriAttention's query centres missing or of another model (`policy=triattention` outside the runner)",
        "`policy.triattention: not calibrated; ...` / `centres of shape (...) for a model of (...); recalibrate`",
        "-",
        _t(
            "test_triattention_refuses_to_decode_uncalibrated_or_with_another_models_centres",
            "tests/test_new_baselines.py",
        ),
    ),
    Case(
        "Shards",
        "`merge_shards.py` into a finished run that holds more problems (another `limit`)",
        "the target's samples stay byte for byte; the shards' missing samples are appended",
        "-",
        _t("test_i1_merge_shards_into_a_finished_run_keeps_every_sample"),
    ),
    Case(
        "Shards",
        "`merge_shards.py` into a run of another protocol, a directory that is not a run, a shard still running",
        "`error: <target>: already holds a run with another protocol (...); nothing was merged, nothing changed` "
        "(the script exits 2)",
        "-",
        _t("test_i1_merge_shards_appends_what_the_target_lacks_and_refuses_another_protocol"),
    ),
]
REFUSALS += HOSTILE_REFUSALS  # the rows of issue 29 and the hostile pass (tests/test_reliability_hostile.py)
REFUSALS += PREFLIGHT_REFUSALS  # issue 40's checks that came after a write, and issue 39's traps
CASES += HOSTILE_CASES
CASES += PREFLIGHT_CASES
CASES += [
    Case(
        r.area,
        r.fault,
        f"`error: {r.expected.format(tmp='<tmp>', data='<dir>').rstrip('; ')}...`",
        "2",
        f"tests/test_reliability.py::test_refusals[{r.id}]",
    )
    for r in REFUSALS
]
AREAS = [
    "Command line",
    "Settings",
    "Sweeps",
    "Model and memory",
    "Data",
    "Sandbox",
    "Run directory",
    "While running",
    "Numerics",
    "Shards",
    *HOSTILE_AREAS,
]


def render() -> str:
    """``docs/reliability.md``: the table of :data:`CASES`, by area."""
    lines = [
        "# Reliability: what the harness does with bad input and faults",
        "",
        "Generated from `tests/test_reliability.py` (`make reliability-doc`); a test fails when this file and the",
        "registry differ, and every row names the test that shows it. Bad input is refused in one line that names the",
        "setting or file and the fix, before anything is written (Hydra's own directory included), data or weights",
        "load; nothing already computed is ever lost or overwritten (`test_destructive_paths_leave_the_finished_"
        "samples_as_they_were` runs every destructive path against a directory of finished samples and compares its",
        "bytes). `raise_errors=true` keeps Python's tracebacks for debugging.",
        "",
        "Exit codes of `python run.py`: 0 done; 2 bad input, refused (nothing written); 1 a failure while running",
        "(one line for the machine's; a traceback for a bug) or a multirun with a failed job (`<sweep "
        "dir>/sweep_summary.json`",
        "lists every job's outcome); 130 interrupted, with the command that resumes.",
        "",
    ]
    for area in AREAS:
        rows = [c for c in CASES if c.area == area]
        lines += [
            f"## {area}",
            "",
            "| Bad input or fault | What the user sees | Exit | Shown by |",
            "|---|---|---|---|",
        ]
        for c in rows:
            file, name = c.test.split("::")
            lines.append(f"| {c.fault} | {c.sees} | {c.code} | `{Path(file).name}::{name}` |")
        lines.append("")
    return "\n".join(lines)


def _test_functions(file: str) -> set[str]:
    tree = ast.parse((ROOT / file).read_text())
    return {n.name for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("test")}


def test_every_case_names_a_test_that_exists():
    assert {c.area for c in CASES} == set(AREAS)
    for c in CASES:
        file, name = c.test.split("::")
        assert name.split("[")[0] in _test_functions(file), c.test
    refusal_rows = [c.test.split("[")[1][:-1] for c in CASES if "::test_refusals[" in c.test]
    assert sorted({r.id for r in REFUSALS}) == sorted(refusal_rows)  # each id once


def test_docs_reliability_md_is_the_rendered_table():
    assert DOC.read_text() == render(), "docs/reliability.md is stale: run `make reliability-doc`"


@pytest.fixture
def no_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    from vase.models import ModelSpec

    def forbidden(*_args, **_kwargs):
        raise AssertionError("weights loaded before the inputs were checked")

    monkeypatch.setattr(ModelSpec, "load", forbidden)


@pytest.mark.parametrize("case", REFUSALS, ids=[r.id for r in REFUSALS])
def test_refusals(case: Refusal, tmp_path: Path, no_weights: None) -> None:
    """Refused in one line, before anything is written: no results directory, no change to a directory given."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "math500.jsonl").write_bytes(case.data)
    shutil.copytree(ROOT / "conf", tmp_path / "conf")
    before = snapshot(tmp_path)
    results = tmp_path / "results"
    overrides = [o.format(tmp=tmp_path, data=data) for o in case.overrides]
    with pytest.raises(ValueError) as err:
        run(compose([*TINY_RUN, "limit=1", f"results_dir={results}", *overrides]), progress=False)
    msg = str(err.value)
    assert msg.startswith(case.expected.format(tmp=tmp_path, data=data)), msg
    assert "\n" not in msg and "; " in msg
    assert snapshot(tmp_path) == before and not results.exists()


def test_destructive_paths_leave_the_finished_samples_as_they_were(finished_run: Path, tmp_path: Path) -> None:
    """Every path that could damage a finished run, against a copy of one; its bytes compared before and after."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from merge_shards import merge

    results = tmp_path / "results"
    run_dir = copy_run(finished_run, results)
    same = [*TINY_RUN, "limit=3", f"results_dir={results}"]
    samples = (run_dir / "samples.jsonl").read_bytes()
    run(compose(same), progress=False)  # the copy's metrics.json now names the copy's directory (run_dir)
    before = snapshot(run_dir)
    assert before["samples.jsonl"] == samples

    def refused(overrides: list[str], match: str) -> None:
        with pytest.raises(ValueError, match=match):
            run(compose(overrides), progress=False)
        assert snapshot(run_dir) == before

    # another protocol into the same directory (run_dir=, or the same directory by name)
    refused([*TINY_RUN, "limit=3", "seed=1", f"run_dir={run_dir}"], r"holds a run with a different protocol \(seed")
    refused([*same, "generation.temperature=0.5"], r"different protocol \(generation.temperature: 1.0 -> 0.5[;)]")
    # a second writer
    with lock_run_dir(run_dir):
        refused(same, "is being written by another run")
    # the same command again, and a smaller limit: nothing to do, nothing rewritten
    for limit in (3, 1):
        metrics = run(compose([*TINY_RUN, f"limit={limit}", f"results_dir={results}"]), progress=False)
        assert metrics["samples"] == 6 and snapshot(run_dir) == before
    # merge_shards: shards of a smaller limit into the finished run, then shards of another protocol
    ids = sorted({r["problem_id"] for r in read_samples(run_dir)})
    for i in range(2):
        shard = run_dir.parent / f"{run_dir.name}-shard{i}of2"
        shutil.copytree(run_dir, shard)
        rows = [r for r in read_samples(run_dir) if r["problem_id"] == ids[i]]
        (shard / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    merge(run_dir)
    after = snapshot(run_dir)
    assert after["samples.jsonl"] == samples
    assert {k: v for k, v in after.items() if k not in ("metrics.json", "throughput.jsonl")} == {
        k: v for k, v in before.items() if k not in ("metrics.json", "throughput.jsonl")
    }
    before = after
    with lock_run_dir(run_dir), pytest.raises(ValueError, match="is being written by another run"):
        merge(run_dir)  # never while a run writes the target
    assert snapshot(run_dir) == before
    for i in range(2):
        shard = run_dir.parent / f"{run_dir.name}-shard{i}of2"
        protocol = json.loads((shard / "protocol.json").read_text())
        (shard / "protocol.json").write_text(json.dumps({**protocol, "seed": 5}))
    with pytest.raises(ValueError, match="already holds a run with another protocol"):
        merge(run_dir)
    assert snapshot(run_dir) == before
    # a larger limit extends the run: what was there stays, byte for byte, at the start of each file
    metrics = run(compose([*TINY_RUN, "limit=4", f"results_dir={results}"]), progress=False)
    assert metrics["samples"] == 8 and metrics["complete"]
    grown = (run_dir / "samples.jsonl").read_bytes()
    assert grown.startswith(samples) and len(grown) > len(samples)
