"""The W&B dashboard builder (vase.analysis.dashboard), offline: sections, panel bindings, nothing saved.

The bindings are checked against what the project really logs: the run summary keys against the runner's
``compute_metrics`` on a run directory in the runner's format, the config keys against the composed Hydra config, the
media keys against the ``report.json`` of a report built from a synthetic results tree.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.test_analysis import make_run, tree_dir  # noqa: F401  (tree_dir is a fixture)
from vase.analysis import dashboard as D
from vase.analysis.report import build_report

ROOT = Path(__file__).resolve().parents[1]
PAPER_SECTIONS = [
    "Main table: pass@1 per policy and task",
    "Comparisons: confidence intervals, paired differences, matched memory",
    "Failure modes: loops, garbage, truncation",
    "Efficiency: memory and throughput",
    "Accuracy vs budget",
    "Ablation: protection × attention temperature",
    "GSM8K pilot: accuracy per policy",
    "Accuracy per policy, other tasks",
    "Cache diversity",
]
#: the sections of tree_dir's report (GSM8K and MATH at two budgets; no ablation grid, no kept sets)
TREE_SECTIONS = [t for t in PAPER_SECTIONS if not t.startswith(("Ablation", "Cache diversity"))]


def _binds(structure: list[dict], prefix: str) -> list[str]:
    return [
        b[len(prefix) :]
        for s in structure
        for g in s["grids"]
        for p in g["panels"]
        for b in p["binds"]
        if b.startswith(prefix)
    ]


@pytest.fixture()
def report_dir(tree_dir: Path, tmp_path: Path) -> Path:  # noqa: F811
    out = tmp_path / "report"
    build_report(tree_dir, out, formats=("png",), group="sweep-a")
    return out


def test_one_section_per_paper_table_and_figure():
    structure = D.outline(D.build_report("ent", "proj", "sweep-a"))
    assert [s["title"] for s in structure] == PAPER_SECTIONS
    for s in structure:  # every section has live panels over the sweep's runs, never over the summary run
        runs = s["grids"][0]
        assert runs["panels"] and "Group\") == 'sweep-a'" in runs["filters"][0]
        assert "JobType\") != 'summary'" in runs["filters"][0]


def test_run_panels_bind_to_what_the_runner_logs(tmp_path: Path):
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from vase.run.records import compute_metrics

    correct = {f"p{i}": [1, 0] * 8 for i in range(3)}
    # a boxed-answer task: the runner logs both grader rules
    run = make_run(tmp_path, "run", "gsm8k", "snapkv", 64, correct, rules={"strict": correct, "last_boxed": correct})
    info = {"policy": "snapkv", "policy_kind": "eviction", "task": "gsm8k", "model": "m"}  # as the runner's info
    info |= {"budget_source": "explicit", "budget": 64, "window": 32, "ratio": 4, "run_dir": str(run)}
    logged = set(compute_metrics(run, ["p0", "p1", "p2"], 16, info, [1, 2, 4, 8, 16]))
    structure = D.outline(D.build_report("ent", "proj", "g"))
    summary_keys = set(_binds(structure, "summary:"))
    assert {"accuracy", "loop_rate", "decode_tokens_per_second", "peak_memory_bytes", "pass@16"} <= summary_keys
    # the efficiency section tells the static allocation apart from what the outputs needed
    assert {"kv_allocated_bytes", "kv_held_bytes_mean", "kv_full_bytes_mean", "rows_in_flight"} <= summary_keys
    assert {"nonfinite_rate", "prompt_too_long_samples", "cut_by_limit_rate"} <= summary_keys
    assert {"accuracy_strict", "accuracy_last_boxed"} <= summary_keys
    assert summary_keys <= logged, f"bound but never logged: {summary_keys - logged}"
    assert set(D.RUN_SUMMARY_KEYS) <= logged

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["policy=vase_attnv"])
    grouped = {g.removeprefix("config.") for sec in structure for grid in sec["grids"] for g in grid["groupby"]}
    config_keys = set(_binds(structure, "config:")) | grouped
    assert {"policy._target_", "policy.n_protect", "policy.attn_temperature", "ratio"} <= config_keys
    missing = [
        k for k in config_keys | set(D.RUN_CONFIG_KEYS) if OmegaConf.select(cfg, k, default="<none>") == "<none>"
    ]
    assert not missing, f"bound config keys the runs' config does not have: {missing}"


def test_report_media_each_in_one_section(report_dir: Path):
    manifest = D.load_manifest(report_dir)
    written = {f"tables/{p.stem}" for p in (report_dir / "tables").glob("*.csv")}
    assert manifest["tables"] == sorted(written)
    assert manifest["figures"] == sorted(f"figures/{p.stem}" for p in (report_dir / "figures").glob("*.png"))
    assert manifest["group"] == "sweep-a" and manifest["charts"]
    structure = D.outline(D.build_report("ent", "proj", manifest["group"], manifest))
    media = _binds(structure, "media:")
    every = manifest["tables"] + manifest["figures"] + manifest["charts"]
    assert sorted(media) == sorted(every)  # each logged key exactly once
    by_title = {s["title"]: _binds([s], "media:") for s in structure}
    assert "tables/accuracy_m_B64" in by_title["Main table: pass@1 per policy and task"]
    assert "tables/summary" in by_title["Main table: pass@1 per policy and task"]
    assert any(k.startswith("figures/accuracy_vs_") for k in by_title["Accuracy vs budget"])
    assert any(k.startswith("figures/failure_modes_") for k in by_title["Failure modes: loops, garbage, truncation"])
    assert "figures/gsm8k_pilot_m_B64" in by_title["GSM8K pilot: accuracy per policy"]
    for s in structure:  # the report's panels read the summary run only
        for grid in s["grids"][1:]:
            assert "JobType\") == 'summary'" in grid["filters"][0]


def test_assign_media_refuses_a_key_no_section_shows():
    with pytest.raises(ValueError, match="figures/brand_new_figure"):
        D.assign_media({"figures": ["figures/brand_new_figure"]})
    got = D.assign_media({"charts": ["charts/accuracy_m_t_4x", "charts/accuracy_vs_ratio_m_t"]})
    assert got[0]["charts"] == ["charts/accuracy_m_t_4x"] and got[4]["charts"] == ["charts/accuracy_vs_ratio_m_t"]


def test_panels_and_workspace_serialize_offline(report_dir: Path):
    manifest = D.load_manifest(report_dir)
    report = D.build_report("ent", "proj", "sweep-a", manifest)
    grids = [b for b in report.blocks if type(b).__name__ == "PanelGrid"]
    for panel in (p for g in grids for p in g.panels):  # the runsets need the W&B API; the panels do not
        assert panel._to_model() is not None
    workspace = D.build_workspace("ent", "proj", "sweep-a", manifest)
    assert [s["title"] for s in D.outline(workspace)] == TREE_SECTIONS
    view = workspace._to_model()
    assert len(view.spec.section.panel_bank_config.sections) == len(TREE_SECTIONS)


def test_bad_names_and_missing_manifest(tmp_path: Path):
    with pytest.raises(ValueError, match="--entity"):
        D.build_report("", "proj", "g")
    with pytest.raises(ValueError, match="--group"):
        D.build_workspace("ent", "proj", None)
    with pytest.raises(ValueError, match="report.json"):
        D.load_manifest(tmp_path)


@pytest.mark.slow  # CI's time budget
def test_script_prints_and_writes_the_structure_without_saving(report_dir: Path, tmp_path: Path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("dashboard_script", ROOT / "scripts" / "dashboard.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    out = tmp_path / "structure.json"
    assert script.main(["--entity", "ent", "--report", str(report_dir), "--out", str(out)]) == 0
    structure = json.loads(out.read_text())
    assert [s["title"] for s in structure] == TREE_SECTIONS
    assert script.main(["--entity", "ent", "--report", str(tmp_path / "nope")]) == 2
    assert script.main(["--entity", "ent"]) == 2  # no group: neither --group nor a report.json


def _script():
    import importlib.util

    spec = importlib.util.spec_from_file_location("dashboard_script", ROOT / "scripts" / "dashboard.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


@pytest.mark.slow  # CI's time budget
def test_prints_without_an_entity_but_does_not_save(report_dir: Path, tmp_path: Path, caplog, monkeypatch):
    monkeypatch.delenv("WANDB_ENTITY", raising=False)
    script = _script()
    with caplog.at_level("INFO", logger="dashboard"):
        assert script.main(["--report", str(report_dir), "--out", str(tmp_path / "s.json")]) == 0
    assert "not saved" in caplog.text
    # one panel is "1 panel", never "1 panels"
    assert "1 panels" not in caplog.text
    assert "Accuracy per policy, other tasks: 3 panels" in caplog.text  # two bar charts and the figures
    assert script.main(["--report", str(report_dir), "--save"]) == 2  # saving needs an entity: one line, no network
    with pytest.raises(ValueError, match="--entity"):
        D.publish(D.build_report(None, "proj", "g"))


def test_one_panel_is_singular(tmp_path: Path, caplog):
    manifest = {"group": "g", "tables": ["tables/diversity"], "figures": [], "charts": []}
    (tmp_path / "report.json").write_text(json.dumps(manifest))
    with caplog.at_level("INFO", logger="dashboard"):
        assert _script().main(["--report", str(tmp_path)]) == 0
    assert "Cache diversity: 2 panels" in caplog.text  # its note and the table
    with caplog.at_level("INFO", logger="dashboard"):
        assert _script().main(["--group", "g"]) == 0  # no report: every section, diversity with its note only
    assert "Cache diversity: 1 panel\n" in caplog.text + "\n" and "1 panels" not in caplog.text


def test_ablation_sections_and_bars_per_cell(tmp_path: Path):
    """A MATH ablation: an ablation section and no GSM8K pilot one; the bars group by the ablation's parameters."""
    root = tmp_path / "abl"
    for n_protect in (16, 32):
        for temp in (0.5, 1.0):
            params = {"n_protect": n_protect, "attn_temperature": temp}
            make_run(root, f"r{n_protect}{temp}", "math500", "vase_attnv", 64, {"p0": [1, 0]}, params=params)
    make_run(root, "full", "math500", "full", 64, {"p0": [1, 1]})
    build_report(root, tmp_path / "report", formats=("png",), group="abl")
    manifest = D.load_manifest(tmp_path / "report")
    assert manifest["cell_keys"] == ["policy.attn_temperature", "policy.n_protect"]
    assert "tables/ablation_m_math500_vase_attnv_B64" in manifest["tables"]
    structure = D.outline(D.build_report("ent", "proj", "abl", manifest))
    titles = [s["title"] for s in structure]
    assert "Ablation: protection × attention temperature" in titles
    assert "GSM8K pilot: accuracy per policy" not in titles and "Cache diversity" not in titles
    ablation = structure[titles.index("Ablation: protection × attention temperature")]
    assert {"media:tables/ablation_m_math500_vase_attnv_B64", "media:figures/ablation_m_math500_vase_attnv_B64"} <= {
        b for grid in ablation["grids"] for p in grid["panels"] for b in p["binds"]
    }
    main = structure[0]["grids"][0]
    assert main["groupby"] == [
        "config.task.name",
        "config.policy._target_",
        "config.policy.attn_temperature",
        "config.policy.n_protect",
    ]
    assert all(p["type"] != "BarPlot" or not any(b.startswith("groupby:") for b in p["binds"]) for p in main["panels"])
