"""Pure metric helpers: pass@k and output-failure classification (no torch).

* :func:`pass_at_k` is the unbiased estimator of Chen et al. (2021): ``1 - C(n - c, k) / C(n, k)``.
* :func:`mean_pass_at_1` is the paper's pass@1: accuracy averaged over the samples of each problem, then over
  problems. :func:`mean_pass_at_k` averages the unbiased pass@k the same way.
* :func:`classify_output` labels one output with the detectors of method.md section 4, in this order of precedence:
  ``loop`` > ``garbage`` > ``truncated`` > ``ok`` (a degenerate ending is the more specific diagnosis: a looping
  output usually also runs into the length limit, and it is the loop that explains the failure).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Mapping, Sequence

LOOP_WINDOW = 500
LOOP_MIN_PHRASE, LOOP_MAX_PHRASE, LOOP_MIN_REPEATS = 10, 40, 5
NON_ASCII_WINDOW, NON_ASCII_MAX = 100, 30
DOMINANT_WINDOW = 200
THINK_CLOSE = "</think>"

# a 10-40 character phrase followed by itself at least 4 more times, back to back
_LOOP_RE = re.compile(rf"(.{{{LOOP_MIN_PHRASE},{LOOP_MAX_PHRASE}}})\1{{{LOOP_MIN_REPEATS - 1},}}", re.DOTALL)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from ``n`` samples of which ``c`` are correct: ``1 - C(n-c, k) / C(n, k)``.

    Computed as a stable product, so large ``n`` does not overflow.
    """
    if n < 1 or not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k: need n >= 1, 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    prob_all_wrong = 1.0
    for i in range(n - c + 1, n + 1):
        prob_all_wrong *= 1.0 - k / i
    return 1.0 - prob_all_wrong


def _check_samples(per_problem: Sequence[Sequence[bool]]) -> None:
    if len(per_problem) == 0:
        raise ValueError("pass@k: no problems")
    for i, samples in enumerate(per_problem):
        if len(samples) == 0:
            raise ValueError(f"pass@k: problem {i} has no samples")


def mean_pass_at_1(per_problem: Sequence[Sequence[bool]]) -> float:
    """pass@1: mean over problems of the fraction of correct samples (problems may have different sample counts)."""
    _check_samples(per_problem)
    return sum(sum(map(bool, s)) / len(s) for s in per_problem) / len(per_problem)


def mean_pass_at_k(per_problem: Sequence[Sequence[bool]], k: int) -> float:
    """Unbiased pass@k averaged over problems (each problem needs at least ``k`` samples)."""
    _check_samples(per_problem)
    return sum(pass_at_k(len(s), sum(map(bool, s)), k) for s in per_problem) / len(per_problem)


def pass_at_1_by_group(per_problem: Mapping[str, Sequence[bool]], group_of: Mapping[str, object]) -> dict[str, float]:
    """pass@1 per group (e.g. per AIME year): ``group_of`` maps a problem id to its group."""
    groups: dict[str, list[Sequence[bool]]] = {}
    for pid, samples in per_problem.items():
        groups.setdefault(str(group_of[pid]), []).append(samples)
    return {g: mean_pass_at_1(v) for g, v in sorted(groups.items())}


def has_loop(text: str) -> bool:
    """A 10-40 character phrase repeated back to back at least 5 times within the last 500 characters."""
    return _LOOP_RE.search(text[-LOOP_WINDOW:]) is not None


def is_garbage(text: str) -> bool:
    """More than 30 non-ASCII characters in the last 100, or one character over half of the last 200."""
    if sum(1 for ch in text[-NON_ASCII_WINDOW:] if ord(ch) > 127) > NON_ASCII_MAX:
        return True
    tail = text[-DOMINANT_WINDOW:]
    return bool(tail) and Counter(tail).most_common(1)[0][1] * 2 > len(tail)


def is_truncated(text: str, finished: bool, thinking: bool) -> bool:
    """Thinking: no ``</think>`` was written (cut off inside the thinking). Otherwise: stopped by the length limit."""
    if thinking:
        return THINK_CLOSE not in text
    return not finished


def classify_output(text: str, finished: bool, thinking: bool) -> str:
    """``"loop"``, ``"garbage"``, ``"truncated"`` or ``"ok"`` (first that applies, in this order).

    Args:
        text: the generated text (without the prompt).
        finished: whether generation stopped by itself (EOS) rather than at the length limit.
        thinking: whether the run had thinking enabled.
    """
    if has_loop(text):
        return "loop"
    if is_garbage(text):
        return "garbage"
    if is_truncated(text, finished, thinking):
        return "truncated"
    return "ok"
