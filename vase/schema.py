"""The one schema every line read back from ``samples.jsonl`` (and a rank's part file) is checked against.

Every reader of sample lines (resume, the metrics, a shard merge, the report, the dashboard) goes through
:func:`vase.run.results.read_samples`, which calls :func:`check_sample` on each line: a line whose fields have the
wrong type (``"correct": "false"``, a string where a count belongs) or hold a non-finite number (``NaN``,
``Infinity``, anywhere in the line) is a one-line :class:`BadSample` naming the file, the line number and the field,
raised before anything is counted from it or written after it. The types are those :func:`vase.run.records.sample_row`
writes; ``correct_<rule>`` / ``extracted_<rule>`` follow ``correct`` / ``extracted``.

:data:`SAMPLE_FIELDS` every line has; :data:`METRIC_FIELDS` a line needs for the metrics
(:func:`vase.run.records.compute_metrics` reads with ``for_metrics=True``). A field a line does not have is not
checked unless it is required; a field the schema does not know (a newer writer's) is only checked to be finite.
"""

from __future__ import annotations

import math
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


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return (isinstance(v, int) and not isinstance(v, bool)) or (isinstance(v, float) and math.isfinite(v))


Check = tuple[Callable[[Any], bool], str]
_BOOL: Check = (lambda v: isinstance(v, bool), "true or false (a JSON boolean)")
_STR: Check = (lambda v: isinstance(v, str), "a string")
_OPT_STR: Check = (lambda v: v is None or isinstance(v, str), "a string or null")
_COUNT: Check = (lambda v: _is_int(v) and v >= 0, "an integer >= 0")
_OPT_COUNT: Check = (lambda v: v is None or (_is_int(v) and v >= 0), "an integer >= 0 or null")
_INT: Check = (lambda v: _is_int(v), "an integer")
_OPT_INT: Check = (lambda v: v is None or _is_int(v), "an integer or null")
_NUMBER: Check = (lambda v: _is_number(v) and v >= 0, "a finite number >= 0")
_OPT_NUMBER: Check = (lambda v: v is None or (_is_number(v) and v >= 0), "a finite number >= 0 or null")
_ANSWER: Check = (
    lambda v: v is None or isinstance(v, str) or _is_number(v),
    "a string, a number or null (the extracted answer)",
)

#: field -> (test, what it must be); ``correct_<rule>`` and ``extracted_<rule>`` as ``correct`` and ``extracted``
SCHEMA: dict[str, Check] = {
    "problem_id": _STR,
    "sample": _COUNT,
    "seed": _OPT_INT,
    "correct": _BOOL,
    "extracted": _ANSWER,
    "grader": _STR,
    "finish_reason": _STR,
    "error": _OPT_STR,
    "output": _STR,
    "cut_by_limit": _BOOL,
    "cut_in_thinking": _BOOL,
    "loop_class": _STR,
    "prompt_tokens": _COUNT,
    "output_tokens": _COUNT,
    "budget": _OPT_COUNT,
    "held_tokens_end": _COUNT,
    "held_tokens_mean": _OPT_NUMBER,
    "held_tokens_max": _OPT_COUNT,
    "kv_retained_bytes_mean": _OPT_NUMBER,
    "kv_retained_bytes_peak": _OPT_NUMBER,
    "compression_ratio": _NUMBER,
    "kv_held_bytes_end": _COUNT,
    "kv_full_bytes_end": _COUNT,
    "decode_steps": _COUNT,
    "evictions": _COUNT,
    "eviction_seconds": _NUMBER,
    "attended_tokens": _OPT_NUMBER,
    "meta": (lambda v: isinstance(v, dict), "an object"),
    "rank": _COUNT,
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
