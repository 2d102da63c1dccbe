"""The one schema every line read back from ``samples.jsonl`` (and a rank's part file) is checked against.

Every reader of sample lines (resume, the metrics, a shard merge, the report, the dashboard) goes through
:func:`vase.run.results.read_samples`, which calls :func:`check_sample` on each line: a line whose fields have the
wrong type (``"correct": "false"``, a string where a count belongs) or hold a non-finite number (``NaN``,
``Infinity``, anywhere in the line) is a one-line :class:`BadSample` naming the file, the line number and the field,
raised before anything is counted from it or written after it. The types are those :func:`vase.run.records.sample_row`
writes, each number with a range too (counts in ``[0, MAX_TOKENS]``, bytes in ``[0, MAX_BYTES]``, ratios ``> 0``,
seconds in ``[0, MAX_SECONDS]``; ``finish_reason`` and ``loop_class`` from their closed sets); ``correct_<rule>`` /
``extracted_<rule>`` follow ``correct`` / ``extracted``. Every file vase reads back is parsed by :func:`loads`, whose
nesting limit (:data:`MAX_DEPTH`) makes a line nested 100,000 deep one line naming it, never a ``RecursionError``;
``metrics.json`` and ``throughput.jsonl`` figures are checked by :func:`number_problem` (rates in ``[0, 1]``). What
the lines must be together (one per planned sample, the run's ``n_samples``, one layout) is
:mod:`vase.run.validate`.

:data:`SAMPLE_FIELDS` every line has; :data:`METRIC_FIELDS` a line needs for the metrics
(:func:`vase.run.records.compute_metrics` reads with ``for_metrics=True``). A field a line does not have is not
checked unless it is required; a field the schema does not know (a newer writer's) is only checked to be finite.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

#: the fields every line of ``samples.jsonl`` has
SAMPLE_FIELDS = ("problem_id", "sample", "correct")
#: the fields the metrics read from every line (besides :data:`SAMPLE_FIELDS`)
METRIC_FIELDS = (
    "finish_reason",
    "loop_class",
    "extracted",
    "output_tokens",
    "compression_ratio",
    "kv_held_bytes_end",
    "kv_full_bytes_end",
)


class BadSample(ValueError):
    """A line of a samples file that is not a valid sample: one line naming the file, the line and the field."""


#: the deepest nesting of arrays and objects a file vase reads back may hold (vase writes at most 4 levels)
MAX_DEPTH = 32
_STRING = re.compile(rb'"(?:[^"\\]++|\\.)*+"')
_BRACKET = re.compile(rb"[\[\]{}]")


class Unparseable(ValueError):
    """Text that is JSON but not one vase reads: nested deeper than :data:`MAX_DEPTH`, or a number of more digits than
    Python converts. The message is the reason only; the reader adds the file and the line."""


def too_deep(raw: bytes, limit: int = MAX_DEPTH) -> bool:
    """Whether arrays and objects nest more than ``limit`` deep in the JSON text ``raw`` (brackets inside strings not
    counted): found without parsing, so a line nested 100,000 deep costs one scan, never a ``RecursionError``."""
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return False
    depth = 0
    for m in _BRACKET.finditer(_STRING.sub(b"", raw)):
        depth += 1 if m.group() in (b"[", b"{") else -1
        if depth > limit:
            return True
    return False


def loads(raw: bytes | str) -> Any:
    """``json.loads`` for a file vase reads back, with a nesting limit (:data:`MAX_DEPTH`): text nested deeper, or
    holding an integer of more digits than Python converts, is an :class:`Unparseable` with the reason (never a
    ``RecursionError``); text that is not JSON is ``json.JSONDecodeError`` / ``UnicodeDecodeError`` as from
    ``json.loads``. ``NaN`` / ``Infinity`` parse (to name the field, :func:`check_sample` refuses them)."""
    data = raw.encode("utf-8", "surrogatepass") if isinstance(raw, str) else raw
    if too_deep(data):
        raise Unparseable(f"arrays or objects nested more than {MAX_DEPTH} deep (vase writes at most 4)")
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise
    except RecursionError:
        raise Unparseable(f"arrays or objects nested more than {MAX_DEPTH} deep (vase writes at most 4)") from None
    except ValueError as err:  # an integer of more than sys.get_int_max_str_digits() digits
        raise Unparseable(f"a number beyond any count vase writes ({' '.join(str(err).split())})") from None


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return (isinstance(v, int) and not isinstance(v, bool)) or (isinstance(v, float) and math.isfinite(v))


#: the largest token count a line may hold (prompt, output, held tokens, decode steps, evictions): far past any
#: context a model has; a count beyond it is a hand edit or damage, never data
MAX_TOKENS = 10**9
#: the most bytes a line's KV figures may hold (1 PiB: far past any machine's memory)
MAX_BYTES = 2**50
#: the most seconds a per-sample or per-session time may hold (a year)
MAX_SECONDS = 365 * 24 * 3600
#: a seed: a 64-bit integer (signed or not)
SEED_RANGE = (-(2**63), 2**64 - 1)
#: the most ranks a data-parallel run has
MAX_RANKS = 2**20
#: what :class:`vase.engine.decode.Decoder` ends a sample with (= ``vase.engine.decode.FINISH_REASONS``)
FINISH_REASONS = ("eos", "stop", "length", "loop", "nonfinite", "prompt_too_long")
#: ``loop_class``: the detectors' classes (:func:`vase.run.metrics.classify_output`) and the two not decoded
LOOP_CLASSES = ("loop", "garbage", "truncated", "ok", "nonfinite", "prompt_too_long")

Check = tuple[Callable[[Any], bool], str]


def _count(hi: int, unit: str = "") -> Check:
    return (lambda v: _is_int(v) and 0 <= v <= hi, f"an integer >= 0 and <= {hi:,}{unit}")


def _opt(check: Check) -> Check:
    return (lambda v: v is None or check[0](v), f"{check[1]} or null")


def _number(lo: float, hi: float, lo_open: bool = False) -> Check:
    return (
        lambda v: _is_number(v) and (v > lo if lo_open else v >= lo) and v <= hi,
        f"a finite number {'>' if lo_open else '>='} {lo:g} and <= {hi:,}",
    )


def _one_of(values: tuple[str, ...]) -> Check:
    return (lambda v: v in values, f"one of {', '.join(values)}")


def _bytes_by_type(v: Any) -> bool:
    return isinstance(v, dict) and all(isinstance(k, str) and _COUNT_BYTES[0](x) for k, x in v.items())


_BOOL: Check = (lambda v: isinstance(v, bool), "true or false (a JSON boolean)")
_STR: Check = (lambda v: isinstance(v, str), "a string")
_OPT_STR: Check = (lambda v: v is None or isinstance(v, str), "a string or null")
_COUNT_TOKENS = _count(MAX_TOKENS)
_COUNT_BYTES = _count(MAX_BYTES, " (bytes)")
_TOKENS = _number(0, MAX_TOKENS)
_SECONDS = _number(0, MAX_SECONDS)
_SEED: Check = (
    lambda v: v is None or (_is_int(v) and SEED_RANGE[0] <= v <= SEED_RANGE[1]),
    "a 64-bit integer or null",
)
_ANSWER: Check = (
    lambda v: v is None or isinstance(v, str) or _is_number(v),
    "a string, a number or null (the extracted answer)",
)

#: field -> (test, what it must be): a type *and* a range for every number; ``correct_<rule>`` and
#: ``extracted_<rule>`` as ``correct`` and ``extracted``
SCHEMA: dict[str, Check] = {
    "problem_id": _STR,
    "sample": _COUNT_TOKENS,  # below the run's n_samples: checked against protocol.json (vase.run.validate)
    "seed": _SEED,
    "correct": _BOOL,
    "extracted": _ANSWER,
    "grader": _STR,
    "finish_reason": _one_of(FINISH_REASONS),
    "error": _OPT_STR,
    "output": _STR,
    "cut_by_limit": _BOOL,
    "cut_in_thinking": _BOOL,
    "loop_class": _one_of(LOOP_CLASSES),
    "prompt_tokens": _COUNT_TOKENS,
    "output_tokens": _COUNT_TOKENS,
    "budget": _opt(_COUNT_TOKENS),
    "held_tokens_end": _COUNT_TOKENS,
    "held_tokens_mean": _opt(_TOKENS),
    "held_tokens_max": _opt(_COUNT_TOKENS),
    "kv_retained_bytes_mean": _opt(_number(0, MAX_BYTES)),
    "kv_retained_bytes_peak": _opt(_number(0, MAX_BYTES)),
    # full-cache bytes over held bytes: > 0 (a cache holds at least one token)
    "compression_ratio": _number(0, MAX_TOKENS, lo_open=True),
    "compression_ratio_full_layers": _number(0, MAX_TOKENS, lo_open=True),
    "kv_held_bytes_end": _COUNT_BYTES,
    "kv_full_bytes_end": _COUNT_BYTES,
    "kv_held_bytes_end_by_type": (
        _bytes_by_type,
        f"an object of layer type -> bytes (integers >= 0 and <= {MAX_BYTES:,})",
    ),
    "decode_steps": _COUNT_TOKENS,
    "evictions": _COUNT_TOKENS,
    "eviction_seconds": _SECONDS,
    "attended_tokens": _opt(_TOKENS),
    "meta": (lambda v: isinstance(v, dict), "an object"),
    "rank": _count(MAX_RANKS),
    "policy_output_checked": _BOOL,  # generation.check_policy_output=true (planning refuses a mixed resume)
}
PREFIXED: dict[str, Check] = {"correct_": _BOOL, "extracted_": _ANSWER}


def _nonfinite(value: Any, name: str) -> str | None:
    """The dotted name of the first non-finite float in ``value`` (``name`` itself for a scalar), or ``None``."""
    if isinstance(value, float):
        return None if math.isfinite(value) else name
    if isinstance(value, Mapping):
        for k, v in value.items():
            found = _nonfinite(v, f"{name}.{k}")
            if found:
                return found
    if isinstance(value, list):
        for i, v in enumerate(value):
            found = _nonfinite(v, f"{name}[{i}]")
            if found:
                return found
    return None


def _check_of(key: str) -> Check | None:
    if key in SCHEMA:
        return SCHEMA[key]
    for prefix, check in PREFIXED.items():
        if key.startswith(prefix) and len(key) > len(prefix):
            return check
    return None


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def check_sample(row: Any, path: Path, lineno: int, for_metrics: bool = False) -> None:
    """Raise :class:`BadSample` unless ``row`` (line ``lineno`` of ``path``) is a sample (see the module docstring).

    ``for_metrics``: the line must also have every field of :data:`METRIC_FIELDS`.
    """
    fix = "fix or delete that line, or restore the file from a copy, then rerun (nothing was counted or written)"
    if not isinstance(row, dict):
        raise BadSample(
            f"{path}: line {lineno} is not a sample (a JSON {type(row).__name__}; every line vase writes is an "
            f"object with {', '.join(SAMPLE_FIELDS)}); {fix}"
        )
    required = SAMPLE_FIELDS + (METRIC_FIELDS if for_metrics else ())
    missing = [k for k in required if k not in row]
    if missing:
        what = (
            "a sample" if not for_metrics or any(k not in row for k in SAMPLE_FIELDS) else "a sample the metrics read"
        )
        raise BadSample(
            f"{path}: line {lineno} is not {what} (an object without {', '.join(missing)}; every line vase writes is "
            f"an object with {', '.join(required)}); {fix}"
        )
    for key, value in row.items():
        bad = _nonfinite(value, key)
        if bad:
            raise BadSample(
                f"{path}: line {lineno}: field {bad} is not a finite number (NaN or infinity is an error, never data); "
                f"{fix}"
            )
        check = _check_of(key)
        if check is not None and not check[0](value):
            raise BadSample(
                f"{path}: line {lineno}: field {key} must be {check[1]}, got {_shown(value)} "
                f"(a JSON {_json_type(value)}); {fix}"
            )


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"


def first_nonfinite(obj: Any) -> str | None:
    """The dotted key of the first non-finite number in a JSON-like ``obj`` (``None`` when every number is finite)."""
    found = _nonfinite(obj, "")
    return None if found is None else (found.lstrip(".") or "<the value>")


def _metric_check(key: str) -> Check | None:
    """The type and range of a ``metrics.json`` / ``throughput.jsonl`` field, by its name (``None``: only finite)."""
    if key in ("complete",):
        return _BOOL
    if key.endswith("_stderr") or "_rate" in key or key.startswith(("accuracy", "pass@")):
        return _opt(_number(0, 1))
    if key in ("problems", "problems_expected", "samples", "correct_samples", "nonfinite_samples"):
        return _COUNT_TOKENS
    if key in ("prompt_too_long_samples", "evictions", "prefills", "prefill_tokens", "decode_steps", "row_steps"):
        return _opt(_COUNT_TOKENS)
    if key in ("tokens", "rows", "rows_in_flight", "capacity_per_row", "rank"):
        return _opt(_COUNT_TOKENS)
    if "bytes" in key:
        return _opt(_number(0, MAX_BYTES))
    if "seconds" in key:
        return _opt(_number(0, MAX_SECONDS))
    if key in ("mean_output_tokens", "held_tokens", "attended_tokens", "rows_in_flight_mean", "tokens_per_correct"):
        return _opt(_TOKENS)
    return None


def number_problem(obj: Mapping, what: str = "field") -> str | None:
    """Why ``obj`` (``metrics.json``, or a ``throughput.jsonl`` line) is not what vase writes, on one line: the first
    non-finite number or a figure outside its type and range (a rate outside [0, 1], a count that is not an
    integer or past :data:`MAX_TOKENS`, bytes past :data:`MAX_BYTES`); ``None`` when every figure is in range."""
    bad = first_nonfinite(obj)
    if bad is not None:
        return f"{what} {bad} is not a finite number"
    for key, value in obj.items():
        check = _metric_check(str(key))
        if check is None:
            continue
        # a figure, or a mapping of figures of that kind (``kv_held_bytes_mean_by_type``: layer type -> bytes)
        for name, v in value.items() if isinstance(value, Mapping) else [(None, value)]:
            if not check[0](v):
                return f"{what} {key}{'' if name is None else f'.{name}'} must be {check[1]}, got {_shown(v)}"
    return None
