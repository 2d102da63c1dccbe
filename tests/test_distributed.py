"""Data parallel through torchrun (issue 22): ranks from the environment, one merged run directory equal to a
single-process run's, resume after a rank is killed, the same error on every rank, the part files."""

from __future__ import annotations

import json
import multiprocessing
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from tests.conftest import compose as _compose
from tests.conftest import sample_metrics
from vase.run import distributed
from vase.run.distributed import World, first_host, launch_from_env
from vase.run.results import (
    append_jsonl,
    fold_parts,
    part_path,
    read_jsonl_tolerant,
    read_samples,
)

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
SHARED = Path(os.environ.get("VASE_SHARED_DATA", ROOT.parent / "shared" / "data"))
TORCHRUN = Path(sys.executable).with_name("torchrun")
ENV = {
    **os.environ,
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "WANDB_MODE": "disabled",
    "TOKENIZERS_PARALLELISM": "false",
    "OMP_NUM_THREADS": "1",
}
# Four MATH-500 problems, two samples each, float32 tiny model (a sample's tokens do not depend on its batch).
# Problem 2 (138 prompt tokens) does not fit max_length=130: its samples are recorded as prompt_too_long.
DP = [
    "model=tiny",
    "task=math500",
    f"task.data_dir={SHARED}",
    "logger=none",
    "limit=4",
    "n_samples=2",
    "budget=32",
    "window=16",
    "generation.max_length=130",
    "progress=false",
]
# Three generated gsm_symbolic problems (prompts of 80, 106 and 101 tokens), two samples each: rank 0 decodes problems
# 0 and 2, rank 1 problem 1. Sampled (temperature 1), float32.
SMALL = [
    "model=tiny",
    "task=gsm_symbolic",
    "logger=none",
    "limit=3",
    "n_samples=2",
    "budget=32",
    "window=16",
    "generation.max_length=116",
    "generation.grade_workers=0",
    "progress=false",
]
needs_data = pytest.mark.skipif(not (SHARED / "math500.jsonl").is_file(), reason=f"no shared data at {SHARED}")
needs_torchrun = pytest.mark.skipif(not TORCHRUN.exists(), reason="no torchrun next to the interpreter")


def _torchrun(args: list[str], env: dict | None = None, timeout: int = 900) -> subprocess.CompletedProcess:
    cmd = [str(TORCHRUN), "--nproc-per-node", "2", "--standalone", "run.py", *args]
    return subprocess.run(cmd, cwd=ROOT, env=env or ENV, capture_output=True, text=True, timeout=timeout)


def _samples(run_dir: Path) -> list[dict]:
    rows = read_jsonl_tolerant(run_dir / "samples.jsonl")
    return sorted(({k: v for k, v in r.items() if k != "eviction_seconds"} for r in rows), key=_key)


def _key(r: dict) -> tuple:
    return (r["problem_id"], r["sample"])


def _metrics(run_dir: Path) -> dict:
    return sample_metrics(run_dir)


def _single_process_runs(root: Path, policies: list[str]) -> dict[str, Path]:
    from vase.run.runner import run

    out = {}
    for policy in policies:
        metrics = run(_compose([*DP, f"policy={policy}", f"results_dir={root}"]), progress=False)
        out[policy] = Path(metrics["run_dir"])
    return out


def _assert_same_run(dp: Path, single: Path) -> None:
    assert dp.relative_to(dp.parents[2]) == single.relative_to(single.parents[2])  # the same run directory name
    assert _samples(dp) == _samples(single)  # sample for sample (the order of lines aside)
    assert len(_samples(dp)) == len(read_jsonl_tolerant(dp / "samples.jsonl")) == 8  # each (problem, sample) once
    assert _metrics(dp) == _metrics(single)  # metric for metric
    assert not (dp / "ranks").exists()  # the rank parts were folded in


# --------------------------------------------------------------------------------------------------------------------
# end to end: torchrun on the CPU (gloo)


@needs_data
@needs_torchrun
@pytest.mark.slow
def test_two_ranks_equal_one_process(tmp_path):
    """``torchrun --nproc-per-node 2 run.py policy=vase_attnv ...`` writes the directory the single process writes
    (same name, same samples, same metrics, one manifest entry per rank; one Hydra directory, rank 1's in rank1/)."""
    r = _torchrun(["policy=vase_attnv", *DP, f"results_dir={tmp_path / 'dp'}"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert len(re.findall(r"^accuracy\s", r.stdout, re.M)) == 1  # rank 0 prints the summary, rank 1 does not
    single = _single_process_runs(tmp_path / "one", ["vase_attnv"])["vase_attnv"]
    dp = tmp_path / "dp" / single.relative_to(tmp_path / "one")
    _assert_same_run(dp, single)
    ranks = json.loads((dp / "manifest.json").read_text())["ranks"]
    assert [(e["rank"], e["device"], e["dtype"]) for e in ranks] == [
        (0, "cpu", "torch.float32"),
        (1, "cpu", "torch.float32"),
    ]
    assert sum(e["samples"] for e in ranks) == 8 and all(e["rows_in_flight"] >= 1 for e in ranks)
    (hydra_dir,) = (tmp_path / "dp" / ".hydra").glob("*/*")  # one directory for both ranks: rank 0's ${now:}
    assert (hydra_dir / ".hydra" / "config.yaml").exists() and (hydra_dir / "run.log").exists()
    assert (hydra_dir / "rank1" / ".hydra" / "config.yaml").exists() and (hydra_dir / "rank1" / "run.log").exists()


@needs_data
@needs_torchrun
@pytest.mark.slow
def test_a_two_rank_sweep_equals_single_process_runs(tmp_path):
    """``torchrun --nproc-per-node 2 run.py -m policy=full,vase_attnv,quest ...``: every cell's directory equals the
    single-process run of the same command (three policies, one sweep of three cells)."""
    policies = ["full", "vase_attnv", "quest"]
    r = _torchrun(["-m", f"policy={','.join(policies)}", *DP, f"results_dir={tmp_path / 'dp'}"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert len(re.findall(r"^accuracy\s", r.stdout, re.M)) == len(policies)  # rank 0's summaries only
    single = _single_process_runs(tmp_path / "one", policies)
    for policy in policies:
        dp = tmp_path / "dp" / single[policy].relative_to(tmp_path / "one")
        _assert_same_run(dp, single[policy])
        assert [e["rank"] for e in json.loads((dp / "manifest.json").read_text())["ranks"]] == [0, 1]
    # Hydra: one sweep directory (rank 0's time), rank 1's own files in its rank1/ subdirectory
    (sweep,) = (tmp_path / "dp" / ".hydra" / "multirun").glob("*/*")
    for where in (sweep, sweep / "rank1"):
        assert (where / "multirun.yaml").exists()
        for job in range(len(policies)):
            assert (where / str(job) / ".hydra" / "config.yaml").exists() and (where / str(job) / "run.log").exists()


@needs_data
@needs_torchrun
@pytest.mark.slow
def test_a_rank_killed_mid_run_resumes_to_the_single_process_run(tmp_path):
    """Rank 1 is SIGKILLed right after its first sample is written (``VASE_TEST_KILL_AT=rank1:written:1``); torchrun
    stops rank 0; the same command again decodes only what no file holds and ends equal to the single-process run."""
    args = ["policy=vase_attnv", *DP, f"results_dir={tmp_path / 'dp'}"]
    killed = _torchrun(args, env={**ENV, "VASE_TEST_KILL_AT": "rank1:written:1"})
    assert killed.returncode != 0
    (run_dir,) = (tmp_path / "dp" / "math500" / "tiny").iterdir()
    kept = read_jsonl_tolerant(part_path(run_dir, 1, "samples.jsonl"))
    assert len(kept) == 1  # rank 1's sample before the kill is on disk
    done_before = read_samples(run_dir)
    assert 1 <= len(done_before) < 8
    r = _torchrun(args)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"{len(done_before)} samples done" in r.stderr
    ranks = json.loads((run_dir / "manifest.json").read_text())["ranks"]
    assert sum(e["samples"] for e in ranks) == 8 - len(done_before)  # only the samples no file held were decoded
    after = {_key(x): x for x in _samples(run_dir)}
    assert all(after[_key(x)]["output"] == x["output"] for x in done_before)
    single = _single_process_runs(tmp_path / "one", ["vase_attnv"])["vase_attnv"]
    _assert_same_run(run_dir, single)


@needs_torchrun
def test_a_launcher_under_torchrun_is_refused_on_every_rank_before_anything_is_written(tmp_path):
    r = _torchrun(["-m", "hydra/launcher=local", *SMALL, f"results_dir={tmp_path}"])
    assert r.returncode != 0
    errors = [x for x in r.stderr.splitlines() if x.startswith("error:")]
    assert len(errors) == 2 and len(set(errors)) == 1 and "the basic launcher" in errors[0]
    assert not any(tmp_path.iterdir())


# --------------------------------------------------------------------------------------------------------------------
# the CI form: two ranks as two spawned processes calling run() (the runner's whole data-parallel path, without
# torchrun's agent and run.py's Hydra handling, which the slow tests above cover), on gsm_symbolic (no shared data)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_rank(rank: int, port: int, overrides: list[str], queue) -> None:
    from vase.run import distributed
    from vase.run.runner import run

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank)
    )
    distributed._WORLD = None  # this process is a rank of its own
    try:
        queue.put((rank, run(_compose(overrides), progress=False)))
    except Exception as err:  # reported, not hung
        queue.put((rank, repr(err)))
    finally:
        queue.close()
        queue.join_thread()
        os._exit(0)


@pytest.mark.slow  # .ci/run runs two_ranks_equal_one_process under torchrun
def test_two_ranks_write_the_directory_one_process_writes(tmp_path):
    """The ranks are spawned, not forked: a fork of a process whose OpenMP / MKL threads already ran (any earlier test
    of the session that ran a model) can hang in the child's first parallel region."""
    from vase.run.runner import run

    overrides = [*SMALL, "policy=vase_attnv"]
    ctx = multiprocessing.get_context("spawn")
    queue, port = ctx.Queue(), _free_port()
    procs = [
        ctx.Process(target=_run_rank, args=(r, port, [*overrides, f"results_dir={tmp_path / 'dp'}"], queue))
        for r in range(2)
    ]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=600) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    assert isinstance(results[0], dict), results
    assert results[0] == results[1]  # every rank returns rank 0's metrics
    single = Path(run(_compose([*overrides, f"results_dir={tmp_path / 'one'}"]), progress=False)["run_dir"])
    dp = Path(results[0]["run_dir"])
    assert dp.relative_to(tmp_path / "dp") == single.relative_to(tmp_path / "one")
    assert _samples(dp) == _samples(single) and len(_samples(dp)) == 6
    assert _metrics(dp) == _metrics(single)
    assert not (dp / "ranks").exists()
    ranks = json.loads((dp / "manifest.json").read_text())["ranks"]
    assert [(e["rank"], e["device"], e["samples"]) for e in ranks] == [(0, "cpu", 4), (1, "cpu", 2)]


# --------------------------------------------------------------------------------------------------------------------
# the ranks agree: every rank raises the same error, none waits for ever


def _rank_main(rank: int, port: int, queue) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank)
    )
    from vase.run.distributed import RankFailed, current_world

    world = current_world()
    out = {"size": world.size, "local": (world.local_rank, world.local_size), "share": world.share(list(range(5)))}
    out["results"] = world.step("adding", lambda: 10 + world.rank)
    out["leader"] = world.leader("asking rank 0", lambda: "from rank 0" if world.is_leader else "never")

    def fails_on_rank_1():
        if world.rank == 1:
            raise ValueError("task.limit: bad on rank 1; fix it")
        return "ok"

    def crashes_on_rank_0():
        if world.rank == 0:
            raise KeyError("boom")
        return "ok"

    for name, fn in (("value", fails_on_rank_1), ("crash", crashes_on_rank_0)):
        try:
            world.step("a phase", fn)
            out[name] = None
        except (ValueError, RankFailed, KeyError) as err:
            out[name] = (type(err).__name__, str(err))
    order = []
    out["leader_first"] = world.leader_first("opening", lambda leader: order.append(leader) or leader)
    out["order"] = order
    out["after"] = world.step("still in step", lambda: world.rank)  # the group is intact after the failures
    queue.put((rank, out))


def test_every_rank_raises_the_same_error_and_the_group_goes_on():
    ctx = multiprocessing.get_context("spawn")
    queue, port = ctx.Queue(), _free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=300) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    assert results[0]["size"] == results[1]["size"] == 2
    assert results[0]["share"] == [0, 2, 4] and results[1]["share"] == [1, 3]
    assert results[0]["results"] == results[1]["results"] == [10, 11]
    assert results[0]["leader"] == results[1]["leader"] == "from rank 0"
    # a ValueError on rank 1: the same ValueError, the same line, on both ranks
    assert results[0]["value"] == results[1]["value"] == ("ValueError", "task.limit: bad on rank 1; fix it")
    # anything else: the original on its rank, one line naming it on the others
    assert results[0]["crash"] == ("KeyError", "'boom'")
    assert results[1]["crash"] == ("RankFailed", "rank 0 failed while a phase: KeyError: 'boom'")
    assert results[0]["leader_first"] is True and results[1]["leader_first"] is False
    assert results[0]["after"] == [0, 1]


def test_ranks_come_from_torchrun_or_an_srun_step_never_from_a_batch_shell():
    assert launch_from_env({}) is None
    t = launch_from_env({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "3"})
    assert (t.rank, t.size, t.local_rank, t.source) == (3, 8, 3, "torchrun")
    s = launch_from_env({"SLURM_PROCID": "5", "SLURM_STEP_NUM_TASKS": "8", "SLURM_LOCALID": "1", "SLURM_NTASKS": "8"})
    assert (s.rank, s.size, s.local_rank, s.source) == (5, 8, 1, "slurm")
    # sbatch --ntasks=8 running python itself (no srun): one process
    assert launch_from_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "8", "SLURM_JOB_ID": "7"}) is None
    with pytest.raises(ValueError, match="rank 4 of world size 2"):
        launch_from_env({"RANK": "4", "WORLD_SIZE": "2"})
    assert first_host("gpu[03-05,9],cpu1") == "gpu03" and first_host("a,b") == "a" and first_host("n[7]") == "n7"
    assert World().share([1, 2, 3]) == [1, 2, 3] and World().pick_device("auto") is None


# --------------------------------------------------------------------------------------------------------------------
# the part files and the lock


def _row(pid: str, sample: int, **extra) -> dict:
    return {"problem_id": pid, "sample": sample, "correct": False, **extra}


def test_readers_take_the_union_and_the_fold_survives_a_kill_between_append_and_delete(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    append_jsonl(run_dir / "samples.jsonl", [_row("a", 0)])
    part0, part1 = part_path(run_dir, 0, "samples.jsonl"), part_path(run_dir, 1, "samples.jsonl")
    part0.parent.mkdir()
    append_jsonl(part0, [_row("b", 1), _row("b", 0)])
    append_jsonl(part1, [_row("c", 0), _row("a", 0, correct=True)])  # a duplicate of a line already folded
    with open(part1, "a") as f:
        f.write('{"problem_id": "c", "sam')  # torn by a kill
    keys = [_key(r) for r in read_samples(run_dir)]
    assert keys == [("a", 0), ("b", 1), ("b", 0), ("c", 0)]
    # a fold killed after appending rank 0's part but before deleting it: the next fold adds nothing twice
    append_jsonl(run_dir / "samples.jsonl", read_jsonl_tolerant(part0))
    assert fold_parts(run_dir) == 1  # only ("c", 0) was missing
    rows = read_jsonl_tolerant(run_dir / "samples.jsonl")
    assert sorted(_key(r) for r in rows) == [("a", 0), ("b", 0), ("b", 1), ("c", 0)]
    assert rows[0]["correct"] is False  # the first line written wins
    assert not (run_dir / "ranks").exists()


def test_a_killed_data_parallel_run_directory_is_still_a_run_and_its_parts_are_checked(tmp_path):
    """``check_run_dir`` (one list of what a run directory holds) accepts ``ranks/`` and its part files, and refuses
    anything else there; a part line that is valid JSON but not a sample is one line naming the part and the line."""
    from vase.run.rundir import check_run_dir

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "protocol.json").write_text("{}")
    append_jsonl(run_dir / "samples.jsonl", [_row("a", 0)])
    (run_dir / "ranks").mkdir()
    append_jsonl(part_path(run_dir, 0, "samples.jsonl"), [_row("b", 0)])
    append_jsonl(part_path(run_dir, 1, "throughput.jsonl"), [{"rank": 1, "time": 1.0}])
    (run_dir / ".vase.lock").write_text("")
    check_run_dir(run_dir)  # a data-parallel run killed mid-way: resumable
    append_jsonl(part_path(run_dir, 1, "samples.jsonl"), [{"problem_id": "c"}])
    with pytest.raises(ValueError, match=r"rank1.samples.jsonl: line 1 is not a sample \(an object without sample"):
        read_samples(run_dir)
    (run_dir / "ranks" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"is not a vase run directory \(it holds ranks/notes.txt\)"):
        check_run_dir(run_dir)


def test_the_local_launcher_is_cpu_only():
    from vase.run.checks import check_settings

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(
            config_name="config",
            overrides=["hydra/launcher=local", "hydra.launcher.gpus_per_node=1"],
            return_hydra_config=True,
        )
    with pytest.raises(ValueError, match=r"hydra.launcher.gpus_per_node: hydra/launcher=local is CPU-only") as err:
        check_settings(cfg)
    assert "\n" not in str(err.value) and "torchrun --nproc-per-node" in str(err.value)


def test_a_machine_with_gpus_is_told_in_one_line_that_the_local_launcher_uses_the_cpu(monkeypatch):
    from vase.run import distributed

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        local = compose(config_name="config", overrides=["hydra/launcher=local"], return_hydra_config=True)
        basic = compose(config_name="config", overrides=[], return_hydra_config=True)
    monkeypatch.setattr(distributed, "gpus_on_machine", lambda: 0)
    assert distributed.local_launcher_note(local) is None  # no GPU: nothing to say
    monkeypatch.setattr(distributed, "gpus_on_machine", lambda: 8)
    note = distributed.local_launcher_note(local)
    assert note and "\n" not in note and "on the CPU" in note and "torchrun --nproc-per-node 8" in note
    assert distributed.local_launcher_note(basic) is None


# --------------------------------------------------------------------------------------------------------------------
# the ranks agree before they work (issue 29)


def _rank_env(rank: int, port: int, **extra: str) -> dict:
    return {
        **ENV,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "RANK": str(rank),
        "WORLD_SIZE": "2",
        "LOCAL_RANK": str(rank),
        **extra,
    }


def _by_hand(args_of_rank: dict[int, list[str]], env: dict | None = None) -> dict[int, subprocess.CompletedProcess]:
    """Ranks started by hand (as ``srun`` would: ``RANK`` / ``WORLD_SIZE`` / ``MASTER_*``), each ``python run.py``."""
    port = _free_port()
    procs = {
        r: subprocess.Popen(
            [sys.executable, "run.py", *args],
            cwd=ROOT,
            env=_rank_env(r, port, **(env or {})),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r, args in args_of_rank.items()
    }
    out = {}
    for r, p in procs.items():
        stdout, stderr = p.communicate(timeout=300)
        out[r] = subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr)
    return out


def _error_line(r: subprocess.CompletedProcess) -> str:
    lines = [x for x in r.stderr.splitlines() if x.strip() and "WARNING" not in x]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in r.stderr, r.stderr[-3000:]
    return lines[0]


def test_ranks_started_with_different_settings_stop_together_before_writing(tmp_path):
    """``seed=0`` on rank 0, ``seed=1`` on rank 1: every rank exits 2 with the same line naming ``seed``; nothing
    is written (not even Hydra's directory)."""
    args = [*SMALL, f"results_dir={tmp_path / 'results'}"]
    done = _by_hand({0: [*args, "seed=0"], 1: [*args, "seed=1"]}, env={"VASE_DIST_TIMEOUT_S": "120"})
    lines = {r: _error_line(p) for r, p in done.items()}
    assert done[0].returncode == done[1].returncode == 2
    assert lines[0] == lines[1]
    assert lines[0].startswith("error: the ranks disagree on the command line: seed is '0' on rank 0 but '1' on rank 1")
    assert not any(tmp_path.iterdir())


def _run_rank_catching(rank: int, port: int, overrides: list[str], queue) -> None:
    os.environ.update(_rank_env(rank, port, VASE_DIST_TIMEOUT_S="120"))
    from vase.run import distributed
    from vase.run.runner import run

    distributed._WORLD = None
    try:
        queue.put((rank, ("ok", run(_compose(overrides), progress=False)["run_dir"])))
    except Exception as err:
        queue.put((rank, (type(err).__name__, str(err))))
    finally:
        queue.close()
        queue.join_thread()
        os._exit(0)


@pytest.mark.slow  # test_ranks_started_with_different_settings_stop_together_before_writing stays
def test_ranks_whose_resolved_settings_differ_raise_the_same_line(tmp_path):
    """The same command, another resolved setting on rank 1 (another config, another environment): ``run`` raises
    the same one-line ``ValueError`` on every rank, naming the setting, before anything is written."""
    ctx = multiprocessing.get_context("spawn")
    queue, port = ctx.Queue(), _free_port()
    base = [*SMALL, "policy=vase_attnv", f"results_dir={tmp_path / 'results'}"]
    overrides = {0: base, 1: [*base, "generation.temperature=0.5"]}
    procs = [ctx.Process(target=_run_rank_catching, args=(r, port, overrides[r], queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=300) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    assert results[0] == results[1], results
    kind, message = results[0]
    assert kind == "ValueError" and "\n" not in message
    assert message.startswith("the ranks disagree on the settings: generation.temperature is 1.0 on rank 0 but 0.5 on")
    assert not (tmp_path / "results").exists()


@pytest.mark.slow  # CI's time budget
def test_a_missing_rank_is_one_line_after_the_bounded_wait(tmp_path):
    """A world of 2 with rank 0 alone, and with rank 1 alone: each says in one line, after ``VASE_DIST_JOIN_S``
    seconds (here 2), which rank did not join, or that rank 0 could not be reached; exit 1, nothing written."""
    args = [*SMALL, f"results_dir={tmp_path / 'results'}"]
    alone0 = _by_hand({0: args}, env={"VASE_DIST_JOIN_S": "2"})[0]
    alone1 = _by_hand({1: args}, env={"VASE_DIST_JOIN_S": "2"})[1]
    assert alone0.returncode == alone1.returncode == 1
    assert _error_line(alone0).startswith(
        "error: rank 0: only 1 of 2 ranks joined within 2 s (VASE_DIST_JOIN_S) (missing: rank 1); start every rank"
    )
    assert _error_line(alone1).startswith("error: rank 1: could not reach rank 0 at 127.0.0.1:")
    assert "within 2 s (VASE_DIST_JOIN_S)" in _error_line(alone1)
    assert not (tmp_path / "results").exists()


def test_the_ranks_wait_for_each_other_a_minute_by_default(monkeypatch):
    """A missing rank is reported within a minute by default (issue 40: it was 1,800 s, silent); a shorter
    ``VASE_DIST_TIMEOUT_S`` shortens it, ``VASE_DIST_JOIN_S`` sets it."""
    monkeypatch.delenv(distributed.JOIN_ENV, raising=False)
    monkeypatch.delenv(distributed.TIMEOUT_ENV, raising=False)
    assert distributed.join_seconds() == 60
    monkeypatch.setenv(distributed.TIMEOUT_ENV, "5")
    assert distributed.join_seconds() == 5
    monkeypatch.setenv(distributed.JOIN_ENV, "120")
    assert distributed.join_seconds() == 120
    monkeypatch.setenv(distributed.JOIN_ENV, "soon")
    with pytest.raises(ValueError, match="VASE_DIST_JOIN_S='soon': must be a number of seconds > 0"):
        distributed.join_seconds()


def test_a_missing_rank_is_named_by_the_store():
    """Rank 0 alone in a world of 3 on a real store: the ranks that never checked in are named (1 and 2)."""
    import datetime

    import torch.distributed as dist

    port = _free_port()
    store = dist.TCPStore("127.0.0.1", port, 3, is_master=True, timeout=datetime.timedelta(seconds=5),
                          wait_for_workers=False)  # fmt: skip
    store.set("vase/test/joined/0", "1")
    assert distributed._missing_ranks(store, "vase/test/joined", 3) == [1, 2]


def test_the_first_difference_names_the_setting_in_rank_0s_order():
    from vase.run.agreement import command_settings, first_difference

    same = {"a": 1, "b": {"c": [1, 2]}}
    assert first_difference([same, dict(same)]) is None
    assert first_difference([same, {"a": 1, "b": {"c": [1, 3]}}]) == ("b.c", [1, 2], 1, [1, 3])
    assert first_difference([same, same, {"b": {"c": [1, 2]}, "a": 2}]) == ("a", 1, 2, 2)
    missing = first_difference([same, {"a": 1}])
    assert missing is not None and missing[0] == "b.c"
    assert command_settings(["-m", "seed=1", "+x=2"]) == {"argument 1": "-m", "seed": "1", "+x": "2"}


@needs_torchrun
def test_under_torchrun_the_summary_shows_the_one_line(tmp_path):
    """A 5000-digit seed under torchrun: each rank prints the one line naming ``seed``, and torchrun's own failure
    summary shows that line as the rank's ``traceback`` (its error file), not a pointer to its docs."""
    r = _torchrun([*SMALL, f"results_dir={tmp_path}", "seed=" + "1" * 5000], timeout=300)
    assert r.returncode != 0
    ours = [x for x in r.stderr.splitlines() if x.startswith("error: seed: an integer of 5000 digits")]
    assert len(ours) == 2, r.stderr[-3000:]
    assert "traceback : error: seed: an integer of 5000 digits is out of range" in r.stderr
    assert not any(tmp_path.iterdir())


def test_shutdown_destroys_the_process_groups_a_rank_started(tmp_path):
    """A rank exits with no gloo group alive (:func:`distributed.shutdown`, registered at exit by ``_start``): one
    left alive let C++ abort the process at teardown (``terminate called without an active exception``, exit -6)
    on 4 of 30 ranks ending with a one-line error."""
    import torch.distributed as dist

    from vase.run import distributed

    if dist.is_initialized():
        pytest.skip("a process group is already running in this process")
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    dist.new_group(backend="gloo")
    distributed.shutdown()
    assert not dist.is_initialized()
    distributed.shutdown()  # twice (atexit after an explicit call): nothing left, no error
