"""The paper-figure dashboard of a sweep on W&B, built by code (``wandb-workspaces``): a report or a saved workspace.

One section per paper table and figure (:data:`SECTIONS`). Each holds

* live panels over the sweep's own runs (``group = <sweep>``, ``job_type != summary``), bound to what the runner
  logs: the run summary is ``metrics.json`` (``accuracy``, ``pass@k``, ``loop_rate``, ``decode_tokens_per_second``,
  ``kv_allocated_bytes``, ``kv_held_bytes_mean``, ``rows_in_flight``, ``peak_memory_bytes``, ``budget``, ...:
  :data:`RUN_SUMMARY_KEYS`, defined in :mod:`vase.run.records`) and the run config is the
  resolved Hydra config (``policy._target_``, ``policy.n_protect``, ``ratio``, ...: :data:`RUN_CONFIG_KEYS`);
* the report's panels from its summary run (``job_type = summary``, written by ``scripts/report.py --wandb``): the
  tables, figures and native charts it logged, whose keys ``report.json`` lists (:func:`load_manifest`).

The runsets group the runs by task and by the cell's config keys (:func:`cell_keys`: the policy class and the
hyper-parameters in the report's policy identities), so each bar is one cell, its seeds averaged, and ablation cells
never collapse into one bar. With a ``report.json``, only the sections its data has are built (:func:`shown_sections`).
Without an entity the dashboard can be built and printed, not saved.

Building needs no network: :func:`build_report` / :func:`build_workspace` return the ``wandb_workspaces`` objects;
only :func:`publish` (``scripts/dashboard.py --save``) talks to W&B. Runsets name the group in their filters, so
the same code serves the next sweep.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vase.schema import loads

if TYPE_CHECKING:
    import wandb_workspaces.reports.v2 as wr
    import wandb_workspaces.workspaces as ws

logger = logging.getLogger(__name__)

POLICY_KEY = "policy._target_"  # the run config key that names the policy class (one bar per policy)
TASK_KEY = "task.name"
PASS_K = (1, 2, 4, 8, 16)  # conf/config.yaml's pass_k
RUN_SUMMARY_KEYS = (
    "accuracy",
    "accuracy_stderr",
    *(f"pass@{k}" for k in PASS_K),
    "answered_rate",
    "loop_rate",
    "garbage_rate",
    "truncation_rate",
    "nonfinite_rate",
    "cut_by_limit_rate",
    "cut_in_thinking_rate",
    "nonfinite_samples",
    "prompt_too_long_samples",
    "mean_output_tokens",
    "compression_ratio",
    "kv_allocated_bytes",
    "kv_allocated_bytes_per_row",
    "kv_held_bytes_mean",
    "kv_full_bytes_mean",
    "kv_full_bytes_max",
    "rows_in_flight",
    "rows_in_flight_mean",
    "peak_memory_bytes",
    "prefill_seconds",
    "decode_seconds",
    "wall_seconds",
    "decode_tokens_per_second",
    "evictions",
    "eviction_seconds",
    "budget",
    "kv_retained_bytes_mean",
    "kv_retained_bytes_peak",
    "correct_samples",
    "tokens_per_correct",
    "decode_seconds_per_correct",
)
RUN_CONFIG_KEYS = (POLICY_KEY, TASK_KEY, "model.key", "ratio", "budget", "policy.n_protect", "policy.attn_temperature")
MEDIA_KINDS = ("tables", "figures", "charts")
#: the config keys that tell a sweep's cells apart without a report.json: the policy and the ablation's parameters
DEFAULT_CELL_KEYS = (POLICY_KEY, "policy.n_protect", "policy.attn_temperature")
#: the entity of a dashboard built only to print it (no --entity): it cannot be saved
UNSET_ENTITY = "ENTITY-UNSET"


@dataclass(frozen=True)
class Section:
    """One paper table or figure: its title, what it shows, its live run panels and the report media it takes.

    Attributes:
        title: the section heading.
        text: one paragraph under the heading.
        run_panels: builds the live panels over the sweep's runs (given the ``wandb_workspaces.reports.v2`` module).
        media: regular expressions; a table / figure / chart key of the report that matches one of them (``re.match``)
            is shown in this section. Each key belongs to exactly one section.
        group_by_task: also split the runs by task (the sections whose panels compare policies within a task).
        requires: regular expressions; with a ``report.json``, the section is shown only when one of its media keys
            matches one (the ablation only for a tree with an ablation grid, the GSM8K pilot only for GSM8K runs).
            Empty: always shown.
    """

    title: str
    text: str
    run_panels: Callable[[Any], list]
    media: tuple[str, ...]
    group_by_task: bool = True
    requires: tuple[str, ...] = ()


def _bars(wr: Any, title: str, metrics: Sequence[str], orientation: str = "v") -> Any:
    """One bar per group of the runset (grouped by the cell's keys: :func:`cell_keys`), its runs averaged."""
    return wr.BarPlot(title=title, metrics=[wr.SummaryMetric(m) for m in metrics], orientation=orientation)


def _scatter(wr: Any, title: str, x: Any, y: Any, **kw: Any) -> Any:
    return wr.ScatterPlot(title=title, x=x, y=y, **kw)


def _main_table(wr: Any) -> list:
    return [
        _bars(wr, "pass@1 per policy (mean ± SE over runs)", ["accuracy"]),
        _bars(wr, "pass@1 under each grader rule (boxed answers)", ["accuracy_strict", "accuracy_last_boxed"]),
        _bars(wr, "pass@k per policy", [f"pass@{k}" for k in PASS_K]),
    ]


def _failures(wr: Any) -> list:
    s = wr.SummaryMetric
    return [
        _bars(
            wr,
            "loop / garbage / truncated / non-finite rate per policy",
            ["loop_rate", "garbage_rate", "truncation_rate", "nonfinite_rate"],
        ),
        _bars(wr, "cut by the length limit / inside the thinking", ["cut_by_limit_rate", "cut_in_thinking_rate"]),
        _bars(wr, "samples not decoded to the end", ["nonfinite_samples", "prompt_too_long_samples"]),
        _bars(wr, "answered rate per policy", ["answered_rate"]),
        _scatter(wr, "pass@1 vs mean output length", s("mean_output_tokens"), s("accuracy")),
    ]


def _efficiency(wr: Any) -> list:
    s = wr.SummaryMetric
    return [
        _bars(wr, "decode tokens / s per policy", ["decode_tokens_per_second"]),
        _bars(wr, "rows in flight (max, mean per decode step)", ["rows_in_flight", "rows_in_flight_mean"]),
        _bars(wr, "allocated KV storage, static (bytes, all rows)", ["kv_allocated_bytes"]),
        _bars(
            wr,
            "KV held per sample vs a full cache's (bytes, at the sample's end)",
            ["kv_held_bytes_mean", "kv_full_bytes_mean"],
        ),
        _bars(wr, "peak memory (bytes)", ["peak_memory_bytes"]),
        _bars(wr, "compression (full / held tokens)", ["compression_ratio"]),
        _scatter(
            wr, "decode tokens / s vs mean rows in flight", s("rows_in_flight_mean"), s("decode_tokens_per_second")
        ),
        _scatter(wr, "decode tokens / s vs mean output length", s("mean_output_tokens"), s("decode_tokens_per_second")),
        _scatter(wr, "peak memory vs budget", s("budget"), s("peak_memory_bytes")),
    ]


def _budget(wr: Any) -> list:
    s = wr.SummaryMetric
    return [
        _scatter(wr, "pass@1 vs compression ratio (ratio=)", wr.Config("ratio"), s("accuracy")),
        _scatter(wr, "pass@1 vs budget", s("budget"), s("accuracy"), log_x=True),
        _scatter(wr, "pass@1 vs achieved compression", s("compression_ratio"), s("accuracy")),
    ]


def _ablation(wr: Any) -> list:
    column = wr.ParallelCoordinatesPlotColumn
    return [
        wr.ParallelCoordinatesPlot(
            title="protection × attention temperature → pass@1",
            columns=[
                column(metric=wr.Config("policy.n_protect"), display_name="n_protect"),
                column(metric=wr.Config("policy.attn_temperature"), display_name="attn_temperature"),
                column(metric=wr.SummaryMetric("accuracy"), display_name="pass@1"),
            ],
        ),
        _scatter(wr, "pass@1 vs n_protect", wr.Config("policy.n_protect"), wr.SummaryMetric("accuracy")),
        _scatter(wr, "pass@1 vs attn_temperature", wr.Config("policy.attn_temperature"), wr.SummaryMetric("accuracy")),
    ]


def _pilot(wr: Any) -> list:
    return [_bars(wr, "pass@1 per policy (the pilot's bars)", ["accuracy"]), _bars(wr, "loop rate", ["loop_rate"])]


def _per_policy(wr: Any) -> list:
    return [_bars(wr, "pass@1 per policy", ["accuracy"]), _bars(wr, "loop rate", ["loop_rate"])]


def _comparisons(wr: Any) -> list:
    s = wr.SummaryMetric
    return [
        _scatter(wr, "pass@1 vs mean retained KV per sample (bytes)", s("kv_retained_bytes_mean"), s("accuracy")),
        _bars(wr, "retained KV per sample: mean, peak (bytes)", ["kv_retained_bytes_mean", "kv_retained_bytes_peak"]),
        _bars(wr, "cost per correct sample: generated tokens", ["tokens_per_correct"]),
        _bars(wr, "cost per correct sample: decode seconds", ["decode_seconds_per_correct"]),
    ]


def _diversity(wr: Any) -> list:
    text = (
        "Kept-set overlap is computed from `kept_sets/*.npz` on disk (runs launched with `record_kept=true`), not "
        "logged per run: its table and figure come from the report's summary run below."
    )
    return [wr.MarkdownPanel(markdown=text)]


SECTIONS: tuple[Section, ...] = (
    Section(
        "Main table: pass@1 per policy and task",
        "pass@1 (%) ± standard error over problems at each operating point, the full cache first, the five-task "
        "average (method.md §4; docs/analysis.md: definitions).",
        _main_table,
        (r"tables/accuracy_", r"tables/summary$", r"charts/accuracy_(?!vs_)"),
    ),
    Section(
        "Comparisons: confidence intervals, paired differences, matched memory",
        "pass@1 with 95 % bootstrap intervals over problems and the spread between seeds; paired differences (same "
        "problem, seed and sample) against the full cache and between policies, Holm-adjusted over the grid; "
        "accuracy against the mean KV bytes a sample retained, and the cost per correct sample (docs/analysis.md).",
        _comparisons,
        (r"tables/statistics_", r"tables/paired_", r"figures/matched_memory_"),
    ),
    Section(
        "Failure modes: loops, garbage, truncation",
        "Share of samples classified loop / garbage / truncated / ok by the detectors of method.md §4, the samples "
        "not decoded to the end (non-finite logits, prompt too long: never counted as loops), the samples cut by the "
        "length limit, answered rate and output lengths.",
        _failures,
        (r"tables/failures_", r"figures/failure_modes_", r"figures/output_lengths_"),
    ),
    Section(
        "Efficiency: memory and throughput",
        "Decode tokens/s and rows in flight; the static KV allocation (all rows, fixed when decoding starts) apart "
        "from what the outputs needed: the KV a sample holds at its end against what a full cache would hold; peak "
        "memory (CUDA max allocated, or peak RSS on CPU) and compression (method.md §5; docs/analysis.md).",
        _efficiency,
        (r"tables/efficiency_", r"figures/throughput_memory_"),
    ),
    Section(
        "Accuracy vs budget",
        "pass@1 against the compression ratio (runs launched with `ratio=`) or the budget (`budget=`); the full "
        "cache is the reference line (the `budgets` sweep).",
        _budget,
        (r"figures/accuracy_vs_", r"charts/accuracy_vs_"),
        group_by_task=False,
        requires=(r"figures/accuracy_vs_", r"charts/accuracy_vs_"),
    ),
    Section(
        "Ablation: protection × attention temperature",
        "VaSE-AttnV's protected value slots (`n_protect`) against its attention temperature (the `vase_ablation` "
        "sweep): the paper's heatmap.",
        _ablation,
        (r"figures/ablation_", r"tables/ablation_"),
        group_by_task=False,
        requires=(r"figures/ablation_", r"tables/ablation_"),
    ),
    Section(
        "GSM8K pilot: accuracy per policy",
        "The pilot's bar chart (full, random, evict_large_value, SnapKV and its variants, VaSE-AttnV, CurDKV / "
        "VaSE-DKV; the `gsm8k_pilot` sweep).",
        _pilot,
        (r"figures/gsm8k_pilot_",),
        requires=(r"figures/gsm8k_pilot_",),
    ),
    Section(
        "Accuracy per policy, other tasks",
        "pass@1 per policy as bars, one chart per task other than GSM8K (`accuracy_bars_*`).",
        _per_policy,
        (r"figures/accuracy_bars_",),
        requires=(r"figures/accuracy_bars_",),
    ),
    Section(
        "Cache diversity",
        "Mean Jaccard overlap of the kept sets across heads, layers and samples (lower = more diverse).",
        _diversity,
        (r"tables/diversity$", r"figures/cache_diversity$"),
        requires=(r"tables/diversity$", r"figures/cache_diversity$"),
    ),
)


def load_manifest(report_dir: str | Path) -> dict:
    """``report.json`` of a ``scripts/report.py`` output folder: the group and the logged media keys."""
    from vase.analysis.report import MANIFEST

    path = Path(report_dir) / MANIFEST
    if not path.exists():
        raise ValueError(f"--report: no {MANIFEST} in {report_dir}; run `python scripts/report.py RESULTS_DIR` first")
    try:
        manifest = loads(path.read_bytes())  # nesting bounded (vase.schema.loads)
    except ValueError as err:  # not JSON, not UTF-8, nested too deep
        raise ValueError(
            f"{path}: damaged ({' '.join(str(err).split())}); run `python scripts/report.py RESULTS_DIR` again"
        ) from None
    if not isinstance(manifest, dict):
        raise ValueError(f"{path}: a JSON {type(manifest).__name__}, not an object; run scripts/report.py again")
    for kind in MEDIA_KINDS:
        manifest.setdefault(kind, [])
    return manifest


def assign_media(manifest: dict | None, sections: Sequence[Section] = SECTIONS) -> list[dict[str, list[str]]]:
    """Per section, the manifest's keys it shows (``{"tables": [...], "figures": [...], "charts": [...]}``).

    Raises:
        ValueError: a key that no section or two sections match (a new table or figure needs a section).
    """
    out = [{kind: [] for kind in MEDIA_KINDS} for _ in sections]
    for kind in MEDIA_KINDS:
        for key in (manifest or {}).get(kind, []):
            hits = [i for i, s in enumerate(sections) if any(re.match(p, key) for p in s.media)]
            if len(hits) != 1:
                where = "no section" if not hits else f"sections {[sections[i].title for i in hits]}"
                raise ValueError(f"dashboard: report key {key!r} matches {where}; extend dashboard.SECTIONS")
            out[hits[0]][kind].append(key)
    return out


def shown_sections(manifest: dict | None, sections: Sequence[Section] = SECTIONS) -> list[int]:
    """Indices of the sections to build: every one without ``manifest``; with it, those whose ``requires`` is empty
    or matched by one of its media keys (no GSM8K pilot section for a MATH ablation)."""
    if manifest is None:
        return list(range(len(sections)))
    keys = [k for kind in MEDIA_KINDS for k in manifest.get(kind, [])]
    return [
        i for i, s in enumerate(sections) if not s.requires or any(re.match(p, k) for p in s.requires for k in keys)
    ]


def cell_keys(manifest: dict | None) -> list[str]:
    """The run config keys whose values tell the sweep's cells apart (the runsets group by them, so ablation cells
    get a bar each): the policy class and the hyper-parameters in the report's policy identities (``report.json``'s
    ``cell_keys``), else :data:`DEFAULT_CELL_KEYS`."""
    keys = (manifest or {}).get("cell_keys")
    return list(dict.fromkeys([POLICY_KEY, *keys])) if keys is not None else list(DEFAULT_CELL_KEYS)


def _filters(group: str, summary: bool) -> list:
    from wandb_workspaces import expr

    job = expr.Metric("JobType") == "summary" if summary else expr.Metric("JobType") != "summary"
    return [expr.Metric("Group") == group, job]


def media_panels(wr: Any, media: dict[str, list[str]]) -> list:
    """The summary run's tables and charts (``WeavePanelSummaryTable``) and figures (one ``MediaBrowser``)."""
    panels = [wr.WeavePanelSummaryTable(table_name=k, layout=wr.Layout(w=24, h=10)) for k in media["tables"]]
    panels += [wr.WeavePanelSummaryTable(table_name=k, layout=wr.Layout(w=12, h=10)) for k in media["charts"]]
    if media["figures"]:
        panels.append(wr.MediaBrowser(title="figures", media_keys=list(media["figures"]), num_columns=2))
    return panels


def _runsets(wr: Any, entity: str, project: str, group: str, section: Section, cells: list[str]) -> tuple[Any, Any]:
    by = ([f"config.{TASK_KEY}"] if section.group_by_task else []) + [f"config.{k}" for k in cells]
    runs = wr.Runset(entity=entity, project=project, name="sweep runs", filters=_filters(group, False), groupby=by)
    summary = wr.Runset(entity=entity, project=project, name="report (summary run)", filters=_filters(group, True))
    return runs, summary


def build_report(
    entity: str | None, project: str, group: str, manifest: dict | None = None, title: str | None = None
) -> wr.Report:
    """The dashboard as a W&B report: per :data:`SECTIONS` entry a heading, a paragraph, a panel grid over the sweep's
    runs and, when ``manifest`` lists media for it, a panel grid over the report's summary run. Nothing is saved."""
    import wandb_workspaces.reports.v2 as wr

    entity = _entity(entity)
    _check_names(entity, project, group)
    cells = cell_keys(manifest)
    blocks: list = [
        wr.P(
            f"The paper's tables and figures for the sweep group `{group}`, built by `scripts/dashboard.py`. "
            "Live panels read the sweep's runs; the report panels read its summary run (`scripts/report.py`)."
        )
    ]
    media_of = assign_media(manifest)
    for section, media in ((SECTIONS[i], media_of[i]) for i in shown_sections(manifest)):
        runs, summary = _runsets(wr, entity, project, group, section, cells)
        blocks += [
            wr.H1(section.title),
            wr.P(section.text),
            wr.PanelGrid(runsets=[runs], panels=section.run_panels(wr)),
        ]
        panels = media_panels(wr, media)
        if panels:
            blocks.append(wr.PanelGrid(runsets=[summary], panels=panels))
    return wr.Report(
        entity=entity,
        project=project,
        title=title or f"vase: paper figures, {group}"[:128],
        description=f"Sweep group {group}: one section per paper table and figure.",
        blocks=blocks,
        width="fluid",
    )


def build_workspace(entity: str | None, project: str, group: str, manifest: dict | None = None) -> ws.Workspace:
    """The dashboard as a saved W&B workspace view: one open section per :data:`SECTIONS` entry (its run panels,
    then its report panels), the runs filtered to ``group`` and grouped by the cells' keys (:func:`cell_keys`).
    Nothing is saved."""
    import wandb_workspaces.reports.v2 as wr
    import wandb_workspaces.workspaces as ws
    from wandb_workspaces import expr

    entity = _entity(entity)
    _check_names(entity, project, group)
    media_of = assign_media(manifest)
    sections = [
        ws.Section(
            name=SECTIONS[i].title, panels=SECTIONS[i].run_panels(wr) + media_panels(wr, media_of[i]), is_open=True
        )
        for i in shown_sections(manifest)
    ]
    return ws.Workspace(
        entity=entity,
        project=project,
        name=f"vase paper figures: {group}",
        sections=sections,
        runset_settings=ws.RunsetSettings(
            filters=[expr.Metric("Group") == group], groupby=[expr.Config(k) for k in cell_keys(manifest)]
        ),
    )


def _entity(entity: str | None) -> str:
    """``entity``, or :data:`UNSET_ENTITY` when it is None (a dashboard built to print; :func:`publish` refuses it)."""
    if entity is None:
        logger.info("no W&B entity given: the dashboard can be printed, not saved")
        return UNSET_ENTITY
    return entity


def _check_names(entity: str, project: str, group: str) -> None:
    for name, value in (("--entity", entity), ("--project", project), ("--group", group)):
        if not value or not isinstance(value, str):
            raise ValueError(f"{name}: required (a W&B {name[2:]} name), got {value!r}")


def outline(dashboard: Any) -> list[dict]:
    """The structure of a built report or workspace, for printing and tests: per section its title, its runsets'
    filters and its panels as ``{"type": ..., "binds": [...]}`` (the metric, config and media keys it reads)."""
    sections: list[dict] = []
    if hasattr(dashboard, "blocks"):
        for block in dashboard.blocks:
            kind = type(block).__name__
            if kind == "H1":
                sections.append({"title": block.text, "grids": []})
            elif kind == "PanelGrid" and sections:
                filters = [str(rs.filters) for rs in block.runsets]
                groupby = [g for rs in block.runsets for g in (rs.groupby or [])]
                panels = [_binds(p) for p in block.panels]
                sections[-1]["grids"].append({"filters": filters, "groupby": groupby, "panels": panels})
    else:
        for s in dashboard.sections:
            filters = [str(dashboard.runset_settings.filters)]
            groupby = [_key(g) for g in dashboard.runset_settings.groupby]
            grid = {"filters": filters, "groupby": groupby, "panels": [_binds(p) for p in s.panels]}
            sections.append({"title": s.name, "grids": [grid]})
    return sections


def _key(metric: Any) -> str:
    kind = type(metric).__name__
    prefix = {"SummaryMetric": "summary", "Config": "config", "Metric": "run"}.get(kind, kind)
    return f"{prefix}:{metric.name}" if hasattr(metric, "name") else str(metric)


def _binds(panel: Any) -> dict:
    kind = type(panel).__name__
    binds: list[str] = []
    if kind == "BarPlot":
        binds = [_key(m) for m in panel.metrics] + ([f"groupby:{_key(panel.groupby)}"] if panel.groupby else [])
    elif kind == "ScatterPlot":
        binds = [_key(m) for m in (panel.x, panel.y, panel.z) if m is not None]
    elif kind == "ParallelCoordinatesPlot":
        binds = [_key(c.metric) for c in panel.columns]
    elif kind == "MediaBrowser":
        binds = [f"media:{k}" for k in panel.media_keys]
    elif kind == "WeavePanelSummaryTable":
        binds = [f"media:{panel.table_name}"]
    return {"type": kind, "title": getattr(panel, "title", None), "binds": binds}


def publish(dashboard: Any) -> str:
    """Save the report (or workspace) to W&B (needs ``wandb login`` and the network); return its URL."""
    if getattr(dashboard, "entity", None) == UNSET_ENTITY:
        raise ValueError("--entity: required to --save (a W&B entity name, or set WANDB_ENTITY)")
    dashboard.save()
    return str(dashboard.url)
