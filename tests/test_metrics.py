"""pass@k estimators and the output classifier (loop / garbage / truncated / ok)."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from vase.run.metrics import (
    classify_output,
    has_loop,
    is_garbage,
    mean_pass_at_1,
    mean_pass_at_k,
    pass_at_1_by_group,
    pass_at_k,
)


def _brute_pass_at_k(n: int, c: int, k: int) -> float:
    """Fraction of the k-subsets of n samples (c correct) that contain a correct one."""
    samples = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(samples[i] for i in s) for s in subsets) / len(subsets)


@pytest.mark.parametrize(
    ("n", "c", "k"), [(n, c, k) for n in range(1, 8) for c in range(n + 1) for k in range(1, n + 1)]
)
def test_pass_at_k_matches_brute_force(n: int, c: int, k: int) -> None:
    assert pass_at_k(n, c, k) == pytest.approx(_brute_pass_at_k(n, c, k), abs=1e-12)


def test_pass_at_k_closed_form_and_large_n() -> None:
    assert pass_at_k(16, 4, 1) == pytest.approx(0.25)
    assert pass_at_k(200, 10, 50) == pytest.approx(1 - math.comb(190, 50) / math.comb(200, 50), rel=1e-9)
    assert 0.0 <= pass_at_k(10_000, 1, 5000) <= 1.0


@pytest.mark.parametrize(("n", "c", "k"), [(0, 0, 1), (4, 5, 1), (4, -1, 1), (4, 2, 0), (4, 2, 5)])
def test_pass_at_k_rejects_bad_arguments(n: int, c: int, k: int) -> None:
    with pytest.raises(ValueError, match="pass_at_k"):
        pass_at_k(n, c, k)


def test_mean_pass_at_1() -> None:
    assert mean_pass_at_1([[True, False, False, True], [True] * 4, [False] * 4]) == pytest.approx((0.5 + 1 + 0) / 3)
    assert mean_pass_at_1([[True], [False, True]]) == pytest.approx(0.75)  # unequal sample counts
    assert mean_pass_at_1([[1, 0], [0, 0]]) == pytest.approx(0.25)
    with pytest.raises(ValueError):
        mean_pass_at_1([])
    with pytest.raises(ValueError):
        mean_pass_at_1([[True], []])


def test_mean_pass_at_k_and_groups() -> None:
    per = [[True, False], [False, False]]
    assert mean_pass_at_k(per, 1) == pytest.approx(mean_pass_at_1(per))
    assert mean_pass_at_k(per, 2) == pytest.approx(0.5)
    by_year = pass_at_1_by_group(
        {"2025-0": [True, True], "2025-1": [False, False], "2026-0": [True, False]},
        {"2025-0": 2025, "2025-1": 2025, "2026-0": 2026},
    )
    assert by_year == {"2025": pytest.approx(0.5), "2026": pytest.approx(0.5)}


PROSE = (
    "We compute the sum of the first ten odd numbers, which equals one hundred. Then we divide by four to get "
    "twenty-five, and check the boundary cases separately before writing the final answer. "
)


@pytest.mark.parametrize(
    ("text", "finished", "thinking", "expected"),
    [
        (PROSE + "</think>\n\nThe answer is \\boxed{25}.", True, True, "ok"),
        ("Short answer: \\boxed{25}.", True, False, "ok"),
        (PROSE + "Wait, let me recheck. " * 5, False, True, "loop"),
        (PROSE + "Wait, let me recheck. " * 4, False, True, "truncated"),  # 4 repeats are not a loop
        (PROSE + "abcdefghi" * 5 + "</think> done", True, True, "ok"),  # 9-char phrase x5: 45 chars, no 10-40 loop
        (PROSE + "0123456789" * 5 + "</think> done", True, True, "loop"),  # exactly 10 chars x5
        (PROSE + ("a" * 41) * 5 + "</think>" + PROSE, True, True, "loop"),  # a 41-char unit still repeats 'a' * 10
        (PROSE + "The value is 42 and we are done here. " * 6 + PROSE * 6 + "</think> ok", True, True, "ok"),
        (PROSE + "\u6211\u4eec" * 20 + "</think>", True, True, "garbage"),  # 40 non-ASCII chars
        (PROSE + "\u00e9" * 30 + " ok</think>" + "z" * 0, True, True, "ok"),  # 30 non-ASCII is not more than 30
        (PROSE + "!" * 60 + "?" * 60 + "</think>", True, True, "loop"),  # a run is also a 10-char loop
        (PROSE + PROSE + "</think>", False, True, "ok"),  # thinking closed: not truncated even at the limit
        (PROSE + PROSE, True, True, "truncated"),  # no </think> while thinking
        (PROSE + PROSE, False, False, "truncated"),  # non-thinking: hit the length limit
        (PROSE + PROSE, True, False, "ok"),
        ("", True, False, "ok"),
        ("", False, True, "truncated"),
    ],
)
def test_classify_output(text: str, finished: bool, thinking: bool, expected: str) -> None:
    assert classify_output(text, finished, thinking) == expected


def test_loop_row_with_ten_char_phrase() -> None:
    # "abcdefgh, " is a 10-character phrase, so five back-to-back copies are a loop
    assert has_loop("abcdefgh, " * 5)
    assert not has_loop("abcdefgh, " * 4)


def test_loop_must_be_in_the_last_500_chars() -> None:
    looped = "again and again " * 10
    assert has_loop(PROSE + looped)
    assert not has_loop(looped + PROSE * 4)


def test_garbage_rules() -> None:
    assert is_garbage(PROSE + "\u00e9" * 31)
    assert not is_garbage(PROSE + "\u00e9" * 30)
    tail = "a b " * 40  # 'a' is 80 of 160 characters: not over half
    assert not is_garbage(PROSE + tail)
    assert is_garbage(PROSE + "a" * 101 + "b" * 99)  # 101 of the last 200
    assert not is_garbage(PROSE + "a" * 100 + "b" * 100)


def test_precedence_loop_over_garbage_over_truncated() -> None:
    text = PROSE + "\u00e9\u00e8" * 40  # a 2-char unicode loop is also garbage; loop wins
    assert classify_output(text, False, True) == "loop"
    rng = random.Random(0)
    garbage = PROSE + "".join(rng.choice("\u00e9\u00e8\u00ea\u00eb\u00e0") for _ in range(60))
    assert classify_output(garbage, False, True) == "garbage"
    dominant = "".join(rng.choice("aaaaaaaabcdef") for _ in range(200))  # 'a' over half, no loop
    assert not has_loop(dominant) and is_garbage(dominant)
    assert classify_output(dominant + "</think>", True, True) == "garbage"


def test_loop_detector_work_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fast on any output, shown without a clock: the loop regex only ever sees the last LOOP_WINDOW characters, so
    its work does not grow with the output (2 million characters here)."""
    import vase.run.metrics as metrics

    seen: list[int] = []
    pattern = metrics._LOOP_RE

    class Recording:
        def search(self, text: str):  # noqa: ANN201
            seen.append(len(text))
            return pattern.search(text)

    monkeypatch.setattr(metrics, "_LOOP_RE", Recording())
    rng = random.Random(0)
    noise = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz ,.") for _ in range(2_000_000))
    assert not has_loop(noise) and has_loop("a" * 100_000) and has_loop("ab" * 50_000)
    assert classify_output(noise, False, True) == "truncated"
    assert seen and max(seen) <= metrics.LOOP_WINDOW
