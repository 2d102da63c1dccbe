# tasks/my_task.py
import hashlib
import json
import random
from dataclasses import dataclass

from tasks.base import Problem
from tasks.math_tasks import MathTask


@dataclass
class MyTask(MathTask):
    """``size`` additions of two numbers below 1000, generated from ``seed`` (nothing to download); graded like the
    math tasks: the last ``\\boxed{}`` answer, checked with math-verify."""

    name: str = "my_task"
    seed: int = 0
    size: int = 5

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.data_dir is not None:
            raise ValueError("task.data_dir: not used by my_task (its problems are generated); leave it null")
        if self.size < 1:
            raise ValueError(f"task.size: must be >= 1, got {self.size}")

    def load_all(self) -> list[Problem]:
        """Every problem, in a fixed order; ids stay the same for the same seed."""
        rng = random.Random(self.seed)
        out = []
        for i in range(self.size):
            a, b = rng.randrange(1000), rng.randrange(1000)
            out.append(Problem(f"{self.seed}-{i}", self.make_prompt(f"What is {a} + {b}?"), str(a + b)))
        content = json.dumps([[p.id, p.prompt, p.answer] for p in out])
        self.record_source({"generator": "my_task", "seed": self.seed, "size": self.size,
                            "sha256": hashlib.sha256(content.encode()).hexdigest()})  # fmt: skip
        return out
