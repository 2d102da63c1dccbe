"""What a run writes per sample (``samples.jsonl``) and per decode session (``throughput.jsonl``), and the metrics
computed from them (``metrics.json``).

Every number that describes the outputs (accuracy, failure rates, evictions, held and full-cache KV bytes) comes
from ``samples.jsonl``, one line per finished sample, each sample counted once: a run resumed after a crash has the
same metrics as an uninterrupted one. Wall-clock measurements (decode throughput, prefill time, peak memory, the
static allocation) come from ``throughput.jsonl``, one line per stretch of decoding, so they describe the sessions
that actually ran.

Per-sample flags (definitions used in the docs):

* ``finish_reason``: ``eos`` (an EOS token), ``stop`` (a stop string), ``length`` (cut by the length limit
  ``max_length``), ``nonfinite`` (the logits became NaN/inf: a numerical failure, reported with ``error``; its tokens
  are kept up to the failure), ``prompt_too_long`` (the prompt leaves no room under ``max_length``; not decoded).
* ``cut_by_limit``: ``finish_reason == "length"``.
* ``cut_in_thinking``: the output ended inside the thinking (no ``</think>``) — cut by the limit while thinking, so
  nothing could be extracted (thinking runs only; a ``<think>`` left open counts too).
* ``loop_class``: ``loop`` / ``garbage`` / ``truncated`` / ``ok`` by the paper's detectors (method.md §4; the
  ``truncated`` class is "cut by the limit", inside the thinking for a thinking run), or ``nonfinite`` /
  ``prompt_too_long`` for samples that were not decoded to the end (never counted as loops).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from vase.run.metrics import classify_output, mean_pass_at_1, mean_pass_at_k
from vase.run.results import SAMPLES, THROUGHPUT, read_jsonl_tolerant

NOT_DECODED = ("nonfinite", "prompt_too_long")


def held_at_end(total: int, prompt_len: int, budget: int | None, window: int | None, evicts: bool) -> int:
    """Tokens the cache holds after ``total`` tokens (prompt + output) under the eviction schedule."""
    if not evicts or budget is None or total <= budget:
        return total
    held = prompt_len
    for _ in range(total - prompt_len - 1):  # the last token is sampled, never appended
        held += 1
        if held > budget and held % window == 0:
            held = budget
    return held + 1


def sample_row(
    problem,
    finished,
    text: str,
    grade,
    *,
    thinking: bool,
    budget: int | None,
    window: int | None,
    evicts: bool,
    bytes_per_token: int,
    max_length: int,
) -> dict:
    """One line of ``samples.jsonl`` for a :class:`vase.engine.decode.Finished` sample and its grade."""
    reason = finished.finish_reason
    p, n_tok = finished.prompt_len, len(finished.tokens)
    total = p + n_tok
    held = held_at_end(total, p, budget, window, evicts) if n_tok else total
    st = finished.stats
    error = None
    if reason == "nonfinite":
        error = f"non-finite logits (NaN/inf) after {n_tok} generated tokens"
        loop_class = "nonfinite"
    elif reason == "prompt_too_long":
        error = f"the prompt has {p} tokens, not less than generation.max_length={max_length}"
        loop_class = "prompt_too_long"
    else:
        loop_class = classify_output(text, reason != "length", thinking)
    return {
        "problem_id": problem.id,
        "sample": finished.sample,
        "seed": finished.seed,
        "output": text,
        "extracted": grade.extracted if grade is not None else None,
        "correct": bool(grade.correct) if grade is not None else False,
        "grade_detail": grade.detail if grade is not None else reason,
        "finish_reason": reason,
        "error": error,
        "cut_by_limit": reason == "length",
        "cut_in_thinking": bool(grade.truncated) if grade is not None else False,
        "loop_class": loop_class,
        "prompt_tokens": p,
        "output_tokens": n_tok,
        "budget": budget,
        "held_tokens_end": held,
        "held_tokens_mean": st.get("held_tokens"),
        "compression_ratio": total / held,
        "kv_held_bytes_end": held * bytes_per_token,
        "kv_full_bytes_end": total * bytes_per_token,
        "decode_steps": st.get("decode_steps", 0),
        "evictions": st.get("evictions", 0),
        "eviction_seconds": st.get("eviction_seconds", 0.0),
        "attended_tokens": st.get("attended_tokens"),
        "meta": problem.meta,
    }


def _dedup(rows: list[dict], ids: set[str] | None) -> dict[str, list[dict]]:
    """Samples per problem, each (problem, sample) once (the first line written wins)."""
    by_problem: dict[str, list[dict]] = defaultdict(list)
    seen = set()
    for r in rows:
        if ids is not None and r["problem_id"] not in ids:
            continue
        key = (r["problem_id"], r["sample"])
        if key not in seen:
            seen.add(key)
            by_problem[r["problem_id"]].append(r)
    return by_problem


def compute_metrics(
    run_dir: Path, problem_ids: Sequence[str], n_samples: int, info: dict, pass_k, restrict: bool = False
) -> dict:
    """The run's metrics, from ``samples.jsonl`` and ``throughput.jsonl`` (see the module docstring).

    Args:
        problem_ids: the problems this invocation asked for. The metrics describe what the directory holds: every
            problem with samples on disk, plus these (``restrict`` limits them to these, e.g. for a shard merge).
        info: policy, task, model, budget... copied into the metrics so they are self-describing.
    """
    rows = read_jsonl_tolerant(run_dir / SAMPLES)
    requested = set(problem_ids)
    by_problem = _dedup(rows, requested if restrict else None)
    expected = requested | set(by_problem) if not restrict else requested
    samples = [r for rs in by_problem.values() for r in rs]
    n = len(samples)
    metrics: dict[str, Any] = {
        "problems": len(by_problem),
        "problems_expected": len(expected),
        "samples": n,
        "complete": set(by_problem) >= expected and all(len(v) == n_samples for v in by_problem.values()),
        **info,
    }
    metrics.update(_throughput(run_dir))
    if not n:
        return metrics
    per_problem = [[r["correct"] for r in rs] for rs in by_problem.values()]
    metrics["accuracy"] = mean_pass_at_1(per_problem)
    if len(per_problem) > 1:
        accs = [sum(p) / len(p) for p in per_problem]
        mean = sum(accs) / len(accs)
        metrics["accuracy_stderr"] = math.sqrt(sum((a - mean) ** 2 for a in accs) / (len(accs) - 1) / len(accs))
    min_n = min(len(p) for p in per_problem)
    for k in pass_k:
        if k <= min_n:
            metrics[f"pass@{k}"] = mean_pass_at_k(per_problem, k)
    classes = [r["loop_class"] for r in samples]
    decoded = [r for r in samples if r["finish_reason"] not in NOT_DECODED]
    metrics.update(
        {
            "answered_rate": sum(r["extracted"] is not None for r in samples) / n,
            "loop_rate": classes.count("loop") / n,
            "garbage_rate": classes.count("garbage") / n,
            "truncation_rate": classes.count("truncated") / n,
            "cut_by_limit_rate": sum(bool(r.get("cut_by_limit")) for r in samples) / n,
            "cut_in_thinking_rate": sum(bool(r.get("cut_in_thinking")) for r in samples) / n,
            "nonfinite_rate": sum(r["finish_reason"] == "nonfinite" for r in samples) / n,
            "nonfinite_samples": sum(r["finish_reason"] == "nonfinite" for r in samples),
            "prompt_too_long_samples": sum(r["finish_reason"] == "prompt_too_long" for r in samples),
            "mean_output_tokens": sum(r["output_tokens"] for r in samples) / n,
            "compression_ratio": sum(r["compression_ratio"] for r in samples) / n,
            "evictions": sum(r.get("evictions", 0) for r in samples),
            "eviction_seconds": sum(r.get("eviction_seconds", 0.0) for r in samples),
        }
    )
    if decoded:
        metrics["kv_held_bytes_mean"] = sum(r["kv_held_bytes_end"] for r in decoded) / len(decoded)
        metrics["kv_full_bytes_mean"] = sum(r["kv_full_bytes_end"] for r in decoded) / len(decoded)
        metrics["kv_full_bytes_max"] = max(r["kv_full_bytes_end"] for r in decoded)
        held = [r["held_tokens_mean"] for r in decoded if r.get("held_tokens_mean") is not None]
        metrics["held_tokens"] = sum(held) / len(held) if held else None
    att = [r["attended_tokens"] for r in samples if r.get("attended_tokens") is not None]
    metrics["attended_tokens"] = sum(att) / len(att) if att else None
    groups = {pid: rs[0].get("meta", {}).get("year") for pid, rs in by_problem.items()}
    if len({g for g in groups.values() if g is not None}) > 1:
        for year in sorted({g for g in groups.values() if g is not None}):
            sub = [[r["correct"] for r in rs] for pid, rs in by_problem.items() if groups[pid] == year]
            metrics[f"accuracy/{year}"] = mean_pass_at_1(sub)
    return metrics


def _throughput(run_dir: Path) -> dict:
    """Wall-clock metrics summed over the decode sessions of ``throughput.jsonl``."""
    lines = read_jsonl_tolerant(run_dir / THROUGHPUT)
    if not lines:
        return {}
    dec_s = sum(x["decode_seconds"] for x in lines)
    steps = sum(x["decode_steps"] for x in lines)
    prefills = sum(x["prefills"] for x in lines)
    return {
        "decode_tokens_per_second": sum(x["tokens"] for x in lines) / dec_s if dec_s else None,
        "decode_seconds": dec_s,
        "prefill_seconds": sum(x["prefill_seconds"] for x in lines) / prefills if prefills else None,
        "rows_in_flight": max(x["rows"] for x in lines),
        "rows_in_flight_mean": sum(x["row_steps"] for x in lines) / steps if steps else None,
        "kv_allocated_bytes": max(x["kv_allocated_bytes"] for x in lines),
        "kv_allocated_bytes_per_row": max(x["kv_allocated_bytes_per_row"] for x in lines),
        "peak_memory_bytes": max(x["peak_memory_bytes"] for x in lines),
        "wall_seconds": sum(x["wall_seconds"] for x in lines),
    }
