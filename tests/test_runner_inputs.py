"""The runner on inputs that used to slip through (issue 12, rows B2, B3, B8, B9, B10): every one is either refused
before any file is written or weights load, or handled per sample without losing what was computed."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from tests.conftest import copy_run, snapshot
from vase.run.records import compute_metrics
from vase.run.results import read_jsonl_tolerant, read_samples
from vase.run.rundir import lock_run_dir
from vase.run.runner import plan, prepare, run

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


@pytest.mark.parametrize(  # v_proj in the default suite, the others in -m slow (CI's time budget)
    "where", [pytest.param("q_proj", marks=pytest.mark.slow), "v_proj", pytest.param("lm_head", marks=pytest.mark.slow)]
)
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


# ---- issue 20: nothing lost, nothing overwritten, every bad input refused in one line -----------------------------
# Each test is named after the item it shows (i1 = item 1); every one failed before the change.

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "disabled"}
FIXTURES = ROOT / "tests" / "fixtures" / "tasks"


# ``python run.py`` with Python's Ctrl-C handler installed whatever the disposition of SIGINT it inherits: a job
# started in the background by a non-interactive shell (``make test &``, a CI runner) inherits SIGINT ignored (POSIX),
# and Python then leaves it ignored, so a test's simulated Ctrl-C would do nothing there.
CTRL_C = (
    "import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
    "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
)


def _run_py(
    *args: str, env: dict | None = None, prefix: tuple[str, ...] = (), ctrl_c: bool = False
) -> subprocess.CompletedProcess:
    python = [sys.executable, "-c", CTRL_C] if ctrl_c else [sys.executable]
    return subprocess.run(
        [*prefix, *python, "run.py", *args],
        cwd=ROOT,
        env=env or ENV,
        capture_output=True,
        text=True,
        timeout=900,
    )


def _one_error_line(r: subprocess.CompletedProcess) -> str:
    """The single ``error:`` line of a refused command (and no traceback)."""
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    lines = [x for x in r.stderr.splitlines() if x.strip() and "WARNING" not in x]
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr[-3000:]
    return lines[0]


def _shard(target: Path, i: int, n: int, problem_ids: set[str]) -> Path:
    """A shard run ``<target>-shard<i>of<n>`` holding ``target``'s samples of ``problem_ids`` (same protocol)."""
    shard = target.parent / f"{target.name}-shard{i}of{n}"
    shutil.copytree(target, shard)
    rows = [r for r in read_samples(target) if r["problem_id"] in problem_ids]
    (shard / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    metrics = compute_metrics(shard, sorted(problem_ids), 2, {"run_dir": str(shard)}, [1])
    (shard / "metrics.json").write_text(json.dumps(metrics))
    return shard


def test_i1_merge_shards_into_a_finished_run_keeps_every_sample(finished_run, tmp_path):
    sys.path.insert(0, str(ROOT / "scripts"))
    from merge_shards import merge

    target = copy_run(finished_run, tmp_path / "results")  # an unsharded run of limit=3: 6 samples
    before = (target / "samples.jsonl").read_bytes()
    ids = sorted({r["problem_id"] for r in read_samples(target)})
    _shard(target, 0, 2, {ids[0]})  # shards of limit=2: problems 0 and 1 only
    _shard(target, 1, 2, {ids[1]})
    merged = merge(target)
    assert (target / "samples.jsonl").read_bytes() == before  # never shortened (it was cut to 4 lines)
    assert merged["samples"] == 6 and merged["problems"] == 3 and merged["complete"]


def test_i1_merge_shards_appends_what_the_target_lacks_and_refuses_another_protocol(finished_run, tmp_path):
    sys.path.insert(0, str(ROOT / "scripts"))
    from merge_shards import merge

    source = copy_run(finished_run, tmp_path / "src")
    ids = sorted({r["problem_id"] for r in read_samples(source)})
    target = tmp_path / "results" / "merged"
    target.parent.mkdir(parents=True)
    for i, pid in enumerate(ids):
        _shard(source, i, 3, {pid}).rename(target.parent / f"{target.name}-shard{i}of3")
    assert merge(target)["samples"] == 6  # into an absent directory
    first = (target / "samples.jsonl").read_bytes()
    assert merge(target)["samples"] == 6 and (target / "samples.jsonl").read_bytes() == first  # rerun: nothing new
    protocol = json.loads((target / "protocol.json").read_text())
    (target / "protocol.json").write_text(json.dumps({**protocol, "seed": 1}))
    before = snapshot(target)
    with pytest.raises(ValueError, match=r"already holds a run with another protocol \(seed: 1 -> 0\)"):
        merge(target)
    assert snapshot(target) == before


def test_i2_run_dir_onto_a_directory_that_is_not_a_run_is_refused(tmp_path, no_weights):
    foreign = tmp_path / "conf"
    shutil.copytree(ROOT / "conf", foreign)
    before = snapshot(foreign)
    with pytest.raises(ValueError) as err:
        run(_compose([*TINY, "limit=1", f"run_dir={foreign}"]), progress=False)
    assert str(err.value).startswith(f"run_dir: {foreign} is not a vase run directory (it holds ")
    assert snapshot(foreign) == before  # conf/config.yaml was replaced by a run's config
    lone = tmp_path / "notes"
    lone.mkdir()
    (lone / "config.yaml").write_text("mine: 1\n")
    with pytest.raises(ValueError, match=r"holds config.yaml but no protocol.json"):
        run(_compose([*TINY, "limit=1", f"run_dir={lone}"]), progress=False)
    assert (lone / "config.yaml").read_text() == "mine: 1\n"


def test_i5_a_second_writer_is_refused_in_one_line(finished_run, tmp_path):
    run_dir = copy_run(finished_run, tmp_path / "results")
    (run_dir / "samples.jsonl").write_text("")  # every sample to do again: a writer would write
    before = snapshot(run_dir)
    with lock_run_dir(run_dir), pytest.raises(ValueError) as err:
        run(_compose([*TINY, "limit=3", f"results_dir={tmp_path / 'results'}"]), progress=False)
    assert str(err.value).startswith(f"run_dir {run_dir} is being written by another run (pid {os.getpid()} on ")
    assert snapshot(run_dir) == before


def test_i5_run_py_refuses_a_directory_another_process_writes(finished_run, tmp_path):
    run_dir = copy_run(finished_run, tmp_path / "results")
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK, str(run_dir)], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    try:
        assert holder.stdout.readline().strip() == b"locked"  # blocks until the holder has the lock: no timing
        r = _run_py(*TINY, "limit=3", f"results_dir={tmp_path / 'results'}")
    finally:
        holder.stdin.close()
        holder.wait()
    assert r.returncode == 2
    assert f"is being written by another run (pid {holder.pid} on " in _one_error_line(r)
    assert not (tmp_path / "results" / ".hydra").exists()


HOLD_LOCK = (
    "import sys\nfrom vase.run.rundir import lock_run_dir\nlock = lock_run_dir(sys.argv[1])\n"
    "print('locked', flush=True)\nsys.stdin.read()\n"
)


def _data_dir(tmp_path: Path, content: bytes, name: str = "math500.jsonl") -> Path:
    data = tmp_path / "data"
    data.mkdir(exist_ok=True)
    (data / name).write_bytes(content)
    return data


MATH_ROW = b'{"problem": "1+1?", "answer": "2", "unique_id": "a"}\n'


@pytest.mark.parametrize(
    "content, expected",
    [
        (b"", "task.data_dir: {file} holds no problems (the file is empty)"),  # i6
        (b"\n\n", "task.data_dir: {file} holds no problems (the file is empty)"),  # i6
        (MATH_ROW + b'{"problem": "2+2?", "unique_id": "b"}\n', "{file}:2: missing field answer"),  # i9
        (MATH_ROW + b"[1, 2]\n", "{file}:2: a JSON list, not an object"),  # i9
        (MATH_ROW + b'"just text"\n', "{file}:2: a JSON str, not an object"),  # i9
        (MATH_ROW + '{"problem": "caf\u00e9", "answer": "1"}\n'.encode("latin-1"), "{file}:2: not UTF-8 text"),  # i10
        (MATH_ROW + b'{"problem": "x", "answer"\n', "{file}:2: invalid JSON"),
    ],
)
def test_i6_i9_i10_a_bad_data_file_is_one_line_naming_it_before_anything(tmp_path, no_weights, content, expected):
    data = _data_dir(tmp_path, content)
    results = tmp_path / "results"
    overrides = [*TINY, "task=math500", f"task.data_dir={data}", f"results_dir={results}"]
    with pytest.raises(ValueError) as err:
        run(_compose(overrides), progress=False)
    assert str(err.value).startswith(expected.format(file=data / "math500.jsonl")) and "\n" not in str(err.value)
    assert not results.exists()


@pytest.mark.parametrize(
    "override, expected",
    [
        ("limit=0", "limit: 0 selects no problems"),
        ("task.limit=0", "task.limit: 0 selects no problems"),
        ("task.num_shards=4", "task.shard: shard 3 of task.num_shards=4 gets no problems"),
    ],
)
def test_i6_an_empty_problem_set_is_an_error(tmp_path, no_weights, override, expected):
    results = tmp_path / "results"
    extra = ["task.limit=null", "task.size=2", "task.shard=3"] if "num_shards" in override else []
    with pytest.raises(ValueError, match="^" + re.escape(expected)):
        run(_compose([*TINY, *extra, override, f"results_dir={results}"]), progress=False)
    assert not results.exists()


def test_i7_a_tiny_temperature_samples_the_greedy_tokens_without_overflow():
    from vase.engine import generate
    from vase.engine.policy import FullCache
    from vase.engine.sampling import SamplingConfig, candidate_distribution
    from vase.models import tiny_model

    logits = torch.randn(4, 300) * 20
    for t in (1e-300, 1e-45, 1e-30):
        probs, ids = candidate_distribution(logits, SamplingConfig(temperature=t, top_p=0.95, top_k=20))
        assert torch.isfinite(probs).all()  # was NaN: the logits over the temperature overflowed float32
        assert torch.equal(ids.gather(-1, probs.argmax(-1, keepdim=True)).squeeze(-1), logits.argmax(-1))
        assert torch.equal(probs.max(-1).values, torch.ones(4))
    model = tiny_model("qwen3")
    prompt = list(range(3, 19))
    kw = dict(n_samples=2, max_new_tokens=24, ignore_eos=True, seed=0)
    tiny_t = generate(model, prompt, FullCache(), sampling=SamplingConfig(temperature=1e-300), **kw)
    greedy = generate(model, prompt, FullCache(), sampling=SamplingConfig(temperature=0), **kw)
    assert tiny_t.tokens == greedy.tokens and set(tiny_t.finish_reasons) == {"length"}


@pytest.mark.parametrize(
    "override, expected",
    [
        ("model.name=no-such-org/no-such-model", "model: cannot resolve no-such-org/no-such-model@main"),
        ("+model.tiny.num_attention_heads=3", "model.tiny: model.tiny.num_hidden_layers=2, model.tiny.num_attention_h"),
        ("+model.tiny.num_layerz=2", "model.tiny.num_layerz: not a field of a qwen3 config (did you mean model.tiny.n"),
        ("generation.kv_memory=1000", "generation.kv_memory: 1000 bytes hold no row of the cache"),
        ("model.device=cuda", "model.device: cuda, but torch sees no CUDA device on this machine"),
        (
            "generation.max_length=100000",
            "generation.max_length: 100000 tokens exceed the context window of tiny",
        ),
    ],
)
def test_i8_failures_that_wrote_protocol_json_now_write_nothing(tmp_path, no_weights, override, expected):
    if override == "model.device=cuda" and torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    results = tmp_path / "results"
    with pytest.raises(ValueError) as err:
        run(_compose([*TINY, "limit=1", override, f"results_dir={results}"]), progress=False)
    assert str(err.value).startswith(expected) and "\n" not in str(err.value)
    assert not results.exists()  # so the corrected command is not refused as "a different protocol"


def test_i8_a_full_cache_too_big_for_the_machine_is_refused_then_the_corrected_run_works(tmp_path, no_weights):
    results = tmp_path / "results"
    huge = [*TINY, "limit=1", "policy=full", "+model.tiny.max_position_embeddings=1000000000", f"results_dir={results}"]
    with pytest.raises(ValueError) as err:
        run(_compose([*huge, "generation.max_length=900000000"]), progress=False)
    assert str(err.value).startswith("generation.max_length: one row of the cache needs ")
    assert "more than the " in str(err.value) and not results.exists()
    with pytest.raises(ValueError, match=r"^generation.kv_memory: 1000 bytes hold no row"):
        run(_compose([*TINY, "limit=1", "generation.kv_memory=1000", f"results_dir={results}"]), progress=False)
    assert not results.exists()
    assert plan(_compose([*TINY, "limit=1", "generation.kv_memory=1MiB", f"results_dir={results}"])).work


def test_i8_the_corrected_command_runs_after_a_refusal(tmp_path):
    results = tmp_path / "results"
    with pytest.raises(ValueError, match="^generation.kv_memory"):
        run(_compose([*TINY, "limit=1", "generation.kv_memory=1000", f"results_dir={results}"]), progress=False)
    metrics = run(_compose([*TINY, "limit=1", "generation.kv_memory=1MiB", f"results_dir={results}"]), progress=False)
    assert metrics["complete"] and metrics["samples"] == 2


def test_i9_a_json_line_that_is_not_a_sample_is_one_line(finished_run, tmp_path):
    run_dir = copy_run(finished_run, tmp_path / "results")
    with open(run_dir / "samples.jsonl", "a") as f:
        f.write('{"note": "added by hand"}\n')
    before = snapshot(run_dir)
    with pytest.raises(ValueError) as err:
        run(_compose([*TINY, "limit=3", f"results_dir={tmp_path / 'results'}"]), progress=False)
    assert str(err.value).startswith(
        f"{run_dir / 'samples.jsonl'}: line 7 is not a sample (an object without problem_id, sample, correct"
    )
    assert snapshot(run_dir) == before


@pytest.mark.parametrize("where", ["results_dir", "run_dir"])
def test_i9_an_unwritable_target_is_one_line(tmp_path, no_weights, where):
    blocker = tmp_path / "file.txt"
    blocker.write_text("x")
    for target, why in (("/dev/null", "is not a directory"), (f"{blocker}/sub", f"({blocker} is not a directory)")):
        with pytest.raises(ValueError) as err:
            run(_compose([*TINY, "limit=1", f"{where}={target}"]), progress=False)
        assert str(err.value).startswith(f"{where}: ") and why in str(err.value) and "\n" not in str(err.value)


def _read_only(directory: Path) -> tuple[str, ...]:
    """A command prefix under which ``directory`` is read-only (a read-only bind mount for root, whose writes
    permissions do not stop; ``chmod`` otherwise)."""
    if os.geteuid() != 0:
        directory.chmod(0o555)
        return ()
    probe = subprocess.run(["unshare", "--mount", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip("root without mount namespaces: no way to make a read-only directory here")
    d = str(directory)
    script = f'mount --bind {d} {d} && mount -o remount,bind,ro {d} {d} && exec "$@"'
    return ("unshare", "--mount", "sh", "-c", script, "sh")


def test_i9_a_read_only_results_dir_is_one_line_exit_2(tmp_path):
    readonly = tmp_path / "ro"
    readonly.mkdir()
    prefix = _read_only(readonly)
    r = _run_py(*TINY, "limit=1", f"results_dir={readonly / 'results'}", prefix=prefix)
    readonly.chmod(0o755)
    assert r.returncode == 2, r.stderr[-3000:]
    assert "is not writable" in _one_error_line(r)
    assert not any(readonly.iterdir())


@pytest.mark.parametrize("name", ["protocol.json", "resolved.json"])
def test_i10_a_truncated_protocol_or_resolved_json_is_named_with_the_fix(finished_run, tmp_path, name):
    run_dir = copy_run(finished_run, tmp_path / "results")
    text = (run_dir / name).read_bytes()
    (run_dir / name).write_bytes(text[: len(text) // 2])
    before = snapshot(run_dir)
    with pytest.raises(ValueError) as err:
        run(_compose([*TINY, "limit=3", f"results_dir={tmp_path / 'results'}"]), progress=False)
    msg = str(err.value)
    assert msg.startswith(f"{run_dir / name}: damaged (") and "restore it from a copy" in msg and "\n" not in msg
    assert snapshot(run_dir) == before


@pytest.mark.parametrize(
    "args, expected",
    [
        (["policy.n_protect=-1"], "error: policy.n_protect: must be >= 0, got -1"),
        pytest.param(  # the slow ones: CI's time budget (a run.py process each)
            ["task=humaneval", "task.timeout_s=abc"],
            "error: task.timeout_s: must be a finite number, got 'abc'",
            marks=pytest.mark.slow,
        ),
        pytest.param(
            ["task.data_dir={empty}", "task=math500"],
            "error: task.data_dir: {empty}/math500.jsonl holds no problems",
            marks=pytest.mark.slow,
        ),
        (["task=gsm_symbolic"], "error: task gsm_symbolic: needs the Python package 'reasoning_gym', which is not"),
    ],
)
def test_i11_refused_before_hydra_writes_anything(tmp_path, args, expected):
    empty = _data_dir(tmp_path, b"")
    env = dict(ENV)
    if "reasoning_gym" in expected:  # a machine without the package: a stub that fails to import first on the path
        stub = tmp_path / "stub"
        stub.mkdir()
        fail = "raise ModuleNotFoundError(\"No module named 'reasoning_gym'\", name='reasoning_gym')\n"
        (stub / "reasoning_gym.py").write_text(fail)
        env["PYTHONPATH"] = f"{stub}{os.pathsep}{ROOT}"
    results = tmp_path / "results"
    args = [a.format(empty=empty) for a in args]
    r = _run_py(*TINY, "limit=1", *args, f"results_dir={results}", env=env)
    assert r.returncode == 2
    assert _one_error_line(r).startswith(expected.format(empty=empty))
    assert not results.exists()  # not even results/.hydra


def test_i4_a_failed_job_is_recorded_and_the_sweep_goes_on(tmp_path):
    results, sweep_dir = tmp_path / "results", tmp_path / "sweep"
    base = [*TINY, "limit=1", f"results_dir={results}"]
    busy = prepare(_compose([*base, "policy=streaming"])).run_dir  # job #0's run directory: another run holds it
    with lock_run_dir(busy):
        r = _run_py("-m", *base, "policy=streaming,vase_attnv", f"hydra.sweep.dir={sweep_dir}")
    assert r.returncode == 1, r.stderr[-3000:]  # the sweep says that something failed
    assert "Traceback" not in r.stderr
    summary = json.loads((sweep_dir / "sweep_summary.json").read_text())
    assert (summary["jobs"], summary["ok"], summary["failed"]) == (2, 1, 1)
    failed, ok = summary["results"]
    assert failed["status"] == "failed" and failed["kind"] == "busy" and "policy=streaming" in failed["overrides"]
    assert failed["error"].startswith(f"run_dir {busy} is being written by another run (pid {os.getpid()} on ")
    assert ok["status"] == "ok" and ok["complete"] and "policy=vase_attnv" in ok["overrides"]
    assert "sweep: job #0 (policy=streaming" in r.stderr and "sweep: 2 jobs, 1 ok, 1 failed" in r.stderr


def test_ctrl_c_exits_130_with_the_resume_command_and_keeps_every_finished_sample(tmp_path):
    results = tmp_path / "results"
    # graded inline: exactly the 1st sample is written when Ctrl-C comes (in the background, the grades already
    # running at that moment are written too, so the count would depend on the machine's speed)
    args = [*TINY, "limit=2", "generation.grade_workers=0", f"results_dir={results}"]
    r = _run_py(*args, env={**ENV, "VASE_TEST_KILL_AT": "written:1:INT"}, ctrl_c=True)  # Ctrl-C after the 1st sample
    assert r.returncode == 130, r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith(
        "interrupted: every finished sample is saved; rerun the same command to resume: python run.py"
    )
    assert last.endswith(f"results_dir={results}")
    (samples,) = results.rglob("samples.jsonl")
    assert len(read_samples(samples.parent)) == 1
    again = run(_compose(args), progress=False)  # the lock was released: the rerun resumes
    assert again["complete"] and again["samples"] == 4


def test_a_full_disk_mid_run_is_one_line_and_the_rerun_resumes(tmp_path, monkeypatch):
    import errno

    from vase.run import grading_pool
    from vase.run.sweep import classify

    args = [*TINY, "limit=2", f"results_dir={tmp_path / 'results'}"]
    write = grading_pool.write_sample  # the one writer of sample lines, inline or background grading
    written = []

    def full_after_one(path, row):
        if written:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        write(path, row)
        written.append(row)

    monkeypatch.setattr(grading_pool, "write_sample", full_after_one)
    with pytest.raises(OSError) as err:
        run(_compose(args), progress=False)
    kind, line, code = classify(err.value)
    assert (kind, code) == ("machine", 1) and line.startswith(f"{err.value.filename}: No space left on device; ")
    assert "rerun the same command to resume" in line
    monkeypatch.setattr(grading_pool, "write_sample", write)
    again = run(_compose(args), progress=False)
    assert again["complete"] and again["samples"] == 4
    rows = read_samples(Path(again["run_dir"]))
    assert rows[0] == written[0] and len({(r["problem_id"], r["sample"]) for r in rows}) == 4


def test_unknown_problem_id_is_refused_before_anything(tmp_path, no_weights):
    results = tmp_path / "results"
    with pytest.raises(ValueError, match=r"^task\.problem_ids: no problem '42-999' in task gsm_symbolic") as err:
        run(_compose([*TINY, "task.problem_ids=[42-1,42-999]", f"results_dir={results}"]), progress=False)
    assert "\n" not in str(err.value)
    assert not results.exists()
    prep = prepare(_compose([*TINY, "task.problem_ids=[42-3,42-1]", f"results_dir={results}"]))
    assert [p.id for p in prep.task.load()] == ["42-1", "42-3"]
    assert "problem_ids" not in prep.protocol["task"]  # like limit: which problems, not how each is decoded
