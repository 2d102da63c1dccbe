"""Paper tables and figures from a results tree (any mix of runs and sweeps), and their W&B summary run.

Everything is read from what the runs saved — ``config.yaml``, ``protocol.json``, ``metrics.json``,
``samples.jsonl``, ``batches.jsonl`` — never from directory names. ``samples.jsonl`` is the source of truth: a
half-finished run (no ``metrics.json``, maybe a torn last line) is recomputed from it and marked incomplete.

Pipeline (what ``scripts/report.py`` runs)::

    tree = load_tree("results/")            # one row per run, plus every sample and every decoded batch
    summary = summarize(tree)               # one row per (model, task, policy, operating point)
    tables = paper_tables(summary)          # accuracy (± SE, five-task avg), failures, efficiency, summary
    figures = paper_figures(tree, summary)  # accuracy vs budget, failure modes, lengths, throughput, ...

Definitions:

* **Policy identity** (the ``policy`` column): the policy's name plus every hyper-parameter that varies across the
  tree's runs of that policy and differs from the policy class's default, e.g. ``vase_attnv[attn_temperature=2.0]``
  (an ablation sweep gives one row per setting). ``budget`` is an axis, never part of the identity.
* **Operating point** (``op``): ``4x`` for a run whose budget was derived from ``ratio``, else ``B=<budget>`` (an
  explicit ``budget=``): the run's ``budget_source`` when it records one, else judged from the saved config (the saved
  budget equals the runner's ``reference output tokens / ratio`` rounded to the window). The full cache is
  independent of it (``op = "full"``) and appears in every table of its model and tasks.
* **Accuracy** (pass@1, %): per-problem accuracy (mean over its samples), then mean over problems. Runs of the same
  identity (seeds, shards, resumes) are pooled; a sample is counted once (``problem_id``, ``sample``, ``seed``).
* **Standard error** (%): ``std(per-problem accuracy, ddof=1) / sqrt(n_problems)``.
* **Five-task average**: the mean over aime25, gpqa_diamond, math500, aime26, hmmt25 (the paper's order) when all five
  are present for that policy, else missing; its standard error is ``sqrt(sum se_t^2) / 5``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import yaml
from matplotlib.figure import Figure

from vase.run.results import BATCHES, SAMPLES, read_jsonl_tolerant, stable_hash

logger = logging.getLogger(__name__)

PAPER_TASKS = ("aime25", "gpqa_diamond", "math500", "aime26", "hmmt25")
TASK_LABELS = {
    "aime25": "AIME25",
    "gpqa_diamond": "GPQA-D",
    "math500": "MATH",
    "aime26": "AIME26",
    "hmmt25": "HMMT25",
    "livecodebench": "LCB",
    "gsm8k": "GSM8K",
    "gsm_symbolic": "GSM-Symbolic",
    "aime": "AIME",
    "humaneval": "HumanEval",
}
TASK_ORDER = (*PAPER_TASKS, "livecodebench", "gsm8k", "gsm_symbolic", "aime", "humaneval")
POLICY_LABELS = {
    "full": "Full cache",
    "snapkv": "SnapKV",
    "rkv": "R-KV",
    "curdkv": "CurDKV",
    "vase_dkv": "VaSE-DKV",
    "vase_attnv": "VaSE-AttnV",
    "quest": "Quest",
    "streaming": "StreamingLLM",
    "random": "Random eviction",
    "evict_large_value": "Evict large values",
    "snapkv_sample": "SnapKV + sampling",
    "snapkv_protect": "SnapKV + protection",
}
# Table order: the full cache first, then the paper's main-table order, then the ablations.
POLICY_ORDER = (
    "full",
    "snapkv",
    "rkv",
    "curdkv",
    "vase_dkv",
    "vase_attnv",
    "quest",
    "streaming",
    "random",
    "evict_large_value",
    "snapkv_sample",
    "snapkv_protect",
)
# The GSM8K pilot bar chart's order (method.md §5).
PILOT_ORDER = (
    "full",
    "random",
    "evict_large_value",
    "snapkv",
    "snapkv_sample",
    "snapkv_protect",
    "vase_attnv",
    "curdkv",
    "vase_dkv",
)
LOOP_CLASSES = ("loop", "garbage", "truncated", "ok")
LOOP_COLORS = {"loop": "#d62728", "garbage": "#9467bd", "truncated": "#ff7f0e", "ok": "#2ca02c"}
NOT_HYPERPARAMETERS = ("_target_", "budget", "name", "kind")
SAMPLE_COLUMNS = (
    "problem_id",
    "sample",
    "seed",
    "correct",
    "loop_class",
    "output_tokens",
    "compression_ratio",
    "finish_reason",
    "truncated",
)
BATCH_COLUMNS = (
    "problem_id",
    "prompt_tokens",
    "output_tokens",
    "prefill_seconds",
    "decode_seconds",
    "evictions",
    "eviction_seconds",
    "kv_cache_bytes",
    "kv_cache_bytes_full",
    "peak_memory_bytes",
    "attended_tokens",
    "held_tokens",
)
MISSING = "–"
# short hyper-parameter names for figure labels (tables spell them out)
PARAM_ABBREVIATIONS = {
    "attn_temperature": "T",
    "n_protect": "P",
    "value_stat": "stat",
    "resample_sketch": "resample",
    "rkv_lambda": "λ",
    "smooth_kernel": "kernel",
    "sample": "sample",
    "window": "W",
}
# protocol.json keys that legitimately differ between runs pooled into one table cell
_PER_RUN_PROTOCOL_KEYS = ("policy", "budget", "window", "seed", "n_samples")


# ------------------------------------------------------------------------------------------------------ loading


@dataclass
class Tree:
    """A loaded results tree.

    Attributes:
        root: the directory that was walked.
        runs: one row per run directory: ``run_id``, ``run_dir``, ``model``, ``task``, ``policy_name``,
            ``policy_kind``, ``params`` (JSON of the hyper-parameters), ``budget``, ``window``, ``ratio``, ``seed``,
            ``group`` (``logger.group``), ``complete``, ``source`` and, after :func:`label_policies`, ``policy``,
            ``method`` and ``op``.
        samples: one row per sample (``run_id`` + :data:`SAMPLE_COLUMNS`, ``answered``).
        batches: one row per decoded batch (``run_id`` + :data:`BATCH_COLUMNS`, ``rows``).
        metrics: run_id -> the run's ``metrics.json`` (absent for half-finished runs).
        skipped: run directories that could not be read, with the reason.
    """

    root: Path
    runs: pd.DataFrame
    samples: pd.DataFrame
    batches: pd.DataFrame
    metrics: dict[int, dict] = field(default_factory=dict)
    skipped: list[tuple[str, str]] = field(default_factory=list)


def find_run_dirs(root: str | Path) -> list[Path]:
    """Every directory under ``root`` (itself included) holding ``metrics.json`` or ``samples.jsonl``, sorted.

    Hidden directories (``.hydra``) and W&B directories are not entered.
    """
    root = Path(root)
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and d != "wandb")
        if "metrics.json" in filenames or SAMPLES in filenames:
            found.append(Path(dirpath))
    return sorted(found)


def _read_json(path: Path) -> dict | None:
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        logger.warning("%s: unreadable JSON (%s); ignored", path, err)
        return None


def _read_config(run_dir: Path) -> dict:
    path = run_dir / "config.yaml"
    if not path.exists():
        return {}
    return yaml.safe_load(path.read_text()) or {}


def _get(d: dict | None, dotted: str, default: Any = None) -> Any:
    cur: Any = d
    for part in dotted.split("."):
        if not isinstance(cur, dict) or part not in cur:
            return default
        cur = cur[part]
    return cur


def _policy_info(config: dict, protocol: dict | None, metrics: dict | None) -> tuple[str, str, dict, str | None]:
    """``(name, kind, hyper-parameters, _target_)`` of a run's policy, from its saved files."""
    pol_cfg = dict(config.get("policy") or {})
    pol_proto = dict(_get(protocol, "policy") or {})
    target = pol_cfg.get("_target_")
    name = (metrics or {}).get("policy") or pol_proto.get("name")
    if not name and target:
        name = _policy_class_name(target) or target.rsplit(".", 1)[-1].lower()
    kind = pol_proto.get("kind")
    if kind is None:
        kind = "none" if name == "full" or (target or "").endswith("FullCache") else "eviction"
    params = {k: v for k, v in (pol_cfg or pol_proto).items() if k not in NOT_HYPERPARAMETERS}
    if kind == "none":
        params = {}
    return str(name or "unknown"), str(kind), params, target


def _import_class(target: str):
    import importlib

    module, _, attr = target.rpartition(".")
    return getattr(importlib.import_module(module), attr)


def _policy_class_name(target: str) -> str | None:
    try:
        return getattr(_import_class(target), "name", None)
    except Exception:  # noqa: BLE001 - any import problem just means "unknown"
        return None


_DEFAULTS_CACHE: dict[str, dict] = {}


def policy_defaults(target: str | None) -> dict:
    """The dataclass defaults of the policy class ``target`` (``{}`` when it cannot be imported)."""
    if not target:
        return {}
    if target not in _DEFAULTS_CACHE:
        out = {}
        try:
            cls = _import_class(target)
            for f in dataclasses.fields(cls):
                if f.default is not dataclasses.MISSING:
                    out[f.name] = f.default
                elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
                    out[f.name] = f.default_factory()  # type: ignore[misc]
        except Exception as err:  # noqa: BLE001
            logger.info("policy %s: defaults unknown (%s); every varying hyper-parameter is shown", target, err)
        _DEFAULTS_CACHE[target] = out
    return _DEFAULTS_CACHE[target]


def _frame(rows: list[dict], columns: Sequence[str], run_id: int) -> pd.DataFrame:
    df = pd.DataFrame([{c: r.get(c) for c in columns} for r in rows], columns=list(columns))
    df.insert(0, "run_id", run_id)
    return df


def load_run(run_dir: str | Path, run_id: int = 0) -> tuple[dict, pd.DataFrame, pd.DataFrame, dict | None]:
    """Read one run directory.

    Returns:
        ``(run, samples, batches, metrics)``: ``run`` is the run's row of :attr:`Tree.runs`; ``samples`` and
        ``batches`` its rows (deduplicated on ``(problem_id, sample)``); ``metrics`` its ``metrics.json`` or None.
    """
    run_dir = Path(run_dir)
    config = _read_config(run_dir)
    protocol = _read_json(run_dir / "protocol.json")
    metrics = _read_json(run_dir / "metrics.json")
    sample_rows = read_jsonl_tolerant(run_dir / SAMPLES)
    batch_rows = read_jsonl_tolerant(run_dir / BATCHES)
    samples = _frame(sample_rows, SAMPLE_COLUMNS, run_id)
    samples["answered"] = [r.get("extracted") is not None for r in sample_rows]
    samples = samples.drop_duplicates(subset=["problem_id", "sample"], keep="first")
    batches = _frame(batch_rows, BATCH_COLUMNS, run_id)
    batches["rows"] = [len(r.get("samples") or []) or 1 for r in batch_rows]

    name, kind, params, target = _policy_info(config, protocol, metrics)
    m = metrics or {}
    n = len(samples)
    complete = bool(m.get("complete")) and (not sample_rows or m.get("samples") == n)
    if metrics is not None and sample_rows and m.get("samples") != n:
        logger.warning(
            "%s: metrics.json counts %s samples but samples.jsonl has %d (resumed?); recomputing",
            run_dir,
            m.get("samples"),
            n,
        )
    run = {
        "run_id": run_id,
        "run_dir": str(run_dir),
        "ratio_derived": _ratio_derived(config, metrics),
        "model": _get(config, "model.key") or m.get("model") or _get(protocol, "model.key") or "unknown",
        "task": _get(config, "task.name") or m.get("task") or _get(protocol, "task.name") or "unknown",
        "policy_name": name,
        "policy_kind": kind,
        "policy_target": target,
        "params": json.dumps(params, sort_keys=True, default=str),
        "budget": config.get("budget", m.get("budget", _get(protocol, "budget"))),
        "window": config.get("window", m.get("window", _get(protocol, "window"))),
        "ratio": config.get("ratio", m.get("ratio")),
        "seed": config.get("seed", _get(protocol, "seed")),
        "group": _get(config, "logger.group"),
        "setting": stable_hash({k: v for k, v in (protocol or {}).items() if k not in _PER_RUN_PROTOCOL_KEYS}),
        "complete": complete,
        "source": SAMPLES if sample_rows else ("metrics.json" if metrics is not None else "none"),
        "problems": int(samples["problem_id"].nunique()) if n else int(m.get("problems") or 0),
        "samples": n if n else int(m.get("samples") or 0),
    }
    return run, samples, batches, metrics


def resolve_budget(reference_tokens: int, ratio: float, window: int) -> int:
    """The runner's rule (:func:`~vase.run.runner.resolve_budget`): ``reference / ratio`` rounded to the window."""
    return max(2, round(reference_tokens / ratio / window)) * window


def _ratio_derived(config: dict, metrics: dict | None = None) -> bool:
    """Whether the run's budget came from ``ratio`` (not an explicit ``budget=``).

    A run that records ``budget_source`` (``"ratio"`` or ``"explicit"``, in ``config.yaml`` or ``metrics.json``) says
    so. Otherwise it is judged from the saved config: the budget equals the runner's rule applied to the task's
    reference length and ``ratio`` (an explicit budget that happens to equal it is then taken for a ratio one).
    """
    source = config.get("budget_source") or (metrics or {}).get("budget_source")
    if source in ("ratio", "explicit"):
        return source == "ratio"
    refs = _get(config, "task.reference_output_tokens") or {}
    key = _get(config, "model.key")
    ref = refs.get(key, refs.get("default")) if isinstance(refs, dict) else None
    budget, ratio, window = config.get("budget"), config.get("ratio"), config.get("window")
    if not ref or not budget or not ratio or not window:
        return False
    try:
        return resolve_budget(int(ref), float(ratio), int(window)) == int(budget)
    except (TypeError, ValueError, ZeroDivisionError):
        return False


def load_tree(root: str | Path) -> Tree:
    """Load every run under ``root`` (see :func:`find_run_dirs`) and label the policies (:func:`label_policies`)."""
    root = Path(root)
    if not root.is_dir():
        raise ValueError(f"results_dir: no such directory: {root}")
    runs, samples, batches, metrics, skipped = [], [], [], {}, []
    for run_dir in find_run_dirs(root):
        try:
            run, s, b, m = load_run(run_dir, run_id=len(runs))
        except (ValueError, OSError, yaml.YAMLError) as err:
            logger.warning("skipping %s: %s", run_dir, err)
            skipped.append((str(run_dir), str(err)))
            continue
        if run["source"] == "none":
            skipped.append((str(run_dir), "no samples and no metrics"))
            continue
        if not run["complete"]:
            logger.warning(
                "%s: incomplete run (%d problems, %d samples so far); marked with †",
                run_dir,
                run["problems"],
                run["samples"],
            )
        runs.append(run)
        samples.append(s)
        batches.append(b)
        if m is not None:
            metrics[run["run_id"]] = m
    if not runs:
        raise ValueError(f"results_dir: no runs (metrics.json or samples.jsonl) under {root}")
    tree = Tree(
        root=root,
        runs=pd.DataFrame(runs),
        samples=pd.concat(samples, ignore_index=True),
        batches=pd.concat(batches, ignore_index=True),
        metrics=metrics,
        skipped=skipped,
    )
    label_policies(tree.runs)
    logger.info("loaded %d runs (%d samples) from %s", len(runs), len(tree.samples), root)
    return tree


# ------------------------------------------------------------------------------------------------------ labels


def _fmt_value(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:g}"
    return str(v)


def _with_defaults(params_json: str, target: str | None) -> dict:
    """A run's hyper-parameters, with the policy class's defaults for keys its config does not list."""
    defaults = {k: v for k, v in policy_defaults(target).items() if k not in NOT_HYPERPARAMETERS}
    return {**defaults, **json.loads(params_json)} if json.loads(params_json) else {}


def label_policies(runs: pd.DataFrame) -> pd.DataFrame:
    """Add ``policy`` (identity), ``method`` (display name) and ``op`` (operating point) columns in place."""
    labels, methods, shorts = [], [], []
    varying: dict[str, list[str]] = {}
    for name, sub in runs.groupby("policy_name"):
        dicts = [_with_defaults(p, t) for p, t in zip(sub["params"], sub["policy_target"])]
        keys = sorted({k for d in dicts for k in d})
        varying[name] = [k for k in keys if len({json.dumps(d.get(k), default=str) for d in dicts}) > 1]
    for _, run in runs.iterrows():
        params = _with_defaults(run["params"], run["policy_target"])
        defaults = policy_defaults(run["policy_target"])
        shown = [
            (k, params.get(k)) for k in varying[run["policy_name"]] if k not in defaults or params.get(k) != defaults[k]
        ]
        base = run["policy_name"]
        labels.append(base + ("[" + ",".join(f"{k}={_fmt_value(v)}" for k, v in shown) + "]" if shown else ""))
        display = POLICY_LABELS.get(base, base)
        methods.append(display + (" (" + ", ".join(f"{k}={_fmt_value(v)}" for k, v in shown) + ")" if shown else ""))
        shorts.append(display + "".join(f" {PARAM_ABBREVIATIONS.get(k, k)}={_fmt_value(v)}" for k, v in shown))
    runs["policy"] = labels
    runs["method"] = methods
    runs["short"] = shorts
    kinds, values = [], []
    for pk, derived, r, b in zip(runs["policy_kind"], runs["ratio_derived"], runs["ratio"], runs["budget"]):
        if pk == "none":
            kinds.append("full")
            values.append(float("nan"))
        elif derived:
            kinds.append("ratio")
            values.append(float(r))
        else:
            kinds.append("budget")
            values.append(float(b) if b is not None else float("nan"))
    runs["op_kind"] = kinds
    runs["op_value"] = values
    runs["op"] = [op_label(v, k) for v, k in zip(values, kinds)]
    return runs


def op_label(value: float, kind: str) -> str:
    """``4x`` for a ratio, ``B=512`` for a budget, ``full`` for the full cache."""
    if kind == "full" or value is None or math.isnan(value):
        return "full"
    return f"{value:g}x" if kind == "ratio" else f"B={value:g}"


def op_sort_key(kind: str, value: float) -> tuple[int, float]:
    """The full cache first, then ratios, then budgets, each ascending."""
    return ({"full": 0, "ratio": 1, "budget": 2}.get(kind, 3), 0.0 if math.isnan(value) else value)


def _natural(text: str) -> tuple:
    """Sort key that orders embedded numbers numerically (``n_protect=16`` before ``n_protect=256``)."""
    return tuple(
        (0, float(t), "") if re.fullmatch(r"\d+(\.\d+)?", t) else (1, 0.0, t)
        for t in re.split(r"(\d+(?:\.\d+)?)", text)
        if t
    )


def policy_sort_key(policy: str) -> tuple:
    """Full cache first, then :data:`POLICY_ORDER`, then alphabetical (numbers in labels numerically)."""
    base = policy.split("[", 1)[0]
    return (POLICY_ORDER.index(base) if base in POLICY_ORDER else len(POLICY_ORDER), _natural(policy))


def task_sort_key(task: str) -> tuple[int, str]:
    return (TASK_ORDER.index(task) if task in TASK_ORDER else len(TASK_ORDER), task)


# ------------------------------------------------------------------------------------------------- aggregation


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


def _at_op(summary: pd.DataFrame, model: str, op: str) -> pd.DataFrame:
    """``model``'s rows at operating point ``op``, plus its full-cache rows of the tasks run at ``op``."""
    sub = summary[summary["model"] == model]
    at = sub[sub["op"] == op]
    full = sub[(sub["op_kind"] == "full") & (sub["task"].isin(set(at["task"])) | (op == "full"))]
    out = pd.concat([full, at]) if op != "full" else full
    order = sorted(
        range(len(out)), key=lambda i: (task_sort_key(out["task"].iloc[i]), policy_sort_key(out["policy"].iloc[i]))
    )
    return out.iloc[order].reset_index(drop=True)


# ------------------------------------------------------------------------------------------------------ tables


@dataclass
class Table:
    """One paper table: numbers for CSV and W&B, text for Markdown and LaTeX.

    Attributes:
        name: file stem.
        data: the numeric table (CSV, W&B).
        display: the same table as formatted text (Markdown, LaTeX); bold cells are wrapped in ``**``.
        caption: one line saying what it shows.
        notes: footnotes (e.g. incomplete runs).
        label_cols: leading text columns (left-aligned); the others are right-aligned numbers.
    """

    name: str
    data: pd.DataFrame
    display: pd.DataFrame
    caption: str
    notes: list[str] = field(default_factory=list)
    label_cols: int = 1


def _fmt(x: float, digits: int = 2) -> str:
    return MISSING if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def _fmt_pm(acc: float, se: float) -> str:
    if acc is None or math.isnan(acc):
        return MISSING
    return f"{acc:.2f}" if se is None or math.isnan(se) else f"{acc:.2f} ± {se:.2f}"


def five_task_average(accs: dict[str, float], ses: dict[str, float]) -> tuple[float, float]:
    """Mean over :data:`PAPER_TASKS` (NaN unless all five are present) and its SE ``sqrt(sum se^2) / 5``."""
    vals = [accs.get(t, float("nan")) for t in PAPER_TASKS]
    if any(v is None or math.isnan(v) for v in vals):
        return float("nan"), float("nan")
    errs = [ses.get(t, float("nan")) for t in PAPER_TASKS]
    se = math.sqrt(sum(e * e for e in errs)) / len(errs) if not any(math.isnan(e) for e in errs) else float("nan")
    return float(np.mean(vals)), se


def accuracy_table(summary: pd.DataFrame, model: str, op: str) -> Table:
    """Policy × task pass@1 (%) ± SE at one operating point, the full cache first, the five-task average.

    Columns of ``data``: per task ``<task>`` and ``<task>_se`` (the paper's tasks first, in its order), then
    ``avg``/``avg_se`` (when the table has all five paper tasks), then the other tasks. Incomplete entries are
    marked † in the display.
    """
    sub = _at_op(summary, model, op)
    tasks = sorted(sub["task"].unique(), key=task_sort_key)
    has_paper = all(t in tasks for t in PAPER_TASKS)  # the average column only when the five tasks are there
    cols = (
        [t for t in tasks if t in PAPER_TASKS]
        + (["avg"] if has_paper else [])
        + [t for t in tasks if t not in PAPER_TASKS]
    )
    policies = sorted(sub["policy"].unique(), key=policy_sort_key)
    data_rows, disp_rows, notes = [], [], []
    incomplete = False
    for pol in policies:
        ps = sub[sub["policy"] == pol]
        accs = dict(zip(ps["task"], ps["accuracy"]))
        ses = dict(zip(ps["task"], ps["accuracy_se"]))
        done = dict(zip(ps["task"], ps["complete"]))
        avg, avg_se = five_task_average(accs, ses)
        d: dict[str, Any] = {"policy": pol, "method": ps["method"].iloc[0]}
        disp: dict[str, Any] = {"Method": ps["method"].iloc[0]}
        for c in cols:
            a, e = (avg, avg_se) if c == "avg" else (accs.get(c, float("nan")), ses.get(c, float("nan")))
            d[c], d[f"{c}_se"] = a, e
            text = _fmt_pm(a, e)
            if c != "avg" and c in done and not done[c]:
                text += " †"
                incomplete = True
            disp[TASK_LABELS.get(c, c) if c != "avg" else "Avg (5)"] = text
        data_rows.append(d)
        disp_rows.append(disp)
    data, display = pd.DataFrame(data_rows), pd.DataFrame(disp_rows)
    _bold_best(data, display, cols)
    at = sub[sub["op_kind"] != "full"]
    budgets = ", ".join(f"{TASK_LABELS.get(t, t)} {b:g}" for t, b in at.groupby("task")["budget"].first().items())
    caption = f"pass@1 (%) ± standard error over problems, {model}, {op}"
    if budgets:
        caption += f" (budgets: {budgets})"
    if incomplete:
        notes.append("† incomplete run: not every problem/sample is done yet.")
    if has_paper and data["avg"].isna().any():
        notes.append("Avg (5): the mean over AIME25, GPQA-D, MATH, AIME26, HMMT25, only for rows with all five.")
    return Table(f"accuracy_{_slug(model)}_{_slug(op)}", data, display, caption, notes)


def _bold_best(data: pd.DataFrame, display: pd.DataFrame, cols: Iterable[str]) -> None:
    """Bold the best evicting/selecting policy per column (the full cache is the reference, never bolded)."""
    non_full = [i for i, p in enumerate(data["policy"]) if not str(p).startswith("full")]
    if len(non_full) < 2:
        return
    for c in cols:
        vals = data.loc[non_full, c]
        if vals.notna().sum() < 2 or vals.nunique() < 2:
            continue
        best = vals.max()
        label = TASK_LABELS.get(c, c) if c != "avg" else "Avg (5)"
        for i in non_full:
            if data.loc[i, c] == best:
                display.loc[i, label] = f"**{display.loc[i, label]}**"


def failure_table(summary: pd.DataFrame, model: str, op: str) -> Table:
    """Per task and policy: loop / garbage / truncated / ok rates (%), answered rate, mean output length."""
    sub = _at_op(summary, model, op)
    cols = [
        "task",
        "policy",
        "method",
        "samples",
        "loop_rate",
        "garbage_rate",
        "truncated_rate",
        "ok_rate",
        "answered_rate",
        "mean_output_tokens",
        "complete",
    ]
    data = sub[cols].reset_index(drop=True)
    display = pd.DataFrame(
        {
            "Task": [TASK_LABELS.get(t, t) for t in data["task"]],
            "Method": [m + ("" if c else " †") for m, c in zip(data["method"], data["complete"])],
            "Samples": data["samples"].astype(int).astype(str),
            "Loop %": data["loop_rate"].map(lambda x: _fmt(x, 1)),
            "Garbage %": data["garbage_rate"].map(lambda x: _fmt(x, 1)),
            "Truncated %": data["truncated_rate"].map(lambda x: _fmt(x, 1)),
            "OK %": data["ok_rate"].map(lambda x: _fmt(x, 1)),
            "Answered %": data["answered_rate"].map(lambda x: _fmt(x, 1)),
            "Mean output tokens": data["mean_output_tokens"].map(lambda x: _fmt(x, 0)),
        }
    )
    notes = ["† incomplete run."] if not data["complete"].all() else []
    return Table(
        f"failures_{_slug(model)}_{_slug(op)}",
        data,
        display,
        f"Output failure modes (method.md §4 detectors), {model}, {op}",
        notes,
        label_cols=2,
    )


def efficiency_table(summary: pd.DataFrame, model: str, op: str) -> Table:
    """Per task and policy: budget, compression, KV-cache bytes, peak memory, decode throughput, evictions."""
    sub = _at_op(summary, model, op)
    cols = [
        "task",
        "policy",
        "method",
        "budget",
        "compression_ratio",
        "kv_cache_bytes",
        "kv_cache_bytes_full",
        "peak_memory_bytes",
        "decode_tokens_per_second",
        "prefill_seconds",
        "evictions",
        "eviction_seconds",
        "attended_tokens",
    ]
    data = sub[[c for c in cols if c in sub]].reset_index(drop=True)
    for c in cols:
        if c not in data:
            data[c] = float("nan")
    mib, gib = 2.0**20, 2.0**30
    display = pd.DataFrame(
        {
            "Task": [TASK_LABELS.get(t, t) for t in data["task"]],
            "Method": data["method"],
            "Budget": data["budget"].map(lambda x: _fmt(x, 0)),
            "Compression": data["compression_ratio"].map(lambda x: _fmt(x, 2) + "×" if not pd.isna(x) else MISSING),
            "KV cache MiB": (data["kv_cache_bytes"] / mib).map(lambda x: _fmt(x, 1)),
            "Full KV MiB": (data["kv_cache_bytes_full"] / mib).map(lambda x: _fmt(x, 1)),
            "Peak GiB": (data["peak_memory_bytes"] / gib).map(lambda x: _fmt(x, 2)),
            "Decode tok/s": data["decode_tokens_per_second"].map(lambda x: _fmt(x, 1)),
            "Evictions": data["evictions"].map(lambda x: _fmt(x, 0)),
        }
    )
    return Table(
        f"efficiency_{_slug(model)}_{_slug(op)}",
        data,
        display,
        f"Memory and throughput, {model}, {op} (KV cache: allocated bytes; peak: CUDA max "
        "allocated or the process's peak RSS on CPU)",
        label_cols=2,
    )


def summary_table(summary: pd.DataFrame) -> Table:
    """Every (model, task, policy, operating point) with every metric (the long table)."""
    data = summary.drop(columns=["run_dirs"]).copy()
    show = [
        "model",
        "task",
        "method",
        "op",
        "budget",
        "runs",
        "problems",
        "samples",
        "accuracy",
        "accuracy_se",
        "loop_rate",
        "garbage_rate",
        "truncated_rate",
        "mean_output_tokens",
        "decode_tokens_per_second",
    ]
    display = data[show].copy()
    display["method"] = [m + ("" if c else " †") for m, c in zip(data["method"], data["complete"])]
    display["budget"] = display["budget"].map(lambda x: _fmt(x, 0))
    for c in show[show.index("accuracy") :]:
        display[c] = display[c].map(lambda x: _fmt(x, 2))
    display = display.astype(str)
    notes = ["† incomplete run."] if not data["complete"].all() else []
    return Table("summary", data, display, "Every run group of the tree, every metric", notes, label_cols=3)


def paper_tables(summary: pd.DataFrame, diversity: pd.DataFrame | None = None) -> list[Table]:
    """All tables the summary supports: per model and operating point accuracy / failures / efficiency, the long
    summary, and the cache-diversity table when kept sets were recorded."""
    tables = [summary_table(summary)]
    for model in sorted(summary["model"].unique()):
        for op in operating_points(summary, model):
            tables += [
                accuracy_table(summary, model, op),
                failure_table(summary, model, op),
                efficiency_table(summary, model, op),
            ]
    if diversity is not None and not diversity.empty:
        disp = diversity.copy()
        for c in disp.columns:
            if c in ("heads", "layers", "samples"):
                disp[c] = disp[c].map(lambda x: _fmt(x, 3))
            elif c == "events" or c.endswith("_pairs") or c == "budget":
                disp[c] = disp[c].map(lambda x: _fmt(float(x), 0))
        tables.append(
            Table(
                "diversity",
                diversity,
                disp.astype(str),
                "Mean Jaccard overlap of the kept sets across heads, layers and samples",
                label_cols=4,
            )
        )
    return tables


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9.=_-]+", "_", str(text)).replace("=", "").strip("_")


_TEX_ESCAPES = {
    "&": r"\&",
    "%": r"\%",
    "$": r"\$",
    "#": r"\#",
    "_": r"\_",
    "{": r"\{",
    "}": r"\}",
    "~": r"\textasciitilde{}",
    "^": r"\textasciicircum{}",
    "±": r"$\pm$",
    "†": r"$^\dagger$",
    "×": r"$\times$",
    "–": "--",
}


def _tex(text: str) -> str:
    bold = text.startswith("**") and text.endswith("**") and len(text) > 4
    if bold:
        text = text[2:-2]
    out = "".join(_TEX_ESCAPES.get(ch, ch) for ch in str(text))
    return rf"\textbf{{{out}}}" if bold else out


def to_markdown(table: Table) -> str:
    """A GitHub-flavoured Markdown table with its caption and notes."""
    df = table.display
    cols = list(df.columns)
    lines = [
        f"**{table.caption}**",
        "",
        "| " + " | ".join(cols) + " |",
        "|" + "|".join("---" if i < table.label_cols else "---:" for i in range(len(cols))) + "|",
    ]
    for _, row in df.iterrows():
        lines.append("| " + " | ".join(str(row[c]).replace("|", "\\|") for c in cols) + " |")
    lines += [""] + [f"{n}  " for n in table.notes]
    return "\n".join(lines).rstrip() + "\n"


def to_latex(table: Table) -> str:
    """A booktabs ``table`` environment (``\\usepackage{booktabs}``)."""
    df = table.display
    cols = list(df.columns)
    spec = "l" * min(table.label_cols, len(cols)) + "r" * max(0, len(cols) - table.label_cols)
    lines = [
        r"\begin{table}[t]",
        r"\centering",
        rf"\caption{{{_tex(table.caption)}}}",
        rf"\label{{tab:{_slug(table.name)}}}",
        r"\small",
        rf"\begin{{tabular}}{{{spec}}}",
        r"\toprule",
        " & ".join(_tex(c) for c in cols) + r" \\",
        r"\midrule",
    ]
    for i, (_, row) in enumerate(df.iterrows()):
        lines.append(" & ".join(_tex(str(row[c])) for c in cols) + r" \\")
        if i == 0 and str(table.data.get("policy", pd.Series([""])).iloc[0]).startswith("full") and len(df) > 1:
            lines.append(r"\midrule")
    lines += [r"\bottomrule", r"\end{tabular}"]
    for n in table.notes:
        lines.append(rf"\par\footnotesize {_tex(n)}")
    lines.append(r"\end{table}")
    return "\n".join(lines) + "\n"


def write_table(table: Table, out_dir: str | Path, formats: Sequence[str] = ("csv", "md", "tex")) -> list[Path]:
    """Write ``table`` as ``<out_dir>/<name>.{csv,md,tex}``; return the paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for fmt in formats:
        path = out_dir / f"{table.name}.{fmt}"
        if fmt == "csv":
            table.data.to_csv(path, index=False)
        elif fmt == "md":
            path.write_text(to_markdown(table))
        elif fmt == "tex":
            path.write_text(to_latex(table))
        else:
            raise ValueError(f"table format: unknown {fmt!r}; choose csv, md or tex")
        paths.append(path)
    return paths


# ----------------------------------------------------------------------------------------------------- figures


@dataclass
class FigureResult:
    """Figures made, and the ones skipped with the reason."""

    figures: dict[str, Figure] = field(default_factory=dict)
    skipped: list[tuple[str, str]] = field(default_factory=list)

    def skip(self, name: str, reason: str) -> None:
        logger.info("figure %s skipped: %s", name, reason)
        self.skipped.append((name, reason))


_PALETTE = [
    "#7f7f7f",
    "#1f77b4",
    "#ff7f0e",
    "#2ca02c",
    "#d62728",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#bcbd22",
    "#17becf",
    "#aec7e8",
    "#ffbb78",
    "#98df8a",
    "#ff9896",
    "#c5b0d5",
    "#c49c94",
]


def _wrap(labels: Iterable[str], width: int = 26) -> list[str]:
    """Tick labels wrapped at ``width`` characters (long ablation names)."""
    import textwrap

    return [textwrap.fill(str(t), width) for t in labels]


def policy_color(policy: str, index: int = 0) -> str:
    """A stable colour per policy name (the variants of one policy get shades via ``index``)."""
    base = policy.split("[", 1)[0]
    i = POLICY_ORDER.index(base) if base in POLICY_ORDER else len(POLICY_ORDER) + abs(hash(base)) % 4
    return _PALETTE[(i + 5 * index) % len(_PALETTE)]


def new_figure(width: float = 6.0, height: float = 4.0) -> Figure:
    """A pyplot-free figure (renders headless with Agg; no global state)."""
    return Figure(figsize=(width, height), layout="constrained")


def save_figure(
    fig: Figure, out_dir: str | Path, name: str, formats: Sequence[str] = ("png", "pdf"), dpi: int = 130
) -> list[Path]:
    """Save ``fig`` as ``<out_dir>/<name>.<fmt>`` for each format; return the paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for fmt in formats:
        path = out_dir / f"{name}.{fmt}"
        fig.savefig(path, dpi=dpi, format=fmt)
        paths.append(path)
    return paths


def _grid(n: int, width: float = 4.2, height: float = 3.4, max_cols: int = 3) -> tuple[Figure, list]:
    cols = min(n, max_cols)
    rows = math.ceil(n / cols)
    fig = new_figure(width * cols, height * rows)
    axes = fig.subplots(rows, cols, squeeze=False).ravel().tolist()
    for ax in axes[n:]:
        ax.set_visible(False)
    return fig, axes[:n]


def figure_accuracy_vs_budget(summary: pd.DataFrame, res: FigureResult) -> None:
    """Per (model, task): accuracy ± SE vs compression ratio (runs launched with ``ratio=``) and/or vs budget (runs
    launched with ``budget=``), one line per policy identity seen at two or more points; the full cache as a band."""
    for (model, task), sub in summary.groupby(["model", "task"], sort=False):
        full = sub[sub["op_kind"] == "full"]
        for kind in ("ratio", "budget"):
            name = f"accuracy_vs_{kind}_{_slug(model)}_{_slug(task)}"
            ev = sub[sub["op_kind"] == kind]
            ev = ev.assign(x=ev["op_value"])
            lines = [(p, ps.sort_values("x")) for p, ps in ev.groupby("policy") if ps["x"].nunique() >= 2]
            if not lines:
                if len(ev):
                    res.skip(
                        name, f"{model}/{task}: no policy at two {kind} values ({', '.join(sorted(set(ev['op'])))})"
                    )
                continue
            fig = new_figure(6.6, 4.2)
            ax = fig.add_subplot()
            for k, (pol, ps) in enumerate(sorted(lines, key=lambda kv: policy_sort_key(kv[0]))):
                ax.errorbar(
                    ps["x"],
                    ps["accuracy"],
                    yerr=ps["accuracy_se"].fillna(0),
                    marker="o",
                    capsize=3,
                    label=ps["short"].iloc[0],
                    color=policy_color(pol, k if "[" in pol else 0),
                )
            if len(full):
                acc, se = full["accuracy"].iloc[0], full["accuracy_se"].iloc[0]
                ax.axhline(acc, color="black", ls="--", lw=1, label="Full cache")
                if not math.isnan(se):
                    ax.axhspan(acc - se, acc + se, color="black", alpha=0.08)
            xs = sorted(set(ev["x"]))
            ax.set_xscale("log", base=2)
            ax.set_xticks(xs, [f"{x:g}×" if kind == "ratio" else f"{x:g}" for x in xs])
            ax.minorticks_off()
            ax.set_xlabel("compression ratio" if kind == "ratio" else "budget B (tokens per layer and KV head)")
            ax.set_ylabel("pass@1 (%)")
            ax.set_title(f"{TASK_LABELS.get(task, task)} — {model}")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7, loc="best")
            res.figures[name] = fig


def figure_failure_modes(summary: pd.DataFrame, res: FigureResult) -> None:
    """Per (model, operating point): stacked bars of loop / garbage / truncated / ok per policy, one panel per task."""
    for model in sorted(summary["model"].unique()):
        for op in operating_points(summary, model):
            sub = _at_op(summary, model, op)
            name = f"failure_modes_{_slug(model)}_{_slug(op)}"
            tasks = sorted(sub["task"].unique(), key=task_sort_key)
            fig, axes = _grid(len(tasks), max(4.6, 0.8 * sub.groupby("task").size().max()), 4.2)
            for ax, task in zip(axes, tasks):
                ts = sub[sub["task"] == task]
                ts = ts.iloc[sorted(range(len(ts)), key=lambda i: policy_sort_key(ts["policy"].iloc[i]))]
                x = np.arange(len(ts))
                bottom = np.zeros(len(ts))
                for c in LOOP_CLASSES:
                    vals = ts[f"{c}_rate"].fillna(0).to_numpy()
                    ax.bar(x, vals, bottom=bottom, color=LOOP_COLORS[c], label=c, width=0.75)
                    bottom += vals
                ax.set_xticks(x, _wrap(ts["short"]), rotation=45, ha="right", rotation_mode="anchor", fontsize=7)
                ax.set_ylim(0, 100)
                ax.set_ylabel("% of samples")
                ax.set_title(TASK_LABELS.get(task, task))
            handles, labels = axes[0].get_legend_handles_labels()
            fig.legend(handles, labels, loc="outside right upper", fontsize=8)
            fig.suptitle(f"Output failure modes — {model}, {op}")
            res.figures[name] = fig


def figure_output_lengths(tree: Tree, summary: pd.DataFrame, res: FigureResult) -> None:
    """Per (model, operating point): output-length distributions per policy (violins), one panel per task."""
    s = tree.samples.merge(tree.runs[["run_id", "model", "task", "policy", "short", "op"]], on="run_id")
    s = s.drop_duplicates(subset=["model", "task", "policy", "op", "problem_id", "sample", "seed"])
    for model in sorted(summary["model"].unique()):
        for op in operating_points(summary, model):
            name = f"output_lengths_{_slug(model)}_{_slug(op)}"
            keys = _at_op(summary, model, op)[["task", "policy", "op"]]
            ms = s[s["model"] == model].merge(keys, on=["task", "policy", "op"])
            if ms.empty:
                res.skip(name, f"{model}: no samples on disk")
                continue
            tasks = sorted(ms["task"].unique(), key=task_sort_key)
            fig, axes = _grid(len(tasks), max(4.6, 0.8 * ms.groupby("task")["policy"].nunique().max()), 4.2)
            for ax, task in zip(axes, tasks):
                ts = ms[ms["task"] == task]
                pols = sorted(ts["policy"].unique(), key=policy_sort_key)
                data = [ts.loc[ts["policy"] == p, "output_tokens"].astype(float).to_numpy() for p in pols]
                parts = ax.violinplot(data, showmedians=True, showextrema=True)
                for body, p in zip(parts["bodies"], pols):
                    body.set_facecolor(policy_color(p))
                    body.set_alpha(0.6)
                labels = [ts.loc[ts["policy"] == p, "short"].iloc[0] for p in pols]
                ax.set_xticks(
                    np.arange(1, len(pols) + 1),
                    _wrap(labels),
                    rotation=45,
                    ha="right",
                    rotation_mode="anchor",
                    fontsize=7,
                )
                ax.set_ylabel("output tokens")
                ax.set_title(TASK_LABELS.get(task, task))
            fig.suptitle(f"Output lengths — {model}, {op}")
            res.figures[name] = fig


def figure_throughput_memory(tree: Tree, res: FigureResult) -> None:
    """Per model: decode throughput, peak memory and KV-cache bytes vs output length per row, per policy."""
    b = tree.batches.merge(tree.runs[["run_id", "model", "policy", "short", "op", "op_kind", "op_value"]], on="run_id")
    if b.empty:
        res.skip("throughput_memory", "no batches.jsonl")
        return
    b = b.assign(
        out_len=pd.to_numeric(b["output_tokens"], errors="coerce") / b["rows"],
        tps=pd.to_numeric(b["output_tokens"], errors="coerce") / pd.to_numeric(b["decode_seconds"], errors="coerce"),
        peak=pd.to_numeric(b["peak_memory_bytes"], errors="coerce") / 2**30,
        kv=pd.to_numeric(b["kv_cache_bytes"], errors="coerce") / 2**20,
    )
    for model, mb in b.groupby("model"):
        name = f"throughput_memory_{_slug(model)}"
        if mb["out_len"].nunique() < 2:
            res.skip(name, f"{model}: one output length only")
            continue
        fig = new_figure(13, 3.8)
        axes = fig.subplots(1, 3)
        several = mb.loc[mb["op_kind"] != "full", "op"].nunique() > 1
        groups = sorted(mb.groupby(["policy", "op"]), key=lambda kv: (policy_sort_key(kv[0][0]), kv[0][1]))
        markers = "osd^v<>P*X"
        for (pol, op), ps in groups:
            label = ps["short"].iloc[0] + (f" ({op})" if several and op != "full" else "")
            ops = sorted(set(mb["op"]))
            kw = {
                "color": policy_color(pol),
                "label": label,
                "s": 14,
                "alpha": 0.75,
                "marker": markers[ops.index(op) % len(markers)],
            }
            for ax, col in zip(axes, ("tps", "peak", "kv")):
                ax.scatter(ps["out_len"], ps[col], **kw)
        for ax, ylabel in zip(axes, ("decode tokens / s (batch)", "peak memory (GiB)", "KV cache allocated (MiB)")):
            ax.set_xlabel("output tokens per sample (batch mean)")
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3)
        axes[0].legend(fontsize=7)
        fig.suptitle(f"Throughput and memory vs output length — {model}")
        res.figures[name] = fig


def figure_ablation_heatmap(
    summary: pd.DataFrame, res: FigureResult, row_param: str = "n_protect", col_param: str = "attn_temperature"
) -> None:
    """Per (model, task, policy name, operating point) where both parameters vary: accuracy heatmap."""
    for (model, task, name_, op), sub in summary.groupby(["model", "task", "policy_name", "op"]):
        params = [json.loads(p) for p in sub["params"]]
        if not all(row_param in p and col_param in p for p in params):
            continue
        rows = sorted({json.dumps(p[row_param]) for p in params}, key=_num_key)
        cols = sorted({json.dumps(p[col_param]) for p in params}, key=_num_key)
        name = f"ablation_{_slug(model)}_{_slug(task)}_{_slug(name_)}_{_slug(op)}"
        if len(rows) < 2 or len(cols) < 2:
            if len(rows) > 1 or len(cols) > 1:
                res.skip(name, f"needs >= 2 values of both {row_param} and {col_param}")
            continue
        grid = np.full((len(rows), len(cols)), np.nan)
        for p, acc in zip(params, sub["accuracy"]):
            grid[rows.index(json.dumps(p[row_param])), cols.index(json.dumps(p[col_param]))] = acc
        fig = new_figure(1.3 * len(cols) + 2.5, 0.8 * len(rows) + 1.8)
        ax = fig.add_subplot()
        im = ax.imshow(grid, cmap="viridis", aspect="auto")
        mid = np.nanmean(grid) if np.isfinite(grid).any() else 0.0
        for i in range(len(rows)):
            for j in range(len(cols)):
                txt = MISSING if np.isnan(grid[i, j]) else f"{grid[i, j]:.1f}"
                color = "black" if np.isfinite(grid[i, j]) and grid[i, j] > mid else "white"
                ax.text(j, i, txt, ha="center", va="center", color=color, fontsize=9)
        ax.set_xticks(range(len(cols)), [_param_text(c) for c in cols])
        ax.set_yticks(range(len(rows)), [_param_text(r) for r in rows])
        ax.set_xlabel(col_param)
        ax.set_ylabel(row_param)
        fig.colorbar(im, ax=ax, label="pass@1 (%)")
        ax.set_title(f"{POLICY_LABELS.get(name_, name_)} — {TASK_LABELS.get(task, task)}, {model}")
        res.figures[name] = fig


def _num_key(s: str) -> tuple[int, float, str]:
    v = json.loads(s)
    return (0, float(v), s) if isinstance(v, (int, float)) else (1, 0.0, s)


def _param_text(s: str) -> str:
    v = json.loads(s)
    return "default" if v is None else _fmt_value(v)


def figure_policy_bars(summary: pd.DataFrame, res: FigureResult) -> None:
    """Per (model, task, operating point) with several policies: accuracy bars in the GSM8K pilot's order
    (full, random, evict_large_value, snapkv and its variants, VaSE-AttnV, CurDKV variants); ``gsm8k_pilot_*`` on
    GSM8K."""
    for model in sorted(summary["model"].unique()):
        for op in operating_points(summary, model):
            sub = _at_op(summary, model, op)
            for task, ts in sub.groupby("task"):
                stem = "gsm8k_pilot" if task == "gsm8k" else f"accuracy_bars_{_slug(task)}"
                name = f"{stem}_{_slug(model)}_{_slug(op)}"
                if len(ts) < 2:
                    res.skip(name, f"{model}/{task}: one policy only")
                    continue

                def order(p: str) -> tuple:
                    base = p.split("[", 1)[0]
                    return (PILOT_ORDER.index(base) if base in PILOT_ORDER else len(PILOT_ORDER), _natural(p))

                ts = ts.iloc[sorted(range(len(ts)), key=lambda i: order(ts["policy"].iloc[i]))]
                fig = new_figure(max(5.0, 0.75 * len(ts) + 2), 4.2)
                ax = fig.add_subplot()
                x = np.arange(len(ts))
                colors = [policy_color(p) for p in ts["policy"]]
                ax.bar(x, ts["accuracy"], yerr=ts["accuracy_se"].fillna(0), color=colors, capsize=3)
                for xi, acc, se, done in zip(x, ts["accuracy"], ts["accuracy_se"].fillna(0), ts["complete"]):
                    if not math.isnan(acc):
                        label = f"{acc:.1f}" + ("" if done else "†")
                        ax.text(xi, acc + se + 1.5, label, ha="center", fontsize=7)
                ax.set_xticks(x, _wrap(ts["short"]), rotation=40, ha="right", rotation_mode="anchor", fontsize=8)
                ax.set_ylabel("pass@1 (%)")
                ax.set_ylim(0, max(100.0, float(np.nanmax(ts["accuracy"].to_numpy(dtype=float), initial=0)) + 8))
                ax.set_title(f"{TASK_LABELS.get(task, task)} — {model}, {op}")
                ax.grid(axis="y", alpha=0.3)
                res.figures[name] = fig


def figure_diversity(diversity: pd.DataFrame, res: FigureResult) -> None:
    """Mean kept-set Jaccard across heads / layers / samples per policy (grouped bars)."""
    name = "cache_diversity"
    if diversity is None or diversity.empty:
        res.skip(name, "no kept_sets recorded (run with record_kept=true)")
        return
    d = diversity.groupby("method", sort=False)[["heads", "layers", "samples"]].mean()
    fig = new_figure(max(5.0, 1.2 * len(d) + 2), 4.0)
    ax = fig.add_subplot()
    x = np.arange(len(d))
    for k, (col, color) in enumerate(zip(("heads", "layers", "samples"), ("#1f77b4", "#ff7f0e", "#2ca02c"))):
        ax.bar(x + (k - 1) * 0.27, d[col].to_numpy(dtype=float), width=0.27, label=f"across {col}", color=color)
    ax.set_xticks(x, _wrap(d.index), rotation=30, ha="right", rotation_mode="anchor", fontsize=8)
    ax.set_ylabel("mean Jaccard of kept sets")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=8)
    ax.set_title("Cache diversity (lower = more diverse)")
    res.figures[name] = fig


def paper_figures(tree: Tree, summary: pd.DataFrame, diversity: pd.DataFrame | None = None) -> FigureResult:
    """Every figure the tree supports; the others are listed in :attr:`FigureResult.skipped` with the reason."""
    res = FigureResult()
    figure_accuracy_vs_budget(summary, res)
    figure_failure_modes(summary, res)
    figure_output_lengths(tree, summary, res)
    figure_throughput_memory(tree, res)
    figure_ablation_heatmap(summary, res)
    figure_policy_bars(summary, res)
    if diversity is not None and not diversity.empty:
        figure_diversity(diversity, res)
    else:
        res.skip("cache_diversity", "no kept_sets recorded (run with record_kept=true)")
    return res


# ---------------------------------------------------------------------------------------------------- diversity


def diversity_table(tree: Tree) -> pd.DataFrame:
    """Per run with recorded kept sets: mean Jaccard across heads, layers and samples (see diversity)."""
    from vase.analysis.diversity import diversity_from_run

    rows = []
    for _, run in tree.runs.iterrows():
        d = diversity_from_run(run["run_dir"])
        if d is None:
            continue
        rows.append(
            {
                "model": run["model"],
                "task": run["task"],
                "policy": run["policy"],
                "method": run["method"],
                "budget": run["budget"],
                **d,
            }
        )
    return pd.DataFrame(rows)


# -------------------------------------------------------------------------------------------------------- W&B


def default_group(tree: Tree) -> str:
    """The sweep's W&B group: the runs' ``logger.group`` when they share one, else the results directory's name."""
    groups = {g for g in tree.runs["group"] if isinstance(g, str) and g}
    if len(groups) == 1:
        return groups.pop()
    return tree.root.resolve().name


def _wandb_frame(df: pd.DataFrame) -> pd.DataFrame:
    out = df.copy()
    for c in out.columns:
        if out[c].dtype == object:
            out[c] = out[c].map(lambda v: "" if v is None or (isinstance(v, float) and math.isnan(v)) else str(v))
    return out


def log_to_wandb(
    tables: Sequence[Table],
    figure_paths: Sequence[Path],
    summary: pd.DataFrame,
    *,
    group: str,
    out_dir: str | Path,
    mode: str = "offline",
    project: str = "vase",
    entity: str | None = None,
    name: str | None = None,
) -> str | None:
    """Log the tables, the figures and native W&B charts to one summary run in the sweep's ``group``.

    The run has ``job_type="summary"``; its files live under ``<out_dir>/wandb`` (offline: upload later with
    ``wandb sync <out_dir>/wandb/offline-run-*``). Logged: every table (``tables/<name>``), every PNG figure
    (``figures/<name>``), a bar chart of accuracy per policy for each (task, operating point) and a line chart of
    accuracy vs operating point per task (``charts/...``), the accuracies as summary values
    (``accuracy/<task>/<op>/<policy>``), and the whole report directory as an artifact of type ``report``.

    Returns:
        the W&B run id, or None when ``mode == "disabled"``.
    """
    if mode not in ("offline", "online", "disabled"):
        raise ValueError(f"--wandb: must be offline, online or disabled, got {mode!r}")
    if mode == "disabled":
        return None
    import wandb

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    run = wandb.init(
        project=project,
        entity=entity,
        group=group,
        job_type="summary",
        name=name or f"summary-{group}",
        mode=mode,
        dir=str(out_dir),
        tags=["summary"],
        reinit="finish_previous",
        config={"results_dir": str(summary.attrs.get("root", "")), "group": group},
    )
    try:
        for t in tables:
            run.log({f"tables/{t.name}": wandb.Table(dataframe=_wandb_frame(t.data))})
        for path in figure_paths:
            if Path(path).suffix == ".png":
                run.log({f"figures/{Path(path).stem}": wandb.Image(str(path))})
        chart_df = summary[["model", "task", "method", "policy", "op", "op_kind", "op_value", "budget", "accuracy"]]
        for (model, task, op), sub in chart_df.groupby(["model", "task", "op"]):
            if op == "full":
                continue
            full = chart_df[(chart_df["model"] == model) & (chart_df["task"] == task) & (chart_df["op"] == "full")]
            tab = wandb.Table(dataframe=_wandb_frame(pd.concat([full, sub])[["method", "accuracy"]]))
            key = f"charts/accuracy_{_slug(model)}_{_slug(task)}_{_slug(op)}"
            run.log({key: wandb.plot.bar(tab, "method", "accuracy", title=f"{task} {model} {op}: pass@1 (%)")})
        for (model, task), sub in chart_df[chart_df["op_kind"] != "full"].groupby(["model", "task"]):
            kind = "ratio" if (sub["op_kind"] == "ratio").all() else "budget"
            sub = sub.assign(x=sub["op_value"] if kind == "ratio" else sub["budget"]).sort_values("x")
            if sub["x"].nunique() < 2:
                continue
            tab = wandb.Table(dataframe=_wandb_frame(sub[["x", "accuracy", "method"]].rename(columns={"x": kind})))
            key = f"charts/accuracy_vs_{kind}_{_slug(model)}_{_slug(task)}"
            title = f"{task} {model}: pass@1 vs {kind}"
            run.log({key: wandb.plot.line(tab, kind, "accuracy", stroke="method", title=title)})
        run.summary.update(
            {
                f"accuracy/{r.task}/{r.op}/{r.policy}": r.accuracy
                for r in summary.itertuples()
                if not math.isnan(r.accuracy)
            }
        )
        art = wandb.Artifact(f"report-{_slug(group)}", type="report")
        for path in sorted(out_dir.rglob("*")):
            if path.is_file() and "wandb" not in path.relative_to(out_dir).parts:
                art.add_file(str(path), name=str(path.relative_to(out_dir)))
        run.log_artifact(art)
        run_id = run.id
    except BaseException:
        run.finish(exit_code=1)
        raise
    run.finish()
    return run_id


# ------------------------------------------------------------------------------------------------------ report


@dataclass
class Report:
    """What :func:`build_report` wrote."""

    out_dir: Path
    tables: list[Table]
    table_paths: list[Path]
    figure_paths: list[Path]
    skipped: list[tuple[str, str]]
    summary: pd.DataFrame
    wandb_run_id: str | None = None


def build_report(
    results_dir: str | Path,
    out_dir: str | Path | None = None,
    *,
    formats: Sequence[str] = ("png", "pdf"),
    wandb_mode: str = "disabled",
    group: str | None = None,
    project: str = "vase",
    entity: str | None = None,
) -> Report:
    """Every table and figure of a results tree into ``out_dir`` (default ``<results_dir>/report``), and W&B.

    Writes ``tables/*.{csv,md,tex}``, ``figures/*.{png,pdf}``, ``report.md`` (every table and figure, and the
    figures skipped with the reason) and, unless ``wandb_mode == "disabled"``, a W&B summary run in ``group``.
    """
    tree = load_tree(results_dir)
    out = Path(out_dir) if out_dir is not None else Path(results_dir) / "report"
    for sub, exts in (("tables", (".csv", ".md", ".tex")), ("figures", (".png", ".pdf", ".svg"))):
        stale = [p for p in (out / sub).glob("*") if p.suffix in exts] if (out / sub).is_dir() else []
        for p in stale:  # the report owns these folders: a rerun must not leave figures of runs since removed
            p.unlink()
        if stale:
            logger.info("removed %d old files from %s", len(stale), out / sub)
    summary = summarize(tree)
    summary.attrs["root"] = str(Path(results_dir).resolve())
    diversity = diversity_table(tree)
    tables = paper_tables(summary, diversity)
    table_paths = [p for t in tables for p in write_table(t, out / "tables")]
    figs = paper_figures(tree, summary, diversity)
    figure_paths = []
    for name, fig in figs.figures.items():
        figure_paths += save_figure(fig, out / "figures", name, formats)
    skipped = figs.skipped + [(d, f"run skipped: {why}") for d, why in tree.skipped]
    _write_index(out, tables, figure_paths, skipped, tree)
    report = Report(out, tables, table_paths, figure_paths, skipped, summary)
    if wandb_mode != "disabled":
        report.wandb_run_id = log_to_wandb(
            tables,
            figure_paths,
            summary,
            group=group or default_group(tree),
            out_dir=out,
            mode=wandb_mode,
            project=project,
            entity=entity,
        )
    logger.info(
        "report: %d tables, %d figure files, %d skipped -> %s", len(tables), len(figure_paths), len(skipped), out
    )
    return report


def _write_index(
    out: Path, tables: list[Table], figure_paths: list[Path], skipped: list[tuple[str, str]], tree: Tree
) -> None:
    n_inc = int((~tree.runs["complete"]).sum())
    lines = [
        f"# Report: {tree.root}",
        "",
        f"{len(tree.runs)} runs ({n_inc} incomplete), {len(tree.samples)} samples.",
        "",
    ]
    for t in tables:
        lines += [f"## {t.name}", "", to_markdown(t), ""]
    pngs = [p for p in figure_paths if p.suffix == ".png"]
    if pngs:
        lines += ["## Figures", ""] + [f"![{p.stem}](figures/{p.name})" for p in pngs] + [""]
    if skipped:
        lines += ["## Skipped", ""] + [f"- `{n}`: {why}" for n, why in skipped] + [""]
    (out / "report.md").write_text("\n".join(lines))
