"""Answer extraction and checking, shared by the tasks.

Extraction is kept apart from correctness: every ``extract_*`` function returns the answer as written (or ``None``),
and the ``*_equal`` / ``grade_*`` functions decide correctness.

Two grader rules read the same output (``protocol.grader`` names the one ``accuracy`` uses; runs report both,
docs/protocol.md):

* ``strict`` (the harness default): the rules below;
* ``last_boxed`` (the authors' parser, terarachang/VaSE ``Utils/parser.py`` ``extract_answer``): the text after the last
  ``boxed`` anywhere in the output, the thinking included and even when it never closed (:func:`extract_last_boxed`);
  for multiple choice, the last stand-alone letter in that box (their ``choice_answer_clean``,
  :func:`extract_choice_last_boxed`). No fallback without a box. Equivalence is the same check as ``strict``
  (math-verify; with a task's ``equivalence="authors"``, ``protocol=paper``, the authors' ``check_is_correct``
  branch for branch, :mod:`tasks.authors_grader`), so the two rules differ only in where the answer is read.
* Code under ``code_extraction="authors"`` (LiveCodeBench, ``protocol=paper``): their ``_extract_code``
  (:func:`extract_code_authors`).

The ``strict`` rules (see ``tests/test_grading.py`` for the golden table):

* The answer section is the text after the last ``</think>``. When the model thinks and no ``</think>`` was written,
  the output was cut off inside the thinking: nothing is extracted (a ``\\boxed{}`` inside the thinking never counts)
  and the output is flagged as truncated. A ``<think>`` without ``</think>`` is treated the same even when thinking
  was not requested.
* Math: the last ``\\boxed{...}`` (or ``\\fbox{...}``) with balanced braces; an unbalanced (cut-off) box is skipped.
  Boxes that follow each other separated only by commas, "and"/"or", spaces, math delimiters or a variable name
  (``\\boxed{2}, \\boxed{3}``, ``$x = \\boxed{2}$ and $x = \\boxed{3}$``) are one multi-part answer, joined with
  ", ". Equivalence is decided by math-verify (gold first) after light normalisation of both sides (percent signs,
  degree signs, ``\\!``, unicode minus, a trailing period, a wrapping ``\\text{}``). A gold written in another base
  (``52_8``) needs the same digits and base, or the decimal value. Math-verify's timeouts use ``SIGALRM``:
  :func:`math_equal` uses them in the main thread and runs without them elsewhere; :func:`math_equal_many` sends work
  from other threads to worker processes.
* Multiple choice: the boxed letter (``\\boxed{C}``, ``\\boxed{\\text{(C)}}``, ``\\boxed{c}``, ``\\boxed{C. text}``) or
  the boxed text of one option; without a box, the last "answer is C" / "Answer: (c)" statement, then the last
  stand-alone "(C)", then a final line that is only a letter.
* Code: the last fenced code block tagged python/py/python3 or untagged (blocks in other languages are skipped; an
  unclosed block at the very end, i.e. cut-off code, is ignored).
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor

logger = logging.getLogger(__name__)

GRADER_RULES = ("strict", "last_boxed")
THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
MATH_TIMEOUT_S = 5


# --------------------------------------------------------------------------------------------------------------------
# thinking


def split_thinking(output: str, thinking: bool) -> tuple[str, bool]:
    """Return ``(answer_section, truncated)``.

    The answer section is what follows the last ``</think>``. Without one, a thinking output (or any output that
    opened ``<think>``) was cut off inside the thinking: the section is empty and ``truncated`` is true. A
    non-thinking output without think tags is entirely the answer section.
    """
    idx = output.rfind(THINK_CLOSE)
    if idx >= 0:
        return output[idx + len(THINK_CLOSE) :], False
    if thinking or THINK_OPEN in output:
        return "", True
    return output, False


# --------------------------------------------------------------------------------------------------------------------
# boxed answers

_BOX_RE = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")
_BOX_SEP_RE = re.compile(
    r"^(?:\s|,|;|\$|\\[()\[\]]|\\quad|\\qquad|\\,|\\;|\band\b|\bor\b|\\text\{\s*(?:and|or)\s*\}|\b[A-Za-z]_?\d?\s*=)*$"
)


def _balanced(text: str, open_idx: int) -> int | None:
    """Index just past the brace matching ``text[open_idx] == "{"``, or ``None`` if it never closes."""
    depth = 0
    i = open_idx
    n = len(text)
    while i < n:
        ch = text[i]
        if ch == "\\" and i + 1 < n and text[i + 1] in "{}":
            i += 2
            continue
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return None


def find_boxes(text: str) -> list[tuple[int, int, str]]:
    """All complete ``\\boxed{...}`` / ``\\fbox{...}`` in order, as ``(start, end, content)``.

    Braces are balanced (escaped ``\\{`` ``\\}`` do not count); ``\\boxed 5`` (no braces) takes the next token; a box
    whose braces never close (cut-off output) is skipped. Boxes nested in a box are not listed separately.
    """
    boxes: list[tuple[int, int, str]] = []
    pos = 0
    while True:
        m = _BOX_RE.search(text, pos)
        if m is None:
            return boxes
        i = m.end()
        j = i
        while j < len(text) and text[j] in " \t":
            j += 1
        if j < len(text) and text[j] == "{":
            end = _balanced(text, j)
            if end is None:
                pos = m.end()
                continue
            boxes.append((m.start(), end, text[j + 1 : end - 1]))
            pos = end
        elif j > i:
            tok = re.match(r"[^\s$]+", text[j:])
            if tok:
                boxes.append((m.start(), j + tok.end(), tok.group(0)))
                pos = j + tok.end()
            else:
                pos = j
        else:
            pos = m.end()


def last_boxed(text: str) -> str | None:
    """Content of the last complete box; adjacent boxes (``\\boxed{2}, \\boxed{3}``) are joined with ", "."""
    boxes = find_boxes(text)
    if not boxes:
        return None
    group = [boxes[-1]]
    for box in reversed(boxes[:-1]):
        between = text[box[1] : group[0][0]]
        if not _BOX_SEP_RE.match(between):
            break
        group.insert(0, box)
    parts: list[str] = []
    for _, _, content in group:
        content = content.strip()
        if content and content not in parts:
            parts.append(content)
    return ", ".join(parts) if parts else group[-1][2].strip()


def extract_math_answer(output: str, thinking: bool) -> tuple[str | None, bool]:
    """``(last boxed answer of the answer section or None, truncated)``."""
    section, truncated = split_thinking(output, thinking)
    if truncated:
        return None, True
    return last_boxed(section), False


def extract_last_boxed(output: str) -> str | None:
    """The authors' answer: what follows the last ``boxed`` anywhere in ``output`` (``None`` when there is none).

    Their rule, step for step: the text after the last occurrence of ``boxed`` (so ``\\boxed``, also inside an
    unfinished thinking); if it opens with ``{``, everything up to the brace that closes it (to the end of the text
    when it never closes: a cut-off box counts), else up to the next ``$``, stripped; then line breaks and the spaces
    after them removed, one leading ``:`` and one trailing ``.`` and ``/`` dropped. An empty answer is ``None``.
    """
    output = output.replace("\u043a\u0438", "")  # a stray token their parser deletes first
    if "boxed" not in output:
        return None
    rest = output.rsplit("boxed", 1)[1]
    if rest.startswith("{"):
        depth, chars = 1, []
        for ch in rest[1:]:
            if ch == "{":
                depth += 1
            elif ch == "}":
                depth -= 1
                if depth == 0:
                    break
            chars.append(ch)
        answer = "".join(chars)
    else:
        answer = rest.split("$")[0].strip()
    answer = re.sub(r"\n\s*", "", answer)
    answer = answer[1:] if answer.startswith(":") else answer
    answer = answer[:-1] if answer.endswith(".") else answer
    answer = answer[:-1] if answer.endswith("/") else answer
    return answer or None


def extract_answer(output: str, thinking: bool, rule: str) -> tuple[str | None, bool]:
    """``(answer or None, truncated)`` of a boxed-answer output under grader ``rule`` (:data:`GRADER_RULES`).

    ``truncated`` describes the output (it ended inside the thinking) under either rule.
    """
    if rule == "strict":
        return extract_math_answer(output, thinking)
    if rule == "last_boxed":
        return extract_last_boxed(output), split_thinking(output, thinking)[1]
    raise ValueError(f"protocol.grader: unknown rule {rule!r}; choose one of {', '.join(GRADER_RULES)}")


# --------------------------------------------------------------------------------------------------------------------
# math equivalence

_TEXT_WRAP_RE = re.compile(r"^\\(?:text|textbf|mathrm|mbox|mathbf)\{(.*)\}$", re.S)
_NESTED_BOX_RE = re.compile(r"^\\(?:boxed|fbox)\{(.*)\}$", re.S)


def normalize_math(ans: str) -> str:
    """Light normalisation applied to gold and prediction before math-verify parses them."""
    s = ans.strip()
    for _ in range(3):  # unwrap \boxed{\boxed{x}} and a whole-answer \text{...}
        m = _NESTED_BOX_RE.match(s)
        if m and _balanced(s, s.index("{")) == len(s):
            s = m.group(1).strip()
            continue
        m = _TEXT_WRAP_RE.match(s)
        if m and _balanced(s, s.index("{")) == len(s) and re.match(r"^\s*[-\d.]", m.group(1)):
            s = m.group(1).strip()
            continue
        break
    s = re.sub(r"(\d),\\!\s*(?=\d{3})", r"\1", s)  # MATH's thousands separator "10,\!080"
    if re.fullmatch(r"-?(?:\\\$)?\d{1,3}(?:,\d{3})+(?:\.\d+)?", s):  # "1,234,567" (no spaces: not a list)
        s = s.replace(",", "")
    s = s.replace("\u2212", "-").replace("\\!", "").replace("\\%", "").replace("%", "")
    s = s.replace("\u00b0", "").replace("^{\\circ}", "").replace("^\\circ", "")
    s = re.sub(r"\\(?:d|t)frac", r"\\frac", s)
    s = re.sub(r"(?<=[\d}])\s*\.$", "", s)  # "3." -> "3"
    return s.strip()


def _mv_timeout() -> int | None:
    return MATH_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


_BASE_RE = re.compile(r"^([0-9A-Za-z]+)_\{?(\d+)\}?$")


def _base_number(s: str) -> tuple[str, int] | None:
    """``("52", 8)`` for a number written in base ``b`` (``52_8``, ``52_{8}``), else ``None``."""
    m = _BASE_RE.match(s.replace(" ", ""))
    if not m or not 2 <= int(m.group(2)) <= 36:
        return None
    return m.group(1).upper(), int(m.group(2))


def _base_equal(gold: tuple[str, int], pred: str) -> bool:
    digits, base = gold
    other = _base_number(pred)
    if other is not None:
        return other[0].lstrip("0") == digits.lstrip("0") and other[1] == base
    try:
        return int(pred.strip()) == int(digits, base)
    except ValueError:
        return False


def math_equal(gold: str, pred: str | None) -> bool:
    """Whether ``pred`` is mathematically equivalent to ``gold`` (math-verify, gold first, after normalisation).

    Uses math-verify's timeouts in the main thread; in other threads it runs without them (use
    :func:`math_equal_many`, which delegates to worker processes, for bulk grading off the main thread).
    """
    if pred is None:
        return False
    from math_verify import parse, verify

    g, p = normalize_math(str(gold)), normalize_math(pred)
    if not p:
        return False
    if g == p:
        return True
    base = _base_number(g)
    if base is not None:  # math-verify drops the subscript: "52_8" would equal "52"
        return _base_equal(base, p)
    timeout = _mv_timeout()
    try:
        gold_parsed = parse(f"\\boxed{{{g}}}", parsing_timeout=timeout)
        pred_parsed = parse(f"\\boxed{{{p}}}", parsing_timeout=timeout)
        if not gold_parsed or not pred_parsed:
            return False
        return bool(verify(gold_parsed, pred_parsed, timeout_seconds=timeout))
    except Exception as exc:  # math-verify raises on pathological inputs; a wrong answer, not a crash
        logger.debug("math_equal(%r, %r) failed: %s", gold, pred, exc)
        return False


#: ``equivalence`` of a math task: ``math_verify`` (the harness) or ``authors`` (their ``check_is_correct``, branch for
#: branch: :mod:`tasks.authors_grader`; ``protocol=paper``)
EQUIVALENCES = ("math_verify", "authors")


def answer_equal(gold: str, pred: str | None, equivalence: str, verdict: bool | None = None) -> bool:
    """Whether ``pred`` answers ``gold`` under ``equivalence`` (:data:`EQUIVALENCES`); ``verdict`` is the verdict of
    the pair under that equivalence when already known (:func:`equal_many`)."""
    if verdict is not None:
        return verdict
    if equivalence == "authors":
        from tasks.authors_grader import check_is_correct

        return check_is_correct(pred, gold)
    return math_equal(gold, pred)


def _math_equal_pairs(pairs: Sequence[tuple[str, str | None]], equivalence: str = "math_verify") -> list[bool]:
    return [answer_equal(g, p, equivalence) for g, p in pairs]


_pool_lock = threading.Lock()
_pool: ProcessPoolExecutor | None = None


def _math_pool() -> ProcessPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            import multiprocessing

            from tasks.sandbox import available_cores

            workers = min(available_cores(), 4)
            _pool = ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn"))
        return _pool


def math_equal_many(
    pairs: Sequence[tuple[str, str | None]], chunk: int = 64, equivalence: str = "math_verify"
) -> list[bool]:
    """:func:`answer_equal` under ``equivalence`` over many ``(gold, pred)`` pairs, with timeouts: in this thread when
    it is the main thread, otherwise in worker processes (spawned once, reused)."""
    if threading.current_thread() is threading.main_thread() or not pairs:
        return _math_equal_pairs(pairs, equivalence)
    pool = _math_pool()
    futures = [
        pool.submit(_math_equal_pairs, list(pairs[i : i + chunk]), equivalence) for i in range(0, len(pairs), chunk)
    ]
    return [ok for f in futures for ok in f.result()]


# --------------------------------------------------------------------------------------------------------------------
# multiple choice

_WRAP_CMDS_RE = re.compile(r"\\(?:text|textbf|mathrm|mathbf|mbox|textit)\{([^{}]*)\}")
_STATED_RE = re.compile(
    r"\b(?:answer|choice|option)\b(?:\s+(?:is|should be|would be|must be))?\s*[:=]?\s*(?:option|choice)?\s*[:=]?"
    r"\s*[*_]*\s*([(\[])?\s*([A-Za-z])\s*([)\]])?",
    re.I,
)
_PAREN_RE = re.compile(r"\(([A-Z])\)")
_LONE_RE = re.compile(r"^[\s*_#>]*[(\[]?([A-Za-z])[)\].:]?[\s*_]*$")


def _norm_option(s: str) -> str:
    s = _WRAP_CMDS_RE.sub(r"\1", s)
    return re.sub(r"[\s$]+", " ", s).strip().strip(".").lower()


def _letter_from_box(content: str, letters: str, options: Sequence[str] | None) -> str | None:
    s = content.strip()
    for _ in range(3):
        s2 = _WRAP_CMDS_RE.sub(r"\1", s).strip()
        if s2 == s:
            break
        s = s2
    m = re.match(r"^[(\[]?\s*([A-Za-z])\s*(?:[)\]:.]|$|\s)", s)
    if m and m.group(1).upper() in letters:
        rest = s[m.end() :].strip()
        # "C", "(C)", "C.", "C) text" - but not a word that merely starts with a letter ("Because")
        if not rest or s[m.end() - 1] in ")].:" or m.end() == len(s):
            return m.group(1).upper()
        if s[1:2].isspace() and rest:
            return m.group(1).upper()
    if options:
        target = _norm_option(s)
        for letter, text in zip(letters, options):
            if target and target == _norm_option(text):
                return letter
    return None


def extract_choice(
    output: str, thinking: bool, letters: str = "ABCD", options: Sequence[str] | None = None
) -> tuple[str | None, bool]:
    """``(chosen letter or None, truncated)`` from a multiple-choice answer; see the module docstring."""
    section, truncated = split_thinking(output, thinking)
    if truncated:
        return None, True
    boxed = last_boxed(section)
    if boxed is not None:
        letter = _letter_from_box(boxed, letters, options)
        if letter is not None:
            return letter, False
    for m in reversed(list(_STATED_RE.finditer(section))):
        letter = m.group(2)
        if letter.upper() not in letters:
            continue
        after = m.end(3) if m.group(3) is not None else m.end(2)
        nxt = section[after : after + 1]
        bracketed = m.group(1) is not None or m.group(3) is not None
        # "answer is C because" is a choice; "answer is a bit" is not: a lowercase letter needs punctuation or an end
        if bracketed or nxt == "" or nxt in ".,;:!*_\n" or (letter.isupper() and nxt.isspace()):
            return letter.upper(), False
    for m in reversed(list(_PAREN_RE.finditer(section))):
        if m.group(1) in letters:
            return m.group(1), False
    for line in reversed(section.strip().splitlines()[-3:]):
        m = _LONE_RE.match(line)
        if m and m.group(1).upper() in letters:
            return m.group(1).upper(), False
    return None, False


def extract_choice_last_boxed(output: str, thinking: bool, letters: str = "ABCD") -> tuple[str | None, bool]:
    """``(letter or None, truncated)`` under the authors' rule: the last stand-alone capital ``A``-``E`` (after
    upper-casing) in the last ``boxed`` of the output (:func:`extract_last_boxed`), if it is one of ``letters``."""
    truncated = split_thinking(output, thinking)[1]
    content = extract_last_boxed(output)
    if content is None:
        return None, truncated
    found = re.findall(r"\b(A|B|C|D|E)\b", content.upper())
    letter = found[-1] if found else content.strip().strip(".").upper()
    return (letter if letter in letters and len(letter) == 1 else None), truncated


# --------------------------------------------------------------------------------------------------------------------
# code

_FENCE_RE = re.compile(r"^[ \t]*```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)^[ \t]*```[ \t]*$", re.S | re.M)
_PY_TAGS = {"", "python", "py", "python3", "py3"}


#: ``code_extraction`` of a code task: ``harness`` (:func:`extract_code`) or ``authors`` (:func:`extract_code_authors`)
CODE_EXTRACTIONS = ("harness", "authors")


def extract_code_authors(output: str, thinking: bool) -> tuple[str | None, bool]:
    """``(code, truncated)`` as the authors' LiveCodeBench grader reads it (terarachang/VaSE ``Utils/livecodebench.py``
    ``_extract_code``, L20-25): the lines between the last two lines that contain a code fence, anywhere in the output
    (the thinking included, any language, a fence inside a line too); fewer than two such lines: no code (``None``;
    theirs runs the empty program, which fails the tests alike). ``truncated`` only reports an unclosed thinking: the
    code is read regardless."""
    _, truncated = split_thinking(output, thinking)
    lines = output.split("\n")
    fences = [i for i, line in enumerate(lines) if "```" in line]
    if len(fences) < 2:
        return None, truncated
    return "\n".join(lines[fences[-2] + 1 : fences[-1]]), truncated


def extract_code(output: str, thinking: bool) -> tuple[str | None, bool]:
    """``(last Python code block of the answer section or None, truncated)``."""
    section, truncated = split_thinking(output, thinking)
    if truncated:
        return None, True
    blocks = [m.group(2) for m in _FENCE_RE.finditer(section) if m.group(1).lower() in _PY_TAGS]
    if not blocks:
        return None, False
    return blocks[-1].rstrip("\n") + "\n" if blocks[-1].strip() else "", False
