"""What the analysis calls things: task and policy display names and orders, policy identities, operating points.

* **Policy identity** (the ``policy`` column): the policy's name plus every hyper-parameter that varies across the
  tree's runs of that policy, e.g. ``vase_attnv[attn_temperature=2.0]`` (an ablation sweep gives one row per setting);
  every run of the policy shows the same keys, the one at the class default included (``attn_temperature=1``), so
  ablation cells sort by their values and none passes for another method. The protocol preset counts as one when the
  tree holds runs of several (``vase_attnv[protocol=paper]``): runs of two protocols are never pooled. ``budget`` is
  an axis, never part of the identity.
* **Selection policies** (``kind = "selection"``: Quest, SeerAttention-R) keep the full cache: their ``method`` and
  ``short`` labels say so (:data:`FULL_CACHE_KEPT`).
* **Operating point** (``op``): ``4x`` for a run whose budget was derived from ``ratio``, else ``B=<budget>`` (an
  explicit ``budget=``): the run's ``budget_source`` when it records one, else judged from the saved config (the saved
  budget equals the runner's ``reference output tokens / ratio`` rounded to the window). The full cache is
  independent of it (``op = "full"``) and appears in every table of its model and tasks.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import logging
import math
import re
from typing import Any

import pandas as pd

from vase.run.records import NOT_DECODED

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
    "seer_attention_r": "SeerAttention-R",
    "streaming": "StreamingLLM-style",
    "random": "Random eviction",
    "random_keep_prompt": "Random, prompt kept",
    "evict_large_value": "Evict large values",
    "snapkv_sample": "SnapKV + sampling",
    "snapkv_protect": "SnapKV + protection",
    "rkv_original": "R-KV (original)",
    "curdkv_original": "CurDKV (kvpress)",
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
    "seer_attention_r",
    "streaming",
    "random",
    "random_keep_prompt",
    "evict_large_value",
    "snapkv_sample",
    "snapkv_protect",
    "rkv_original",
    "curdkv_original",
)
# The GSM8K pilot bar chart's order (method.md §5).
PILOT_ORDER = (
    "full",
    "random",
    "random_keep_prompt",
    "evict_large_value",
    "snapkv",
    "snapkv_sample",
    "snapkv_protect",
    "vase_attnv",
    "curdkv",
    "vase_dkv",
)
LOOP_CLASSES = ("loop", "garbage", "truncated", "ok")
# Samples not decoded to the end (vase.run.records.NOT_DECODED): own classes, shown only when present, never loops.
NOT_DECODED_CLASSES = NOT_DECODED
FAILURE_CLASSES = (*LOOP_CLASSES, *NOT_DECODED_CLASSES)
LOOP_COLORS = {
    "loop": "#d62728",
    "garbage": "#9467bd",
    "truncated": "#ff7f0e",
    "ok": "#2ca02c",
    "nonfinite": "#7f7f7f",
    "prompt_too_long": "#8c564b",
}
CLASS_LABELS = {
    "loop": "Loop",
    "garbage": "Garbage",
    "truncated": "Truncated",
    "ok": "OK",
    "nonfinite": "Non-finite",
    "prompt_too_long": "Prompt too long",
}
NOT_HYPERPARAMETERS = ("_target_", "budget", "name", "kind")
#: what tables and figures say of a selection policy (Quest, SeerAttention-R): it attends to a subset, holds every token
FULL_CACHE_KEPT = "full cache kept"
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


#: axis names of the hyper-parameters an ablation grid shows
PARAM_NAMES = {
    "n_protect": "protected value slots (n_protect)",
    "attn_temperature": "attention temperature T",
    "rkv_lambda": "R-KV λ",
    "sinks": "sink tokens",
    "smooth_kernel": "smoothing kernel",
}


def import_class(target: str) -> type:
    """The class (or any attribute) a dotted ``module.Name`` path names."""
    module, _, attr = target.rpartition(".")
    return getattr(importlib.import_module(module), attr)


def policy_class_name(target: str) -> str | None:
    """The ``name`` class attribute of the policy class ``target`` (None when it cannot be imported)."""
    try:
        return getattr(import_class(target), "name", None)
    except Exception:  # noqa: BLE001 - any import problem just means "unknown"
        return None


def policy_display_name(name: str, target: str | None = None) -> str:
    """How tables and figures name policy ``name``: :data:`POLICY_LABELS`, else the ``display_name`` its class
    declares (``target``: the run's ``_target_``), else ``name`` itself."""
    if name in POLICY_LABELS:
        return POLICY_LABELS[name]
    if target:
        try:
            declared = getattr(import_class(target), "display_name", None)
        except Exception:  # noqa: BLE001 - any import problem just means "no declared name"
            declared = None
        if declared:
            return str(declared)
    return name


_DEFAULTS_CACHE: dict[str, dict] = {}


def policy_defaults(target: str | None) -> dict:
    """The dataclass defaults of the policy class ``target`` (``{}`` when it cannot be imported)."""
    if not target:
        return {}
    if target not in _DEFAULTS_CACHE:
        out = {}
        try:
            cls = import_class(target)
            for f in dataclasses.fields(cls):
                if f.default is not dataclasses.MISSING:
                    out[f.name] = f.default
                elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
                    out[f.name] = f.default_factory()  # type: ignore[misc]
        except Exception as err:  # noqa: BLE001
            logger.info("policy %s: defaults unknown (%s); every varying hyper-parameter is shown", target, err)
        _DEFAULTS_CACHE[target] = out
    return _DEFAULTS_CACHE[target]


def fmt_value(v: Any) -> str:
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
    protocols = runs["protocol"] if "protocol" in runs else pd.Series("default", index=runs.index)

    def identity(params_json: str, target: str | None, protocol: str) -> dict:
        return {**_with_defaults(params_json, target), "protocol": protocol}

    for name, sub in runs.groupby("policy_name"):
        dicts = [identity(p, t, pr) for p, t, pr in zip(sub["params"], sub["policy_target"], protocols[sub.index])]
        keys = sorted({k for d in dicts for k in d})
        varying[name] = [k for k in keys if len({json.dumps(d.get(k), default=str) for d in dicts}) > 1]
    for i, run in runs.iterrows():
        params = identity(run["params"], run["policy_target"], protocols[i])
        # every hyper-parameter that varies across the policy's runs, on every run (a cell at the class default too)
        shown = [(k, params.get(k)) for k in varying[run["policy_name"]]]
        base = run["policy_name"]
        labels.append(base + ("[" + ",".join(f"{k}={fmt_value(v)}" for k, v in shown) + "]" if shown else ""))
        display = policy_display_name(base, run["policy_target"])
        kept = f" ({FULL_CACHE_KEPT})" if run["policy_kind"] == "selection" else ""
        methods.append(
            display + (" (" + ", ".join(f"{k}={fmt_value(v)}" for k, v in shown) + ")" if shown else "") + kept
        )
        shorts.append(display + "".join(f" {PARAM_ABBREVIATIONS.get(k, k)}={fmt_value(v)}" for k, v in shown) + kept)
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


def natural_key(text: str) -> tuple:
    """Sort key that orders embedded numbers numerically (``n_protect=16`` before ``n_protect=256``)."""
    return tuple(
        (0, float(t), "") if re.fullmatch(r"\d+(\.\d+)?", t) else (1, 0.0, t)
        for t in re.split(r"(\d+(?:\.\d+)?)", text)
        if t
    )


def policy_sort_key(policy: str) -> tuple:
    """Full cache first, then :data:`POLICY_ORDER`, then alphabetical (numbers in labels numerically)."""
    base = policy.split("[", 1)[0]
    return (POLICY_ORDER.index(base) if base in POLICY_ORDER else len(POLICY_ORDER), natural_key(policy))


def task_sort_key(task: str) -> tuple[int, str]:
    return (TASK_ORDER.index(task) if task in TASK_ORDER else len(TASK_ORDER), task)


def slug(text: str) -> str:
    """A file-name-safe form of ``text`` (``B=512`` -> ``B512``)."""
    return re.sub(r"[^A-Za-z0-9.=_-]+", "_", str(text)).replace("=", "").strip("_")
