"""Math tasks graded on the last ``\\boxed{}`` answer: AIME 2025/2026, HMMT 2025, MATH-500, GSM8K, gsm_symbolic.

Prompts follow the paper: competition math gets ``problem + MATH_SUFFIX``; GSM8K and its offline stand-in
``gsm_symbolic`` get ``question + GSM_SUFFIX``.

``task=aime`` is AIME 2025 and AIME 2026 together (60 problems, ids ``"2025-<id>"`` / ``"2026-<id>"``, ``meta["year"]``
for the per-year breakdown, see :func:`vase.run.metrics.pass_at_1_by_group`); ``task=aime25`` / ``task=aime26`` are one
year each with the dataset's own ids.

Hub revisions are pinned to commit shas through the ``*_REVISION`` constants (the same values as
``conf/task/*.yaml``; where they come from and how to check them: ``docs/reproducibility.md``); ``task.revision``
overrides them. The MathArena HMMT sets have no known sha yet: they load ``main`` with a warning, and the commit it
resolved to is recorded in the run's ``resolved.json`` so it can be pinned.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from tasks.base import Grade, Problem, Task
from tasks.grading import EQUIVALENCES, GRADER_RULES, answer_equal, extract_answer, math_equal_many

logger = logging.getLogger(__name__)

MATH_SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."
GSM_SUFFIX = " Put your final answer within \\boxed{}."

# Pinned hub revisions: the commit shas that other public evaluation code pins (docs/reproducibility.md).
AIME25_REVISION = "563bb8404243c5f09de6ec262f2db674fe5bce9b"
AIME26_REVISION = "79037aebdb6580008fb960d17cb21fd3099083e3"
MATH500_REVISION = "6e4ed1a2a79af7d8630a6b768ec859cb5af4d3be"
GSM8K_REVISION = "740312add88f781978c0658806c59bc2815b9866"
# No sha known for the MathArena HMMT sets: "main", resolved and recorded at load time (pin it from resolved.json).
HMMT_FEB_2025_REVISION = "main"
HMMT_NOV_2025_REVISION = "main"


@dataclass
class MathTask(Task):
    """A task whose gold is a math expression and whose output ends with ``\\boxed{answer}``.

    Attributes:
        equivalence: ``math_verify`` (the harness) or ``authors`` (the authors' ``check_is_correct`` branch for
            branch, :mod:`tasks.authors_grader`: e.g. gold x 100 and gold / 100 accepted; ``protocol=paper``), for
            both grader rules.
    """

    equivalence: str = "math_verify"
    prompt_suffix: ClassVar[str] = MATH_SUFFIX
    grader_rules: ClassVar[tuple[str, ...]] = GRADER_RULES

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.equivalence not in EQUIVALENCES:
            raise ValueError(
                f"task.equivalence: must be one of {', '.join(EQUIVALENCES)}, got {self.equivalence!r}; e.g. "
                "protocol.equivalence=authors (the authors' check_is_correct)"
            )

    def make_prompt(self, problem_text: str) -> str:
        """The user message: the problem followed by the task's instruction."""
        return problem_text.strip() + self.prompt_suffix

    def grade(self, problem: Problem, output: str, thinking: bool | None = None) -> Grade:
        """The last boxed answer after ``</think>`` (``strict``), and the last ``boxed`` anywhere (``last_boxed``, in
        ``Grade.rules``), each checked with math-verify against the gold."""
        return self.grade_many([(problem, output)], thinking)[0]

    def grade_many(self, items: list[tuple[Problem, str]], thinking: bool | None = None) -> list[Grade]:
        """Like :meth:`grade` for each item; the math-verify checks run with timeouts (worker processes when this
        is not the main thread), once per distinct (gold, answer) pair."""
        think = self.thinking if thinking is None else thinking
        found = {rule: [extract_answer(out, think, rule) for _, out in items] for rule in self.grader_rules}
        pairs = sorted(
            {(str(items[i][0].answer), ans) for rule in found for i, (ans, _) in enumerate(found[rule]) if ans},
        )
        verdicts = dict(zip(pairs, math_equal_many(pairs, equivalence=self.equivalence)))
        grades = []
        for i, (problem, _) in enumerate(items):
            by_rule = {}
            for rule in self.grader_rules:
                ans, trunc = found[rule][i]
                if rule == "strict" and trunc:
                    by_rule[rule] = Grade(None, False, True, "truncated")
                elif ans is None:
                    by_rule[rule] = Grade(None, False, trunc, "no_box")
                else:
                    ok = answer_equal(str(problem.answer), ans, self.equivalence, verdicts[(str(problem.answer), ans)])
                    by_rule[rule] = Grade(ans, ok, trunc, "" if ok else "wrong_answer")
            top = by_rule["strict"]
            grades.append(Grade(top.extracted, top.correct, top.truncated, top.detail, rules=by_rule))
        return grades


@dataclass
class AIME25(MathTask):
    """AIME 2025 (30 problems), hub ``math-ai/aime25`` or ``aime25.jsonl``."""

    name: str = "aime25"
    local_file: ClassVar[str] = "aime25.jsonl"
    row_fields: ClassVar[tuple[str, ...]] = ("problem", "answer")
    hub_id: ClassVar[str] = "math-ai/aime25"
    pins: ClassVar[dict[str, str]] = {"": AIME25_REVISION}
    year: ClassVar[int] = 2025

    def problem_from_row(self, row: dict, index: int) -> Problem:
        """Fields ``problem``, ``answer``, ``id``."""
        pid = str(row.get("id", index))
        return Problem(pid, self.make_prompt(row["problem"]), str(row["answer"]).strip(), {"year": self.year})

    def load_hub(self) -> list[Problem]:
        """Split ``test`` of the pinned revision."""
        return self.hub_rows(self.hub_id, None, "test", self.revision_of(), self.problem_from_row)

    def hub_sources(self) -> list[dict]:
        """``math-ai/aime2x``, split ``test``."""
        return [{"dataset": self.hub_id, "config": None, "split": "test", "revision": self.revision_of()}]


@dataclass
class AIME26(AIME25):
    """AIME 2026 (30 problems), hub ``math-ai/aime26`` or ``aime26.jsonl``."""

    name: str = "aime26"
    local_file: ClassVar[str] = "aime26.jsonl"
    hub_id: ClassVar[str] = "math-ai/aime26"
    pins: ClassVar[dict[str, str]] = {"": AIME26_REVISION}
    year: ClassVar[int] = 2026


@dataclass
class AIME(MathTask):
    """AIME 2025 + 2026 (60 problems); ids ``"<year>-<id>"`` and ``meta["year"]`` for a per-year breakdown."""

    name: str = "aime"
    years: list[int] = field(default_factory=lambda: [2025, 2026])
    pins: ClassVar[dict[str, str]] = {"aime25": AIME25_REVISION, "aime26": AIME26_REVISION}

    def __post_init__(self) -> None:
        super().__post_init__()
        self.years = [int(y) for y in self.years]
        unknown = [y for y in self.years if y not in _AIME_BY_YEAR]
        if unknown or not self.years:
            raise ValueError(f"task.years: must be a non-empty subset of {sorted(_AIME_BY_YEAR)}, got {self.years}")

    def year_task(self, year: int) -> AIME25:
        """The one-year task of ``year``, with this task's data_dir and that year's revision."""
        return _AIME_BY_YEAR[year](data_dir=self.data_dir, revision=self.revision_of(f"aime{year % 100}"))

    def hub_sources(self) -> list[dict]:
        """One entry per year."""
        return [src for year in self.years for src in self.year_task(year).hub_sources()]

    def describe(self) -> dict:
        """Per-year sources (each year has its own local file)."""
        return {
            **super().describe(),
            "years": list(self.years),
            "parts": [self.year_task(y).describe() for y in self.years],
        }

    def load_all(self) -> list[Problem]:
        """Each year's problems in order, years in the configured order."""
        out = []
        for year in self.years:
            sub = self.year_task(year)
            for p in sub.load_all():
                out.append(Problem(f"{year}-{p.id}", p.prompt, p.answer, {**p.meta, "year": year}))
            for src in sub._resolved:
                self.record_source(src)
        return out


_AIME_BY_YEAR: dict[int, type[AIME25]] = {2025: AIME25, 2026: AIME26}


@dataclass
class HMMT25(MathTask):
    """HMMT February 2025 + November 2025 (60 problems), hub ``MathArena/hmmt_{feb,nov}_2025`` or ``hmmt25.jsonl``.

    Ids are positions in the concatenation (February first), as in the local file.
    """

    name: str = "hmmt25"
    local_file: ClassVar[str] = "hmmt25.jsonl"
    row_fields: ClassVar[tuple[str, ...]] = ("problem", "answer")
    hub_parts: ClassVar[tuple[tuple[str, str], ...]] = (
        ("MathArena/hmmt_feb_2025", "feb"),
        ("MathArena/hmmt_nov_2025", "nov"),
    )
    pins: ClassVar[dict[str, str]] = {"feb": HMMT_FEB_2025_REVISION, "nov": HMMT_NOV_2025_REVISION}

    def problem_from_row(self, row: dict, index: int) -> Problem:
        """Fields ``problem``, ``answer``, ``id``."""
        return Problem(str(row.get("id", index)), self.make_prompt(row["problem"]), str(row["answer"]).strip(), {})

    def hub_sources(self) -> list[dict]:
        """February then November."""
        return [
            {"dataset": d, "config": None, "split": "train", "revision": self.revision_of(part)}
            for d, part in self.hub_parts
        ]

    def load_hub(self) -> list[Problem]:
        """Split ``train`` of both competitions, February first."""
        out: list[Problem] = []
        for dataset, part in self.hub_parts:
            for row in self.hub_rows(dataset, None, "train", self.revision_of(part), lambda row, _: row, part):
                answer = str(row["answer"]).strip()
                out.append(Problem(str(len(out)), self.make_prompt(row["problem"]), answer, {"competition": part}))
        return out


@dataclass
class MATH500(MathTask):
    """MATH-500, hub ``HuggingFaceH4/MATH-500`` or ``math500.jsonl``; ids are the ``unique_id`` paths."""

    name: str = "math500"
    local_file: ClassVar[str] = "math500.jsonl"
    row_fields: ClassVar[tuple[str, ...]] = ("problem", "answer")
    pins: ClassVar[dict[str, str]] = {"": MATH500_REVISION}

    def problem_from_row(self, row: dict, index: int) -> Problem:
        """Fields ``problem``, ``answer``, ``subject``, ``level``, ``unique_id``."""
        meta = {"subject": row.get("subject"), "level": row.get("level")}
        return Problem(str(row.get("unique_id", index)), self.make_prompt(row["problem"]), str(row["answer"]), meta)

    def load_hub(self) -> list[Problem]:
        """Split ``test`` of the pinned revision."""
        return self.hub_rows("HuggingFaceH4/MATH-500", None, "test", self.revision_of(), self.problem_from_row)

    def hub_sources(self) -> list[dict]:
        """``HuggingFaceH4/MATH-500``, split ``test``."""
        return [{"dataset": "HuggingFaceH4/MATH-500", "config": None, "split": "test", "revision": self.revision_of()}]


def gsm8k_gold(answer: str) -> str:
    """The final answer of a GSM8K solution: the text after ``####``, without thousands separators."""
    return answer.split("####")[-1].strip().replace(",", "")


@dataclass
class GSM8K(MathTask):
    """GSM8K test split (the paper's pilot uses the first 500: ``limit: 500`` in the config).

    Hub ``openai/gsm8k`` config ``main``, or ``gsm8k.jsonl`` in ``data_dir`` with the hub's fields ``question`` and
    ``answer`` (gold after ``####``) and an optional ``id``. Ids are ``"test-<index>"``.
    """

    name: str = "gsm8k"
    max_length: int = 4096
    local_file: ClassVar[str] = "gsm8k.jsonl"
    row_fields: ClassVar[tuple[str, ...]] = ("question", "answer")
    pins: ClassVar[dict[str, str]] = {"": GSM8K_REVISION}
    prompt_suffix: ClassVar[str] = GSM_SUFFIX

    def problem_from_row(self, row: dict, index: int) -> Problem:
        """Fields ``question``, ``answer``."""
        pid = str(row.get("id", f"test-{index}"))
        return Problem(pid, self.make_prompt(row["question"]), gsm8k_gold(str(row["answer"])), {})

    def load_hub(self) -> list[Problem]:
        """Split ``test`` of config ``main``."""
        return self.hub_rows("openai/gsm8k", "main", "test", self.revision_of(), self.problem_from_row)

    def hub_sources(self) -> list[dict]:
        """``openai/gsm8k``, config ``main``, split ``test``."""
        return [{"dataset": "openai/gsm8k", "config": "main", "split": "test", "revision": self.revision_of()}]


@dataclass
class GSMSymbolic(MathTask):
    """Offline stand-in for GSM8K: ``gsm_symbolic`` problems from ``reasoning-gym``, generated from ``seed``/``size``.

    The same seed and size always give the same problems in the same order; ids are ``"<seed>-<index>"``. Nothing is
    downloaded, so ``data_dir`` is not used (setting it is an error).
    """

    name: str = "gsm_symbolic"
    max_length: int = 4096
    thinking: bool = False
    seed: int = 42
    size: int = 100
    prompt_suffix: ClassVar[str] = GSM_SUFFIX

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.data_dir is not None:
            raise ValueError("task.data_dir: not used by gsm_symbolic (its problems are generated); leave it null")
        if self.size < 1:
            raise ValueError(f"task.size: must be >= 1, got {self.size}")

    def load_all(self) -> list[Problem]:
        """Generate ``size`` problems from ``seed``."""
        import reasoning_gym

        data = reasoning_gym.create_dataset("gsm_symbolic", seed=self.seed, size=self.size)
        out = []
        for i in range(self.size):
            item = data[i]
            meta = {"difficulty": item.get("metadata", {}).get("difficulty")}
            out.append(Problem(f"{self.seed}-{i}", self.make_prompt(item["question"]), str(item["answer"]), meta))
        content = json.dumps([[p.id, p.prompt, p.answer] for p in out], ensure_ascii=False)
        self.record_source(
            {
                "generator": "reasoning_gym gsm_symbolic",
                "seed": self.seed,
                "size": self.size,
                "sha256": hashlib.sha256(content.encode()).hexdigest(),  # of every generated problem
            }
        )
        return out

    def describe(self) -> dict:
        """The generator and its parameters (and after :meth:`load`, ``resolved``: the problems' sha256)."""
        import reasoning_gym

        out = {
            "name": self.name,
            "task_class": f"{type(self).__module__}.{type(self).__qualname__}",
            "generator": "reasoning_gym gsm_symbolic",
            "reasoning_gym": getattr(reasoning_gym, "__version__", None),
            "seed": self.seed,
            "size": self.size,
        }
        if self._loaded:
            out["resolved"] = self.resolved_sources()
        return out

    def load_local(self, data_dir: Path) -> list[Problem]:  # pragma: no cover - data_dir is rejected
        """Not used."""
        raise ValueError("task.data_dir: not used by gsm_symbolic")
