"""The report's W&B summary run: every table, figure and native chart of a report in the sweep's group.

The keys it logs (:func:`logged_keys`: ``tables/<name>``, ``figures/<name>``, ``charts/...``) are also written to the
report's ``report.json``, from which :mod:`vase.analysis.dashboard` binds its panels.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from vase.analysis.labels import slug
from vase.analysis.load import Tree
from vase.analysis.tables import Table


def default_group(tree: Tree) -> str:
    """The sweep's W&B group: the runs' ``logger.group`` when they share one, else the results directory's name."""
    groups = {g for g in tree.runs["group"] if isinstance(g, str) and g}
    if len(groups) == 1:
        return groups.pop()
    return tree.root.resolve().name


def table_key(name: str) -> str:
    """The summary run's key of table ``name``."""
    return f"tables/{name}"


def figure_key(stem: str) -> str:
    """The summary run's key of the figure saved as ``<stem>.png``."""
    return f"figures/{stem}"


@dataclass
class Chart:
    """A native W&B chart of the summary run: a bar chart (``x = "method"``) or a line chart (``x`` = ratio/budget).

    ``data`` holds the columns ``x`` and ``accuracy`` (and ``method`` for a line chart, one line per method).
    """

    key: str
    kind: str
    x: str
    title: str
    data: pd.DataFrame


def chart_specs(summary: pd.DataFrame) -> list[Chart]:
    """The native charts of a summary: pass@1 per policy for each (model, task, operating point), the full cache
    included (``charts/accuracy_<model>_<task>_<op>``), and pass@1 vs the operating point per (model, task) with two
    or more points (``charts/accuracy_vs_<ratio|budget>_<model>_<task>``)."""
    charts = []
    chart_df = summary[["model", "task", "method", "policy", "op", "op_kind", "op_value", "budget", "accuracy"]]
    for (model, task, op), sub in chart_df.groupby(["model", "task", "op"]):
        if op == "full":
            continue
        full = chart_df[(chart_df["model"] == model) & (chart_df["task"] == task) & (chart_df["op"] == "full")]
        key = f"charts/accuracy_{slug(model)}_{slug(task)}_{slug(op)}"
        data = pd.concat([full, sub])[["method", "accuracy"]]
        charts.append(Chart(key, "bar", "method", f"{task} {model} {op}: pass@1 (%)", data))
    for (model, task), sub in chart_df[chart_df["op_kind"] != "full"].groupby(["model", "task"]):
        kind = "ratio" if (sub["op_kind"] == "ratio").all() else "budget"
        sub = sub.assign(x=sub["op_value"] if kind == "ratio" else sub["budget"]).sort_values("x")
        if sub["x"].nunique() < 2:
            continue
        key = f"charts/accuracy_vs_{kind}_{slug(model)}_{slug(task)}"
        data = sub[["x", "accuracy", "method"]].rename(columns={"x": kind})
        charts.append(Chart(key, "line", kind, f"{task} {model}: pass@1 vs {kind}", data))
    return charts


def logged_keys(tables: Sequence[Table], figure_paths: Sequence[Path], summary: pd.DataFrame) -> dict[str, list[str]]:
    """The media keys :func:`log_to_wandb` logs for these tables, figures and summary: ``tables``, ``figures`` (the
    PNG files) and ``charts``, each sorted."""
    return {
        "tables": sorted(table_key(t.name) for t in tables),
        "figures": sorted(figure_key(Path(p).stem) for p in figure_paths if Path(p).suffix == ".png"),
        "charts": sorted(c.key for c in chart_specs(summary)),
    }


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
            run.log({table_key(t.name): wandb.Table(dataframe=_wandb_frame(t.data))})
        for path in figure_paths:
            if Path(path).suffix == ".png":
                run.log({figure_key(Path(path).stem): wandb.Image(str(path))})
        for chart in chart_specs(summary):
            tab = wandb.Table(dataframe=_wandb_frame(chart.data))
            if chart.kind == "bar":
                plot = wandb.plot.bar(tab, chart.x, "accuracy", title=chart.title)
            else:
                plot = wandb.plot.line(tab, chart.x, "accuracy", stroke="method", title=chart.title)
            run.log({chart.key: plot})
        run.summary.update(
            {
                f"accuracy/{r.task}/{r.op}/{r.policy}": r.accuracy
                for r in summary.itertuples()
                if not math.isnan(r.accuracy)
            }
        )
        art = wandb.Artifact(f"report-{slug(group)}", type="report")
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
