"""The side-by-side benchmarks of whole runs: vLLM against the harness (scripts/bench_vllm.py) and run.py variants
(scripts/bench_variants.py). vLLM itself is not installed for the tests: its worker runs against a stand-in module
that records what it is asked; the same work (prompt ids) is checked against the runner's own rendering.
"""

from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path

import pytest

from vase.bench import REPO
from vase.bench import variants as bv
from vase.bench import vllm as bvl
from vase.bench.runs import abba, read_run, spawn, thread_env


def test_abba_alternates_the_order_of_rounds():
    assert abba(["a", "b", "c"], 2) == [(0, "a"), (0, "b"), (0, "c"), (1, "c"), (1, "b"), (1, "a")]
    assert abba(["a"], 3) == [(0, "a"), (1, "a"), (2, "a")]


def test_spawn_measures_the_process_and_kills_it_at_its_timeout(tmp_path):
    code = "import sys; b = bytearray(200 * 2**20); b[::4096] = b'x' * len(b[::4096]); print('done')"
    got = spawn([sys.executable, "-c", code], thread_env(1), tmp_path, 60, tmp_path / "a.log")
    assert got["rc"] == 0 and got["stdout"].strip() == "done" and got["peak_rss"] > 200 * 2**20
    slow = spawn(
        [sys.executable, "-c", "import time; time.sleep(60)"], thread_env(1), tmp_path, 0.5, tmp_path / "b.log"
    )
    assert slow["rc"] != 0 and slow["seconds"] < 30
    env = thread_env(2, base={"PATH": "/bin"})
    assert env["OMP_NUM_THREADS"] == env["MKL_NUM_THREADS"] == "2" and env["HF_HUB_OFFLINE"] == "1"


def _fake_run_dir(root: Path) -> Path:
    run = root / "humaneval" / "tiny" / "full-abc-s0"
    run.mkdir(parents=True)
    (run / "metrics.json").write_text(json.dumps({"accuracy": 0.5, "decode_tokens_per_second": 40.0}))
    (run / "manifest.json").write_text(json.dumps({"git_sha": "abc", "eos_token_ids": [2]}))
    lines = [dict(tokens=30, prefills=2, prefill_seconds=0.5, decode_seconds=1.0), dict(tokens=10, prefills=0,
             prefill_seconds=0.0, decode_seconds=0.25)]  # fmt: skip
    (run / "throughput.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    rest = dict(sample=0, loop_class="ok", extracted=None, output_tokens=20, compression_ratio=1.0,
                kv_held_bytes_end=0, kv_full_bytes_end=0)  # fmt: skip
    samples = [dict(problem_id="p1", correct=True, prompt_tokens=7, finish_reason="eos", **rest),
               dict(problem_id="p2", correct=False, prompt_tokens=9, finish_reason="length", **rest)]  # fmt: skip
    (run / "samples.jsonl").write_text("".join(json.dumps(x) + "\n" for x in samples))
    return run


def test_read_run_totals_the_throughput_log(tmp_path):
    _fake_run_dir(tmp_path)
    run = read_run(tmp_path)
    assert (run["tokens"], run["prefills"], run["prefill_s"], run["decode_s"]) == (40, 2, 0.5, 1.25)
    assert run["prompt_tokens"] == {"p1": 7, "p2": 9} and run["finish_reasons"] == {"eos": 1, "length": 1}
    assert run["metrics"]["accuracy"] == 0.5 and run["manifest"]["git_sha"] == "abc"
    with pytest.raises(ValueError, match="expected one run directory"):
        read_run(tmp_path / "humaneval" / "nothing")


def test_vllm_rows_share_one_definition_of_decode_and_generation_rates():
    runs = [
        bvl.finish(dict(engine="vllm", policy="full", dtype="float32", tokens=100, prefill_s=1.0, decode_s=4.0)),
        bvl.finish(dict(engine="vllm", policy="full", dtype="float32", tokens=100, prefill_s=1.0, decode_s=2.0)),
        bvl.finish(dict(engine="harness", policy="full", dtype="float32", tokens=90, prefill_s=0.5, decode_s=1.5)),
        dict(engine="harness", policy="vase_attnv", dtype="float32", error="exit 1: boom"),
    ]
    assert runs[0]["decode_tok_s"] == 25.0 and runs[0]["gen_tok_s"] == 20.0 and runs[0]["gen_s"] == 5.0
    table = {(x["engine"], x["policy"]): x for x in bvl.summarise(runs)}
    assert table[("vllm", "full")]["decode_tok_s"] == pytest.approx(37.5)  # median of 25 and 50
    assert table[("harness", "full")]["x_vllm"] == pytest.approx(60 / 37.5)
    assert (
        table[("harness", "vase_attnv")]["errors"] == ["exit 1: boom"] and table[("harness", "vase_attnv")]["runs"] == 0
    )
    assert "| engine | policy |" in bvl.markdown(bvl.summarise(runs), bvl.COLUMNS)
    assert bvl.variants(["float32", "bfloat16"]) == [
        ("vllm", "full", "float32"), ("harness", "full", "float32"), ("harness", "vase_attnv", "float32"),
        ("vllm", "full", "bfloat16"), ("harness", "full", "bfloat16"), ("harness", "vase_attnv", "bfloat16"),
    ]  # fmt: skip


def test_dtypes_auto_is_the_runners_choice_and_bad_ones_are_refused():
    import torch

    from vase.engine import auto_dtype

    want = auto_dtype(torch.device("cpu"), 64)[0]
    assert [d for d, _ in bvl.resolve_dtypes("auto", 64)] == [want]
    assert [d for d, _ in bvl.resolve_dtypes("auto,float32,bfloat16", 64)][0] == want
    assert len(bvl.resolve_dtypes("float32,bfloat16,float32", 64)) == 2
    with pytest.raises(ValueError, match="--dtypes"):
        bvl.resolve_dtypes("float16", 64)


def test_the_work_given_to_vllm_is_the_runners_prompts_sampling_and_eos():
    """build_work renders exactly the prompt ids the runner feeds (vase.run.runner), on the tiny model's tokenizer."""
    from hydra import compose, initialize_config_dir

    from vase.run.planning import measure, prepare

    overrides = ["model=tiny", "limit=3", "n_samples=2", "logger=none"]
    work = bvl.build_work(overrides)
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides)
    prep = prepare(cfg)
    problems = prep.task.load()
    runner_ids = [w.ids for w in measure(prep, [(p, [0]) for p in problems])]
    assert work["prompts"] == runner_ids and len(runner_ids) == 3
    assert [p.id for p in work["problems"]] == [p.id for p in problems]
    assert work["n_samples"] == 2 and work["max_length"] == prep.max_length
    assert work["sampling"] == dict(temperature=prep.sampling.temperature, top_p=prep.sampling.top_p,
                                    top_k=prep.sampling.top_k)  # fmt: skip
    tok = work["tokenizer"]
    assert tok.eos_token_id in work["eos_token_ids"]
    row = dict(
        dtype="float32",
        prompt_tokens={p.id: len(ids) for p, ids in zip(problems, runner_ids)},
        manifest_eos=work["eos_token_ids"],
        manifest_sampling=dict(work["sampling"], greedy=False),
        manifest_dtype="torch.float32",
    )
    assert bvl.cross_check(work, row) == []
    bad = dict(row, prompt_tokens={problems[0].id: 1}, manifest_eos=[0], manifest_dtype="torch.bfloat16")
    assert len(bvl.cross_check(work, bad)) == 3


class _FakeLLM:
    """Stands in for ``vllm.LLM``: records its arguments, returns one output per prompt with timestamps."""

    seen: dict = {}

    def __init__(self, **kwargs):
        _FakeLLM.seen["init"] = kwargs

    def generate(self, prompts, params, use_tqdm=True):
        import time

        _FakeLLM.seen["prompts"], _FakeLLM.seen["params"] = prompts, params
        t = time.monotonic()
        outs = []
        for i, (p, sp) in enumerate(zip(prompts, params)):
            tokens = list(range(min(sp.max_tokens, 3 + i)))
            metrics = types.SimpleNamespace(first_token_ts=t + 0.1 + 0.01 * i, last_token_ts=t + 1.0 + 0.1 * i)
            out = types.SimpleNamespace(
                token_ids=tokens, finish_reason="length" if len(tokens) == sp.max_tokens else "stop"
            )
            outs.append(types.SimpleNamespace(outputs=[out], metrics=metrics, prompt_token_ids=p["prompt_token_ids"]))
        return outs


def test_vllm_worker_asks_for_the_same_work_and_times_prefill_and_decode(monkeypatch):
    fake = types.ModuleType("vllm")
    fake.__version__ = "fake"
    fake.LLM = _FakeLLM
    fake.SamplingParams = lambda **kw: types.SimpleNamespace(**kw)
    inputs = types.ModuleType("vllm.inputs")
    inputs.TokensPrompt = lambda prompt_token_ids: {"prompt_token_ids": prompt_token_ids}
    monkeypatch.setitem(sys.modules, "vllm", fake)
    monkeypatch.setitem(sys.modules, "vllm.inputs", inputs)
    spec = dict(model_path="/m", dtype="float32", max_length=12, max_num_seqs=4, prompts=[[1, 2, 3], [4, 5, 6, 7, 8]],
                n_samples=2, sampling=dict(temperature=0.7, top_p=0.8, top_k=20), greedy=False, eos_token_ids=[9],
                seed=0)  # fmt: skip
    out = bvl.vllm_worker(spec)
    init = _FakeLLM.seen["init"]
    assert init["dtype"] == "float32" and init["max_model_len"] == 12 and init["disable_log_stats"] is False
    params = _FakeLLM.seen["params"]
    assert [p.max_tokens for p in params] == [9, 9, 7, 7]  # max_length - prompt, one request per sample
    assert all(p.stop_token_ids == [9] and (p.temperature, p.top_p, p.top_k) == (0.7, 0.8, 20) for p in params)
    assert not any(hasattr(p, "seed") for p in params)  # unseeded requests (a seed crashes vLLM's CPU sampler)
    assert [x["prompt_token_ids"] for x in _FakeLLM.seen["prompts"]] == [[1, 2, 3]] * 2 + [[4, 5, 6, 7, 8]] * 2
    assert [(s["problem"], s["sample"]) for s in out["samples"]] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert out["decode_s"] == pytest.approx(1.3 - 0.13, abs=1e-6)  # last token - the last request's first token
    assert 0.13 <= out["prefill_s"] < 0.13 + 5.0


def test_variants_parse_plan_and_refuse_bad_ones():
    v = bv.parse_variant("bg:HEAD:2:generation.grading=background limit=1")
    assert (v.label, v.rev, v.threads, v.args) == ("bg", "HEAD", 2, ["generation.grading=background", "limit=1"])
    grid = bv.plan([], "before=08d79e0,after=HEAD", "1,2")
    assert [(x.label, x.rev, x.threads) for x in grid] == [
        ("before-t1", "08d79e0", 1), ("before-t2", "08d79e0", 2), ("after-t1", "HEAD", 1), ("after-t2", "HEAD", 2)
    ]  # fmt: skip
    assert [x.label for x in bv.plan([], "a=HEAD", "1")] == ["a"]
    for bad in (["x:HEAD"], ["x:HEAD:two"], ["a:HEAD:1", "a:.:1"]):
        with pytest.raises(ValueError):
            bv.plan(bad, None, "1")
    with pytest.raises(ValueError, match="not a commit"):
        bv.resolve_rev("no-such-revision-xyz")


def test_variant_checkout_is_a_worktree_of_that_commit(tmp_path):
    head = bv.resolve_rev("HEAD")
    assert bv.resolve_rev(".") == head and bv.checkout(".", head, tmp_path) == REPO
    root = bv.checkout("HEAD", head, tmp_path)
    try:
        assert (root / "run.py").exists() and root != REPO
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True).stdout.strip()
        assert sha == head
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(root)], cwd=REPO, capture_output=True)
    assert not root.exists()


def test_variant_summary_divides_by_the_base():
    variants = [bv.Variant("a", "HEAD", 1), bv.Variant("b", "HEAD", 2)]
    runs = [dict(label="a", decode_tok_s=10.0, pass_at_1=0.5, dtype="torch.float32"),
            dict(label="a", decode_tok_s=14.0, pass_at_1=0.25, dtype="torch.float32"),
            dict(label="b", decode_tok_s=24.0, pass_at_1=0.5, dtype="torch.float32"),
            dict(label="b", error="exit 1: x")]  # fmt: skip
    table = bv.summarise(runs, variants, None)
    assert table[0]["decode_tok_s"] == 12.0 and table[0]["pass_at_1"] == 0.375 and table[1]["x_base"] == 2.0
    assert table[1]["runs"] == 1 and table[1]["errors"] == ["exit 1: x"]
    assert bv.summarise(runs, variants, "b")[0]["x_base"] == 0.5


@pytest.mark.slow  # two run.py processes on the tiny model (~1 min on a loaded 2-core machine)
def test_variants_end_to_end_on_the_tiny_model(tmp_path):
    args = types.SimpleNamespace(
        variant=["here:.:1", "head:HEAD:1:seed=1"], revs=None, threads="1", rounds=1, base=None, timeout=600,
        run_args="model=tiny limit=1 n_samples=1 generation.max_length=320", out=str(tmp_path),
    )  # fmt: skip
    result = bv.compare(args)
    assert [r["label"] for r in result["runs"]] == ["here", "head"]
    assert all(not r.get("error") and r["decode_tok_s"] > 0 for r in result["runs"]), result["runs"]
    assert (tmp_path / "table.md").exists() and (tmp_path / "variants.csv").exists()


@pytest.mark.slow  # the harness side of bench_vllm on the tiny model, vLLM's venv absent (~1 min)
def test_bench_vllm_runs_the_harness_side_and_reports_vllm_missing(tmp_path):
    code = bvl.main(
        ["--venv", str(tmp_path / "no-venv"), "--run-args", "model=tiny limit=1 n_samples=2 generation.max_length=320",
         "--dtypes", "float32", "--rounds", "1", "--out", str(tmp_path / "out")]
    )  # fmt: skip
    result = json.loads((tmp_path / "out" / "vllm.json").read_text())
    assert "no venv" in result["machine"]["vllm_error"]
    assert [(r["engine"], r["policy"]) for r in result["runs"]] == [("harness", "full"), ("harness", "vase_attnv")]
    assert all(r["decode_tok_s"] > 0 and r["samples"] == 2 for r in result["runs"]), result["runs"]
    assert code == 0


def test_vllm_preloads_are_found_or_named(tmp_path, monkeypatch):
    """``--vllm-preload auto`` takes Intel's OpenMP from the vLLM venv and names what it cannot find; an explicit
    path that does not exist is a one-line error; ``none`` preloads nothing."""
    lib = tmp_path / "venv" / "lib"
    lib.mkdir(parents=True)
    (lib / "libiomp5.so").write_bytes(b"")
    monkeypatch.setattr(bvl, "PRELOAD_LIBS", {"iomp": ("libiomp5.so",), "nosuchlib": ("libnosuchlib_xyz.so",)})
    found, missing = bvl.find_preloads(tmp_path / "venv", "auto")
    assert found == [str((lib / "libiomp5.so").resolve())] and missing == ["nosuchlib"]
    assert bvl.find_preloads(tmp_path / "venv", "none") == ([], [])
    assert bvl.find_preloads(tmp_path, str(lib / "libiomp5.so")) == ([str(lib / "libiomp5.so")], [])
    with pytest.raises(ValueError, match="--vllm-preload: no such library"):
        bvl.find_preloads(tmp_path, str(tmp_path / "missing.so"))
