"""What a run writes per sample (``samples.jsonl``) and per decode session (``throughput.jsonl``), and the metrics
computed from them (``metrics.json``).

Every number that describes the outputs (accuracy, failure rates, evictions, held and full-cache KV bytes) comes
from ``samples.jsonl``, one line per finished sample, each sample counted once: a run resumed after a crash has the
same metrics as an uninterrupted one. Wall-clock measurements (decode throughput, prefill time, peak memory, the
static allocation) come from ``throughput.jsonl``, one line per stretch of decoding, so they describe the sessions
that actually ran.

Grading: ``extracted`` / ``correct`` / ``grade_detail`` are the run's grader rule (``grader``, from
``protocol.grader``). A task with several rules (boxed answers: ``strict`` and ``last_boxed``, docs/protocol.md)
grades every output under each, and the sample also stores ``extracted_<rule>`` (what the rule read, or ``None``) and
``correct_<rule>`` apart, as lm-eval-harness keeps the filtered answer apart from the metric. The metrics then hold
``accuracy`` (the run's rule) and, for each rule, ``accuracy_<rule>``, ``accuracy_<rule>_stderr``,
``pass@<k>_<rule>`` and ``answered_rate_<rule>``, all from the same outputs.

Per-sample flags (definitions used in the docs):

* ``finish_reason``: ``eos`` (an EOS token), ``stop`` (a stop string), ``length`` (cut by the length limit
  ``max_length``), ``loop`` (``generation.stop_on_loop``: the repetition-loop detector fired, the sample was ended),
  ``nonfinite`` (the logits became NaN/inf: a numerical failure, reported with ``error``; its tokens are kept up to
  the failure), ``prompt_too_long`` (the prompt leaves no room under ``max_length``; not decoded).
* ``cut_by_limit``: ``finish_reason == "length"``.
* ``cut_in_thinking``: a thinking run's output (``output``: the text of :mod:`vase.reasoning`, where a harmony
  output without a ``final`` message is an unclosed ``<think>``) has no closing ``</think>`` (a ``<think>`` left
  open counts too), so no answer could be extracted; usually the limit cut it (then ``cut_by_limit`` is true as
  well), but a sample can also end at EOS without closing its thinking. Without thinking, only an output that
  opens ``<think>`` itself and never closes it.
* ``loop_class``: ``loop`` / ``garbage`` / ``truncated`` / ``ok`` by the paper's detectors (method.md §4, first that
  applies): ``truncated`` is ``cut_in_thinking`` for a thinking run and ``cut_by_limit`` otherwise; or ``nonfinite`` /
  ``prompt_too_long`` for samples that were not decoded to the end (never counted as loops).

Long module: a sample's line, the metrics read from those lines and the manifest are one record format.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from vase.engine.capture import merge_reports, report_delta
from vase.run.metrics import classify_output, mean_pass_at_1, mean_pass_at_k
from vase.run.results import (
    THROUGHPUT,
    append_jsonl,
    device_info,
    git_sha,
    library_versions,
    peak_memory_bytes,
    read_samples,
    read_throughput,
    write_json,
)
from vase.run.validate import missing_note, partial_fields

NOT_DECODED = ("nonfinite", "prompt_too_long")
#: a sample field that a newer release added -> the metrics read from it (None when only some lines carry the field)
METRICS_OF_FIELD = {
    "held_tokens_mean": ("held_tokens",),
    "kv_retained_bytes_mean": ("kv_retained_bytes_mean",),
    "kv_retained_bytes_peak": ("kv_retained_bytes_peak",),
    "compression_ratio_full_layers": ("compression_ratio_full_layers",),
    "kv_held_bytes_end_by_type": ("kv_held_bytes_mean_by_type",),
    "attended_tokens": ("attended_tokens",),
    "evictions": ("evictions",),
    "eviction_seconds": ("eviction_seconds",),
    "cut_by_limit": ("cut_by_limit_rate",),
    "cut_in_thinking": ("cut_in_thinking_rate",),
}
THROUGHPUT_EVERY_S = 30.0  # a throughput.jsonl line at least this often while decoding
PROGRESS_EVERY_S = 5.0  # the progress bar's tok/s and rows at most this often


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


def retained_kv_bytes(
    held_mean: float | None, held_max: int | None, bytes_per_token: int, ring: tuple[float, float] = (0.0, 0.0)
) -> dict:
    """``kv_retained_bytes_mean`` / ``kv_retained_bytes_peak``: the K/V bytes a sample's cache holds, over the model's
    every layer and KV head (``bytes_per_token`` per token the full-attention layers hold, plus ``ring``: the
    sliding layers' bytes, mean and peak), averaged over its decode steps / at the most it held (``None`` where the
    engine did not report the held-token count)."""
    return {
        "kv_retained_bytes_mean": held_mean * bytes_per_token + ring[0] if held_mean is not None else None,
        "kv_retained_bytes_peak": held_max * bytes_per_token + ring[1] if held_max is not None else None,
    }


def ring_tokens(prompt_len: int, steps: int, window: int) -> tuple[float, int]:
    """Tokens a sliding layer's ring holds over a sample's ``steps`` decode steps (after each step's append):
    ``(mean, peak)`` of ``min(prompt_len + t, window)`` for ``t = 1..steps`` (``min(prompt_len, window)`` without a
    step)."""
    if steps < 1:
        return float(min(prompt_len, window)), min(prompt_len, window)
    below = max(0, min(steps, window - prompt_len - 1))  # steps whose ring is not full yet
    total = below * prompt_len + below * (below + 1) // 2 + (steps - below) * window
    return total / steps, min(prompt_len + steps, window)


def kv_by_type(geometry, held: int, total: int) -> dict[str, int]:
    """K/V bytes per layer type of a sample at its end: its full-attention layers hold ``held`` of its ``total``
    tokens, its sliding layers ``min(total, window)``, its linear-attention layers their fixed state
    (:meth:`vase.engine.geometry.CacheGeometry.held_bytes_by_type`; a geometry of full layers only: those)."""
    return {k: int(v) for k, v in geometry.held_bytes_by_type(held, total).items()}


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
    grader: str = "strict",
    rules: tuple[str, ...] = (),
    policy=None,
    geometry=None,
) -> dict:
    """One line of ``samples.jsonl`` for a :class:`vase.engine.decode.Finished` sample and its grade.

    ``grade`` (a :class:`tasks.base.Grade`, ``None`` when the sample was not decoded) is read under ``grader``; with
    several ``rules`` (the task's ``grader_rules``) every rule's answer and verdict is stored too.
    ``policy`` (when given) supplies the eviction schedule for ``held_tokens_end`` (its ``held_after``: a period other
    than the window, prefill compression); without it, VaSE's scaffold from ``budget`` and ``window``.
    ``geometry`` (the decoder's :class:`~vase.engine.geometry.CacheGeometry`, when given) accounts the K/V bytes per
    layer type (``kv_held_bytes_end_by_type``; sliding layers hold their window, linear-attention layers their state)
    and ``compression_ratio`` is then the
    whole model's cache (every layer type) against the full cache's; ``compression_ratio_full_layers`` is the
    full-attention layers' own (tokens of the sequence / tokens held). Without it every layer counts as full
    attention at ``bytes_per_token``.
    """
    reason = finished.finish_reason
    p, n_tok = finished.prompt_len, len(finished.tokens)
    total = p + n_tok
    if not n_tok:
        held = total
    elif policy is not None:
        held = policy.held_after(p, n_tok - 1) + 1  # the last token is sampled, never appended
    else:
        held = held_at_end(total, p, budget, window, evicts)
    st = finished.stats
    if geometry is not None:
        held_by_type, full_by_type = kv_by_type(geometry, held, total), kv_by_type(geometry, total, total)
    else:
        held_by_type = {"full_attention": held * bytes_per_token}
        full_by_type = {"full_attention": total * bytes_per_token}
    ring = (0.0, 0.0)
    if geometry is not None and geometry.sliding_window is not None:
        n_ring = len(geometry.layers_of("sliding_attention")) * geometry.bytes_per_token_of_layer
        mean, peak = ring_tokens(p, st.get("decode_steps", 0), geometry.sliding_window)
        ring = (mean * n_ring, float(peak * n_ring))
    error = None
    if reason == "nonfinite":
        error = f"non-finite logits (NaN/inf) after {n_tok} generated tokens"
        loop_class = "nonfinite"
    elif reason == "prompt_too_long":
        error = f"the prompt has {p} tokens, not less than generation.max_length={max_length}"
        loop_class = "prompt_too_long"
    else:
        loop_class = classify_output(text, reason != "length", thinking)
    chosen = grade.under(grader) if grade is not None else None
    by_rule = {}
    if len(rules) > 1:
        for rule in rules:
            g = grade.under(rule) if grade is not None else None
            by_rule[f"extracted_{rule}"] = g.extracted if g is not None else None
            by_rule[f"correct_{rule}"] = bool(g.correct) if g is not None else False
    return {
        "problem_id": problem.id,
        "sample": finished.sample,
        "seed": finished.seed,
        "output": text,
        "grader": grader,
        "extracted": chosen.extracted if chosen is not None else None,
        "correct": bool(chosen.correct) if chosen is not None else False,
        "grade_detail": chosen.detail if chosen is not None else reason,
        **by_rule,
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
        "held_tokens_max": st.get("held_tokens_max"),
        "compression_ratio": sum(full_by_type.values()) / sum(held_by_type.values()),
        "compression_ratio_full_layers": total / held,
        "kv_held_bytes_end": sum(held_by_type.values()),
        "kv_full_bytes_end": sum(full_by_type.values()),
        "kv_held_bytes_end_by_type": held_by_type,
        **retained_kv_bytes(
            st.get("held_tokens"),
            st.get("held_tokens_max"),
            bytes_per_token if geometry is None else geometry.bytes_per_token,
            ring,
        ),
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
    rows = read_samples(
        run_dir, for_metrics=True
    )  # schema-checked; samples.jsonl and, mid-way through a data-parallel run, the rank part files
    requested = set(problem_ids)
    # in (problem, sample) order: the sums below do not depend on the order the lines were written in (one process or
    # several ranks, grading inline or in the background)
    deduped = _dedup(rows, requested if restrict else None)
    by_problem = {pid: sorted(deduped[pid], key=lambda r: r["sample"]) for pid in sorted(deduped, key=str)}
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
    metrics.update(_accuracy(by_problem, "correct", "", pass_k))
    for rule in grader_rules(samples):
        metrics.update(_accuracy(by_problem, f"correct_{rule}", f"_{rule}", pass_k))
        metrics[f"answered_rate_{rule}"] = sum(r[f"extracted_{rule}"] is not None for r in samples) / n
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
        by_type = [r["kv_held_bytes_end_by_type"] for r in decoded if r.get("kv_held_bytes_end_by_type")]
        if by_type:  # per layer type (full_attention, sliding_attention, ...): the mean over decoded samples
            kinds = sorted({k for d in by_type for k in d})
            metrics["kv_held_bytes_mean_by_type"] = {k: sum(d.get(k, 0) for d in by_type) / len(by_type) for k in kinds}
        ratios = [r["compression_ratio_full_layers"] for r in decoded if r.get("compression_ratio_full_layers")]
        if ratios:
            metrics["compression_ratio_full_layers"] = sum(ratios) / len(ratios)
        held = [r["held_tokens_mean"] for r in decoded if r.get("held_tokens_mean") is not None]
        metrics["held_tokens"] = sum(held) / len(held) if held else None
        metrics.update(retained_kv_metrics(decoded))
    metrics.update(cost_per_correct(samples, metrics.get("decode_seconds")))
    att = [r["attended_tokens"] for r in samples if r.get("attended_tokens") is not None]
    metrics["attended_tokens"] = sum(att) / len(att) if att else None
    groups = {pid: rs[0].get("meta", {}).get("year") for pid, rs in by_problem.items()}
    if len({g for g in groups.values() if g is not None}) > 1:
        for year in sorted({g for g in groups.values() if g is not None}):
            sub = [[r["correct"] for r in rs] for pid, rs in by_problem.items() if groups[pid] == year]
            metrics[f"accuracy/{year}"] = mean_pass_at_1(sub)
    partial = partial_fields(samples)  # a field only a newer release's lines carry: never averaged over a subset
    if partial:
        for name in partial:
            for key in METRICS_OF_FIELD.get(name, ()):
                metrics[key] = None
        metrics["fields_missing"] = missing_note(partial, n)
    return metrics


def retained_kv_metrics(decoded: list[dict]) -> dict:
    """``kv_retained_bytes_mean`` (the mean over samples of each sample's mean retained KV bytes) and
    ``kv_retained_bytes_peak`` (the most any sample held), over the samples that record them."""
    means = [r["kv_retained_bytes_mean"] for r in decoded if r.get("kv_retained_bytes_mean") is not None]
    peaks = [r["kv_retained_bytes_peak"] for r in decoded if r.get("kv_retained_bytes_peak") is not None]
    return {
        "kv_retained_bytes_mean": sum(means) / len(means) if means else None,
        "kv_retained_bytes_peak": max(peaks) if peaks else None,
    }


def cost_per_correct(samples: list[dict], decode_seconds: float | None) -> dict:
    """Cost per solved sample: ``tokens_per_correct`` (generated tokens of every sample / correct samples) and
    ``decode_seconds_per_correct`` (the run's decode wall time / correct samples); ``None`` without a correct one."""
    correct = sum(bool(r["correct"]) for r in samples)
    tokens = sum(r["output_tokens"] for r in samples)
    return {
        "correct_samples": correct,
        "tokens_per_correct": tokens / correct if correct else None,
        "decode_seconds_per_correct": decode_seconds / correct if correct and decode_seconds else None,
    }


def grader_rules(samples: list[dict]) -> list[str]:
    """The grader rules every one of ``samples`` was graded under (``correct_<rule>`` keys), in first-seen order."""
    if not samples:
        return []
    rules = [k[len("correct_") :] for k in samples[0] if k.startswith("correct_")]
    return [rule for rule in rules if all(f"correct_{rule}" in r for r in samples)]


def _accuracy(by_problem: dict[str, list[dict]], key: str, suffix: str, pass_k) -> dict:
    """``accuracy<suffix>``, its standard error over problems and the unbiased ``pass@k<suffix>``, from ``key``."""
    per_problem = [[bool(r[key]) for r in rs] for rs in by_problem.values()]
    out: dict[str, float] = {f"accuracy{suffix}": mean_pass_at_1(per_problem)}
    if len(per_problem) > 1:
        accs = [sum(p) / len(p) for p in per_problem]
        mean = sum(accs) / len(accs)
        out[f"accuracy{suffix}_stderr"] = math.sqrt(sum((a - mean) ** 2 for a in accs) / (len(accs) - 1) / len(accs))
    min_n = min(len(p) for p in per_problem)
    for k in pass_k:
        if k <= min_n:
            out[f"pass@{k}{suffix}"] = mean_pass_at_k(per_problem, k)
    return out


def _throughput(run_dir: Path) -> dict:
    """Wall-clock metrics summed over the decode sessions of ``throughput.jsonl``."""
    lines = read_throughput(run_dir)
    if not lines:
        return {}
    dec_s = sum(x["decode_seconds"] for x in lines)
    steps = sum(x["decode_steps"] for x in lines)
    prefills = sum(x["prefills"] for x in lines)
    tokens = sum(x["tokens"] for x in lines)
    compile_s = sum(x.get("compile_seconds", 0.0) for x in lines)  # older runs' lines have none
    steady_s = dec_s - compile_s
    return {
        "decode_tokens_per_second": tokens / dec_s if dec_s else None,
        "decode_seconds": dec_s,
        # a compiled step: the first forward of each row bucket, and the decode speed without it
        "compile_seconds": compile_s,
        "decode_tokens_per_second_after_compile": tokens / steady_s if compile_s and steady_s > 0 else None,
        # per row bucket of a compiled step: compile seconds, forwards, CUDA graphs recorded / replayed, skips (reason)
        "compile_buckets": merge_reports([x.get("buckets", []) for x in lines]),
        "prefill_seconds": sum(x["prefill_seconds"] for x in lines) / prefills if prefills else None,
        "rows_in_flight": max(x["rows"] for x in lines),
        "rows_in_flight_mean": sum(x["row_steps"] for x in lines) / steps if steps else None,
        "kv_allocated_bytes": max(x["kv_allocated_bytes"] for x in lines),
        "kv_allocated_bytes_per_row": max(x["kv_allocated_bytes_per_row"] for x in lines),
        "peak_memory_bytes": max(x["peak_memory_bytes"] for x in lines),
        "wall_seconds": sum(x["wall_seconds"] for x in lines),
    }


def row_maker(prep, problem, finished, text: str, geometry):
    """``grade -> line of samples.jsonl`` for one finished sample of the run ``prep`` (called once it is graded)."""

    checked = prep.policy.kind == "eviction" and bool(prep.cfg.generation.get("check_policy_output", False))

    def make(grade) -> dict:
        row = sample_row(
            problem,
            finished,
            text,
            grade,
            thinking=prep.thinking,
            budget=prep.cfg.budget if prep.policy.kind != "none" else None,
            window=prep.cfg.window,
            evicts=prep.policy.kind == "eviction",
            bytes_per_token=geometry.bytes_per_token,
            max_length=prep.max_length,
            grader=prep.grader,
            rules=prep.task.grader_rules,
            policy=prep.policy,
            geometry=geometry,
        )
        if checked:  # every keep() answer of this sample was checked (generation.check_policy_output)
            row["policy_output_checked"] = True
        return row

    return make


def rank_entry(rank: int | None, dec, model, plan, samples: int, grading: str) -> dict:
    """A process's entry in ``manifest.json``'s ``ranks`` (one per rank of a data-parallel run): where and how it
    decoded its ``samples``."""
    import socket

    return {
        "rank": 0 if rank is None else rank,
        "host": socket.gethostname(),
        "device": str(dec.device),
        "dtype": str(next(model.parameters()).dtype),
        "rows_in_flight": plan.rows,
        "samples": samples,
        "grading": grading,
    }


def write_manifest(prep, run_dir: Path, model, tokenizer, spec, dtype_reason: str, dec, plan, stop) -> None:
    """``manifest.json``: code, libraries, machine, the weights and dtype, the engine's sizing, data, protocol."""
    write_json(run_dir / "manifest.json", manifest(prep, model, tokenizer, spec, dtype_reason, dec, plan, stop))


def manifest(prep, model, tokenizer, spec, dtype_reason: str, dec, plan, stop) -> dict:
    """The content of ``manifest.json`` (see :func:`write_manifest`)."""
    cfg = prep.cfg
    return {
        "git_sha": git_sha(),
        "libraries": library_versions(),
        "device": device_info(),
        "model": {
            "name": spec.name,
            "revision": spec.revision,
            "resolved": spec.resolve(),
            # how the generated tokens became the recorded text (think_tags / harmony: vase/reasoning.py)
            "reasoning_format": spec.reasoning_format,
            "dtype": str(next(model.parameters()).dtype),
            "dtype_choice": dtype_reason,
            "attn_backend": dec.backend,
        },
        # backend and why, the SDPA kernel each kind of attention call lowers to here, device name, CUDA / cuDNN
        "attention": dec.attention_report(),
        # generation.compile: whether the decode step is compiled, why (auto's rule), the mode and the row buckets
        "compile": dec.compile_report(),
        "engine": {
            "batching": prep.batching,
            "rows_in_flight": plan.rows,
            "rows_choice": plan.reason,
            "capacity_per_row": dec.geometry.capacity,
            "capacity_choice": "cache_capacity(policy, longest prompt to decode, its output cap)",
            "kv_allocated_bytes": dec.geometry.kv_bytes,
            # per layer type (full_attention: the capacity; sliding_attention: the model's window; linear_attention:
            # a hybrid model's conv and recurrent states), every row
            "kv_allocated_bytes_by_type": {k: v * dec.geometry.rows for k, v in dec.geometry.kv_bytes_by_type.items()},
            "layer_types": {k: len(dec.geometry.layers_of(k)) for k in dict.fromkeys(dec.geometry.types)},
            "sliding_window": dec.geometry.sliding_window,
            "row_bytes": plan.row_bytes,
            "sync_every": dec.sync_every,
        },
        "dataset": prep.task.describe() if hasattr(prep.task, "describe") else {"name": prep.task.name},
        # hub, the authors' files (terarachang/VaSE@bfa2692) or another local copy (docs/protocol.md)
        "data_copy": prep.data_copy,
        "prompt_template": getattr(tokenizer, "chat_template", None),
        "thinking": prep.thinking,
        "sampling": asdict(prep.sampling),
        "max_length": prep.max_length,
        "seed": cfg.seed,
        "eos_token_ids": stop,
        "budget": cfg.budget if prep.policy.kind != "none" else None,
        # ratio=: {"tokens", "source", "ratio"} (the reference length and the setting it came from); null: budget=
        "budget_reference": prep.reference,
        "window": cfg.window,
        "policy": prep.policy.describe(),
    }


class ThroughputLog:
    """Writes ``throughput.jsonl`` lines (wall-clock stretches of one decoder) and drives the progress display."""

    def __init__(self, run_dir: Path, dec, path: Path | None = None, rank: int | None = None):
        """Lines go to ``path`` (default ``run_dir/throughput.jsonl``; a rank's part file in a data-parallel run,
        each line then tagged with its ``rank``)."""
        self.run_dir, self.dec = run_dir, dec
        self.path = path or Path(run_dir) / THROUGHPUT
        self.rank = rank
        self.decoded = 0  # samples out of the decoder (the bar counts the graded ones)
        self.t_start = self.t_last = time.perf_counter()
        self.t_show = 0.0
        self.last = asdict(dec.stats)
        self.last_buckets: list[dict] = []  # the decoder's capture report at the last line
        self.max_rows = 0

    def step(self, bar, info) -> None:
        self.max_rows = max(self.max_rows, info.active_rows)
        now = time.perf_counter()
        if now - self.t_show >= PROGRESS_EVERY_S:
            self.t_show = now
            self.show(bar, info.active_rows)
        if now - self.t_last >= THROUGHPUT_EVERY_S:
            self.flush()

    def show(self, bar, rows: int | None = None) -> None:
        """The bar counts graded samples; its postfix shows the decoded ones, tok/s and rows in flight."""
        st = self.dec.stats
        tps = st.row_steps / st.decode_seconds if st.decode_seconds else 0.0
        rows = self.dec.cache.n_live if rows is None else rows
        bar.set_postfix_str(f"decoded={self.decoded} tok/s={tps:.1f} rows={rows}", refresh=True)

    def sample(self, bar, correct: list[bool], run_logger) -> None:
        st = self.dec.stats
        acc = sum(correct) / len(correct) if correct else 0.0
        tps = st.tokens / st.decode_seconds if st.decode_seconds else 0.0
        run_logger.log_progress(
            {
                "progress/samples_done": len(correct),
                "progress/accuracy": acc,
                "progress/decode_tokens_per_second": tps,
                "progress/rows_in_flight": self.dec.cache.n_live,
            }
        )

    def flush(self) -> None:
        now = time.perf_counter()
        st = asdict(self.dec.stats)
        delta = {k: st[k] - self.last[k] for k in st if k != "max_live_rows"}
        if not delta["decode_steps"] and not delta["prefills"]:
            return
        buckets = self.dec.capture.report()  # compiled: per row bucket, compile seconds and CUDA-graph capture
        delta["buckets"], self.last_buckets = report_delta(buckets, self.last_buckets), buckets
        g = self.dec.geometry
        append_jsonl(
            self.path,
            [
                {
                    **({} if self.rank is None else {"rank": self.rank}),
                    **delta,
                    "rows": max(self.max_rows, 1),
                    "wall_seconds": now - self.t_last,
                    "kv_allocated_bytes": self.dec.cache.kv_bytes() or g.kv_bytes,
                    "kv_allocated_bytes_per_row": g.kv_bytes_per_row,
                    "capacity_per_row": g.capacity,
                    "peak_memory_bytes": peak_memory_bytes(self.dec.device),
                    "time": time.time(),
                }
            ],
        )
        self.last, self.t_last, self.max_rows = st, now, 0
