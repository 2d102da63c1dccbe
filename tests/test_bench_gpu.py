"""The GPU scripts on the CPU: kernel report, staggered rows, time caps, the smoke's table and its dry run.

Everything runs on tiny shapes in float32; no timing assertions (a time cap is tested with a deadline already past).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from vase.bench import REPO
from vase.bench.attention_check import check, decode_side, default_pairs
from vase.bench.gpu_rows import equal_memory, point, staggered_lengths, staggered_requests
from vase.bench.jobs import make_policy
from vase.bench.measure import TimeCap, deadline_hook
from vase.bench.sdpa_kernels import SdpaKernels, default_kernels
from vase.bench.smoke import format_table, run
from vase.bench.worker import WORKERS, resolve
from vase.models import tiny_model


def test_every_worker_kind_resolves_to_a_function():
    for kind in WORKERS:
        assert callable(resolve(kind)), kind
    with pytest.raises(ValueError, match="unknown 'nope'"):
        resolve("nope")


def test_kernel_counter_names_the_kernel_each_call_ran():
    q, k = torch.randn(2, 4, 1, 16), torch.randn(2, 2, 10, 16)
    mask = torch.ones(2, 1, 1, 10, dtype=torch.bool)
    mask[1, ..., 6:] = False
    counter = SdpaKernels()
    with torch.inference_mode(), counter:
        F.scaled_dot_product_attention(q, k, k, attn_mask=mask, enable_gqa=True)  # the CPU's default: flash
        with sdpa_kernel(SDPBackend.MATH):
            F.scaled_dot_product_attention(q, k, k, attn_mask=mask, enable_gqa=True)
        with counter.paused():
            F.scaled_dot_product_attention(q, k, k, attn_mask=mask, enable_gqa=True)  # not counted
        p = torch.randn(1, 4, 5, 16)
        F.scaled_dot_product_attention(p, k[:1, :, :5], k[:1, :, :5], is_causal=True, enable_gqa=True)
    assert counter.summary() == {"prefill": {"flash_cpu": 1}, "decode": {"flash_cpu": 1, "math": 1}}
    with torch.no_grad(), SdpaKernels() as outside_inference:  # the fused op is seen directly outside inference mode
        F.scaled_dot_product_attention(q, k, k, attn_mask=mask, enable_gqa=True)
    assert outside_inference.summary()["decode"] == {"flash_cpu": 1}
    kernels = default_kernels(torch.device("cpu"), torch.float32, heads=(8, 2))
    assert kernels == {
        "decode_gqa_mask": {"flash_cpu": 1},
        "decode_packed": {"flash_cpu": 1},
        "prefill": {"flash_cpu": 1},
    }


def test_default_pairs_without_flash_attn_compare_the_default_dispatch_with_math():
    assert default_pairs(torch.device("cpu"), torch.float32) == ["sdpa:sdpa-math"]
    assert default_pairs(torch.device("cpu"), torch.bfloat16) == ["sdpa:sdpa-math"]


def test_teacher_forcing_feeds_the_given_tokens_and_rows_have_their_own_lengths():
    model = tiny_model("qwen3")
    policy = make_policy("snapkv", 16, 8)
    prompt = torch.randint(0, 256, (30,), generator=torch.Generator().manual_seed(0))
    prompts = [prompt, prompt[9:]]
    free = decode_side(model, policy, "sdpa", prompts, steps=20, seed=0)
    forced = [[(7 * r + s) % 256 for s in range(20)] for r in range(2)]
    run_ = decode_side(model, policy, "sdpa", prompts, steps=20, seed=0, forced=forced)
    assert run_.tokens == forced and free.tokens != forced
    assert len(run_.logits) == 20 and run_.logits[0].shape == (2, 256)
    assert run_.kept and run_.staggered_eviction_steps > 0  # rows 30 and 21 tokens long evict at different steps
    with pytest.raises(TimeCap):
        decode_side(model, policy, "sdpa", prompts, steps=20, seed=0, deadline=time.perf_counter() - 1)


@pytest.mark.slow  # three decodes of the tiny model per pair (~10 s on a loaded 2-core machine)
def test_attention_check_passes_on_the_tiny_preset_for_every_cpu_pair():
    args = argparse.Namespace(
        device="cpu", dtype="float32", model="tiny", pair="sdpa:sdpa-math,sdpa:eager", policy="snapkv", budget=16,
        window=8, batch=3, prompt_len=30, stagger=7, steps=24, seed=0, init_std=0.3, logit_tol=1e-3, kernel_tol=1e-4,
    )  # fmt: skip
    result = check(args)
    assert result["ok"], [r["checks"] for r in result["pairs"]]
    assert [r["pair"] for r in result["pairs"]] == ["sdpa:sdpa-math", "sdpa:eager"]
    first = result["pairs"][0]
    assert first["kernel_calls"] == 2 * (3 + 23)  # 2 layers x (3 prefills + 23 decode steps)
    assert first["kernels_A"]["decode"] == {"flash_cpu": 2 * 23} and first["checks"]["rows_evict_at_different_steps"]
    assert result["row_prompt_lens"] == [30, 23, 16]


def test_staggered_prompts_spread_lengths_and_evictions():
    ev = staggered_lengths("eviction", prompts=4, context=8192, budget=2048, window=64, stagger=0.5)
    assert ev == [2048, 2032, 2016, 2000]  # all within a window below the budget: 4 eviction phases
    assert len({x % 64 for x in ev}) == 4
    full = staggered_lengths("none", prompts=4, context=8192, budget=2048, window=64, stagger=0.5)
    assert full[0] == 8192 and full[-1] == 4096 and len(set(full)) == 4
    assert staggered_lengths("none", prompts=1, context=100, budget=10, window=8, stagger=0.5) == [100]
    reqs = staggered_requests([40, 30, 20], rows=7, vocab=256, seed=0, max_new_tokens=[5, 6])
    assert [len(r.prompt_ids) for r in reqs] == [40, 30, 20]
    assert [list(r.samples) for r in reqs] == [[0, 3, 6], [1, 4], [2, 5]]
    assert [r.max_new_tokens for r in reqs] == [5, 6, 5]
    assert len({s for r in reqs for s in r.seeds}) == 7


def test_gpu_rows_point_decodes_staggered_rows_and_a_past_deadline_stops_it():
    model = tiny_model("qwen3")
    policy = make_policy("vase_dkv", 32, 8)
    lengths = staggered_lengths("eviction", prompts=4, context=0, budget=32, window=8, stagger=0)
    r = point(model, policy, lengths, rows=6, steps=12, warmup=8)
    assert r["samples"] == 6 and r["capacity"] == 40 and r["nonfinite_samples"] == 0
    assert r["evictions"] > 0 and r["staggered_eviction_steps"] > 0 and r["tok_s"] > 0
    with pytest.raises(TimeCap):
        point(model, policy, lengths, rows=6, steps=12, warmup=8, deadline=time.perf_counter() - 1)
    args = argparse.Namespace(
        policy="vase_dkv", context=64, budget=32, window=8, kv_memory_gib="0.0002", prompts=2, stagger=0.5,
        steps=4, warmup=4,
    )  # fmt: skip
    skipped = equal_memory(model, args, deadline=time.perf_counter() - 1, progress=lambda _: None)
    assert [r.get("skipped") for r in skipped] == ["time cap", "time cap"]
    ran = equal_memory(model, args, deadline=None, progress=lambda _: None)
    assert [r["policy"] for r in ran] == ["full", "vase_dkv"] and all(r["tok_s"] > 0 for r in ran)
    assert ran[1]["rows"] > ran[0]["rows"] and ran[1]["vs_full"] > 0


def test_deadline_hook_calls_through_then_raises():
    seen = []
    hook = deadline_hook(time.perf_counter() + 3600, seen.append)
    hook(argparse.Namespace(step=1))
    assert len(seen) == 1
    with pytest.raises(TimeCap, match="step 2"):
        deadline_hook(time.perf_counter() - 1)(argparse.Namespace(step=2))


def test_smoke_sections_report_in_one_table_and_a_time_cap_is_reported_not_raised(tmp_path):
    args = argparse.Namespace(dry_run=True, sections=["env", "decode"], cap_scale=None)
    sections, record = run(args)
    assert record["ok"], format_table(sections)
    assert record["decode"]["checks"] == dict.fromkeys(record["decode"]["checks"], True)
    assert record["env"]["auto_backend_bf16"] == "sdpa" and record["env"]["default_sdpa_kernels"]["decode_packed"]
    table = format_table(sections)
    assert table.splitlines()[0].split() == ["section", "what", "rows", "tok/s", "peak", "GiB", "result"]
    assert "vase_dkv B=32, sampled" in table and "PASS" in table
    capped, rec = run(argparse.Namespace(dry_run=True, sections=["decode"], cap_scale=0.0))
    assert not rec["ok"] and "time cap" in format_table(capped)


@pytest.mark.slow  # the whole dry run: ~40 s of CPU on tiny shapes (1-2 min on a loaded 2-core machine)
def test_gpu_smoke_dry_run_runs_every_section(tmp_path):
    env = dict(os.environ, PY=sys.executable, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    proc = subprocess.run(
        ["bash", "scripts/gpu_smoke.sh", "--dry-run", "--out", str(tmp_path)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    record = json.loads((tmp_path / "result.json").read_text())
    assert record["ok"] and set(record["seconds"]) == {"env", "kernel", "decode", "compile", "rows"}
    same, total = record["compile"]["samples_equal"].split("/")
    assert record["compile"]["on"]["compile"]["compiled"] and same == total
    assert all(x["ratio"] > 0 for x in record["compile"]["off"]["first_vs_tenth"])
    assert all(r["ok"] for r in record["kernel"]["pairs"])
    assert [r["policy"] for r in record["rows"]] == ["full", "vase_dkv", "full", "vase_dkv"]
    table = (tmp_path / "table.txt").read_text()
    assert proc.stdout.startswith(table.splitlines()[0]) and "PASS in" in proc.stdout
    assert Path(tmp_path / "table.txt").exists()


def _fake_python(path: Path, name: str) -> Path:
    """An executable at ``path/bin/python`` that prints its name and arguments (stands in for an environment)."""
    exe = path / "bin" / "python"
    exe.parent.mkdir(parents=True)
    exe.write_text(f'#!/usr/bin/env bash\necho "{name}:$*"\n')
    exe.chmod(0o755)
    return exe


@pytest.mark.parametrize("script", ["scripts/gpu_smoke.sh", "scripts/gpu_bench_14b.sh"])
def test_gpu_scripts_pick_the_projects_python_as_the_makefile(tmp_path, script):
    """PY= first, then the active virtual environment, a conda env other than base, else $VENV (.venv) -- the
    Makefile's order -- and a missing interpreter is one line with the fix, not `No module named 'torch'`."""
    venv, conda, dot = (_fake_python(tmp_path / n, n) for n in ("venv", "conda", "dotvenv"))
    bare = {k: v for k, v in os.environ.items() if k not in ("PY", "VIRTUAL_ENV", "CONDA_PREFIX", "CONDA_DEFAULT_ENV")}

    bash = shutil.which("bash")

    def which(**env: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [bash, script, "--dry-run"], cwd=REPO, env={**bare, **env}, capture_output=True, text=True, timeout=60
        )

    cases = [
        ({"VENV": str(tmp_path / "dotvenv")}, "dotvenv"),  # nothing active: the Makefile's .venv ($VENV)
        ({"VENV": str(tmp_path / "dotvenv"), "VIRTUAL_ENV": str(tmp_path / "venv")}, "venv"),
        (
            {"VENV": str(tmp_path / "dotvenv"), "CONDA_PREFIX": str(tmp_path / "conda"), "CONDA_DEFAULT_ENV": "x"},
            "conda",
        ),
        (
            {"VENV": str(tmp_path / "dotvenv"), "CONDA_PREFIX": str(tmp_path / "conda"), "CONDA_DEFAULT_ENV": "base"},
            "dotvenv",
        ),
        ({"VIRTUAL_ENV": str(tmp_path / "venv"), "PY": str(dot)}, "dotvenv"),  # PY= wins
    ]
    for env, expected in cases:
        r = which(**env)
        assert r.returncode == 0 and r.stdout.strip().startswith(f"{expected}:"), (env, r.stdout, r.stderr)
        assert "dry" in r.stdout  # the dry run was asked for
    assert venv.exists() and conda.exists()
    # no .venv: python3 from PATH (a machine set up by hand), said in one line; nothing at all: one line with the fix
    tools = tmp_path / "tools"
    tools.mkdir()
    for tool in ("dirname", "date", "bash"):  # bash: the fake interpreters are bash scripts
        (tools / tool).symlink_to(shutil.which(tool))
    _fake_python(tmp_path / "onpath", "onpath").rename(tools / "python3")
    r = which(VENV=str(tmp_path / "nowhere"), PATH=str(tools))
    assert r.returncode == 0 and r.stdout.startswith("onpath:"), (r.stdout, r.stderr)
    assert r.stderr.count("\n") == 1 and "no " + str(tmp_path / "nowhere") + "/bin/python" in r.stderr
    (tools / "python3").unlink()
    r = which(VENV=str(tmp_path / "nowhere"), PATH=str(tools))
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and f"no Python at {tmp_path / 'nowhere'}/bin/python" in r.stderr
    assert "make setup" in r.stderr and "PY=" in r.stderr


def test_first_vs_tenth_step_per_step_shape():
    """The first step at each new (rows, key slots) against its tenth: a plan built on a shape's first step shows."""
    from vase.bench.smoke import first_vs_tenth

    steps = (
        [((4, 256), 50.0)] + [((4, 256), 5.0)] * 11 + [((2, 256), 3.0)] * 5 + [((2, 512), 8.0)] + [((2, 512), 4.0)] * 9
    )
    got = {(x["rows"], x["key_slots"]): x for x in first_vs_tenth(steps)}
    assert set(got) == {(4, 256), (2, 512)}  # (2, 256) ran 5 steps: no tenth
    assert got[(4, 256)]["ratio"] == pytest.approx(10.0) and got[(2, 512)]["ratio"] == pytest.approx(2.0)
