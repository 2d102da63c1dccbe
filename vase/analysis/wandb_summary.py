"""The report's W&B summary run: every table, figure and native chart of a report in the sweep's group."""

from __future__ import annotations

import math
from collections.abc import Sequence
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
            key = f"charts/accuracy_{slug(model)}_{slug(task)}_{slug(op)}"
            run.log({key: wandb.plot.bar(tab, "method", "accuracy", title=f"{task} {model} {op}: pass@1 (%)")})
        for (model, task), sub in chart_df[chart_df["op_kind"] != "full"].groupby(["model", "task"]):
            kind = "ratio" if (sub["op_kind"] == "ratio").all() else "budget"
            sub = sub.assign(x=sub["op_value"] if kind == "ratio" else sub["budget"]).sort_values("x")
            if sub["x"].nunique() < 2:
                continue
            tab = wandb.Table(dataframe=_wandb_frame(sub[["x", "accuracy", "method"]].rename(columns={"x": kind})))
            key = f"charts/accuracy_vs_{kind}_{slug(model)}_{slug(task)}"
            title = f"{task} {model}: pass@1 vs {kind}"
            run.log({key: wandb.plot.line(tab, kind, "accuracy", stroke="method", title=title)})
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
