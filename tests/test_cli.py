"""run.py's command line: Hydra typos and bad values are one line, exit code 2, nothing written (issue 12, §1 / B7)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "disabled"}

_spec = importlib.util.spec_from_file_location("vase_run_script", ROOT / "run.py")
cli = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cli)


def _run_py(*args: str, tmp_path: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "run.py", *args, f"results_dir={tmp_path / 'results'}"],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(
    "override, expected",
    [
        ("polcy=full", "polcy=full: unknown setting polcy (did you mean policy=full?)"),
        ("foo=1", "foo=1: unknown setting foo; top-level settings and groups: budget, generation"),
        ("policy.nosuchkey=1", "policy.nosuchkey=1: unknown setting policy.nosuchkey; keys of policy: _target_,"),
        ("generation.max_length=0", "generation.max_length: must be an integer >= 1"),
    ],
)
def test_typo_or_bad_value_is_one_line_exit_2_and_writes_nothing(override, expected, tmp_path):
    r = _run_py("model=tiny", override, tmp_path=tmp_path)
    assert r.returncode == 2, r.stderr
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"error: {expected}"), r.stderr
    assert r.stdout == ""
    assert not (tmp_path / "results").exists()  # not even Hydra's output directory


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["model=tiny", "model.tiny.nosuchkey=1"], "to add a new key: +model.tiny.nosuchkey=1"),
        (["+generation.compil=on"], "generation.compil: unknown setting (did you mean generation.compile?)"),
        (["+foo=1"], "foo: unknown setting; top-level settings and groups: ratio,"),
        (["policy=quest", "policy.page_sze=8"], "(did you mean policy.page_size=8?)"),
        (["generation.max_lenght=5"], "(did you mean generation.max_length=5?)"),
        (["polcy.budget=3"], "(did you mean policy.budget=3?)"),
        (["hydra.run.dirr=x"], "(did you mean hydra.run.dir=x?)"),
        (["~foo"], "~foo: unknown setting foo"),
        (["+seed=1"], "+seed=1: seed already exists; drop the + (seed=1) or write ++seed=1"),
        (["seed.x=1"], "seed.x=1: seed is a single value"),
        (["foo=[1,"], "foo=[1,: cannot parse it"),
        (["polcy"], "polcy: cannot parse it"),
        (["policy=full,snapkv"], "a comma-separated value is a sweep; add -m"),
        (["-m", "generation.sync_every=2,0"], "generation.sync_every: must be an integer >= 1"),
        (["-m", "policy=full,snapkv", "generation.attn_backend=fooo"], "generation.attn_backend: unknown choice"),
        (["hydra/launcher=slurmm"], "hydra/launcher=slurmm: unknown hydra/launcher (did you mean slurm?)"),
    ],
)
def test_check_overrides_messages(argv, expected):
    msg = cli.check_group_choices(argv) or cli.check_overrides(argv)
    assert msg is not None and expected in msg and "\n" not in msg


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["model=tiny", "policy=quest", "policy.page_size=8"],
        ["+policy.extra=1"],
        ["++seed=3"],
        ["-m", "policy=full,snapkv", "generation.sync_every=1,16"],
        ["-m", "sweep=smoke"],
        ["hydra/launcher=local"],
        ["--help"],
        ["--cfg", "job", "seed=2"],
    ],
)
def test_good_command_lines_pass(argv):
    assert cli.check_group_choices(argv) is None
    assert cli.check_overrides(argv) is None


def test_summary_of_a_budget_free_policy_shows_no_budget(capsys):
    """§3: the full cache ignores the budget, so its summary must not say ``budget 128``."""
    from hydra import compose, initialize_config_dir

    metrics = {"task": "gsm_symbolic", "policy": "full", "budget": 128, "samples": 2}
    cli.print_summary(metrics, budget_free=True)
    out = capsys.readouterr().out
    assert "128" not in out and "none (the full cache keeps every token)" in out
    cli.print_summary({**metrics, "policy": "snapkv"})
    assert [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("budget")] == [
        ["budget", "128"]
    ]

    def budget_free(policy: str) -> bool:
        with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
            return cli._budget_free(compose(config_name="config", overrides=[f"policy={policy}"]))

    assert budget_free("full") and not budget_free("snapkv") and not budget_free("quest")
