"""Issue 40's bad inputs that passed every check, wrote files, then failed, and its wrong hints; issue 39's first-day
traps: each refused in one line (exit 2) before anything is written, Hydra's own directory included.

:data:`PREFLIGHT_REFUSALS` run in ``tests/test_reliability.py::test_refusals``; :data:`PREFLIGHT_CASES` name the tests
below (``python run.py`` in a subprocess where the refusal must come before Hydra writes ``.hydra``).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import TINY_RUN, compose
from tests.reliability_registry import Case, Refusal

ROOT = Path(__file__).resolve().parents[1]
HERE = "tests/test_preflight_refusals.py"
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "disabled"}

_spec = importlib.util.spec_from_file_location("vase_run_script_preflight", ROOT / "run.py")
cli = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cli)

PREFLIGHT_REFUSALS = [
    Refusal(
        "ratio-tiny",
        "Settings",
        "a ratio that makes a budget no cache can hold (`ratio=1e-300`: a 300-digit budget, then 'File name too "
        "long' after `.hydra` was written)",
        ("budget=null", "ratio=1e-300"),
        "ratio: 1e-300 gives budget = 512 / 1e-300 tokens, more than a cache can hold (at most 16777216 tokens)",
    ),
    Refusal(
        "budget-huge",
        "Settings",
        "a budget beyond any context window (`budget=99999999999`)",
        ("budget=99999999999",),
        "budget: must be <= 16777216 tokens (the most a cache can hold), got 99999999999",
    ),
    Refusal(
        "tri-calibration-empty",
        "New settings",
        "`policy=triattention` with an empty calibration text (was an IndexError as 'an unexpected error')",
        ("policy=triattention", "policy.calibration_text={data}/math500.jsonl"),
        "policy.calibration_text: '{data}/math500.jsonl' is empty (no text to calibrate on)",
        b"  \n",
    ),
    Refusal(
        "tri-calibration-binary",
        "New settings",
        "`policy=triattention` with a binary calibration text (was a bare UTF-8 error naming nothing)",
        ("policy=triattention", "policy.calibration_text={data}/math500.jsonl"),
        "policy.calibration_text: '{data}/math500.jsonl' is not UTF-8 text (byte 3 is 0xff)",
        b"abc\xff\xfe\x00",
    ),
    Refusal(
        "plus-generation-typo",
        "Settings",
        "a `+` key that is no setting (`+generation.compil=on`, was accepted silently)",
        ("+generation.compil=on",),
        "generation.compil: unknown setting (did you mean generation.compile?)",
    ),
    Refusal(
        "plus-top-level-typo",
        "Settings",
        "a `+` top-level key that is no setting (`+n_sample=3`)",
        ("+n_sample=3",),
        "n_sample: unknown setting (did you mean n_samples?)",
    ),
]


def _t(name: str) -> str:
    return f"{HERE}::{name}"


PREFLIGHT_CASES = [
    Case(
        "Run directory",
        "`run_dir` a dangling symbolic link, or a symbolic link loop (was: `.hydra` written, then 'File exists')",
        "`error: run_dir: <dir> is a dangling symbolic link (to <target>); remove or repair the link, ...`",
        "2",
        _t("test_run_py_refuses_before_hydra_writes_anything"),
    ),
    Case(
        "Policies",
        "SeerAttention-R `policy.gate_path` whose `config.json` is not JSON (was: refused after the run directory was "
        "written)",
        "`error: policy.gate_path: <dir>/config.json is not JSON (...); fix the file, or ...`",
        "2",
        _t("test_run_py_refuses_before_hydra_writes_anything"),
    ),
    Case(
        "Policies",
        "SeerAttention-R `policy.gate_repo` that cannot be reached (resolved in the preflight from the model's config)",
        "`error: policy seer_attention_r: cannot load gates <repo>@main (offline or unreachable: ...); ...`",
        "2",
        _t("test_run_py_refuses_before_hydra_writes_anything"),
    ),
    Case(
        "Command line",
        "a `conf/<group>/` file with a YAML syntax error, a tab, a list, or nothing in it (was a 100-line traceback)",
        "`error: conf/generation/tab.yaml, line 2, column 1: the YAML cannot be read (...); indent with spaces, not "
        "tabs`",
        "2",
        _t("test_a_bad_conf_file_is_one_line_naming_the_file_and_line"),
    ),
    Case(
        "Sweeps",
        "`sweep=pilot` without `-m` (was: one cell run silently)",
        "`error: sweep=pilot: a sweep preset runs its jobs only with -m (it sweeps policy over ...); add -m ...`",
        "2",
        _t("test_a_sweep_preset_without_m_says_so"),
    ),
    Case(
        "Sweeps",
        "in a sweep over policies, a key of one swept policy (`-m policy=quest,snapkv policy.page_size=8`; was "
        "refused with the default policy's keys)",
        "`error: job #1 (policy=snapkv): policy.page_size=8: unknown setting policy.page_size; keys of policy: "
        "<snapkv's>`",
        "2",
        _t("test_a_swept_policys_key_is_checked_against_that_policy"),
    ),
    Case(
        "Policies",
        "`keep_prompt` with a budget below the prompts: the hint's budget comes from the longest prompt (was the "
        "first: its budget then refused again)",
        "`error: policy.keep_prompt: a prompt of <longest> tokens ... raise budget to >= <n>`; `budget=<n>` then "
        "passes",
        "2",
        _t("test_the_keep_prompt_hint_comes_from_the_longest_prompt"),
    ),
    Case(
        "Command line",
        "`python run.py ...` outside the project's virtual environment (was a 36-line `No module named 'hydra'`)",
        "`error: this Python (<python>) has no module 'hydra': the harness's packages live in the project's .venv; "
        "activate it (source .venv/bin/activate) ...`",
        "2",
        _t("test_run_py_without_the_venv_names_it_in_one_line"),
    ),
    Case(
        "Model and memory",
        "a paper-scale task on a CPU (`task=aime` with the 0.5B model: 960 samples x 32K tokens, was queued silently)",
        "`error: limit, n_samples: task aime on the CPU would decode 960 samples x up to ... tokens ...; set both "
        "explicitly`; a large plan that runs says its size in one warning line",
        "2",
        _t("test_a_paper_scale_plan_on_a_cpu_asks_for_explicit_limit_and_n_samples"),
    ),
    Case(
        "Data parallel",
        "a rank that never starts (was a silent 1,800 s wait)",
        "`error: rank 0: only 1 of 2 ranks joined within 60 s (VASE_DIST_JOIN_S) (missing: rank 1); start every rank "
        "...`; every 10 s a line names the ranks it waits for",
        "1",
        "tests/test_distributed.py::test_the_ranks_wait_for_each_other_a_minute_by_default",
    ),
]


def _run_py(*args: str, cwd: Path = ROOT, env: dict | None = None, python: list[str] | None = None):
    return subprocess.run(
        [*(python or [sys.executable]), "run.py", *args],
        cwd=cwd,
        env=env or ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _one_error_line(r: subprocess.CompletedProcess) -> str:
    lines = [x for x in r.stderr.splitlines() if x.strip() and " WARNING " not in x]
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), r.stderr[-3000:]
    assert "Traceback" not in r.stderr and r.stdout == ""
    return lines[0][len("error: ") :]


def _broken_gates(tmp: Path) -> Path:
    gates = tmp / "gates"
    gates.mkdir()
    (gates / "config.json").write_text('{"num_attention_heads": 4,\n')
    (gates / "attn_gate_weights.pth").write_bytes(b"")
    return gates


CASES_BEFORE_HYDRA = {
    "run-dir-dangling": (["run_dir={tmp}/dangling"], "run_dir: {tmp}/dangling is a dangling symbolic link (to "),
    "run-dir-loop": (["run_dir={tmp}/loop1"], "run_dir: {tmp}/loop1 is a symbolic link loop; "),
    "run-dir-under-dangling": (["run_dir={tmp}/dangling/run"], "run_dir: {tmp}/dangling is a dangling symbolic link"),
    "ratio-tiny": (["budget=null", "ratio=1e-300"], "ratio: 1e-300 gives budget = 512 / 1e-300 tokens"),
    "gate-config": (
        ["policy=seer_attention_r", "policy.block_size=16", "policy.gate_path={tmp}/gates"],
        "policy.gate_path: {tmp}/gates/config.json is not JSON (",
    ),
    "gate-repo": (
        ["policy=seer_attention_r", "policy.block_size=16", "policy.gate_repo=nobody/no-such-gates"],
        "policy seer_attention_r: cannot load gates nobody/no-such-gates@main (",
    ),
    "plus-typo": (["+generation.compil=on"], "generation.compil: unknown setting (did you mean generation.compile?)"),
    "tensor-one-rank": (["parallel.tensor=2"], "parallel.tensor=2 does not divide the 1 ranks started"),
}


@pytest.mark.parametrize("case", sorted(CASES_BEFORE_HYDRA))
def test_run_py_refuses_before_hydra_writes_anything(case: str, tmp_path: Path) -> None:
    """Each case: exit 2, one line, and nothing under the results directory (``.hydra`` included) or anywhere in the
    test's directory besides what the test made."""
    overrides, expected = CASES_BEFORE_HYDRA[case]
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    (tmp_path / "loop1").symlink_to(tmp_path / "loop2")
    (tmp_path / "loop2").symlink_to(tmp_path / "loop1")
    _broken_gates(tmp_path)
    before = sorted(p.name for p in tmp_path.iterdir())
    args = [*TINY_RUN, "limit=1", f"results_dir={tmp_path / 'results'}", *(o.format(tmp=tmp_path) for o in overrides)]
    line = _one_error_line(_run_py(*args))
    assert line.startswith(expected.format(tmp=tmp_path)), line
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no results/, no .hydra
    assert not (tmp_path / "nowhere").exists()


@pytest.mark.parametrize(
    "text, expected",
    [
        ("temperature: [1\n", "conf/generation/broken.yaml, line 2, column 1: the YAML cannot be read ("),
        ("a:\n\tb: 1\n", "conf/generation/broken.yaml, line 2, column 1: the YAML cannot be read (found character"),
        ("- 1\n- 2\n", "conf/generation/broken.yaml, line 1: the file holds a list, not key: value settings; "),
        ("", "conf/generation/broken.yaml, line 1: the file is empty; "),
        ("# only a comment\n", "conf/generation/broken.yaml, line 1: the file is empty; "),
    ],
    ids=["syntax", "tab", "list", "empty", "comment-only"],
)
def test_a_bad_conf_file_is_one_line_naming_the_file_and_line(text: str, expected: str, tmp_path: Path) -> None:
    from vase.run.conf_files import check_conf_dir

    conf = tmp_path / "conf"
    shutil.copytree(ROOT / "conf", conf)
    assert check_conf_dir(conf) is None  # the project's own files are fine
    (conf / "generation" / "broken.yaml").write_text(text)
    msg = check_conf_dir(conf)
    assert msg is not None and msg.startswith(expected) and "\n" not in msg, msg
    if "\t" in text:
        assert msg.endswith("indent with spaces, not tabs")


def test_run_py_with_a_bad_conf_file_writes_nothing(tmp_path: Path) -> None:
    """The whole path: a copy of run.py beside a conf/ with a tab in a group file, the group chosen: one line naming
    the file and line, exit 2, no results directory (was a 100-line traceback)."""
    shutil.copy(ROOT / "run.py", tmp_path / "run.py")
    shutil.copytree(ROOT / "conf", tmp_path / "conf")
    (tmp_path / "conf" / "generation" / "tabbed.yaml").write_text("temperature: 1.0\ntop_p:\n\t0.9\n")
    env = {**ENV, "PYTHONPATH": str(ROOT)}
    r = _run_py(*TINY_RUN, "generation=tabbed", f"results_dir={tmp_path / 'results'}", cwd=tmp_path, env=env)
    line = _one_error_line(r)
    assert line.startswith("conf/generation/tabbed.yaml, line 3, column 1: the YAML cannot be read"), line
    assert not (tmp_path / "results").exists()


def test_a_sweep_preset_without_m_says_so() -> None:
    msg = cli.check_overrides(["sweep=pilot"])
    assert msg is not None and "\n" not in msg
    assert msg.startswith("sweep=pilot: a sweep preset runs its jobs only with -m (it sweeps policy over full,random")
    assert "python run.py -m sweep=pilot" in msg and "sweep=pilot policy=full" in msg
    assert cli.check_overrides(["sweep=pilot", "policy=snapkv"]) is None  # one cell of it, on purpose (docs/pilot.md)
    assert cli.check_overrides(["-m", "sweep=smoke"]) is None


def test_a_swept_policys_key_is_checked_against_that_policy() -> None:
    """Hydra checks a multirun's command line against the default policy; the message names the job whose policy
    lacks the key, with that policy's keys, or (every swept policy has it) the ``++`` that Hydra accepts."""
    msg = cli.check_overrides(["-m", "policy=quest,snapkv", "policy.page_size=8"])
    assert msg is not None and msg.startswith("job #1 (policy=snapkv): policy.page_size=8: unknown setting"), msg
    assert "keys of policy: _target_, attn_temperature" in msg and "page_size," not in msg
    msg = cli.check_overrides(["-m", "policy=quest,snapkv", "policy.page_sise=8"])
    assert msg is not None and msg.startswith("job #0 (policy=quest): policy.page_sise=8: unknown setting"), msg
    assert "(did you mean policy.page_size=8?); keys of policy: _target_, budget, dense_layers" in msg
    msg = cli.check_overrides(["-m", "policy=quest,quest", "policy.page_size=8"])
    assert msg is not None and msg.endswith("write ++policy.page_size=8"), msg
    assert cli.check_overrides(["-m", "policy=quest,quest", "++policy.page_size=8"]) is None  # the fix, followed


def test_a_key_of_a_closed_node_gets_no_hint_to_add_it() -> None:
    """``policy.nosuchkey=1`` used to end with 'to add a new key: +policy.nosuchkey=1', which is refused too."""
    msg = cli.check_overrides(["policy.nosuchkey=1"])
    assert msg is not None and "to add a new key" not in msg
    msg = cli.check_overrides(["generation.compil=on"])
    assert msg is not None and "did you mean generation.compile=on?" in msg and "to add a new key" not in msg


def test_the_keep_prompt_hint_comes_from_the_longest_prompt(tmp_path: Path) -> None:
    """Three problems with prompts of different lengths, a budget too small for keep_prompt: the hint's budget is the
    longest prompt's, so the command it gives passes the same check (it used to be the first prompt's)."""
    from vase.run.planning import plan

    base = [*TINY_RUN, "limit=3", "policy=random_keep_prompt", f"results_dir={tmp_path / 'results'}"]
    with pytest.raises(ValueError) as err:
        plan(compose(base))
    msg = str(err.value)
    assert msg.startswith("policy.keep_prompt: a prompt of ") and "\n" not in msg
    budget = int(msg.split("(budget=")[1].split(":")[0])
    p = plan(compose([*base, f"budget={budget}"]))
    lengths = [len(w.ids) for w in p.work]
    assert len(set(lengths)) > 1, lengths  # the case needs prompts of different lengths
    assert f"a prompt of {max(lengths)} tokens" in msg
    assert not (tmp_path / "results").exists()


def test_run_py_without_the_venv_names_it_in_one_line(tmp_path: Path) -> None:
    """``python -S`` (no site-packages: what a Python outside the virtual environment sees): one line naming the
    missing package and the venv, exit 2, instead of a traceback ending in ``No module named 'hydra'``."""
    r = _run_py(
        "policy=vase_dkv", "ratio=4", "task=aime", f"results_dir={tmp_path / 'results'}", python=[sys.executable, "-S"]
    )
    line = _one_error_line(r)
    assert line.startswith("this Python (") and "has no module 'hydra'" in line, line
    assert "source .venv/bin/activate" in line and 'make run ARGS="..."' in line
    assert not (tmp_path / "results").exists()


def test_a_paper_scale_plan_on_a_cpu_asks_for_explicit_limit_and_n_samples(tmp_path, monkeypatch, caplog) -> None:
    """The rule (:func:`vase.run.scale.check_scale`) on numbers, then through the preflight on the tiny run with a
    threshold the tiny run crosses: refused without an explicit ``limit=``, passed with it (a line says the size)."""
    from vase.run import scale
    from vase.run.planning import plan

    aime = [(70, 16)] * 60  # aime: 60 problems x 16 samples, 70-token prompts, 32K tokens each
    with pytest.raises(ValueError) as err:
        scale.check_scale("aime", "cpu", aime, 32768, 384 * 2**20, explicit=False)
    msg = str(err.value)
    assert msg.startswith("limit, n_samples: task aime on the CPU would decode 960 samples x up to 32698 new tokens")
    assert "384.0 MiB" in msg and "set both explicitly" in msg and "\n" not in msg
    scale.check_scale("aime", "cpu", aime, 32768, None, explicit=True)  # asked for: a line, no refusal
    scale.check_scale("aime", "cuda", aime, 32768, None, explicit=False)  # a GPU: no question
    scale.check_scale("aime", "cpu", aime, 32768, None, explicit=False, machine=False)  # a SLURM node decides
    assert scale.plan_tokens([(10, 2), (600, 3)], 512) == (5, 2 * 502)  # a prompt too long generates nothing

    monkeypatch.setattr(scale, "CPU_ASK_TOKENS", 100)
    monkeypatch.setattr(scale, "NOTE_TOKENS", 100)
    results = tmp_path / "results"
    base = [*TINY_RUN, "task.limit=2", f"results_dir={results}"]  # n_samples=2 set, limit not: not explicit
    with pytest.raises(ValueError, match=r"^limit, n_samples: task gsm_symbolic on the CPU would decode 4 samples"):
        plan(compose(base))
    with caplog.at_level(logging.WARNING, logger="vase.run.scale"):
        plan(compose([*base, "limit=2"]))
    assert any("plan: task gsm_symbolic on cpu decodes 4 samples" in r.getMessage() for r in caplog.records)
    assert not results.exists()
