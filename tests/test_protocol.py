"""``protocol=paper`` (docs/protocol.md): every knob composed, checked up front and recorded; sampling without top-k
against the authors' decode loop; the GSM8K pilot sweep cell by cell against the paper's rows; an offline run."""

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
from omegaconf import OmegaConf

from tasks.grading import CODE_EXTRACTIONS, EQUIVALENCES, GRADER_RULES
from tests.test_tasks import SHARED, needs_shared
from tests.tolerance import close
from vase.analysis.load import GRADER_RULES as ANALYSIS_RULES
from vase.analysis.paper import GSM8K_PILOT
from vase.engine.rng import TOKEN_SALT, RowRNG
from vase.engine.sampling import SamplingConfig, candidate_distribution, sample_tokens
from vase.engine.scores import SCORE_DTYPES
from vase.hub import sha256_file
from vase.run import checks
from vase.run.protocol import (
    AUTHORS_DATA,
    DEFAULT,
    check_authors_data,
    check_authors_source,
    comparable,
    data_copy,
    run_tag,
)
from vase.run.results import check_protocol
from vase.run.runner import prepare, run

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
DOC = ROOT / "docs" / "protocol.md"
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "disabled"}

#: method.md §4 (the paper's protocol table): budget at ~4x and protected value slots per task
PAPER_TASKS = {
    "aime25": (4096, 1024),
    "aime26": (4096, 1024),
    "hmmt25": (4096, 1024),
    "math500": (1024, 256),
    "gpqa_diamond": (2048, 512),
    "livecodebench": (2048, 512),
    "gsm8k": (512, 256),
}


def _compose(overrides: list[str], hydra: bool = False):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="config", overrides=overrides, return_hydra_config=hydra)


def _gsm8k_dir(tmp_path: Path) -> Path:
    d = tmp_path / "data"
    d.mkdir()
    shutil.copy(ROOT / "tests" / "fixtures" / "tasks" / "gsm8k.fixture.jsonl", d / "gsm8k.jsonl")
    return d


def test_the_choices_of_the_checks_are_the_engines_and_the_graders():
    assert checks.GRADERS == GRADER_RULES == ANALYSIS_RULES
    assert checks.SCORE_DTYPES == tuple(SCORE_DTYPES)
    default = OmegaConf.load(CONF / "protocol" / "default.yaml")
    assert {k: default[k] for k in DEFAULT} == DEFAULT


# ---- n_protect and the other knobs per task ---------------------------------------------------------------------


@pytest.mark.parametrize("task", sorted(PAPER_TASKS))
def test_paper_protocol_per_task(task):
    budget, n_protect = PAPER_TASKS[task]
    ratio = [] if task != "gsm8k" else ["budget=512"]  # GSM8K: the pilot's B (its 4x budget is the same)
    prep = prepare(_compose(["protocol=paper", f"task={task}", "model=qwen3_4b", "policy=vase_attnv", *ratio]))
    assert prep.policy.budget == budget and prep.policy.protect_count == n_protect
    assert prep.sampling.top_k == 0 and prep.sampling.temperature == 0.6 and prep.sampling.top_p == 0.95
    assert prep.model_spec.dtype == "bfloat16" and prep.score_dtype is torch.bfloat16
    assert prep.grader == ("strict" if task == "livecodebench" else "last_boxed")  # code: one grader
    knobs = prep.protocol["protocol"]
    assert knobs["name"] == "paper" and knobs["n_protect"] == n_protect and knobs["top_k"] == 0
    assert knobs["score_dtype"] == "bfloat16" and knobs["model_dtype"] == "bfloat16"
    assert knobs["max_length"] == (4096 if task == "gsm8k" else 32768) and knobs["window"] == 64
    if task == "gpqa_diamond":
        assert prep.task.shuffle_choices is False and knobs["shuffle_choices"] is False
    # the same protection ladder value for the protection-only ablation
    protect = prepare(_compose(["protocol=paper", f"task={task}", "model=qwen3_4b", "policy=snapkv_protect", *ratio]))
    assert protect.policy.protect_count == n_protect


@pytest.mark.parametrize("task", sorted(PAPER_TASKS))
def test_default_protocol_per_task(task):
    ratio = [] if task != "gsm8k" else ["budget=512"]
    prep = prepare(_compose([f"task={task}", "model=qwen3_4b", "policy=vase_attnv", *ratio]))
    assert prep.policy.protect_count == prep.policy.budget // 4  # 128 on the GSM8K pilot, not the paper's 256
    assert prep.sampling.top_k == 20 and prep.score_dtype is torch.float32 and prep.grader == "strict"
    assert prep.protocol["protocol"]["name"] == "default" and not prep.run_dir.name.endswith("-paper")


def test_explicit_n_protect_and_knob_overrides_win_and_are_recorded():
    prep = prepare(_compose(["protocol=paper", "task=math500", "model=qwen3_4b", "policy.n_protect=64"]))
    assert prep.policy.protect_count == 64 and prep.protocol["protocol"]["n_protect"] == 64
    prep = prepare(_compose(["protocol=paper", "task=math500", "model=qwen3_4b", "generation.top_k=20"]))
    assert prep.sampling.top_k == 20 and prep.protocol["protocol"]["top_k"] == 20
    prep = prepare(_compose(["protocol=paper", "task=math500", "model=qwen3_4b", "protocol.score_dtype=float32"]))
    assert prep.score_dtype is torch.float32
    # a task the paper does not run: budget // 4
    prep = prepare(_compose(["protocol=paper", "task=humaneval", "model=tiny", "budget=64", "window=16"]))
    assert prep.policy.protect_count == 16


@pytest.mark.parametrize(
    "overrides, setting",
    [
        (["protocol.grader=last_box"], "protocol.grader: unknown choice, got 'last_box'; did you mean"),
        (["protocol.score_dtype=float16"], "protocol.score_dtype: unknown choice"),
        (["protocol=paper", "task=aime25", "budget=512"], "protocol.n_protect: 1024 protected value slots"),
        (["protocol=paper", "task=math500", "ratio=16"], "protocol.n_protect: 256 protected value slots"),
        (["protocol.n_protect=-3"], "protocol.n_protect: must be"),
        (["protocol=paper", "protocol.n_protect_by_task.math500=x", "task=math500"], "n_protect_by_task.math500"),
    ],
)
def test_bad_knobs_are_one_line_errors_naming_the_setting(overrides, setting):
    with pytest.raises(ValueError) as err:
        prepare(_compose(["model=qwen3_4b", *overrides]))
    assert setting in str(err.value) and "\n" not in str(err.value)


def test_the_command_line_refuses_a_bad_knob_before_hydra_writes_anything(tmp_path):
    r = subprocess.run(
        [sys.executable, "run.py", "protocol=papr", f"results_dir={tmp_path}"],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and "did you mean paper" in r.stderr and not any(tmp_path.iterdir())


def test_run_directories_of_two_protocols_never_meet(tmp_path):
    base = ["task=math500", "model=qwen3_4b", f"results_dir={tmp_path}"]
    default, paper = prepare(_compose(base)).run_dir, prepare(_compose(["protocol=paper", *base])).run_dir
    assert default != paper and paper.name.endswith("-paper") and "-default" not in default.name
    assert run_tag(None) == "" and run_tag(DEFAULT) == ""
    changed = run_tag({**DEFAULT, "grader": "last_boxed"})
    assert changed.startswith("-default-") and changed != run_tag({**DEFAULT, "score_dtype": "bfloat16"})


def test_a_run_written_before_the_protocol_section_resumes_under_the_default(tmp_path):
    prep = prepare(_compose(["task=math500", "model=qwen3_4b"]))
    old = {k: v for k, v in prep.protocol.items() if k != "protocol"}
    (tmp_path / "protocol.json").write_text(json.dumps(old))
    assert comparable(tmp_path, prep.protocol) == old
    paper = prepare(_compose(["protocol=paper", "task=math500", "model=qwen3_4b"]))
    assert "protocol" in comparable(tmp_path, paper.protocol)  # a paper run is not the old default run


# ---- sampling without top-k: the authors' decode loop ----------------------------------------------------------


def ref_top_p(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """Temperature then nucleus, one row at a time with Python floats: sort descending, keep a token while the mass
    of the tokens strictly before it is below ``top_p`` (the most likely token always), renormalise."""
    out = torch.zeros(logits.shape, dtype=torch.float64)
    for b in range(logits.shape[0]):
        z = [float(x) / temperature for x in logits[b]]
        m = max(z)
        e = [pow(2.718281828459045, x - m) for x in z]
        total = sum(e)
        p = [x / total for x in e]
        order = sorted(range(len(p)), key=lambda i: -p[i])
        kept, mass = [], 0.0
        for i in order:
            if mass >= top_p and kept:
                break
            kept.append(i)
            mass += p[i]
        s = sum(p[i] for i in kept)
        for i in kept:
            out[b, i] = p[i] / s
    return out


def _full_probs(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    probs, ids = candidate_distribution(logits, cfg)
    if ids is None:
        return probs.double()
    return torch.zeros(logits.shape, dtype=torch.float64).scatter(-1, ids, probs.double())


@pytest.mark.parametrize("temperature,top_p", [(0.6, 0.95), (1.0, 0.5), (0.3, 1.0), (1.5, 0.9)])
def test_no_top_k_is_temperature_and_top_p_only(temperature, top_p):
    logits = torch.randn(3, 200, generator=torch.Generator().manual_seed(1)) * 3
    got = _full_probs(logits, SamplingConfig(temperature=temperature, top_p=top_p, top_k=0))
    # float32 softmax over 200 logits against a float64 reference
    torch.testing.assert_close(got, ref_top_p(logits, temperature, top_p), **close(torch.float32, 200, scale=1e-2))


def test_no_top_k_equals_the_authors_warper():
    """Their loop (generation_utils.py L59-66): float logits / T, transformers' TopPLogitsWarper, softmax."""
    from transformers.generation.logits_process import TopPLogitsWarper

    logits = torch.randn(4, 500, generator=torch.Generator().manual_seed(2))
    theirs = torch.softmax(TopPLogitsWarper(top_p=0.95, min_tokens_to_keep=1)(None, logits / 0.6), dim=-1)
    ours = _full_probs(logits, SamplingConfig(temperature=0.6, top_p=0.95, top_k=0))
    torch.testing.assert_close(ours, theirs.double(), **close(torch.float32, 500, scale=1e-2))
    # the knob matters: tokens past the 20th are in the nucleus, and top-k 20 drops them
    assert ((ours > 0).sum(dim=-1) > 20).all()
    top20 = _full_probs(logits, SamplingConfig(temperature=0.6, top_p=0.95, top_k=20))
    assert ((top20 > 0).sum(dim=-1) <= 20).all()


def test_sampling_without_top_k_draws_from_the_nucleus_in_proportion():
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -8.0]]).expand(4000, -1)
    cfg = SamplingConfig(temperature=0.8, top_p=0.9, top_k=0)
    rng = RowRNG.from_seeds(range(4000), salt=TOKEN_SALT)
    tokens = sample_tokens(logits, cfg, rng)
    freq = torch.bincount(tokens, minlength=8).double() / 4000
    want = ref_top_p(logits[:1], 0.8, 0.9)[0]
    assert (freq[want == 0] == 0).all()  # never outside the nucleus
    assert (freq - want).abs().max() < 0.03  # about 4 standard errors at n = 4000


# ---- the GSM8K pilot, cell by cell --------------------------------------------------------------------------------


def test_every_cell_of_the_gsm8k_pilot_is_a_row_of_the_paper():
    sweep = _compose(["sweep=gsm8k_pilot", "model=qwen3_4b"], hydra=True)
    cells = [c.strip() for c in str(sweep.hydra.sweeper.params.pilot_row).split(",")]
    assert sorted(cells) == sorted(r.row for r in GSM8K_PILOT.rows)
    assert sorted(p.stem for p in (CONF / "pilot_row").glob("*.yaml")) == sorted(cells)
    dirs = set()
    for cell in cells:
        prep = prepare(_compose(["sweep=gsm8k_pilot", "model=qwen3_4b", f"pilot_row={cell}"]))
        paper = GSM8K_PILOT.row(cell)
        assert prep.policy.name == paper.policy, cell
        for key, value in paper.settings.items():
            assert getattr(prep.policy, key) == value, (cell, key)
        assert prep.task.name == GSM8K_PILOT.task and prep.n_samples == GSM8K_PILOT.samples
        assert prep.task.limit == GSM8K_PILOT.problems and prep.max_length == GSM8K_PILOT.max_length
        if prep.policy.kind != "none":
            assert prep.policy.budget == GSM8K_PILOT.budget and prep.policy.window == 64
        assert prep.protocol["protocol"]["name"] == "paper" and prep.sampling.top_k == 0
        assert prep.grader == "last_boxed" and prep.score_dtype is torch.bfloat16
        # and the analysis finds the row back from what the run saves
        params = {k: v for k, v in OmegaConf.to_container(prep.cfg.policy, resolve=True).items() if k != "_target_"}
        assert GSM8K_PILOT.match(prep.policy.name, params) == paper
        dirs.add(prep.run_dir)
    assert len(dirs) == len(cells)  # no two cells share a run directory
    ladder = [GSM8K_PILOT.row(f"snapkv_protect{n}").settings["n_protect"] for n in (16, 32, 64, 256)]
    assert ladder == [16, 32, 64, 256] and GSM8K_PILOT.row("vase_attnv").settings["n_protect"] == 256


@pytest.mark.slow
def test_the_gsm8k_pilot_runs_as_one_multirun(tmp_path):
    """``python run.py -m sweep=gsm8k_pilot`` on the tiny model: one job per row, each in its own directory."""
    data = _gsm8k_dir(tmp_path)
    r = subprocess.run(
        [
            sys.executable,
            "run.py",
            "-m",
            "sweep=gsm8k_pilot",
            "model=tiny",
            f"task.data_dir={data}",
            "limit=1",
            "n_samples=1",
            "generation.max_length=80",
            "logger=none",
            "progress=false",
            f"results_dir={tmp_path / 'results'}",
        ],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    runs = sorted((tmp_path / "results" / "gsm8k" / "tiny").iterdir())
    assert len(runs) == len(GSM8K_PILOT.rows) and all(p.name.endswith("-paper") for p in runs)


# ---- protocol=paper runs offline and records every knob of docs/protocol.md ------------------------------------


def documented_keys() -> set[str]:
    """The ``protocol.json`` keys the first column of docs/protocol.md's knob table names."""
    keys = set()
    for line in DOC.read_text().splitlines():
        if line.startswith("| ") and not line.startswith("| knob") and not line.startswith("|---"):
            first = line.split("|")[1]
            keys |= set(re.findall(r"`([a-z_]+)`", first))
    return keys


def test_paper_run_offline_records_every_knob(tmp_path):
    data = _gsm8k_dir(tmp_path)
    cmd = [
        sys.executable,
        "run.py",
        "protocol=paper",
        "model=tiny",
        "task=gsm8k",
        f"task.data_dir={data}",
        "limit=2",
        "n_samples=1",
        "budget=320",
        "generation.max_length=100",
        "logger=none",
        "progress=false",
        f"results_dir={tmp_path / 'results'}",
    ]
    r = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    (run_dir,) = (tmp_path / "results" / "gsm8k" / "tiny").iterdir()
    knobs = json.loads((run_dir / "protocol.json").read_text())["protocol"]
    documented = documented_keys()
    assert len(documented) >= 20 and documented == set(knobs), documented ^ set(knobs)
    assert knobs["name"] == "paper" and knobs["grader"] == "last_boxed" and knobs["score_dtype"] == "bfloat16"
    assert knobs["top_k"] == 0 and knobs["model_dtype"] == "bfloat16" and knobs["n_protect"] == 256
    assert knobs["prompt_suffix"] == " Put your final answer within \\boxed{}." and knobs["max_length"] == 100
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["grader"] == "last_boxed" and metrics["protocol"] == "paper"
    for rule in GRADER_RULES:
        assert f"accuracy_{rule}" in metrics and f"answered_rate_{rule}" in metrics
    assert metrics["accuracy"] == metrics["accuracy_last_boxed"]
    rows = [json.loads(x) for x in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(r["grader"] == "last_boxed" for r in rows)
    assert all(
        {"extracted_strict", "correct_strict", "extracted_last_boxed", "correct_last_boxed"} <= set(r) for r in rows
    )


@pytest.mark.slow  # test_paper_run_offline_records_every_knob stays
def test_paper_run_evicts_with_bf16_scores(tmp_path):
    """protocol=paper through the runner with evictions: float32 weights and a short window for speed (an eviction
    every 16 steps past 64 tokens); the scores are still bf16."""
    data = _gsm8k_dir(tmp_path)
    cfg = _compose(
        [
            "protocol=paper",
            "model=tiny",
            "model.dtype=float32",
            "task=gsm8k",
            f"task.data_dir={data}",
            "limit=1",
            "n_samples=2",
            "budget=64",
            "window=16",
            "policy.n_protect=8",
            "generation.max_length=140",
            "logger=none",
            "progress=false",
            f"results_dir={tmp_path / 'results'}",
        ]
    )
    metrics = run(cfg, progress=False)
    assert metrics["evictions"] > 0 and metrics["nonfinite_samples"] == 0
    assert metrics["grader"] == "last_boxed" and "accuracy_strict" in metrics
    knobs = json.loads((Path(metrics["run_dir"]) / "protocol.json").read_text())["protocol"]
    assert knobs["score_dtype"] == "bfloat16" and knobs["n_protect"] == 8 and knobs["model_dtype"] == "float32"


# ---- the authors' data files, answer equivalence and code extraction ------------------------------------------------


def test_the_equivalence_and_extraction_choices_are_the_graders():
    assert checks.EQUIVALENCES == EQUIVALENCES and checks.CODE_EXTRACTIONS == CODE_EXTRACTIONS


def test_paper_grades_with_the_authors_equivalence_and_extraction_and_records_them():
    paper = prepare(_compose(["protocol=paper", "task=math500", "model=qwen3_4b"]))
    assert paper.task.equivalence == "authors" and paper.protocol["protocol"]["equivalence"] == "authors"
    lcb = prepare(_compose(["protocol=paper", "task=livecodebench", "model=qwen3_4b"]))
    assert lcb.task.code_extraction == "authors" and lcb.protocol["protocol"]["code_extraction"] == "authors"
    default = prepare(_compose(["task=math500", "model=qwen3_4b"]))
    assert default.task.equivalence == "math_verify" and default.protocol["protocol"]["code_extraction"] is None
    with pytest.raises(ValueError, match=r"^protocol\.equivalence: unknown choice, got 'sympy'"):
        prepare(_compose(["task=math500", "model=qwen3_4b", "protocol.equivalence=sympy"]))


def test_a_run_stored_before_the_equivalence_knob_resumes_only_as_it_was_graded(tmp_path):
    """protocol.json of a run made before ``equivalence`` / ``code_extraction`` existed: the default preset (which
    grades as that run did) resumes it; the authors' equivalence is another protocol and is refused."""
    prep = prepare(_compose(["task=math500", "model=qwen3_4b"]))
    old = json.loads(json.dumps(prep.protocol, default=str))
    del old["task"]["equivalence"], old["protocol"]["equivalence"], old["protocol"]["code_extraction"]
    (tmp_path / "protocol.json").write_text(json.dumps(old))
    check_protocol(tmp_path, comparable(tmp_path, prep.protocol), write=False)
    other = prepare(_compose(["task=math500", "model=qwen3_4b", "protocol.equivalence=authors"]))
    with pytest.raises(ValueError, match=r"different protocol \(.*equivalence: '<unset>' -> 'authors'"):
        check_protocol(tmp_path, comparable(tmp_path, other.protocol), write=False)


def test_the_authors_data_table_is_their_repository_and_the_shared_copies():
    """Each entry names a file of their repository at bfa2692; where ../shared/data is here, its files have the
    listed sha256 (the copies are theirs byte for byte)."""
    assert len(AUTHORS_DATA) == 10
    for name, (path, sha) in AUTHORS_DATA.items():
        assert path.startswith("eval/reasoning_tasks/data/") and path.endswith("/test.jsonl") and len(sha) == 64
        if SHARED.is_dir():
            assert sha256_file(SHARED / name) == sha, name


@needs_shared
@pytest.mark.parametrize("task", ["math500", "aime", "gpqa_diamond", "hmmt25"])
def test_paper_with_the_shared_data_reads_the_authors_files(task):
    """protocol=paper with ../shared/data: the check passes and the run records that it read the authors' copy (any
    protocol records it)."""
    for preset in (["protocol=paper"], []):
        cfg = _compose([*preset, f"task={task}", "model=qwen3_4b", f"task.data_dir={SHARED}"])
        prep = prepare(cfg)
        prep.task.load()
        check_authors_data(prep.task, cfg.protocol)
        copy = data_copy(prep.task)
        assert copy["copy"] == "authors" and copy["files"]
        assert all(f["authors"].startswith("eval/reasoning_tasks/data/") for f in copy["files"].values())
    prep.task.data_dir = None
    assert data_copy(prep.task) == {"copy": "hub", "files": {}}


def test_paper_refuses_a_local_copy_that_is_not_the_authors_before_anything(tmp_path):
    data, results = tmp_path / "mine", tmp_path / "results"
    data.mkdir()
    (data / "math500.jsonl").write_text('{"problem": "1+1?", "answer": "2", "unique_id": "a"}\n')
    args = ["protocol=paper", "task=math500", "model=tiny", f"task.data_dir={data}", "budget=1024", "logger=none"]
    with pytest.raises(ValueError, match=r"^task\.data_dir: .*math500\.jsonl is not the authors' copy") as err:
        run(_compose([*args, f"results_dir={results}"]), progress=False)
    msg = str(err.value)
    assert "\n" not in msg and "eval/reasoning_tasks/data/math/test.jsonl" in msg and "a2392729" in msg
    assert "protocol.require_authors_data=false" in msg and not results.exists()
    # the fix it names: this copy runs, recorded as a local copy, not the authors' (so does the default protocol)
    for extra in (["protocol.require_authors_data=false"], ["protocol=default"]):
        cfg = _compose([*args, *extra, f"results_dir={results}"])
        prep = prepare(cfg)
        prep.task.load()
        check_authors_data(prep.task, cfg.protocol)
        assert data_copy(prep.task) == {
            "copy": "local",
            "files": {"math500.jsonl": {"sha256": sha256_file(data / "math500.jsonl"), "authors": None}},
        }
    # a task whose data the authors do not ship as a file (GSM8K: their code loads the hub) is not checked
    cfg = _compose(["protocol=paper", "task=gsm8k", "model=tiny", f"task.data_dir={_gsm8k_dir(tmp_path)}"])
    gsm = prepare(cfg)
    gsm.task.load()
    check_authors_data(gsm.task, cfg.protocol)
    assert data_copy(gsm.task)["copy"] == "local"


def test_a_run_between_the_papers_rows_is_shown_beside_the_closest_one_with_what_differs():
    """A pilot cell that matches no paper row exactly (VaSE-AttnV at its defaults: 4 sinks, ``n_protect`` = budget // 4)
    is put beside the row it agrees with most, naming the fields that differ; an exact match, a tie or a policy
    without a row gives none."""
    defaults = {
        "sinks": 4,
        "n_protect": None,
        "sample": True,
        "value_stat": "range",
        "smooth_kernel": 5,
        "smooth_along": "storage",
    }
    row, differs = GSM8K_PILOT.closest("vase_attnv", defaults)
    assert row.row == "vase_attnv_sinks" and differs == {"n_protect": (None, 256)}
    row, differs = GSM8K_PILOT.closest("vase_attnv", {**defaults, "sinks": 0})
    assert row.row == "vase_attnv" and set(differs) == {"n_protect"}
    exact = dict(GSM8K_PILOT.row("vase_attnv_sinks").settings)
    assert GSM8K_PILOT.closest("vase_attnv", exact) is None and GSM8K_PILOT.match("vase_attnv", exact) is not None
    assert GSM8K_PILOT.closest("vase_attnv", {**defaults, "sinks": 2}) is None  # both rows differ in two fields
    assert GSM8K_PILOT.closest("no_such_policy", defaults) is None


@pytest.mark.parametrize("task", ["math500", "aime"])
def test_paper_without_a_data_dir_refuses_the_hub_before_anything(tmp_path, task):
    """protocol=paper alone would read the hub's copies (other files than the authors'): one line naming the setting
    and the fix, before any problem loads or file is written. GSM8K, which their code reads from the hub, runs."""
    results = tmp_path / "results"
    args = ["protocol=paper", f"task={task}", "model=tiny", "budget=4096", "logger=none", f"results_dir={results}"]
    with pytest.raises(ValueError, match=r"^task\.data_dir: protocol 'paper' reads the authors' data files") as err:
        run(_compose(args), progress=False)
    msg = str(err.value)
    assert "\n" not in msg and "task.data_dir=../shared/data" in msg and "require_authors_data=false" in msg
    assert ("aime25.jsonl, aime26.jsonl" if task == "aime" else "math500.jsonl") in msg
    assert not results.exists()
    for fine in (["protocol.require_authors_data=false"], ["protocol=default"]):
        cfg = _compose([*args, *fine])
        check_authors_source(prepare(cfg).task, cfg.protocol)  # no refusal
    cfg = _compose(["protocol=paper", "task=gsm8k", "model=tiny"])
    check_authors_source(prepare(cfg).task, cfg.protocol)
