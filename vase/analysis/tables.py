"""The paper's tables (accuracy ± SE, failure modes, efficiency, the long summary, diversity) and their writers.

A :class:`Table` holds numbers (CSV, W&B) and formatted text (Markdown, LaTeX). The accuracy table is the runs' own
grader (``protocol.grader``); where the samples carry both grader rules (boxed answers), the same table follows under
each rule (``accuracy_<model>_<op>_strict``, ``..._last_boxed``: the same outputs, graded two ways, docs/protocol.md).

**Five-task average**: the mean over aime25, gpqa_diamond, math500, aime26, hmmt25 (the paper's order) when all five
are present for that policy, else missing; its standard error is ``sqrt(sum se_t^2) / 5``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from vase.analysis.aggregate import at_op, operating_points, present_classes
from vase.analysis.labels import (
    CLASS_LABELS,
    LOOP_CLASSES,
    MISSING,
    PAPER_TASKS,
    TASK_LABELS,
    policy_sort_key,
    slug,
    task_sort_key,
)
from vase.analysis.load import GRADER_RULES


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


def accuracy_table(summary: pd.DataFrame, model: str, op: str, rule: str | None = None) -> Table:
    """Policy × task pass@1 (%) ± SE at one operating point, the full cache first, the five-task average.

    ``rule``: ``None`` for the runs' own grader (``accuracy``), or a grader rule (``strict`` | ``last_boxed``: the
    ``accuracy_<rule>`` columns, missing for tasks whose runs did not record it).

    Columns of ``data``: per task ``<task>`` and ``<task>_se`` (the paper's tasks first, in its order), then
    ``avg``/``avg_se`` (when the table has all five paper tasks), then the other tasks. Incomplete entries are
    marked † in the display.
    """
    sub = at_op(summary, model, op)
    if rule is not None:
        sub = sub.assign(accuracy=sub[f"accuracy_{rule}"], accuracy_se=sub[f"accuracy_{rule}_se"])
        sub = sub[sub["accuracy"].notna()]
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
    graders = sorted({g for gs in sub.get("grader", pd.Series(dtype=object)).dropna() for g in str(gs).split(",")})
    caption += f"; grader: {rule}" if rule is not None else (f"; grader: {', '.join(graders)}" if graders else "")
    if incomplete:
        notes.append("† incomplete run: not every problem/sample is done yet.")
    if has_paper and data["avg"].isna().any():
        notes.append("Avg (5): the mean over AIME25, GPQA-D, MATH, AIME26, HMMT25, only for rows with all five.")
    name = f"accuracy_{slug(model)}_{slug(op)}" + (f"_{rule}" if rule is not None else "")
    return Table(name, data, display, caption, notes)


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
    """Per task and policy: loop / garbage / truncated / ok rates (%), the non-finite and prompt-too-long rates when
    any sample of the table has them, answered rate, mean output length."""
    sub = at_op(summary, model, op)
    classes = present_classes(sub)
    rate_cols = [f"{c}_rate" for c in classes]
    cols = ["task", "policy", "method", "samples", *rate_cols, "answered_rate", "mean_output_tokens", "complete"]
    data = sub[cols].reset_index(drop=True)
    display = pd.DataFrame(
        {
            "Task": [TASK_LABELS.get(t, t) for t in data["task"]],
            "Method": [m + ("" if c else " †") for m, c in zip(data["method"], data["complete"])],
            "Samples": data["samples"].astype(int).astype(str),
            **{f"{CLASS_LABELS[c]} %": data[f"{c}_rate"].map(lambda x: _fmt(x, 1)) for c in classes},
            "Answered %": data["answered_rate"].map(lambda x: _fmt(x, 1)),
            "Mean output tokens": data["mean_output_tokens"].map(lambda x: _fmt(x, 0)),
        }
    )
    notes = ["† incomplete run."] if not data["complete"].all() else []
    meaning = {
        "nonfinite": "Non-finite: the logits became NaN/inf (a numerical failure; the sample ends there).",
        "prompt_too_long": "Prompt too long: the prompt leaves no room under max_length (not decoded).",
    }
    if len(classes) > len(LOOP_CLASSES):
        notes.append(" ".join(meaning[c] for c in classes[len(LOOP_CLASSES) :]) + " Never counted as a loop.")
    return Table(
        f"failures_{slug(model)}_{slug(op)}",
        data,
        display,
        f"Output failure modes (method.md §4 detectors), {model}, {op}",
        notes,
        label_cols=2,
    )


EFFICIENCY_COLUMNS = (
    "task",
    "policy",
    "method",
    "budget",
    "compression_ratio",
    "decode_tokens_per_second",
    "rows_in_flight",
    "rows_in_flight_mean",
    "kv_allocated_bytes",
    "kv_allocated_bytes_per_row",
    "kv_held_bytes_mean",
    "kv_full_bytes_mean",
    "kv_full_bytes_max",
    "kv_retained_bytes_mean",
    "kv_retained_bytes_peak",
    "tokens_per_correct",
    "decode_seconds_per_correct",
    "peak_memory_bytes",
    "prefill_seconds",
    "decode_seconds",
    "evictions",
    "eviction_seconds",
    "attended_tokens",
)


def efficiency_table(summary: pd.DataFrame, model: str, op: str) -> Table:
    """Per task and policy: budget, compression, decode throughput, rows in flight, the static KV allocation, the KV
    bytes held per sample against a full cache's, peak memory, evictions."""
    sub = at_op(summary, model, op)
    data = sub[[c for c in EFFICIENCY_COLUMNS if c in sub]].reset_index(drop=True)
    for c in EFFICIENCY_COLUMNS:
        if c not in data:
            data[c] = float("nan")
    data = data[list(EFFICIENCY_COLUMNS)]
    mib, gib = 2.0**20, 2.0**30
    display = pd.DataFrame(
        {
            "Task": [TASK_LABELS.get(t, t) for t in data["task"]],
            "Method": data["method"],
            "Budget": data["budget"].map(lambda x: _fmt(x, 0)),
            "Compression": data["compression_ratio"].map(lambda x: _fmt(x, 2) + "×" if not pd.isna(x) else MISSING),
            "Decode tok/s": data["decode_tokens_per_second"].map(lambda x: _fmt(x, 1)),
            "Rows in flight": data["rows_in_flight"].map(lambda x: _fmt(x, 0)),
            "Mean rows": data["rows_in_flight_mean"].map(lambda x: _fmt(x, 1)),
            "Allocated KV MiB": (data["kv_allocated_bytes"] / mib).map(lambda x: _fmt(x, 1)),
            "KV held / sample MiB": (data["kv_held_bytes_mean"] / mib).map(lambda x: _fmt(x, 2)),
            "Full KV / sample MiB": (data["kv_full_bytes_mean"] / mib).map(lambda x: _fmt(x, 2)),
            "Retained KV mean MiB": (data["kv_retained_bytes_mean"] / mib).map(lambda x: _fmt(x, 2)),
            "Retained KV peak MiB": (data["kv_retained_bytes_peak"] / mib).map(lambda x: _fmt(x, 2)),
            "Tokens / correct": data["tokens_per_correct"].map(lambda x: _fmt(x, 0)),
            "Decode s / correct": data["decode_seconds_per_correct"].map(lambda x: _fmt(x, 2)),
            "Peak GiB": (data["peak_memory_bytes"] / gib).map(lambda x: _fmt(x, 2)),
            "Evictions": data["evictions"].map(lambda x: _fmt(x, 0)),
        }
    )
    return Table(
        f"efficiency_{slug(model)}_{slug(op)}",
        data,
        display,
        f"Memory and throughput, {model}, {op}",
        [
            "Allocated KV: the static K/V storage of all rows in flight (allocated once, whatever the outputs need). "
            "KV held / sample: what the policy holds at a sample's end; full KV / sample: what a full cache would "
            "hold then (means over the samples decoded to the end). Rows in flight: the most decoding together; mean "
            "rows: per decode step. Peak: CUDA max allocated, or the process's peak RSS on CPU.",
            "Retained KV: the K/V bytes a sample's cache holds over every layer and KV head (held tokens x bytes per "
            "token), mean over its decode steps (averaged over samples) and peak (the most any sample held), beside "
            "the nominal budget (tokens per layer and KV head). Selection policies keep the full cache. Tokens / "
            "correct: generated tokens of every sample per correct sample; decode s / correct: decode wall time per "
            "correct sample (– without a correct one).",
        ],
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
        *(["grader"] if "grader" in data else []),
        "accuracy",
        "accuracy_se",
        *[c for c in ("accuracy_strict", "accuracy_last_boxed") if c in data and data[c].notna().any()],
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
            tables.append(accuracy_table(summary, model, op))
            at = at_op(summary, model, op)
            for rule in GRADER_RULES:  # the same outputs under each grader rule, where the runs recorded it
                if f"accuracy_{rule}" in at and at[f"accuracy_{rule}"].notna().any():
                    tables.append(accuracy_table(summary, model, op, rule))
            tables += [failure_table(summary, model, op), efficiency_table(summary, model, op)]
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
        rf"\label{{tab:{slug(table.name)}}}",
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
