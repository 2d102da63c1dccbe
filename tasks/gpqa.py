"""GPQA-Diamond: 198 four-choice science questions, graded on the chosen letter.

Local data (``gpqa_diamond.jsonl``): the question already holds the choices ``A.`` to ``D.`` and the answer
instruction, and ``answer`` is the gold letter. In the ``../shared/data`` copy the gold letter is ``A`` for every
question (the correct answer is written first), so unshuffled it rewards a bias towards "A": ``shuffle_choices:
true`` (the config's default) re-shuffles the four options of each question and remaps the gold letter.

Hub data (``Idavidrein/gpqa``, config ``gpqa_diamond``, gated: accept its terms on the dataset page and set
``HF_TOKEN``): the correct and three incorrect answers are always shuffled and written in the local file's layout.

The shuffle is the same for both sources: it is seeded by ``seed`` and the question's text (whitespace-normalised),
not by an id (the local file numbers its rows, the hub has ``Record ID``), and it permutes a canonical order of the
options (the correct one, then the incorrect ones sorted by text), so the order the source lists them in does not
matter. A question read from either source gets the same options in the same order and the same gold letter.
"""

from __future__ import annotations

import hashlib
import random
import re
from dataclasses import dataclass
from typing import ClassVar

from tasks.base import Grade, Problem, Task
from tasks.grading import GRADER_RULES, extract_choice, extract_choice_last_boxed

LETTERS = "ABCD"
GPQA_INSTRUCTION = (
    "Please reason step-by-step and put your choice letter without any other text with \\boxed{} in the end."
)
# Pinned hub revision: the commit sha that other public evaluation code pins (docs/reproducibility.md).
GPQA_REVISION = "633f5ee89ab8ad4522a9f850766b73f62147ffdd"

_OPTION_RE = re.compile(r"^([A-D])\. (.*)$")


def format_question(question: str, options: list[str]) -> str:
    """The question, the lettered options and the instruction, in the local file's layout."""
    lines = "\n".join(f"{letter}. {text}" for letter, text in zip(LETTERS, options))
    return f"{question.strip()}\n\n{lines}\n\n{GPQA_INSTRUCTION}"


def split_options(prompt: str) -> tuple[str, list[str]] | None:
    """``(question, [option A..D])`` parsed back from a formatted prompt, or ``None`` if the layout differs."""
    body = prompt.split(GPQA_INSTRUCTION)[0].rstrip()
    lines = body.split("\n")
    starts = [i for i, line in enumerate(lines) if _OPTION_RE.match(line)]
    if len(starts) < 4:
        return None
    first = [i for i in starts if lines[i].startswith("A. ")]
    if not first:
        return None
    a = first[-1]
    blocks: list[list[str]] = []
    for line in lines[a:]:
        m = _OPTION_RE.match(line)
        if m and len(blocks) < 4 and m.group(1) == LETTERS[len(blocks)]:
            blocks.append([m.group(2)])
        elif blocks:
            blocks[-1].append(line)
    if len(blocks) != 4:
        return None
    return "\n".join(lines[:a]).rstrip(), ["\n".join(b).strip() for b in blocks]


def normalize_text(text: str) -> str:
    """``text`` with every run of whitespace collapsed to one space and the ends stripped."""
    return " ".join(str(text).split())


def canonical_options(options: list[str], correct: int) -> list[str]:
    """The correct option first, then the incorrect ones sorted by their normalised text."""
    wrong = [o for i, o in enumerate(options) if i != correct]
    return [options[correct]] + sorted(wrong, key=normalize_text)


def shuffle_key(question: str) -> str:
    """The shuffle's per-question key: a hash of the whitespace-normalised question text (no id)."""
    return hashlib.sha256(normalize_text(question).encode("utf-8")).hexdigest()[:16]


def shuffled(options: list[str], correct: int, seed: int, question: str) -> tuple[list[str], str]:
    """Deterministically shuffle ``options`` (seeded by ``seed`` and the question's text); returns them and the gold
    letter. The result depends only on the texts, not on the order of the incorrect options in ``options``."""
    canon = canonical_options(options, correct)
    order = list(range(len(canon)))
    random.Random(f"gpqa-{seed}-{shuffle_key(question)}").shuffle(order)
    return [canon[i] for i in order], LETTERS[order.index(0)]


@dataclass
class GPQADiamond(Task):
    """GPQA-Diamond multiple choice; ``answer`` is the gold letter, ``meta["options"]`` the option texts."""

    name: str = "gpqa_diamond"
    shuffle_choices: bool = False
    seed: int = 0
    local_file: ClassVar[str] = "gpqa_diamond.jsonl"
    row_fields: ClassVar[tuple[str, ...]] = ("question", "answer")
    pins: ClassVar[dict[str, str]] = {"": GPQA_REVISION}
    grader_rules: ClassVar[tuple[str, ...]] = GRADER_RULES

    def problem_from_row(self, row: dict, index: int) -> Problem:
        """Local row: ``id``, ``question`` (formatted), ``answer`` (letter)."""
        pid, prompt, gold = str(row.get("id", index)), row["question"], str(row["answer"]).strip().upper()
        parsed = split_options(prompt)
        options = parsed[1] if parsed else None
        if self.shuffle_choices:
            if parsed is None:
                raise ValueError(f"task {self.name}: cannot find options A-D in question {pid} to shuffle")
            new_options, gold = shuffled(parsed[1], LETTERS.index(gold), self.seed, parsed[0])
            prompt, options = format_question(parsed[0], new_options), new_options
        return Problem(pid, prompt, gold, {"options": options})

    def hub_problem(self, row: dict, index: int) -> Problem:
        """Hub row: ``Question``, ``Correct Answer``, ``Incorrect Answer 1..3``, ``Record ID``."""
        pid = str(row.get("Record ID") or index)
        options = [row["Correct Answer"]] + [row[f"Incorrect Answer {k}"] for k in (1, 2, 3)]
        options = [str(o).strip() for o in options]
        new_options, gold = shuffled(options, 0, self.seed, row["Question"])
        return Problem(pid, format_question(row["Question"], new_options), gold, {"options": new_options})

    def load_hub(self) -> list[Problem]:
        """Config ``gpqa_diamond``, split ``train`` (its only split)."""
        return self.hub_rows("Idavidrein/gpqa", "gpqa_diamond", "train", self.revision_of(), self.hub_problem)

    def hub_sources(self) -> list[dict]:
        """``Idavidrein/gpqa``, config ``gpqa_diamond``, split ``train`` (gated)."""
        return [
            {"dataset": "Idavidrein/gpqa", "config": "gpqa_diamond", "split": "train", "revision": self.revision_of()}
        ]

    def describe(self) -> dict:
        """Source plus the shuffling settings."""
        return {
            **super().describe(),
            "shuffle_choices": self.shuffle_choices or self.data_dir is None,
            "shuffle_seeded_by": "seed and the question text",
            "seed": self.seed,
        }

    def grade(self, problem: Problem, output: str, thinking: bool | None = None) -> Grade:
        """The chosen letter (boxed or stated, ``strict``; the last ``boxed`` anywhere, ``last_boxed`` in
        ``Grade.rules``) against the gold letter."""
        think = self.thinking if thinking is None else thinking
        gold = str(problem.answer).upper()
        letter, truncated = extract_choice(output, think, LETTERS, problem.meta.get("options"))
        if truncated:
            strict = Grade(None, False, True, "truncated")
        elif letter is None:
            strict = Grade(None, False, False, "no_choice")
        else:
            strict = Grade(letter, letter == gold, False, "" if letter == gold else "wrong_answer")
        letter, truncated = extract_choice_last_boxed(output, think, LETTERS)
        if letter is None:
            last = Grade(None, False, truncated, "no_choice")
        else:
            last = Grade(letter, letter == gold, truncated, "" if letter == gold else "wrong_answer")
        rules = {"strict": strict, "last_boxed": last}
        return Grade(strict.extracted, strict.correct, strict.truncated, strict.detail, rules=rules)
