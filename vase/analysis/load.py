"""Loading a results tree: find the run directories, read what each run saved, one table of runs.

Everything is read from what the runs saved — ``config.yaml``, ``protocol.json``, ``metrics.json``,
``samples.jsonl``, ``throughput.jsonl`` — never from directory names. ``samples.jsonl`` is the source of truth for
every number that describes the outputs (accuracy, failure modes, evictions, held and full-cache KV bytes): a
half-finished run (no ``metrics.json``, maybe a torn last line) is recomputed from it and marked incomplete.
``throughput.jsonl`` (one line per stretch of decoding) holds the wall-clock numbers: decode throughput, prefill
time, rows in flight, the static KV allocation and peak memory. The fields are defined in :mod:`vase.run.records`.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
import yaml

from vase.analysis.labels import NOT_HYPERPARAMETERS, label_policies, policy_class_name
from vase.run.results import SAMPLES, THROUGHPUT, BadSample, read_samples, read_throughput, stable_hash
from vase.run.validate import OldLayout, partial_fields
from vase.schema import first_nonfinite, loads, number_problem

logger = logging.getLogger(__name__)

#: the grader rules a sample may carry apart (``correct_<rule>``; = ``tasks.grading.GRADER_RULES``)
GRADER_RULES = ("strict", "last_boxed")
SAMPLE_COLUMNS = (
    "problem_id",
    "sample",
    "seed",
    "correct",
    "grader",
    *(f"correct_{rule}" for rule in GRADER_RULES),
    "finish_reason",
    "cut_by_limit",
    "cut_in_thinking",
    "loop_class",
    "prompt_tokens",
    "output_tokens",
    "held_tokens_end",
    "held_tokens_mean",
    "held_tokens_max",
    "compression_ratio",
    "kv_held_bytes_end",
    "kv_full_bytes_end",
    "kv_retained_bytes_mean",
    "kv_retained_bytes_peak",
    "decode_steps",
    "evictions",
    "eviction_seconds",
    "attended_tokens",
)
THROUGHPUT_COLUMNS = (
    "prefills",
    "prefill_tokens",
    "prefill_seconds",
    "decode_steps",
    "row_steps",
    "tokens",
    "decode_seconds",
    "samples",
    "rows",
    "wall_seconds",
    "kv_allocated_bytes",
    "kv_allocated_bytes_per_row",
    "capacity_per_row",
    "peak_memory_bytes",
    "time",
)
OLD_BATCHES = "batches.jsonl"  # written by the runner before continuous batching; not read
_PER_RUN_PROTOCOL_KEYS = ("policy", "budget", "window", "seed", "n_samples")


@dataclass
class Tree:
    """A loaded results tree.

    Attributes:
        root: the directory that was walked.
        runs: one row per run directory: ``run_id``, ``run_dir``, ``model``, ``task``, ``policy_name``,
            ``policy_kind``, ``params`` (JSON of the hyper-parameters), ``budget``, ``window``, ``ratio``, ``seed``,
            ``group`` (``logger.group``), ``protocol`` (the preset's name), ``complete``, ``source``, ``machine``
            (:func:`machine_name`), ``identity`` (:func:`drop_duplicate_runs`) and, after
            :func:`label_policies`, ``policy``, ``method`` and ``op``.
        samples: one row per sample (``run_id`` + :data:`SAMPLE_COLUMNS`, ``answered``, ``answered_<rule>``; the
            ``correct_<rule>`` columns hold every grader rule's verdict on the same output; ``output``, the generated
            text, with ``load_tree(..., with_output=True)``), deduplicated on
            ``(problem_id, sample)`` within a run; a key a run did not write is missing (NaN / None).
        throughput: one row per ``throughput.jsonl`` line, i.e. per stretch of decoding (``run_id`` +
            :data:`THROUGHPUT_COLUMNS`); every line counts (each is wall-clock time that really ran).
        metrics: run_id -> the run's ``metrics.json`` (absent for half-finished runs).
        skipped: run directories that could not be read, with the reason.
    """

    root: Path
    runs: pd.DataFrame
    samples: pd.DataFrame
    throughput: pd.DataFrame
    metrics: dict[int, dict] = field(default_factory=dict)
    skipped: list[tuple[str, str]] = field(default_factory=list)


def find_run_dirs(root: str | Path) -> list[Path]:
    """Every directory under ``root`` (itself included) holding ``metrics.json`` or ``samples.jsonl``, sorted.

    Hidden directories (``.hydra``) and W&B directories are not entered.
    """
    root = Path(root)
    found = []

    def unreadable(err: OSError) -> None:
        logger.warning("skipping %s: cannot read it (%s)", err.filename, err.strerror or err)

    for dirpath, dirnames, filenames in os.walk(root, onerror=unreadable):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and d != "wandb")
        if "metrics.json" in filenames or SAMPLES in filenames:
            found.append(Path(dirpath))
    return sorted(found)


def _read_json(path: Path) -> dict | None:
    """A JSON object a run saved, or ``None`` (with a warning) when absent, unreadable, nested deeper than vase writes,
    not an object or holding a non-finite number (``NaN`` / ``Infinity``: never data); a ``metrics.json`` whose
    figures are out of their range (a rate outside [0, 1], a count that is not one) too: the run's numbers are then
    recomputed from its ``samples.jsonl``."""
    if not path.exists():
        return None
    try:
        obj = loads(path.read_bytes().decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError, ValueError) as err:
        logger.warning("%s: unreadable JSON (%s); ignored", path, " ".join(str(err).split()))
        return None
    if not isinstance(obj, dict):
        logger.warning("%s: a JSON %s, not an object; ignored", path, type(obj).__name__)
        return None
    if path.name == "metrics.json":
        why = number_problem(obj, "key")
    else:
        why = None if (bad := first_nonfinite(obj)) is None else f"holds {bad}, not a finite number"
    if why is not None:
        logger.warning("%s: not what vase writes (%s); ignored", path, why)
        return None
    return obj


def not_a_run(run_dir: Path) -> str | None:
    """Why ``run_dir`` (found by :func:`find_run_dirs`) is not a vase run directory, or ``None`` when it is one.

    A vase run names its policy in what it saved: ``protocol.json`` or ``config.yaml`` (a run under way), or a
    ``metrics.json`` with its policy, task and model. A directory that merely holds a ``metrics.json`` or a
    ``samples.jsonl`` of another tool is not one (the report skips it with one warning)."""
    run_dir = Path(run_dir)
    for name in ("protocol.json", "metrics.json"):
        path = run_dir / name
        if not path.is_file():
            continue
        try:
            obj = loads(path.read_bytes().decode("utf-8"))
        except (OSError, ValueError, UnicodeDecodeError):
            continue
        if isinstance(obj, dict) and "policy" in obj and (name == "protocol.json" or {"task", "model"} <= set(obj)):
            return None
    try:
        config = _read_config(run_dir)
    except (OSError, ValueError, yaml.YAMLError):
        config = {}
    if isinstance(config, dict) and isinstance(config.get("policy"), dict):
        return None
    return "not a vase run (no protocol.json, config.yaml or metrics.json that names its policy, task and model)"


def _read_config(run_dir: Path) -> dict:
    path = run_dir / "config.yaml"
    if not path.exists():
        return {}
    try:
        config = yaml.safe_load(path.read_text())
    except RecursionError:  # PyYAML composes nested nodes recursively
        raise ValueError(f"{path}: nested deeper than a config vase writes; restore it from a copy") from None
    if config is not None and not isinstance(config, dict):
        raise ValueError(f"{path}: a YAML {type(config).__name__}, not the mapping vase writes; restore it from a copy")
    return config or {}


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
        name = policy_class_name(target) or target.rsplit(".", 1)[-1].lower()
    kind = pol_proto.get("kind")
    if kind is None:
        kind = "none" if name == "full" or (target or "").endswith("FullCache") else "eviction"
    params = {k: v for k, v in (pol_cfg or pol_proto).items() if k not in NOT_HYPERPARAMETERS}
    if kind == "none":
        params = {}
    return str(name or "unknown"), str(kind), params, target


def _frame(rows: list[dict], columns: Sequence[str], run_id: int) -> pd.DataFrame:
    df = pd.DataFrame([{c: r.get(c) for c in columns} for r in rows], columns=list(columns))
    df.insert(0, "run_id", run_id)
    return df


def load_run(
    run_dir: str | Path, run_id: int = 0, *, with_output: bool = False
) -> tuple[dict, pd.DataFrame, pd.DataFrame, dict | None]:
    """Read one run directory (``with_output``: the samples keep their generated text, column ``output``).

    Returns:
        ``(run, samples, throughput, metrics)``: ``run`` is the run's row of :attr:`Tree.runs`; ``samples`` its
        samples (deduplicated on ``(problem_id, sample)``, the first line written wins, as in the runner's metrics);
        ``throughput`` its ``throughput.jsonl`` lines; ``metrics`` its ``metrics.json`` or None.
    """
    run_dir = Path(run_dir)
    config = _read_config(run_dir)
    protocol = _read_json(run_dir / "protocol.json")
    metrics = _read_json(run_dir / "metrics.json")
    # schema-checked; with the rank part files of a data-parallel run under way or killed
    sample_rows = read_samples(run_dir, for_metrics=True)
    # a field a newer release added that only some lines carry (a resumed older run): missing for the whole run,
    # never averaged over the lines that have it
    partial = partial_fields(sample_rows)
    if partial:
        logger.warning(
            "%s: %s absent from some samples (lines written by an older release): shown as missing for this run, "
            "not averaged over the rest; rerun it into a new directory for them",
            run_dir,
            ", ".join(f"{k} ({n} of {len(sample_rows)})" for k, n in partial.items()),
        )
        sample_rows = [{k: v for k, v in r.items() if k not in partial} for r in sample_rows]
    throughput_rows = read_throughput(run_dir)
    if not throughput_rows and (run_dir / OLD_BATCHES).exists():
        logger.warning(
            "%s: written before continuous batching (%s, no %s): its throughput and memory are not read; "
            "rerun it with the current runner for them",
            run_dir,
            OLD_BATCHES,
            THROUGHPUT,
        )
    samples = _frame(sample_rows, (*SAMPLE_COLUMNS, "output") if with_output else SAMPLE_COLUMNS, run_id)
    samples["answered"] = [r.get("extracted") is not None for r in sample_rows]
    for rule in GRADER_RULES:  # None where a sample does not carry the rule (a task with one grader, an older run)
        key = f"extracted_{rule}"
        samples[f"answered_{rule}"] = [
            (r.get(key) is not None) if f"correct_{rule}" in r else None for r in sample_rows
        ]
    samples = samples.drop_duplicates(subset=["problem_id", "sample"], keep="first")
    throughput = _frame(throughput_rows, THROUGHPUT_COLUMNS, run_id)

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
        "protocol": _get(protocol, "protocol.name") or "default",  # a run written before the preset: default
        "setting": stable_hash({k: v for k, v in (protocol or {}).items() if k not in _PER_RUN_PROTOCOL_KEYS}),
        "complete": complete,
        "source": SAMPLES if sample_rows else ("metrics.json" if metrics is not None else "none"),
        "problems": int(samples["problem_id"].nunique()) if n else int(m.get("problems") or 0),
        "samples": n if n else int(m.get("samples") or 0),
        "machine": machine_name(_read_json(run_dir / "manifest.json")),
        "fields_missing": ", ".join(sorted(partial)) or None,
    }
    run["identity"] = stable_hash({k: run[k] for k in _IDENTITY_KEYS})
    return run, samples, throughput, metrics


#: what makes two run directories the same run (:func:`drop_duplicate_runs`); ``setting`` hashes ``protocol.json``
_IDENTITY_KEYS = (
    "model",
    "task",
    "policy_name",
    "params",
    "budget",
    "ratio_derived",
    "window",
    "ratio",
    "seed",
    "protocol",
    "setting",
)


def machine_name(manifest: dict | None) -> str | None:
    """The machine a run decoded on, from its ``manifest.json``: the CUDA device's name, else ``CPU (<n> cores)``."""
    device = (manifest or {}).get("device")
    if not isinstance(device, dict):
        return None
    if device.get("cuda_device"):
        return str(device["cuda_device"])
    return f"CPU ({device['cpus']} cores)" if device.get("cpus") else "CPU"


def resolve_budget(reference_tokens: int, ratio: float, window: int) -> int:
    """The runner's rule (:func:`~vase.run.planning.resolve_budget`): ``reference / ratio`` rounded to the window."""
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
    ref = _get(config, "model.reference_tokens")
    if not ref:
        ref = refs.get(key, refs.get("default")) if isinstance(refs, dict) else None
    budget, ratio, window = config.get("budget"), config.get("ratio"), config.get("window")
    if not ref or not budget or not ratio or not window:
        return False
    try:
        return resolve_budget(int(ref), float(ratio), int(window)) == int(budget)
    except (TypeError, ValueError, ZeroDivisionError):
        return False


def _sample_keys(samples: pd.DataFrame) -> frozenset:
    return frozenset(zip(samples["problem_id"].astype(str), samples["sample"], samples["seed"]))


def drop_duplicate_runs(loaded: list[tuple[dict, pd.DataFrame, pd.DataFrame, dict | None]]) -> list:
    """``loaded`` without the runs that repeat another one (one log line naming them).

    A run repeats another when both have the same identity (model, task, policy and its hyper-parameters, budget,
    window, ratio, seed, protocol preset and the rest of ``protocol.json``) and its samples (``problem_id``,
    ``sample``, ``seed``) are a subset of the other's: a copy of a run in a second results folder, or a half-finished
    copy of it. The run with the most samples is kept (the first in path order among equals). Shards of one run
    (the same identity, disjoint problems) are all kept.
    """
    order = sorted(range(len(loaded)), key=lambda i: -len(loaded[i][1]))
    kept: dict[str, list[tuple[int, frozenset]]] = {}
    dropped: dict[int, int] = {}
    for i in order:
        run, samples = loaded[i][0], loaded[i][1]
        keys = _sample_keys(samples)
        same = kept.setdefault(run["identity"], [])
        match = next((j for j, other in same if keys <= other and (keys or not other)), None)
        if match is None:
            same.append((i, keys))
        else:
            dropped[i] = match
    if dropped:
        logger.warning(
            "dropped %d duplicate run(s) (same protocol and samples as a run kept): %s",
            len(dropped),
            "; ".join(f"{loaded[i][0]['run_dir']} (= {loaded[j][0]['run_dir']})" for i, j in sorted(dropped.items())),
        )
    return [x for i, x in enumerate(loaded) if i not in dropped]


def load_tree(root: str | Path, *, with_output: bool = False, drop_duplicates: bool = True) -> Tree:
    """Load every run under ``root`` (see :func:`find_run_dirs`) and label the policies (:func:`label_policies`).

    Args:
        with_output: keep each sample's generated text (``tree.samples["output"]``; off by default: it is most of
            the size of ``samples.jsonl``).
        drop_duplicates: drop the runs that repeat another one (:func:`drop_duplicate_runs`), so no sample of the
            same run counts twice.
    """
    root = Path(root)
    if not root.is_dir():
        raise ValueError(f"results_dir: no such directory: {root}")
    if not os.access(root, os.R_OK | os.X_OK):
        raise ValueError(f"results_dir: {root} cannot be read (permission denied); give a results tree you can read")
    loaded, skipped = [], []
    for run_dir in find_run_dirs(root):
        why = not_a_run(run_dir)
        if why is not None:
            logger.warning("skipping %s: %s", run_dir, why)
            skipped.append((str(run_dir), why))
            continue
        try:
            run, s, t, m = load_run(run_dir, run_id=len(loaded), with_output=with_output)
        except OldLayout as err:  # a run of an older release: the others are reported, this one named with its fix
            logger.warning("skipping %s", err)
            skipped.append((str(run_dir), str(err)))
            continue
        except BadSample:
            raise  # a damaged sample line of a vase run: an error (one line naming it), never a run left out quietly
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
        loaded.append((run, s, t, m))
    if drop_duplicates:
        loaded = drop_duplicate_runs(loaded)
    runs, samples, throughput, metrics = [], [], [], {}
    for run, s, t, m in loaded:
        runs.append(run)
        samples.append(s)
        throughput.append(t)
        if m is not None:
            metrics[run["run_id"]] = m
    if not runs:
        raise ValueError(f"results_dir: no runs (metrics.json or samples.jsonl) under {root}")
    tree = Tree(
        root=root,
        runs=pd.DataFrame(runs),
        samples=pd.concat(samples, ignore_index=True),
        throughput=pd.concat(throughput, ignore_index=True),
        metrics=metrics,
        skipped=skipped,
    )
    label_policies(tree.runs)
    logger.info("loaded %d runs (%d samples) from %s", len(runs), len(tree.samples), root)
    return tree
