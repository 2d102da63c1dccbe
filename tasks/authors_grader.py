"""The authors' answer check, branch for branch: ``protocol.equivalence=authors`` (``protocol=paper``).

terarachang/VaSE grades a math answer with ``check_is_correct(pred, gold)`` (``eval/reasoning_tasks/Utils/grader.py``):
both sides pass through ``strip_string`` (``Utils/parser.py``), then ``math_equal(pred, gold)`` tries, in order,

1. case-insensitive string equality;
2. a multiple-choice letter (``choice_answer_clean``) when the gold is one of ``A``-``E``;
3. a leading choice marker (``(A)``, ``A.``, ``A)``, ``**A**``, ``A:``) removed, recursively;
4. both sides split at commas into as many parts: the sorted parts equal one by one, recursively;
5. both sides numbers (``parse_digits``): the prediction within 1e-4 of gold / 100, gold or gold x 100, and if not,
   **False at once** (no symbolic check of two numbers);
6. an empty prediction: False;
7. brackets: ``[..]``/``(..)`` stripped on both sides and every brace and parenthesis dropped, then a
   case-insensitive comparison;
8. ``(a, b)`` against ``(c, d)``: part by part, recursively;
9. ``pmatrix``/``bmatrix`` against each other: row by row, cell by cell, recursively;
10. equations: ``a = b`` against ``c = d`` as ``a - (b)`` against ``c - (d)`` or its negation (symbolically); or a
    short ``x = v`` on one side against a value on the other, recursively;
11. symbolic equality under a 3-second limit (``symbolic_equal``): each side parsed by the first of their parsers that
    accepts it, then string or structural equality, ``simplify(a - b) == 0``, equal equations, numeric equality within
    1e-4, or equal matrices rounded to 3 places.

Recursion stops at depth 5 (False). This module follows those branches in that order (rewritten, not copied; the
table test in ``tests/test_authors_grader.py`` takes its cases from their code's branches).

One deviation, forced by the environment: their parser chain is ``[sympy parse_latex, parse_expr, latex2sympy2]``.
sympy's ``parse_latex`` needs ANTLR 4.11 and their ``latex2sympy2`` pins ANTLR 4.7.2, so in their environment
``parse_latex`` always raises ``ImportError`` and the chain is really ``[parse_expr, latex2sympy2]``. Here it is
``[parse_expr, latex2sympy2_extended]`` (the maintained fork of the same grammar that math-verify ships, running on
the ANTLR 4.9 that Hydra needs), with its own normalisation switched off. A LaTeX expression that the two grammars
read differently can be graded differently; the string, numeric and structural branches are theirs exactly.
"""

from __future__ import annotations

import logging
import math
import re
import signal
import threading
from collections.abc import Callable
from contextlib import contextmanager
from typing import Any

logger = logging.getLogger(__name__)

#: their limit on one symbolic check (``call_with_timeout(..., timeout=3)``)
SYMBOLIC_TIMEOUT_S = 3
#: their recursion limit (``max_depth=5``)
MAX_DEPTH = 5

# --------------------------------------------------------------------------------------------------------------------
# strip_string (Utils/parser.py)

#: units removed as whole words (``unit_texts``: MathQA's units; each also with an ``s`` appended). Their list, in
#: their order (the order matters: each removal sees the previous ones' result).
_UNITS_BASE = (
    "east|degree|mph|kmph|ft|m sqaure| m east|sq m|deg|mile|q .|monkey|prime|ratio|profit of rs|rd|o|gm|p . m|lb|"
    "tile|per|dm|lt|gain|ab|way|west|a .|b .|c .|d .|e .|f .|g .|h .|t|a|h|no change|men|soldier|pie|bc|excess|st|"
    "inches|noon|percent|by|gal|kmh|c|acre|rise|a . m|th|π r 2|sq|mark|l|toy|coin|sq . m|gallon|° f|profit|minw|yr|"
    "women|feet|am|pm|hr|cu cm|square|v â € ™|are|rupee|rounds|cubic|cc|mtr|s|ohm|number|kmph|day|hour|minute|min|"
    "second|man|woman|sec|cube|mt|sq inch|mp|∏ cm ³|hectare|more|sec|unit|cu . m|cm 2|rs .|rs|kg|g|month|km|m|cm|mm|"
    "apple|liter|loss|yard|pure|year|increase|decrease|d|less|Surface|litre|pi sq m|s .|metre|meter|inch"
).split("|")
UNIT_TEXTS: tuple[str, ...] = (*_UNITS_BASE, *(u + "s" for u in _UNITS_BASE))

_MONTHS_RE = re.compile(
    r"\b(January|February|March|April|May|June|July|August|September|October|November|December)\b", re.IGNORECASE
)


def _fix_fracs(s: str) -> str:
    r"""``\frac12`` -> ``\frac{1}{2}``, ``\frac1{72}`` -> ``\frac{1}{72}``; unchanged when a ``\frac`` has fewer than
    two characters after it."""
    head, *rest = s.split("\\frac")
    out = [head]
    for part in rest:
        out.append("\\frac")
        if part.startswith("{"):
            out.append(part)
            continue
        if len(part) < 2:
            return s
        a, b, tail = part[0], part[1], part[2:]
        out.append("{" + a + "}" + (b + tail if b == "{" else "{" + b + "}" + tail))
    return "".join(out)


def _fix_a_slash_b(s: str) -> str:
    r"""``3/4`` -> ``\frac{3}{4}`` when both sides are integers written plainly (or contain ``sqrt``)."""
    parts = s.split("/")
    if len(parts) != 2:
        return s
    a, b = parts
    try:
        a_v: Any = a if "sqrt" in a else int(a)
        b_v: Any = b if "sqrt" in b else int(b)
    except ValueError:
        return s
    if s != f"{a_v}/{b_v}":
        return s
    return "\\frac{" + str(a_v) + "}{" + str(b_v) + "}"


def _word_number(s: str) -> str:
    """``word2number``'s reading of the whole answer (any number word in it turns it into that number), as theirs."""
    from word2number import w2n

    try:
        return str(w2n.word_to_num(s))
    except Exception:  # their bare except: anything w2n cannot read stays as it is
        return s


def authors_strip(text: Any) -> str:
    """Their ``strip_string``: the normalisation both the prediction and the gold go through before comparison."""
    s = str(text).strip().replace("\n", "").rstrip(".").replace("\\!", "")
    s = re.sub(r"\\begin\{array\}\{.*?\}", r"\\begin{pmatrix}", s)
    s = re.sub(r"\\end\{array\}", r"\\end{pmatrix}", s)
    s = s.replace("bmatrix", "pmatrix").replace("tfrac", "frac").replace("dfrac", "frac")
    s = s.replace("\\neq", "\\ne").replace("\\leq", "\\le").replace("\\geq", "\\ge")
    s = s.replace("\\left", "").replace("\\right", "").replace("\\{", "{").replace("\\}", "}")
    without_unit = re.sub(r"\\text{.*?}$", "", s).strip()
    if without_unit and without_unit != s:
        s = without_unit
    for unit in UNIT_TEXTS:  # a regular expression each, as theirs ("q ." and "s ." match any character after a space)
        removed = re.sub(r"(^|\W)" + unit + r"($|\W)", r"\1\2", s)
        if removed:
            s = removed
    s = s.replace("^{\\circ}", "").replace("^\\circ", "")
    s = s.replace("\\$", "").replace("$", "").replace("\\(", "").replace("\\)", "")
    s = _word_number(s)
    s = re.sub(r"\\text\{(.*?)\}", r"\1", s)
    for key in ("x=", "y=", "z=", "x\\in", "y\\in", "z\\in", "x\\to", "y\\to", "z\\to"):
        s = s.replace(key, "")
    s = s.replace("\\emptyset", "{}").replace("(-\\infty,\\infty)", "\\mathbb{R}")
    s = s.replace("\\%", "").replace("%", "")
    s = _MONTHS_RE.sub("", s)
    s = s.replace(" .", " 0.").replace("{.", "{0.")
    if s.isalnum() and any(s.startswith(o) and s.endswith(c) for o, c in ("{}", "()", "[]")):
        s = s[1:-1]  # (unreachable for an alphanumeric string: kept for the order of their steps)
    s = s.replace("infinity", "\\infty")
    if "\\infty" not in s:
        s = s.replace("inf", "\\infty")
    s = s.replace("+\\inity", "\\infty")
    s = s.replace("and", "").replace("\\mathbf", "")
    s = re.sub(r"\\mbox{.*?}", "", s)
    if "j" in s and "i" not in s:
        s = s.replace("j", "i")
    s = re.sub(r"(\d+)\.0*([^\d])", r"\1\2", s)
    s = re.sub(r"(\d+)\.0*$", r"\1", s)
    if not s:
        return s
    if s[0] == ".":
        s = "0" + s
    halves = s.split("=")
    if len(halves) == 2 and len(halves[0]) <= 2:
        s = halves[1]
    s = re.sub(r"\\sqrt(\w+)", r"\\sqrt{\1}", s)
    s = s.replace(" ", "")
    return _fix_a_slash_b(_fix_fracs(s))


# --------------------------------------------------------------------------------------------------------------------
# math_equal (Utils/grader.py)

#: ``single_choice_patterns``: by marker kind, then letter, as their list
_CHOICE_MARKERS = tuple(
    re.compile(p.replace("X", letter))
    for p in (r"^\(X\)", r"^X\.", r"^X\)", r"^\*\*X\*\*", r"^X:")
    for letter in "ABCDE"
)


def choice_letter(pred: str) -> str:
    """Their ``choice_answer_clean``: the last stand-alone ``A``-``E`` of the upper-cased prediction, else the
    prediction itself, stripped of a trailing ``.`` and ``/``."""
    pred = pred.strip("\n").rstrip(".").rstrip("/").strip(" ").lstrip(":")
    letters = re.findall(r"\b(A|B|C|D|E)\b", pred.upper())
    last = letters[-1] if letters else pred.strip().strip(".")
    return last.rstrip(".").rstrip("/")


def parse_digits(text: Any) -> float | None:
    """Their ``parse_digits``: commas dropped, then ``float``; failing that a trailing ``%`` (or ``\\%``) divides by
    100; ``None`` otherwise."""
    num = str(text).replace(",", "")
    try:
        return float(num)
    except ValueError:
        if num.endswith("%"):
            num = num[:-1].removesuffix("\\")
            try:
                return float(num) / 100
            except ValueError:
                pass
    return None


def numeric_equal(pred: float, ref: float) -> bool:
    """Their ``numeric_equal``: an absolute tolerance of 1e-4."""
    return math.isclose(ref, pred, abs_tol=1e-4)


def _str_to_pmatrix(s: str) -> str:
    rows = re.findall(r"\{.*,.*\}", s.strip())
    return ", ".join(r"\begin{pmatrix}" + m.strip("{}").replace(",", "\\") + r"\end{pmatrix}" for m in rows)


def _is_matrix(s: str) -> bool:
    opens = s.startswith("\\begin{pmatrix}") or s.startswith("\\begin{bmatrix}")
    return opens and (s.endswith("\\end{pmatrix}") or s.endswith("\\end{bmatrix}"))


def _matrix_rows(s: str) -> list[str]:
    inner = s[len("\\begin{pmatrix}") : -len("\\end{pmatrix}")]
    return [row.strip() for row in inner.split("\\\\") if row.strip()]


def math_equal_authors(pred: Any, ref: Any, depth: int = 0, timeout: bool = True) -> bool:
    """Their ``math_equal(prediction, reference)`` with ``include_percentage=True``, ``is_close=True`` (the only way
    ``check_is_correct`` calls it): the branches of the module docstring, in order."""
    if depth > MAX_DEPTH or pred is None or ref is None:
        return False
    again: Callable[[Any, Any], bool] = lambda p, r: math_equal_authors(p, r, depth + 1, timeout)  # noqa: E731
    if str(pred.strip().lower()) == str(ref.strip().lower()):
        return True
    if ref in ("A", "B", "C", "D", "E") and choice_letter(pred) == ref:
        return True
    for marker in _CHOICE_MARKERS:
        if marker.match(pred) and again(marker.sub("", pred, count=1).strip(), ref):
            return True
    if "," in pred and "," in ref:
        p_parts = sorted(part.strip() for part in pred.split(","))
        r_parts = sorted(part.strip() for part in ref.split(","))
        if len(p_parts) == len(r_parts) and all(again(p, r) for p, r in zip(p_parts, r_parts)):
            return True
    p_num, r_num = parse_digits(pred), parse_digits(ref)
    if p_num is not None and r_num is not None:  # two numbers: the numeric rule decides, nothing else is tried
        return any(numeric_equal(p_num, r) for r in (r_num / 100, r_num, r_num * 100))
    if not pred and pred not in (0, False):
        return False
    ref, pred = str(ref).strip(), str(pred).strip()
    if "pmatrix" in pred and "pmatrix" not in ref:
        ref = _str_to_pmatrix(ref)
    p_str, r_str = pred, ref
    if (pred.startswith("[") and pred.endswith("]") and not ref.startswith("(")) or (
        pred.startswith("(") and pred.endswith(")") and not ref.startswith("[")
    ):
        p_str, r_str = p_str.strip("[]()"), r_str.strip("[]()")
    for ch in "{}()":
        p_str, r_str = p_str.replace(ch, ""), r_str.replace(ch, "")
    if p_str.lower() == r_str.lower():
        return True
    tuple_re = r"(\(|\[).+(\)|\])"
    if re.match(tuple_re, pred) and re.match(tuple_re, ref):
        p_parts, r_parts = pred[1:-1].split(","), ref[1:-1].split(",")
        if len(p_parts) == len(r_parts) and all(again(p, r) for p, r in zip(p_parts, r_parts)):
            return True
    if _is_matrix(pred) and _is_matrix(ref):
        p_rows, r_rows = _matrix_rows(pred), _matrix_rows(ref)
        matched = len(p_rows) == len(r_rows)
        for p_row, r_row in zip(p_rows, r_rows) if matched else ():
            p_cells, r_cells = p_row.split("&"), r_row.split("&")
            if len(p_cells) != len(r_cells) or not all(again(p, r) for p, r in zip(p_cells, r_cells)):
                matched = False
                break
        if matched:
            return True
    if pred.count("=") == 1 and ref.count("=") == 1:
        lhs, rhs = pred.split("=")
        p_eq = f"{lhs.strip()} - ({rhs.strip()})"
        lhs, rhs = ref.split("=")
        r_eq = f"{lhs.strip()} - ({rhs.strip()})"
        if symbolic_equal(p_eq, r_eq) or symbolic_equal(f"-({p_eq})", r_eq):
            return True
    elif pred.count("=") == 1 and len(pred.split("=")[0].strip()) <= 2 and "=" not in ref:
        if again(pred.split("=")[1], ref):
            return True
    elif ref.count("=") == 1 and len(ref.split("=")[0].strip()) <= 2 and "=" not in pred:
        if again(pred, ref.split("=")[1]):
            return True
    if timeout:
        return _with_timeout(symbolic_equal, pred, ref)
    return symbolic_equal(pred, ref)


def check_is_correct(pred: str | None, gold: Any) -> bool:
    """Their ``check_is_correct(pred, gt)``: both stripped (:func:`authors_strip`), then :func:`math_equal_authors`.
    A missing prediction (no box) is wrong."""
    if pred is None:
        return False
    return math_equal_authors(authors_strip(pred), authors_strip(gold))


# --------------------------------------------------------------------------------------------------------------------
# symbolic_equal


def _parse(s: str) -> Any:
    """The first parser that accepts ``s`` (each tried on ``s`` with ``\\\\`` as ``\\``, then on ``s``); ``s`` itself
    when none does. Their chain less sympy's ``parse_latex`` (which cannot run in their environment: see the module
    docstring)."""
    from latex2sympy2_extended import latex2sympy
    from latex2sympy2_extended.latex2sympy2 import ConversionConfig

    config = ConversionConfig(
        interpret_as_mixed_fractions=False, interpret_simple_eq_as_assignment=False, lowercase_symbols=False
    )
    parsers: tuple[Callable[[str], Any], ...] = (
        _safe_parse_expr,
        lambda x: latex2sympy(x, normalization_config=None, conversion_config=config),
    )
    for parser in parsers:
        for candidate in (s.replace("\\\\", "\\"), s):
            try:
                return parser(candidate)
            except Exception:  # their bare excepts: a parser that fails passes the string on
                continue
    return s


def _safe_parse_expr(s: str) -> Any:
    """sympy's ``parse_expr`` (their second parser), which evaluates Python: text with ``__`` (a way out of sympy's
    namespace) is not given to it, so a model's answer cannot run code here (theirs would)."""
    from sympy.parsing.sympy_parser import parse_expr

    if "__" in s:
        raise ValueError("not parsed: contains '__'")
    return parse_expr(s)


def symbolic_equal(a: str, b: str) -> bool:
    """Their ``symbolic_equal``: parsed forms equal as strings or objects, ``simplify(a - b) == 0``, equations with
    equal ``|lhs - rhs|``, numerically equal within 1e-4, or matrices equal when rounded to 3 places."""
    from sympy import N, simplify

    x, y = _parse(a), _parse(b)
    checks: tuple[Callable[[], Any], ...] = (
        lambda: str(x) == str(y) or x == y,
        lambda: x.equals(y) or simplify(x - y) == 0,
        lambda: abs(x.lhs - x.rhs).equals(abs(y.lhs - y.rhs)),
        lambda: numeric_equal(float(N(x)), float(N(y))),
        lambda: x.shape == y.shape and x.applyfunc(lambda v: round(v, 3)).equals(y.applyfunc(lambda v: round(v, 3))),
    )
    for check in checks:
        try:
            if check():
                return True
        except Exception:  # each of their checks is wrapped in a bare except
            continue
    return False


class _Timeout(Exception):
    pass


@contextmanager
def _alarm(seconds: float):
    def _raise(signum: int, frame: Any) -> None:
        raise _Timeout

    previous = signal.signal(signal.SIGALRM, _raise)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _with_timeout(fn: Callable[[str, str], bool], a: str, b: str) -> bool:
    """``fn(a, b)``, False after :data:`SYMBOLIC_TIMEOUT_S` (theirs: a process killed after 3 s). The limit applies in
    the main thread of a process (grading runs there or in worker processes' main threads); elsewhere it runs
    without one."""
    if threading.current_thread() is not threading.main_thread():
        return fn(a, b)
    try:
        with _alarm(SYMBOLIC_TIMEOUT_S):
            return fn(a, b)
    except _Timeout:
        logger.debug("symbolic check of %r against %r: over %s s, counted as not equal", a, b, SYMBOLIC_TIMEOUT_S)
        return False
