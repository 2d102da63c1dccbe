"""protocol.equivalence=authors is the authors' ``check_is_correct`` branch for branch (tasks/authors_grader.py).

The expected columns are what their code (terarachang/VaSE ``eval/reasoning_tasks/Utils/grader.py`` and
``parser.py``, run in a separate environment with their dependencies: sympy 1.14, latex2sympy2 1.9.1 on ANTLR 4.7.2,
word2number 1.1, regex) returned for each pair: ``strip_string(pred)``, ``strip_string(gold)`` and
``check_is_correct(pred, gold)``. The cases walk their branches in order (string, choice letter, choice marker, comma
split, numbers with the x100 and /100 rule, brackets, tuples, matrices, equations, symbolic), their normalisation's
traps (units such as a lone ``a`` or ``cm`` removed, word numbers, percent, degrees, months) and a string that would
run code through sympy's ``parse_expr``.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest

from tasks.authors_grader import UNIT_TEXTS, authors_strip, check_is_correct, math_equal_authors, parse_digits
from tasks.grading import answer_equal

SHARED = Path(os.environ.get("VASE_SHARED_DATA", Path(__file__).resolve().parents[1].parent / "shared" / "data"))

# (pred, gold, their strip_string(pred), their strip_string(gold), their check_is_correct(pred, gold))
THEIRS = [
    ("Yes", "yes", "Yes", "yes", True),
    ("B", "B", "B", "B", True),
    ("The answer is (B)", "B", "Theansweris(B)", "B", True),
    ("(C)", "B", "(C)", "B", False),
    ("A. 7", "7", "A.7", "7", True),
    ("**C** 12", "12", "**C**12", "12", True),
    ("B: 4", "4", "B:4", "4", True),
    ("D) 9", "9", "D)9", "9", True),
    ("3, 1, 2", "1,2,3", "3,1,2", "1,2,3", True),
    ("3, 1", "1,2,3", "3,1", "1,2,3", False),
    ("0.5", "50", "0.5", "50", True),
    ("5000", "50", "5000", "50", True),
    ("50", "0.5", "50", "0.5", True),
    ("3.00005", "3", "3.00005", "3", True),
    ("3.001", "3", "3.001", "3", False),
    ("1,000", "1000", "1,000", "1000", True),
    ("10", "10.5", "10", "10.5", False),
    ("51", "50", "51", "50", False),
    ("2", "\\frac{4}{2}", "2", "\\frac{4}{2}", True),
    ("0.3333", "1/3", "0.3333", "\\frac{1}{3}", True),
    ("\\frac{1}{3}", "1/3", "\\frac{1}{3}", "\\frac{1}{3}", True),
    ("\\dfrac12", "\\frac{1}{2}", "\\frac{1}{2}", "\\frac{1}{2}", True),
    ("[1,2]", "(1,2)", "[1,2]", "(1,2)", True),
    ("[1,2]", "[2,1]", "[1,2]", "[2,1]", False),
    ("(1, \\frac{1}{2})", "(1, 0.5)", "(1,\\frac{1}{2})", "(1,0.5)", True),
    ("(1,2)", "(2,1)", "(1,2)", "(2,1)", False),
    (
        "\\begin{pmatrix}1\\\\2\\end{pmatrix}",
        "\\begin{pmatrix}1\\\\2.0\\end{pmatrix}",
        "\\begin{pmatrix}1\\\\2\\end{pmatrix}",
        "\\begin{pmatrix}1\\\\2\\end{pmatrix}",
        True,
    ),
    (
        "\\begin{bmatrix}1&2\\\\3&4\\end{bmatrix}",
        "\\begin{pmatrix}1&2\\\\3&5\\end{pmatrix}",
        "\\begin{pmatrix}1&2\\\\3&4\\end{pmatrix}",
        "\\begin{pmatrix}1&2\\\\3&5\\end{pmatrix}",
        False,
    ),
    ("y = 2x+1", "y=1+2x", "2x+1", "1+2x", True),
    ("2x+1=y", "y=1+2x", "2x+1=y", "1+2x", False),
    ("x=5", "5", "5", "5", True),
    ("k = 5", "5", "5", "5", True),
    ("5", "n=5", "5", "5", True),
    ("\\sqrt{4}", "2", "\\sqrt{4}", "2", True),
    ("2\\pi", "\\pi*2", "2\\pi", "\\pi*2", True),
    ("x^2-1", "(x-1)(x+1)", "x^2-1", "(x-1)(x+1)", True),
    ("\\sqrt2", "\\sqrt{2}", "\\sqrt{2}", "\\sqrt{2}", True),
    ("five", "5", "5", "5", True),
    ("two apples", "2", "2", "2", True),
    ("5 cm", "5", "5", "5", True),
    ("10\\text{ dollars}", "10", "10", "10", True),
    ("50\\%", "50", "50", "50", True),
    ("50\\%", "0.5", "50", "0.5", True),
    ("90^\\circ", "90", "90", "90", True),
    ("a", "b", "a", "b", False),
    ("", "5", "", "5", False),
    ("\\infty", "inf", "\\infty", "\\infty", True),
    ("-\\infty", "-infinity", "-\\infty", "-\\infty", True),
    ("\\{1,2\\}", "{1,2}", "{1,2}", "{1,2}", True),
    ("\\emptyset", "{}", "{}", "{}", True),
    ("(-\\infty,\\infty)", "\\mathbb{R}", "\\mathbb{R}", "\\mathbb{R}", True),
    ("March 5", "5", "5", "5", True),
    (".5", "0.5", "0.5", "0.5", True),
    ("3.0", "3", "3", "3", True),
    ("\\left(1,2\\right)", "(1,2)", "(1,2)", "(1,2)", True),
    ("x \\leq 3", "x \\le 3", "x\\le3", "x\\le3", True),
    ("__import__('os').getcwd()", "1", "__import__('').getcwd()", "1", False),
    ("1/2", "\\frac{1}{2}", "\\frac{1}{2}", "\\frac{1}{2}", True),
    ("\\frac{\\sqrt{3}}{2}", "\\sqrt{3}/2", "\\frac{\\sqrt{3}}{2}", "\\frac{\\sqrt{3}}{2}", True),
    ("12\\text{ cm}^2", "12", "12^2", "12", False),
    ("2, 3", "3, 2", "2,3", "3,2", True),
    ("\\text{(A)}", "A", "(A)", "A", True),
    ("E", "e", "E", "e", True),
    ("3+2i", "3+2j", "3+2i", "3+2i", True),
    ("1e3", "1000", "1e3", "1000", True),
    ("10^{3}", "1000", "10^{3}", "1000", True),
    ("\\pi", "3.14159", "\\pi", "3.14159", True),
    ("\\pi", "3.1416", "\\pi", "3.1416", True),
    ("None", "0", "None", "0", False),
]


@pytest.mark.parametrize(("pred", "gold", "pred_stripped", "gold_stripped", "correct"), THEIRS)
def test_check_is_correct_equals_the_authors_code(pred, gold, pred_stripped, gold_stripped, correct) -> None:
    assert authors_strip(pred) == pred_stripped
    assert authors_strip(gold) == gold_stripped
    assert check_is_correct(pred, gold) is correct
    assert answer_equal(gold, pred, "authors") is correct


def test_the_table_covers_true_and_false_in_every_branch_family() -> None:
    """The table is not one-sided: each family of branches has a right and a wrong pair."""
    verdicts = [row[4] for row in THEIRS]
    assert 10 <= verdicts.count(False) and 10 <= verdicts.count(True)


def test_two_numbers_that_fail_the_numeric_rule_are_wrong_without_a_symbolic_check() -> None:
    """Their branch 5 returns False for two numbers outside 1e-4 of gold / 100, gold and gold x 100, where math-verify
    (the harness's rule) and a symbolic check could say otherwise (e.g. ``1e3`` against ``1000.0001``)."""
    assert math_equal_authors("1000.001", "1000", timeout=False) is False
    assert math_equal_authors("0.5", "50", timeout=False) is True
    assert math_equal_authors("5000", "50", timeout=False) is True


def test_parse_digits_and_the_unit_list_are_theirs() -> None:
    assert [parse_digits(t) for t in ("1,000", "50%", "50\\%", "-2.5", "1/2", "x")] == [
        1000.0,
        0.5,
        0.5,
        -2.5,
        None,
        None,
    ]
    assert len(UNIT_TEXTS) == 2 * 132 and UNIT_TEXTS[0] == "east" and UNIT_TEXTS[-1] == "inchs"


def test_no_box_is_wrong() -> None:
    assert check_is_correct(None, "5") is False


#: their check_is_correct on 360 pairs built from ../shared/data/math500.jsonl's first 120 answers (each answer against
#: itself, itself without spaces, and a seeded random other answer): "1" for True
MATH500_THEIRS = (
    "110110110110110111110110110110110110110110110110110110110110110110110110110110110110110110"
    "110110110110110110110110110110110110110110110110110110110110110110110110110110111110110110"
    "110110110110110110110110110110110110110110110110110110110110110110110110110110110110110110"
    "110110110110110110110110110110110110110110110110110110110110110110110110110110110110110110"
)


def test_check_is_correct_equals_the_authors_code_on_math500_answers() -> None:
    path = SHARED / "math500.jsonl"
    if not path.is_file():
        pytest.skip("no ../shared/data/math500.jsonl")
    golds = [str(json.loads(line)["answer"]) for line in path.read_text().splitlines()[:120]]
    rng = random.Random(0)
    pairs = [pair for g in golds for pair in ((g, g), (g.replace(" ", ""), g), (rng.choice(golds), g))]
    mine = "".join("1" if check_is_correct(p, g) else "0" for p, g in pairs)
    assert mine == MATH500_THEIRS
