"""The templates of docs/templates/ (what docs/adding-a-policy.md and the task guide show): copied where their first
line says, they are picked up by the shared tests and pass them.

Fast: each template, loaded from its file, takes the settings the guides promise (``policy.evict_every=8`` without a
``+``), answers the eviction contract over four calls with every row independent of its batch-mates, and the task
loads, describes itself and grades its own gold. Slow: a copy of the repository with both templates dropped in runs
the auto-discovered test matrices filtered to them (``-k 'my_policy or my_task'``), as a reader's ``make test`` would.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import OmegaConf

from tests.scaffold import run_scaffold

ROOT = Path(__file__).resolve().parents[1]
TEMPLATES = ROOT / "docs" / "templates"
POLICY, POLICY_YAML = TEMPLATES / "my_policy.py", TEMPLATES / "my_policy.yaml"
TASK, TASK_YAML = TEMPLATES / "my_task.py", TEMPLATES / "my_task.yaml"
# the shared matrices that discover conf/policy/*.yaml (tests/policy_configs.py) and conf/task/*.yaml
DISCOVERING = [
    "tests/test_policies.py", "tests/test_policy_authoring.py", "tests/test_gpu_path.py", "tests/test_continuous.py",
    "tests/test_engine.py", "tests/test_policies_e2e.py", "tests/test_tasks.py",
]  # fmt: skip


def destination(template: Path) -> str:
    """Where the template goes in a checkout: its first line, ``# <path>``."""
    first = template.read_text().splitlines()[0]
    assert first.startswith("# "), f"{template}: the first line must be '# <where it goes>'"
    return first[2:].strip()


def load_template(template: Path, monkeypatch: pytest.MonkeyPatch):
    """The template's module, imported under the name its destination gives it (``baselines.my_policy``)."""
    module = destination(template).removesuffix(".py").replace("/", ".")
    spec = importlib.util.spec_from_file_location(module, template)
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, module, mod)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def conf_with_templates(tmp_path: Path) -> Path:
    """A copy of conf/ with the two YAML templates where they go."""
    conf = tmp_path / "conf"
    shutil.copytree(ROOT / "conf", conf)
    for yaml in (POLICY_YAML, TASK_YAML):
        shutil.copyfile(yaml, tmp_path / destination(yaml))
    return conf


def test_templates_say_where_they_go():
    assert destination(POLICY) == "baselines/my_policy.py" and destination(POLICY_YAML) == "conf/policy/my_policy.yaml"
    assert destination(TASK) == "tasks/my_task.py" and destination(TASK_YAML) == "conf/task/my_task.yaml"
    assert OmegaConf.load(POLICY_YAML)._target_ == "baselines.my_policy.MyPolicy"
    assert OmegaConf.load(TASK_YAML)._target_ == "tasks.my_task.MyTask"


def test_policy_template_takes_the_settings_and_answers_the_contract(conf_with_templates, monkeypatch):
    load_template(POLICY, monkeypatch)
    with initialize_config_dir(config_dir=str(conf_with_templates), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[
            "policy=my_policy", "model=tiny", "budget=64", "window=16", "policy.evict_every=8",
            "policy.compress_prefill=true", "policy.keep_prompt=false", "policy.sinks=2",
        ])  # fmt: skip
    policy = instantiate(cfg.policy)
    assert (policy.evict_every, policy.compress_prefill, policy.sinks, policy.eviction_period) == (8, True, 2, 8)
    assert policy.kind == "eviction" and policy.name == "my_policy"
    calls = run_scaffold(policy, [100, 101, 102], h=2, hq=8, calls=4)
    alone = run_scaffold(instantiate(cfg.policy), [101], h=2, hq=8, calls=4)
    for call, solo in zip(calls, alone):
        idx = call.keep
        assert idx.shape == (3, 2, call.inputs.n_keep) and idx.dtype == torch.int64
        assert (idx.sort(dim=-1).values.diff(dim=-1) > 0).all()
        assert all((call.held_after == s).any(-1).all() for s in range(policy.sinks))
        assert torch.equal(idx[1:2], solo.keep)


def test_task_template_loads_describes_itself_and_grades_its_gold(conf_with_templates, monkeypatch):
    load_template(TASK, monkeypatch)
    with initialize_config_dir(config_dir=str(conf_with_templates), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["task=my_task", "model=tiny", "task.size=7"])
    task = instantiate(cfg.task)
    problems = task.load()
    assert len(problems) == 7 and len({p.id for p in problems}) == 7
    assert task.describe()["name"] == "my_task" and task.resolved_sources()
    grade = task.grade(problems[0], f"\\boxed{{{problems[0].answer}}}", thinking=False)
    assert grade.correct
    assert not task.grade(problems[0], f"\\boxed{{{int(problems[0].answer) + 1}}}", thinking=False).correct


@pytest.mark.slow
def test_templates_dropped_into_a_checkout_pass_the_discovered_tests(tmp_path):
    """A copy of the tracked tree with both templates where they go: the discovering matrices, filtered to them,
    collect them and pass (what failed for the README's KeyNorm: two tests, before docs/templates/)."""
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    tree = tmp_path / "tree"
    for f in files:
        if (ROOT / f).is_file():
            (tree / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / f, tree / f)
    for t in (POLICY, POLICY_YAML, TASK, TASK_YAML):
        shutil.copyfile(t, tree / destination(t))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(tree)}
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-k", "my_policy or my_task"]
    res = subprocess.run(cmd + DISCOVERING, cwd=tree, capture_output=True, text=True, env=env)
    tail = res.stdout[-3000:] + res.stderr[-2000:]
    assert res.returncode == 0, tail
    summary = res.stdout.strip().splitlines()[-1]
    assert " passed" in summary and "failed" not in summary, summary
    assert int(summary.split(" passed")[0].split()[-1]) >= 10, summary  # the matrices really collected them
