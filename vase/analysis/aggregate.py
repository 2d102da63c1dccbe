"""Aggregation: one row per (model, task, policy identity, operating point) from a loaded tree.

* **Accuracy** (pass@1, %): per-problem accuracy (mean over its samples), then mean over problems. Runs of the same
  identity (seeds, shards, resumes) are pooled; a sample is counted once (``problem_id``, ``sample``, ``seed``).
* **Standard error** (%): ``std(per-problem accuracy, ddof=1) / sqrt(n_problems)``.
"""

from __future__ import annotations

import logging
import math

import numpy as np
import pandas as pd

from vase.analysis.labels import LOOP_CLASSES, op_sort_key, policy_sort_key, task_sort_key
from vase.analysis.load import Tree

logger = logging.getLogger(__name__)


def per_problem_accuracy(samples: pd.DataFrame) -> pd.Series:
    """Mean correctness of each problem's samples (index: ``problem_id``)."""
    return samples.groupby("problem_id")["correct"].mean()


def accuracy_and_se(samples: pd.DataFrame) -> tuple[float, float]:
    """pass@1 and its standard error over problems (fractions; SE is NaN with fewer than two problems)."""
    if samples.empty:
        return float("nan"), float("nan")
    acc = per_problem_accuracy(samples).astype(float)
    se = float(acc.std(ddof=1) / math.sqrt(len(acc))) if len(acc) > 1 else float("nan")
    return float(acc.mean()), se


def _group_metrics_from_samples(s: pd.DataFrame) -> dict:
    acc, se = accuracy_and_se(s)
    n = len(s)
    out = {"problems": int(s["problem_id"].nunique()), "samples": n, "accuracy": 100 * acc, "accuracy_se": 100 * se}
    classes = s["loop_class"].fillna("ok")
    for c in LOOP_CLASSES:
        out[f"{c}_rate"] = 100 * float((classes == c).mean())
    out["answered_rate"] = 100 * float(s["answered"].mean())
    out["mean_output_tokens"] = float(s["output_tokens"].mean())
    out["compression_ratio"] = float(pd.to_numeric(s["compression_ratio"], errors="coerce").mean())
    return out


def _group_metrics_from_json(ms: list[dict]) -> dict:
    """Fallback when no run of a group has samples on disk: combine ``metrics.json`` files."""
    w = np.array([m.get("problems") or 0 for m in ms], dtype=float)
    w = w if w.sum() else np.ones(len(ms))

    def wmean(key: str, scale: float = 1.0) -> float:
        vals = [(m.get(key), wi) for m, wi in zip(ms, w) if m.get(key) is not None]
        if not vals:
            return float("nan")
        return scale * sum(v * wi for v, wi in vals) / sum(wi for _, wi in vals)

    se = 100 * ms[0]["accuracy_stderr"] if len(ms) == 1 and ms[0].get("accuracy_stderr") is not None else float("nan")
    rates = {"loop": "loop_rate", "garbage": "garbage_rate", "truncated": "truncation_rate"}
    out = {
        "problems": int(sum(m.get("problems") or 0 for m in ms)),
        "samples": int(sum(m.get("samples") or 0 for m in ms)),
        "accuracy": wmean("accuracy", 100),
        "accuracy_se": se,
    }
    for c, key in rates.items():
        out[f"{c}_rate"] = wmean(key, 100)
    out["ok_rate"] = 100 - sum(out[f"{c}_rate"] for c in rates)
    out["answered_rate"] = wmean("answered_rate", 100)
    out["mean_output_tokens"] = wmean("mean_output_tokens")
    out["compression_ratio"] = wmean("compression_ratio")
    return out


_BATCH_METRICS = (
    "kv_cache_bytes",
    "kv_cache_bytes_full",
    "peak_memory_bytes",
    "decode_tokens_per_second",
    "prefill_seconds",
    "evictions",
    "eviction_seconds",
    "attended_tokens",
    "held_tokens",
)


def _batch_metrics(b: pd.DataFrame) -> dict:
    if b.empty:
        return dict.fromkeys(_BATCH_METRICS, float("nan"))
    num = b.apply(pd.to_numeric, errors="coerce")
    dec = num["decode_seconds"].sum()
    att = num["attended_tokens"].dropna()
    return {
        "kv_cache_bytes": float(num["kv_cache_bytes"].max()),
        "kv_cache_bytes_full": float(num["kv_cache_bytes_full"].max()),
        "peak_memory_bytes": float(num["peak_memory_bytes"].max()),
        "decode_tokens_per_second": float(num["output_tokens"].sum() / dec) if dec else float("nan"),
        "prefill_seconds": float(num["prefill_seconds"].mean()),
        "evictions": float(num["evictions"].sum()),
        "eviction_seconds": float(num["eviction_seconds"].sum()),
        "attended_tokens": float(att.mean()) if len(att) else float("nan"),
        "held_tokens": float(num["held_tokens"].mean()),
    }


def summarize(tree: Tree) -> pd.DataFrame:
    """One row per (model, task, policy identity, operating point), sorted (full cache first).

    Columns: ``model``, ``task``, ``policy``, ``method``, ``policy_name``, ``params``, ``op`` (NaN for the full
    cache), ``op_kind``, ``budget`` (the budgets, as text), ``ratio``, ``runs``, ``seeds``, ``complete``, ``problems``,
    ``samples``, ``accuracy`` and ``accuracy_se`` (%), ``{loop,garbage,truncated,ok}_rate`` and ``answered_rate``
    (%), ``mean_output_tokens``, ``compression_ratio``, ``kv_cache_bytes``, ``kv_cache_bytes_full``,
    ``peak_memory_bytes``, ``decode_tokens_per_second``, ``prefill_seconds``, ``evictions``, ``eviction_seconds``,
    ``attended_tokens``, ``held_tokens``, ``run_dirs``.
    """
    runs = tree.runs
    rows = []
    for key, grp in runs.groupby(["model", "task", "policy", "op"], sort=False):
        ids = set(grp["run_id"])
        s = tree.samples[tree.samples["run_id"].isin(ids)]
        s = s.drop_duplicates(subset=["problem_id", "sample", "seed"], keep="first")
        with_samples = set(s["run_id"])
        if s.empty:
            m = _group_metrics_from_json([tree.metrics[i] for i in sorted(ids) if i in tree.metrics])
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
            "params": first["params"],
            "budget": float(budgets[0]) if len(budgets) == 1 and first["op_kind"] != "full" else float("nan"),
            "budgets": ",".join(map(str, budgets)),
            "ratio": float(first["ratio"]) if first["ratio"] is not None else float("nan"),
            "runs": len(grp),
            "seeds": len(set(grp["seed"])),
            "complete": bool(grp["complete"].all()),
            **m,
            **_batch_metrics(tree.batches[tree.batches["run_id"].isin(ids)]),
            "run_dirs": ";".join(grp["run_dir"]),
        }
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
