"""Aggregation: one row per (model, task, policy identity, operating point) from a loaded tree.

* **Accuracy** (pass@1, %): per-problem accuracy (mean over its samples), then mean over problems. Runs of the same
  identity (seeds, shards, resumes) are pooled; a sample is counted once (``problem_id``, ``sample``, ``seed``).
* **Standard error** (%): ``std(per-problem accuracy, ddof=1) / sqrt(n_problems)``.
* **Grader rules**: ``accuracy`` is the runs' own grader (``grader``); a task with boxed answers also has every rule's
  verdict on the same outputs (``accuracy_strict``, ``accuracy_last_boxed`` and their ``_se``, docs/protocol.md), NaN
  where a run did not record the rule.
* **Per-sample quantities** (``samples.jsonl``, the runner's :func:`~vase.run.records.compute_metrics` rules):
  failure-class rates over every sample; evictions and eviction seconds summed; KV held / full-cache bytes per sample
  and held tokens averaged over the samples decoded to the end (not ``nonfinite`` / ``prompt_too_long``); compression
  averaged over every sample; attended tokens over the samples that record them (Quest).
* **Wall-clock quantities** (``throughput.jsonl``, pooled over the lines of the group's runs): decode tokens/s
  ``= Σ tokens / Σ decode_seconds``; prefill seconds per prefill; rows in flight (max) and their mean per decode step
  ``Σ row_steps / Σ decode_steps``; the static KV allocation, per row and in all, and peak memory (max).
* A group with no ``samples.jsonl`` (resp. no ``throughput.jsonl``) takes those numbers from its runs'
  ``metrics.json``.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass

import numpy as np
import pandas as pd

from vase.analysis.labels import (
    FAILURE_CLASSES,
    LOOP_CLASSES,
    NOT_DECODED_CLASSES,
    _with_defaults,
    op_sort_key,
    policy_sort_key,
    slug,
    task_sort_key,
)
from vase.analysis.load import GRADER_RULES, Tree

logger = logging.getLogger(__name__)

# Per-sample efficiency columns of the summary (from samples.jsonl, else metrics.json).
SAMPLE_EFFICIENCY = (
    "evictions",
    "eviction_seconds",
    "kv_held_bytes_mean",
    "kv_full_bytes_mean",
    "kv_full_bytes_max",
    "held_tokens",
    "attended_tokens",
    "kv_retained_bytes_mean",
    "kv_retained_bytes_peak",
)
# Cost per solved sample (generated tokens of every sample, and decode seconds, per correct sample).
COST_COLUMNS = ("correct_samples", "tokens_per_correct", "decode_seconds_per_correct")
# Wall-clock columns of the summary (from throughput.jsonl, else metrics.json).
THROUGHPUT_METRICS = (
    "decode_tokens_per_second",
    "decode_seconds",
    "wall_seconds",
    "prefill_seconds",
    "rows_in_flight",
    "rows_in_flight_mean",
    "kv_allocated_bytes",
    "kv_allocated_bytes_per_row",
    "capacity_per_row",
    "peak_memory_bytes",
)


def per_problem_accuracy(samples: pd.DataFrame, column: str = "correct") -> pd.Series:
    """Mean correctness of each problem's samples (index: ``problem_id``), from ``column``."""
    return samples.assign(_c=samples[column].astype(bool)).groupby("problem_id")["_c"].mean()


def accuracy_and_se(samples: pd.DataFrame, column: str = "correct") -> tuple[float, float]:
    """pass@1 and its standard error over problems (fractions; SE is NaN with fewer than two problems)."""
    if samples.empty:
        return float("nan"), float("nan")
    acc = per_problem_accuracy(samples, column).astype(float)
    se = float(acc.std(ddof=1) / math.sqrt(len(acc))) if len(acc) > 1 else float("nan")
    return float(acc.mean()), se


def _num(s: pd.DataFrame, col: str) -> pd.Series:
    return pd.to_numeric(s[col], errors="coerce") if col in s else pd.Series(np.nan, index=s.index)


def _mean(x: pd.Series) -> float:
    x = x.dropna()
    return float(x.mean()) if len(x) else float("nan")


def _flag_rate(s: pd.DataFrame, col: str) -> float:
    """% of samples with the flag set (NaN when no sample records it, e.g. runs written before the flag existed)."""
    vals = s[col].dropna() if col in s else pd.Series(dtype=object)
    return 100 * float(vals.astype(bool).sum()) / len(s) if len(vals) else float("nan")


def _group_metrics_from_samples(s: pd.DataFrame) -> dict:
    acc, se = accuracy_and_se(s)
    n = len(s)
    out = {"problems": int(s["problem_id"].nunique()), "samples": n, "accuracy": 100 * acc, "accuracy_se": 100 * se}
    graders = s["grader"].fillna("strict") if "grader" in s else pd.Series("strict", index=s.index)
    out["grader"] = ",".join(sorted(set(graders)))
    for rule in GRADER_RULES:
        col = f"correct_{rule}"
        has = col in s and bool(s[col].notna().all())
        acc_r, se_r = accuracy_and_se(s, col) if has else (float("nan"), float("nan"))
        out[f"accuracy_{rule}"], out[f"accuracy_{rule}_se"] = 100 * acc_r, 100 * se_r
        out[f"answered_rate_{rule}"] = 100 * float(s[f"answered_{rule}"].astype(bool).mean()) if has else float("nan")
    classes = s["loop_class"].fillna("ok")
    for c in FAILURE_CLASSES:
        out[f"{c}_rate"] = 100 * float((classes == c).mean())
    for c in NOT_DECODED_CLASSES:
        out[f"{c}_samples"] = int((s["finish_reason"] == c).sum())
    out["cut_by_limit_rate"] = _flag_rate(s, "cut_by_limit")
    out["cut_in_thinking_rate"] = _flag_rate(s, "cut_in_thinking")
    out["answered_rate"] = 100 * float(s["answered"].mean())
    out["mean_output_tokens"] = float(s["output_tokens"].mean())
    out["compression_ratio"] = _mean(_num(s, "compression_ratio"))
    decoded = s[~s["finish_reason"].isin(NOT_DECODED_CLASSES)]
    out["evictions"] = float(_num(s, "evictions").sum(min_count=1))
    out["eviction_seconds"] = float(_num(s, "eviction_seconds").sum(min_count=1))
    out["kv_held_bytes_mean"] = _mean(_num(decoded, "kv_held_bytes_end"))
    out["kv_full_bytes_mean"] = _mean(_num(decoded, "kv_full_bytes_end"))
    full = _num(decoded, "kv_full_bytes_end").dropna()
    out["kv_full_bytes_max"] = float(full.max()) if len(full) else float("nan")
    out["held_tokens"] = _mean(_num(decoded, "held_tokens_mean"))
    out["attended_tokens"] = _mean(_num(s, "attended_tokens"))
    mean_b, peak_b = retained_bytes(decoded)
    out["kv_retained_bytes_mean"] = _mean(mean_b)
    out["kv_retained_bytes_peak"] = float(peak_b.max()) if peak_b.notna().any() else float("nan")
    out["correct_samples"] = int(s["correct"].astype(bool).sum())
    out["tokens_per_correct"] = _per(float(_num(s, "output_tokens").sum()), out["correct_samples"])
    return out


def _per(total: float, count: int) -> float:
    return total / count if count and not math.isnan(total) else float("nan")


def retained_bytes(s: pd.DataFrame) -> tuple[pd.Series, pd.Series]:
    """Per sample: the mean and the peak K/V bytes its cache retained (over every layer and KV head).

    From ``kv_retained_bytes_mean`` / ``_peak`` where the run recorded them; a run written before them gets the mean
    from ``held_tokens_mean`` x bytes per token (``kv_full_bytes_end / (prompt + output tokens)``), the peak NaN.
    """
    mean, peak = _num(s, "kv_retained_bytes_mean"), _num(s, "kv_retained_bytes_peak")
    total = _num(s, "prompt_tokens") + _num(s, "output_tokens")
    per_token = _num(s, "kv_full_bytes_end") / total.where(total > 0)
    return mean.fillna(_num(s, "held_tokens_mean") * per_token), peak


def _json_values(ms: list[dict], key: str) -> list[float]:
    return [float(m[key]) for m in ms if isinstance(m.get(key), (int, float)) and not isinstance(m.get(key), bool)]


def _wmean(ms: list[dict], key: str, scale: float = 1.0) -> float:
    """Mean of ``key`` over ``metrics.json`` files, weighted by their problem counts (NaN when none has it)."""
    vals = [(float(m[key]), float(m.get("problems") or 0)) for m in ms if isinstance(m.get(key), (int, float))]
    if not vals:
        return float("nan")
    if not sum(w for _, w in vals):
        vals = [(v, 1.0) for v, _ in vals]
    return scale * sum(v * w for v, w in vals) / sum(w for _, w in vals)


def _group_metrics_from_json(ms: list[dict]) -> dict:
    """Fallback when no run of a group has samples on disk: combine ``metrics.json`` files."""
    se = 100 * ms[0]["accuracy_stderr"] if len(ms) == 1 and ms[0].get("accuracy_stderr") is not None else float("nan")
    n = int(sum(m.get("samples") or 0 for m in ms))
    rates = {"loop": "loop_rate", "garbage": "garbage_rate", "truncated": "truncation_rate"}
    out = {
        "problems": int(sum(m.get("problems") or 0 for m in ms)),
        "samples": n,
        "accuracy": _wmean(ms, "accuracy", 100),
        "accuracy_se": se,
        "grader": ",".join(sorted({str(m.get("grader", "strict")) for m in ms})),
    }
    for rule in GRADER_RULES:
        out[f"accuracy_{rule}"] = _wmean(ms, f"accuracy_{rule}", 100)
        one = len(ms) == 1 and ms[0].get(f"accuracy_{rule}_stderr") is not None
        out[f"accuracy_{rule}_se"] = 100 * ms[0][f"accuracy_{rule}_stderr"] if one else float("nan")
        out[f"answered_rate_{rule}"] = _wmean(ms, f"answered_rate_{rule}", 100)
    for c, key in rates.items():
        out[f"{c}_rate"] = _wmean(ms, key, 100)
    for c in NOT_DECODED_CLASSES:  # exact counts (a run that does not record them had none)
        out[f"{c}_samples"] = int(sum(_json_values(ms, f"{c}_samples")))
        out[f"{c}_rate"] = 100 * out[f"{c}_samples"] / n if n else 0.0
    known = [out[f"{c}_rate"] for c in (*rates, *NOT_DECODED_CLASSES)]
    out["ok_rate"] = 100 - sum(0.0 if math.isnan(r) else r for r in known)
    out["cut_by_limit_rate"] = _wmean(ms, "cut_by_limit_rate", 100)
    out["cut_in_thinking_rate"] = _wmean(ms, "cut_in_thinking_rate", 100)
    out["answered_rate"] = _wmean(ms, "answered_rate", 100)
    out["mean_output_tokens"] = _wmean(ms, "mean_output_tokens")
    out["compression_ratio"] = _wmean(ms, "compression_ratio")
    for key in ("evictions", "eviction_seconds"):
        vals = _json_values(ms, key)
        out[key] = float(sum(vals)) if vals else float("nan")
    for key in ("kv_held_bytes_mean", "kv_full_bytes_mean", "held_tokens", "attended_tokens", "kv_retained_bytes_mean"):
        out[key] = _wmean(ms, key)
    peaks = _json_values(ms, "kv_retained_bytes_peak")
    out["kv_retained_bytes_peak"] = max(peaks) if peaks else float("nan")
    out["correct_samples"] = int(sum(_json_values(ms, "correct_samples")))
    tokens = sum(float(m.get("mean_output_tokens") or 0) * float(m.get("samples") or 0) for m in ms)
    out["tokens_per_correct"] = _per(tokens, out["correct_samples"])
    full = _json_values(ms, "kv_full_bytes_max")
    out["kv_full_bytes_max"] = max(full) if full else float("nan")
    return out


def _throughput_metrics(t: pd.DataFrame) -> dict:
    """The wall-clock columns from ``throughput.jsonl`` lines (the rules of the module docstring)."""
    if t.empty:
        return dict.fromkeys(THROUGHPUT_METRICS, float("nan"))

    def total(col: str) -> float:
        return float(_num(t, col).sum(min_count=1))

    def top(col: str) -> float:
        x = _num(t, col).dropna()
        return float(x.max()) if len(x) else float("nan")

    def ratio(a: float, b: float) -> float:
        return a / b if b and not math.isnan(a) and not math.isnan(b) else float("nan")

    return {
        "decode_tokens_per_second": ratio(total("tokens"), total("decode_seconds")),
        "decode_seconds": total("decode_seconds"),
        "wall_seconds": total("wall_seconds"),
        "prefill_seconds": ratio(total("prefill_seconds"), total("prefills")),
        "rows_in_flight": top("rows"),
        "rows_in_flight_mean": ratio(total("row_steps"), total("decode_steps")),
        "kv_allocated_bytes": top("kv_allocated_bytes"),
        "kv_allocated_bytes_per_row": top("kv_allocated_bytes_per_row"),
        "capacity_per_row": top("capacity_per_row"),
        "peak_memory_bytes": top("peak_memory_bytes"),
    }


def _throughput_from_json(ms: list[dict]) -> dict:
    """Fallback when no run of a group has ``throughput.jsonl``: combine the wall-clock numbers of ``metrics.json``."""
    out = dict.fromkeys(THROUGHPUT_METRICS, float("nan"))
    for key in ("rows_in_flight", "kv_allocated_bytes", "kv_allocated_bytes_per_row", "peak_memory_bytes"):
        vals = _json_values(ms, key)
        out[key] = max(vals) if vals else float("nan")
    for key in ("decode_seconds", "wall_seconds"):
        vals = _json_values(ms, key)
        out[key] = float(sum(vals)) if vals else float("nan")
    for key in ("prefill_seconds", "rows_in_flight_mean"):
        out[key] = _wmean(ms, key)
    timed = [m for m in ms if _json_values([m], "decode_tokens_per_second") and _json_values([m], "decode_seconds")]
    if timed and len(timed) == len(_json_values(ms, "decode_tokens_per_second")):  # tokens = tok/s × seconds
        seconds = sum(m["decode_seconds"] for m in timed)
        tokens = sum(m["decode_tokens_per_second"] * m["decode_seconds"] for m in timed)
        out["decode_tokens_per_second"] = tokens / seconds if seconds else float("nan")
    else:
        out["decode_tokens_per_second"] = _wmean(ms, "decode_tokens_per_second")
    return out


def _group_throughput(t: pd.DataFrame, saved: list[dict]) -> dict:
    return _throughput_metrics(t) if not t.empty else _throughput_from_json(saved)


def summarize(tree: Tree) -> pd.DataFrame:
    """One row per (model, task, policy identity, operating point), sorted (full cache first).

    Columns: ``model``, ``task``, ``policy``, ``method``, ``policy_name``, ``params``, ``op`` (NaN for the full
    cache), ``op_kind``, ``budget`` (the budgets, as text), ``ratio``, ``runs``, ``seeds``, ``complete``, ``problems``,
    ``samples``, ``accuracy`` and ``accuracy_se`` (%) under the runs' ``grader``, ``accuracy_<rule>`` and
    ``accuracy_<rule>_se`` (%) for every grader rule, ``{loop,garbage,truncated,ok,nonfinite,prompt_too_long}_rate``,
    ``cut_by_limit_rate``, ``cut_in_thinking_rate`` and ``answered_rate`` (%), ``nonfinite_samples``,
    ``prompt_too_long_samples``, ``mean_output_tokens``, ``compression_ratio``, :data:`SAMPLE_EFFICIENCY`,
    :data:`THROUGHPUT_METRICS`, ``run_dirs``.
    """
    runs = tree.runs
    rows = []
    for key, grp in runs.groupby(["model", "task", "policy", "op"], sort=False):
        ids = set(grp["run_id"])
        s = tree.samples[tree.samples["run_id"].isin(ids)]
        s = s.drop_duplicates(subset=["problem_id", "sample", "seed"], keep="first")
        with_samples = set(s["run_id"])
        saved = [tree.metrics[i] for i in sorted(ids) if i in tree.metrics]
        if s.empty:
            m = _group_metrics_from_json(saved)
        else:
            if with_samples != ids:
                logger.warning(
                    "%s: %d run(s) without samples.jsonl ignored next to runs that have it",
                    "/".join(map(str, key)),
                    len(ids - with_samples),
                )
            m = _group_metrics_from_samples(s)
        if grp["setting"].nunique() > 1:
            logger.warning(
                "%s: pooled runs differ in model/task/generation settings (protocol.json): %s",
                "/".join(map(str, key)),
                ", ".join(grp["run_dir"]),
            )
        first = grp.iloc[0]
        budgets = sorted({int(b) for b in grp["budget"].dropna()})
        row = {
            "model": key[0],
            "task": key[1],
            "policy": key[2],
            "op": key[3],
            "op_kind": first["op_kind"],
            "op_value": first["op_value"],
            "method": first["method"],
            "short": first["short"],
            "policy_name": first["policy_name"],
            "policy_kind": first["policy_kind"],
            "policy_target": first["policy_target"],
            "params": first["params"],
            "budget": float(budgets[0]) if len(budgets) == 1 and first["op_kind"] != "full" else float("nan"),
            "budgets": ",".join(map(str, budgets)),
            "ratio": float(first["ratio"]) if first["ratio"] is not None else float("nan"),
            "runs": len(grp),
            "seeds": len(set(grp["seed"])),
            "complete": bool(grp["complete"].all()),
            **m,
            **_group_throughput(tree.throughput[tree.throughput["run_id"].isin(ids)], saved),
            "run_dirs": ";".join(grp["run_dir"]),
        }
        row["decode_seconds_per_correct"] = _per(row["decode_seconds"], row["correct_samples"])
        rows.append(row)
    out = pd.DataFrame(rows)
    order = sorted(
        range(len(out)),
        key=lambda i: (
            out.loc[i, "model"],
            task_sort_key(out.loc[i, "task"]),
            op_sort_key(out.loc[i, "op_kind"], out.loc[i, "op_value"]),
            policy_sort_key(out.loc[i, "policy"]),
        ),
    )
    return out.loc[order].reset_index(drop=True)


@dataclass
class AblationGrid:
    """One policy's cells over two hyper-parameters at one (model, task, operating point): ``acc``, ``se`` (%) and
    ``n`` (samples), each ``(len(rows), len(cols))``, NaN / 0 where a cell was not run."""

    model: str
    task: str
    policy_name: str
    op: str
    row_param: str
    col_param: str
    rows: list
    cols: list
    acc: np.ndarray
    se: np.ndarray
    n: np.ndarray


def _value_key(v: object) -> tuple:
    return (0, float(v), "") if isinstance(v, (int, float)) and not isinstance(v, bool) else (1, 0.0, str(v))


def ablation_grids(
    summary: pd.DataFrame, row_param: str = "n_protect", col_param: str = "attn_temperature"
) -> list[AblationGrid | tuple[str, str]]:
    """Per (model, task, policy name, operating point) whose cells set both parameters (the class defaults filled
    in): an :class:`AblationGrid` when each takes two or more values, else ``(name, reason)`` when only one of them
    varies; values sorted (numbers numerically)."""
    out: list[AblationGrid | tuple[str, str]] = []
    for (model, task, name, op), sub in summary.groupby(["model", "task", "policy_name", "op"]):
        targets = sub["policy_target"] if "policy_target" in sub else pd.Series(None, index=sub.index)
        params = [_with_defaults(p, t) or json.loads(p) for p, t in zip(sub["params"], targets)]
        if not all(row_param in p and col_param in p for p in params):
            continue
        rows = sorted({p[row_param] for p in params}, key=_value_key)
        cols = sorted({p[col_param] for p in params}, key=_value_key)
        if len(rows) < 2 or len(cols) < 2:
            if len(rows) > 1 or len(cols) > 1:
                stem = f"ablation_{slug(model)}_{slug(task)}_{slug(name)}_{slug(op)}"
                out.append((stem, f"needs >= 2 values of both {row_param} and {col_param}"))
            continue
        acc = np.full((len(rows), len(cols)), np.nan)
        se, n = np.full_like(acc, np.nan), np.zeros_like(acc)
        for p, a, e, k in zip(params, sub["accuracy"], sub["accuracy_se"], sub["samples"]):
            i, j = rows.index(p[row_param]), cols.index(p[col_param])
            acc[i, j], se[i, j], n[i, j] = a, e, k
        out.append(AblationGrid(model, task, name, op, row_param, col_param, rows, cols, acc, se, n))
    return out


def present_classes(sub: pd.DataFrame) -> list[str]:
    """The failure classes to show for these summary rows: loop / garbage / truncated / ok always, ``nonfinite`` and
    ``prompt_too_long`` (samples not decoded to the end) only when one of the rows has such a sample."""
    extra = [c for c in NOT_DECODED_CLASSES if f"{c}_rate" in sub and (sub[f"{c}_rate"].fillna(0) > 0).any()]
    return [*LOOP_CLASSES, *extra]


def operating_points(summary: pd.DataFrame, model: str) -> list[str]:
    """``model``'s operating points other than the full cache, sorted; ``["full"]`` when it has only full-cache runs."""
    sub = summary[(summary["model"] == model) & (summary["op_kind"] != "full")]
    keys = {op: op_sort_key(k, v) for op, k, v in zip(sub["op"], sub["op_kind"], sub["op_value"])}
    return sorted(keys, key=keys.get) or ["full"]


def at_op(summary: pd.DataFrame, model: str, op: str) -> pd.DataFrame:
    """``model``'s rows at operating point ``op``, plus its full-cache rows of the tasks run at ``op``."""
    sub = summary[summary["model"] == model]
    at = sub[sub["op"] == op]
    full = sub[(sub["op_kind"] == "full") & (sub["task"].isin(set(at["task"])) | (op == "full"))]
    out = pd.concat([full, at]) if op != "full" else full
    order = sorted(
        range(len(out)), key=lambda i: (task_sort_key(out["task"].iloc[i]), policy_sort_key(out["policy"].iloc[i]))
    )
    return out.iloc[order].reset_index(drop=True)
