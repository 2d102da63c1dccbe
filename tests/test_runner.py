"""The runner: config composition, validation, results on disk, resume after SIGKILL, multirun, W&B offline."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import OmegaConf

from vase.run.planning import prepare, resolve_budget
from vase.run.records import held_at_end
from vase.run.results import check_protocol, read_jsonl_tolerant

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
ENV = {
    **os.environ,
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "WANDB_MODE": "disabled",
    "TOKENIZERS_PARALLELISM": "false",
}
# A tiny random model on gsm_symbolic: one problem, two samples, a short output cap, eviction every 16 steps.
TINY = [
    "model=tiny",
    "task=gsm_symbolic",
    "logger=none",
    "limit=1",
    "n_samples=2",
    "budget=32",
    "window=16",
    "generation.max_length=200",
    "progress=false",
]


def _compose(overrides: list[str]):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="config", overrides=overrides)


def _options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


@pytest.mark.parametrize("group", ["model", "task", "policy", "generation", "protocol", "pilot_row", "logger", "sweep"])
def test_every_config_composes_and_instantiates(group, tmp_path):
    for option in _options(group):
        overrides = [f"{group}={option}"] if group != "sweep" else [f"sweep={option}"]
        if group != "model":
            overrides.append("model=tiny")
        if option == "seer_attention_r":  # no gates are published for the tiny model: random ones in their format
            from tests.seer_reference import write_random_gates
            from vase.models import tiny_config

            gates = write_random_gates(tmp_path / "gates", tiny_config("qwen3"))
            overrides.append(f"policy.gate_path={gates}")
        # the GSM8K pilot's rows protect up to 256 value slots: a budget they fit in
        budget = "budget=512" if group in ("sweep", "pilot_row") else "budget=128"
        cfg = _compose(overrides + [budget, "window=16"])
        spec = instantiate(cfg.model)  # a description: no weights are loaded
        assert spec.key and spec.name
        task = instantiate(OmegaConf.to_container(cfg.task, resolve=True))
        assert task.n_samples >= 1
        policy = instantiate(cfg.policy)
        assert policy.name
        instantiate(cfg.logger)
        prepare(cfg)


@pytest.mark.parametrize("launcher", ["slurm", "local"])
def test_launcher_configs_compose(launcher):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[f"hydra/launcher={launcher}"], return_hydra_config=True)
    assert "submitit" in cfg.hydra.launcher._target_


def test_sweep_files_are_headed_by_their_launch_command():
    for path in (CONF / "sweep").glob("*.yaml"):
        text = path.read_text()
        assert "python run.py -m" in text.split("hydra:")[0], path.name


def test_budget_from_ratio_and_reference():
    assert resolve_budget(16384, 4, 64) == 4096
    assert resolve_budget(15325, 4, 64) == 3840
    cfg = _compose(["model=qwen3_4b", "task=aime25", "ratio=4"])
    prep = prepare(cfg)
    assert prep.cfg.budget == 4096 and prep.policy.budget == 4096 and prep.policy.window == 64
    assert prep.n_samples == 16 and prep.max_length == 32768 and prep.thinking
    assert prep.sampling.temperature == 0.6 and prep.sampling.top_p == 0.95 and prep.sampling.top_k == 20
    cfg = _compose(["model=qwen3_4b", "task=aime25", "budget=2048"])
    assert prepare(cfg).policy.budget == 2048


def test_full_cache_run_is_shared_by_every_ratio():
    dirs = {
        r: prepare(_compose(["model=tiny", "task=gsm_symbolic", f"ratio={r}", "policy=full"])).run_dir for r in (2, 8)
    }
    assert dirs[2] == dirs[8] and "-b" not in dirs[2].name
    evict = {
        r: prepare(_compose(["model=tiny", "task=gsm_symbolic", f"ratio={r}", "policy=snapkv"])).run_dir for r in (2, 4)
    }
    assert evict[2] != evict[4]


@pytest.mark.parametrize(
    "override, setting",
    [
        ("ratio=0", "ratio"),
        ("ratio=-2", "ratio"),
        ("budget=16", "budget"),
        ("n_samples=0", "n_samples"),
        ("limit=-1", "limit"),
        ("window=0", "window"),
        ("budget=100", "policy.budget"),
    ],
)
def test_invalid_numbers_fail_before_anything_loads(override, setting):
    cfg = _compose(["model=tiny", "window=16", override])
    with pytest.raises(ValueError, match=setting):
        prepare(cfg)


def test_cli_errors_are_one_line_and_list_valid_names(tmp_path):
    r = subprocess.run(
        [sys.executable, "run.py", "policy=vase_dkvv"], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 2
    lines = [x for x in r.stderr.strip().splitlines() if x]
    assert len(lines) == 1 and "did you mean vase_dkv" in lines[0] and "snapkv" in lines[0]
    r = subprocess.run(
        [sys.executable, "run.py", *TINY, "ratio=0", f"results_dir={tmp_path}"],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2
    errors = [x for x in r.stderr.splitlines() if "error" in x.lower()]
    assert len(errors) == 1 and "ratio: must be > 0" in errors[0]
    assert "Traceback" not in r.stderr


def test_torn_last_line_is_tolerated_and_repaired(tmp_path):
    path = tmp_path / "samples.jsonl"
    path.write_text('{"a": 1}\n{"a": 2}\n{"a": 3, "b": "tor')
    assert read_jsonl_tolerant(path) == [{"a": 1}, {"a": 2}]
    read_jsonl_tolerant(path, repair=True)
    assert path.read_text() == '{"a": 1}\n{"a": 2}\n'
    path.write_text('{"a": 1}\n{"bad\n{"a": 3}\n')
    with pytest.raises(ValueError, match="corrupt line 2"):
        read_jsonl_tolerant(path)


def test_changed_protocol_is_refused(tmp_path):
    check_protocol(tmp_path, {"generation": {"temperature": 0.6}, "seed": 0})
    check_protocol(tmp_path, {"generation": {"temperature": 0.6}, "seed": 0})
    with pytest.raises(ValueError, match=r"generation.temperature: 0.6 -> 0.7"):
        check_protocol(tmp_path, {"generation": {"temperature": 0.7}, "seed": 0})


def test_held_at_end_follows_the_eviction_schedule():
    assert held_at_end(100, 20, 256, 16, True) == 100
    assert held_at_end(100, 20, 32, 16, False) == 100
    # prompt 20, budget 32, window 16: evictions when held reaches 48 -> 32; 99 appended tokens
    held = 20
    for _ in range(79):
        held += 1
        if held > 32 and held % 16 == 0:
            held = 32
    assert held_at_end(100, 20, 32, 16, True) == held + 1


def _run_dirs(root: Path) -> list[Path]:
    return sorted(p.parent for p in root.rglob("protocol.json"))


def test_run_writes_a_complete_result_directory(tmp_path):
    r = subprocess.run(
        [sys.executable, "run.py", *TINY, f"results_dir={tmp_path}"],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    (run_dir,) = _run_dirs(tmp_path)
    for name in ("config.yaml", "protocol.json", "manifest.json", "samples.jsonl", "throughput.jsonl", "metrics.json"):
        assert (run_dir / name).exists(), name
    metrics = json.loads((run_dir / "metrics.json").read_text())
    for key in (
        "accuracy",
        "pass@1",
        "pass@2",
        "answered_rate",
        "loop_rate",
        "garbage_rate",
        "truncation_rate",
        "mean_output_tokens",
        "kv_allocated_bytes",
        "kv_held_bytes_mean",
        "kv_full_bytes_mean",
        "rows_in_flight",
        "peak_memory_bytes",
        "prefill_seconds",
        "decode_tokens_per_second",
        "evictions",
        "eviction_seconds",
        "budget",
        "compression_ratio",
    ):
        assert key in metrics, key
    assert metrics["complete"] and metrics["samples"] == 2 and metrics["budget"] == 32
    assert metrics["kv_held_bytes_mean"] < metrics["kv_full_bytes_mean"]  # what the outputs needed vs held
    manifest = json.loads((run_dir / "manifest.json").read_text())
    engine = manifest["engine"]  # the static allocation: rows in flight x capacity per row
    assert metrics["kv_allocated_bytes"] == engine["kv_allocated_bytes"]
    assert metrics["kv_allocated_bytes"] == metrics["rows_in_flight"] * metrics["kv_allocated_bytes_per_row"]
    assert manifest["sampling"]["temperature"] == 1.0 and manifest["prompt_template"]
    attention = manifest["attention"]  # what the attention ran on, probed with the real geometry (CPU here)
    assert attention["backend"] == "sdpa" and attention["backend_choice"].startswith("auto: ")
    assert set(attention["sdpa_kernels"].values()) == {"aten._scaled_dot_product_flash_attention_for_cpu"}
    assert attention["device"] == "cpu" and {"device_name", "cuda", "cudnn"} <= set(attention)
    # generation.compile=auto on the CPU: off, and the manifest says why
    assert manifest["compile"]["setting"] == "auto" and not manifest["compile"]["compiled"]
    assert manifest["compile"]["choice"].startswith("auto: off on cpu")
    rows = read_jsonl_tolerant(run_dir / "samples.jsonl")
    assert {r["sample"] for r in rows} == {0, 1}
    assert all(r["budget"] == 32 and r["compression_ratio"] >= 1 for r in rows)
    assert "accuracy" in r.stdout  # the summary table
    # rerunning the same command resumes: nothing is decoded again
    r2 = subprocess.run(
        [sys.executable, "run.py", *TINY, f"results_dir={tmp_path}"],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r2.returncode == 0 and "0 problems to decode" in r2.stderr
    assert read_jsonl_tolerant(run_dir / "samples.jsonl") == rows


def test_sigkill_midway_then_relaunch_gives_every_sample_once(tmp_path):
    """Killed at a known point: the runner SIGKILLs itself right after its 2nd sample is durable (the test hook
    VASE_TEST_KILL_AT=written:2), whatever the machine's speed; no poll, no race."""
    args = [sys.executable, "run.py", *TINY, "limit=3", f"results_dir={tmp_path}"]
    killed = subprocess.run(
        args, cwd=ROOT, env={**ENV, "VASE_TEST_KILL_AT": "written:2"}, capture_output=True, text=True, timeout=900
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    (samples,) = tmp_path.rglob("samples.jsonl")
    assert len(read_jsonl_tolerant(samples)) == 2
    assert not (samples.parent / "metrics.json").exists()
    r = subprocess.run(args, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "3 problems, 2 samples done" in r.stderr  # resumed: the 2 samples are not decoded again
    rows = read_jsonl_tolerant(samples)
    keys = [(x["problem_id"], x["sample"]) for x in rows]
    assert len(keys) == len(set(keys)) == 6
    metrics = json.loads((samples.parent / "metrics.json").read_text())
    assert metrics["complete"] and metrics["samples"] == 6


@pytest.mark.slow  # CI's time budget: tests/test_runner_inputs.py::test_i4 runs the same two-policy multirun
def test_multirun_of_two_policies_writes_two_result_directories(tmp_path):
    r = subprocess.run(
        [sys.executable, "run.py", "-m", "sweep=smoke", f"results_dir={tmp_path}", "progress=false"],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    dirs = _run_dirs(tmp_path)
    assert len(dirs) == 2
    policies = sorted(json.loads((d / "metrics.json").read_text())["policy"] for d in dirs)
    assert policies == ["streaming", "vase_attnv"]
    assert all(json.loads((d / "metrics.json").read_text())["complete"] for d in dirs)


@pytest.mark.slow
def test_submitit_local_launcher_runs_a_two_job_sweep(tmp_path):
    r = subprocess.run(
        [
            sys.executable,
            "run.py",
            "-m",
            "sweep=smoke",
            "hydra/launcher=local",
            f"results_dir={tmp_path}",
            "progress=false",
            f"hydra.sweep.dir={tmp_path / 'sweep'}",
        ],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    dirs = _run_dirs(tmp_path)
    assert len(dirs) == 2 and all((d / "metrics.json").exists() for d in dirs)
    summary = json.loads((tmp_path / "sweep" / "sweep_summary.json").read_text())  # the jobs ran in other processes
    assert (summary["jobs"], summary["ok"], summary["failed"]) == (2, 2, 0)


@pytest.mark.slow  # CI's time budget: test_analysis.py::test_report_script_and_wandb_offline writes an offline run
def test_wandb_offline_run_is_accepted_by_wandb_sync(tmp_path):
    env = {**ENV, "WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path), "WANDB_SILENT": "true"}
    args = [
        sys.executable,
        "run.py",
        *[a for a in TINY if a != "logger=none"],
        "logger=wandb",
        f"results_dir={tmp_path}",
    ]
    r = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    (run_dir,) = _run_dirs(tmp_path)
    offline = list((run_dir / "wandb").glob("offline-run-*"))
    assert len(offline) == 1 and list(offline[0].glob("*.wandb"))
    sync = subprocess.run(
        [str(Path(sys.executable).with_name("wandb")), "sync", "--dry-run", str(offline[0])],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert sync.returncode == 0, sync.stdout + sync.stderr


def test_sharded_runs_merge_into_one(tmp_path):
    from vase.run.runner import run

    sys.path.insert(0, str(ROOT / "scripts"))
    from merge_shards import merge

    base = [a for a in TINY if not a.startswith("limit=")] + ["limit=2", "task.num_shards=2", f"results_dir={tmp_path}"]
    metrics = [run(_compose(base + [f"task.shard={i}"]), progress=False) for i in range(2)]
    assert all(m["complete"] and m["problems"] == 1 for m in metrics)
    prefix = Path(metrics[0]["run_dir"].rsplit("-shard", 1)[0])
    merged = merge(prefix)
    assert merged["complete"] and merged["problems"] == 2 and merged["samples"] == 4
    acc = sum(m["accuracy"] for m in metrics) / 2
    assert abs(merged["accuracy"] - acc) < 1e-9


def test_compile_seconds_and_the_decode_speed_after_them(tmp_path):
    """``metrics.json``'s ``compile_seconds`` sums the throughput lines' first forwards of each row bucket, and
    ``decode_tokens_per_second_after_compile`` leaves them out; an eager run (or a run written before they existed:
    no key) has 0 s and no such speed."""
    from vase.run.records import _throughput

    line = dict(decode_steps=10, prefills=1, prefill_seconds=0.5, rows=4, row_steps=40, kv_allocated_bytes=8)
    line.update(kv_allocated_bytes_per_row=2, peak_memory_bytes=0, wall_seconds=1.0)
    lines = [dict(line, tokens=100, decode_seconds=10.0, compile_seconds=6.0, time=1.0)]
    lines.append(dict(line, tokens=100, decode_seconds=10.0, compile_seconds=2.0, time=2.0))
    (tmp_path / "throughput.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    got = _throughput(tmp_path)
    assert got["decode_tokens_per_second"] == pytest.approx(200 / 20) and got["compile_seconds"] == 8.0
    assert got["decode_tokens_per_second_after_compile"] == pytest.approx(200 / 12)
    for x in lines:
        del x["compile_seconds"]
    (tmp_path / "throughput.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    got = _throughput(tmp_path)
    assert got["compile_seconds"] == 0 and got["decode_tokens_per_second_after_compile"] is None


def test_check_policy_output_refuses_to_resume_unchecked_samples(tmp_path):
    """``generation.check_policy_output=true`` on a run whose samples were decoded without it: refused in one line,
    not resumed with nothing checked (issue 39); samples decoded with it carry ``policy_output_checked``."""
    from types import SimpleNamespace

    from vase.run.planning import check_resumed_output_checks

    on, off = OmegaConf.create({"generation": {"check_policy_output": True}}), _compose(TINY)
    evicting, full = SimpleNamespace(kind="eviction"), SimpleNamespace(kind="none")
    checked, plain = {"problem_id": "a", "sample": 0, "policy_output_checked": True}, {"problem_id": "a", "sample": 1}
    check_resumed_output_checks(on, evicting, tmp_path, [])  # a fresh run
    check_resumed_output_checks(on, evicting, tmp_path, [checked])  # every finished sample was checked
    check_resumed_output_checks(off, evicting, tmp_path, [plain])  # no check asked for
    check_resumed_output_checks(on, full, tmp_path, [plain])  # nothing to check: no keep()
    with pytest.raises(ValueError, match=r"check_policy_output=true: 1 of the 2 samples .* set run_dir= to a new"):
        check_resumed_output_checks(on, evicting, tmp_path, [checked, plain])

    base = [sys.executable, "run.py", *TINY, "policy=snapkv", f"results_dir={tmp_path}"]
    first = subprocess.run(base, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr[-2000:]
    (run_dir,) = _run_dirs(tmp_path)
    rows = [json.loads(x) for x in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and not any("policy_output_checked" in r for r in rows)
    again = subprocess.run([*base, "generation.check_policy_output=true"], cwd=ROOT, env=ENV, capture_output=True,
                           text=True, timeout=600)  # fmt: skip
    assert again.returncode == 2, again.stdout[-1000:]
    assert "generation.check_policy_output=true: 2 of the 2 samples" in again.stderr
    assert len(again.stderr.strip().splitlines()) == 1
    fresh = [*base, "generation.check_policy_output=true", f"run_dir={tmp_path / 'checked'}"]
    for _ in range(2):  # a fresh checked run, then its resume (every finished sample checked: accepted)
        ok = subprocess.run(fresh, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
        assert ok.returncode == 0, ok.stderr[-2000:]
    rows = [json.loads(x) for x in (tmp_path / "checked" / "samples.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(r["policy_output_checked"] is True for r in rows)
