"""Tables and figures from synthetic results trees: values equal hand-computed ones, every figure renders headless.

The main tree (built in a tmp dir, directory names deliberately misleading — the analysis must read the saved configs):

    task     policy      budget  per-problem correct samples               notes
    gsm8k    full        (64)    p0 [1,1] p1 [1,0] p2 [0,0]                -> 50.00 ± 28.87
    gsm8k    snapkv      64      p0 [1,0] p1 [0,0] p2 [0,0]                -> 16.67 ± 16.67
    gsm8k    snapkv      128     p0 [1,1] p1 [1,0] p2 [0,1]                -> 66.67 ± 16.67
    gsm8k    vase_attnv  64      p0 [1,1] p1 [1] + a torn line, no metrics -> 100.00 ± 0.00, incomplete
    gsm8k    vase_attnv  128     (missing run)                             -> –
    math500  full        (64)    p0 [1,1] p1 [1,1]                         -> 100.00 ± 0.00
    math500  snapkv      64      p0 [0,1] p1 [0,0]                         -> 25.00 ± 25.00
    math500  vase_attnv  64      p0 [1,1] p1 [0,1]                         -> 75.00 ± 25.00
    math500  vase_attnv  128     p0 [1,1] p1 [1,1]                         -> 100.00 ± 0.00
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

from vase.analysis.aggregate import summarize
from vase.analysis.figures import FigureResult, figure_ablation_heatmap, figure_accuracy_vs_budget
from vase.analysis.labels import MISSING
from vase.analysis.load import find_run_dirs, load_tree
from vase.analysis.load import resolve_budget as analysis_resolve_budget
from vase.analysis.report import build_report
from vase.analysis.tables import accuracy_table, paper_tables, to_latex, to_markdown, write_table

TARGETS = {
    "full": "vase.engine.policy.FullCache",
    "snapkv": "baselines.snapkv.SnapKV",
    "vase_attnv": "vase.policies.attnv.VaSEAttnV",
    "snapkv_protect": "baselines.snapkv.SnapKVProtect",
    "random": "baselines.random.RandomEviction",
}
KINDS = {"full": "none"}


def make_run(
    root: Path,
    dirname: str,
    task: str,
    policy: str,
    budget: int,
    correct: dict[str, list[int]],
    *,
    classes: list[str] | None = None,
    tokens: list[int] | None = None,
    complete: bool = True,
    torn: bool = False,
    params: dict | None = None,
    ratio: float = 4,
    window: int = 32,
    reference: int | None = None,
    seed: int = 0,
    model: str = "m",
    group: str | None = "sweep-a",
    decode_seconds: list[float] | None = None,
) -> Path:
    """Write one synthetic run directory in the runner's format."""
    d = root / dirname
    d.mkdir(parents=True)
    pol = {"_target_": TARGETS[policy], "budget": budget, "window": window}
    if policy != "full":
        pol.update({"sinks": 0} | (params or {}))
    task_cfg = {"_target_": "tasks.x.X", "name": task, "n_samples": 2}
    if reference is not None:
        task_cfg["reference_output_tokens"] = {"default": reference}
    config = {
        "ratio": ratio,
        "budget": budget,
        "window": window,
        "seed": seed,
        "model": {"key": model},
        "task": task_cfg,
        "policy": pol,
        "logger": {"group": group},
    }
    (d / "config.yaml").write_text(yaml.safe_dump(config))
    (d / "protocol.json").write_text(json.dumps({"policy": {"name": policy, "kind": KINDS.get(policy, "eviction")}}))
    rows, batches = [], []
    i = 0
    for j, (pid, cs) in enumerate(correct.items()):
        for s, c in enumerate(cs):
            rows.append(
                {
                    "problem_id": pid,
                    "sample": s,
                    "seed": 1000 * seed + 10 * j + s,
                    "output": "x",
                    "extracted": "1" if c else None,
                    "correct": bool(c),
                    "truncated": False,
                    "grade_detail": "",
                    "loop_class": (classes or [])[i] if classes else "ok",
                    "finish_reason": "eos",
                    "prompt_tokens": 10,
                    "output_tokens": (tokens or [])[i] if tokens else 100,
                    "budget": budget,
                    "held_tokens_end": 50,
                    "compression_ratio": 2.0,
                    "prefill_seconds": 0.1,
                    "batch_decode_seconds": 1.0,
                    "meta": {},
                }
            )
            i += 1
        n_out = sum(r["output_tokens"] for r in rows if r["problem_id"] == pid)
        batches.append(
            {
                "problem_id": pid,
                "samples": list(range(len(cs))),
                "prompt_tokens": 10,
                "output_tokens": n_out,
                "prefill_seconds": 0.1,
                "decode_seconds": decode_seconds[j] if decode_seconds else 1.0,
                "evictions": 3,
                "eviction_seconds": 0.01,
                "kv_cache_bytes": 1000 * budget,
                "kv_cache_bytes_full": 500000,
                "aux_bytes": 0,
                "attended_tokens": None,
                "held_tokens": 40.0,
                "peak_memory_bytes": 2**30 + j,
            }
        )
    with open(d / "samples.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
        if torn:
            f.write('{"problem_id": "p1", "sample": 1, "corr')
    with open(d / "batches.jsonl", "w") as f:
        for b in batches:
            f.write(json.dumps(b) + "\n")
    if complete:
        metrics = {
            "policy": policy,
            "task": task,
            "model": model,
            "complete": True,
            "samples": len(rows),
            "problems": len(correct),
            "budget": budget,
        }
        (d / "metrics.json").write_text(json.dumps(metrics))
    return d


@pytest.fixture()
def tree_dir(tmp_path: Path) -> Path:
    root = tmp_path / "results"
    make_run(root, "gsm8k/snapkv-b999", "gsm8k", "full", 64, {"p0": [1, 1], "p1": [1, 0], "p2": [0, 0]})
    make_run(
        root,
        "gsm8k/a",
        "gsm8k",
        "snapkv",
        64,
        {"p0": [1, 0], "p1": [0, 0], "p2": [0, 0]},
        classes=["loop", "ok", "truncated", "loop", "ok", "garbage"],
        tokens=[100, 200, 300, 400, 500, 600],
        decode_seconds=[1.0, 2.0, 3.0],
    )
    make_run(
        root,
        "gsm8k/b",
        "gsm8k",
        "snapkv",
        128,
        {"p0": [1, 1], "p1": [1, 0], "p2": [0, 1]},
        tokens=[50, 150, 250, 350, 450, 550],
    )
    make_run(root, "sweep/x/y/c", "gsm8k", "vase_attnv", 64, {"p0": [1, 1], "p1": [1]}, complete=False, torn=True)
    make_run(root, "math500/full", "math500", "full", 64, {"p0": [1, 1], "p1": [1, 1]})
    make_run(root, "math500/s", "math500", "snapkv", 64, {"p0": [0, 1], "p1": [0, 0]})
    make_run(root, "math500/v64", "math500", "vase_attnv", 64, {"p0": [1, 1], "p1": [0, 1]})
    make_run(root, "math500/v128", "math500", "vase_attnv", 128, {"p0": [1, 1], "p1": [1, 1]})
    (root / ".hydra" / "x").mkdir(parents=True)  # hydra's folders hold no runs
    return root


def row(summary: pd.DataFrame, task: str, policy: str, op: str) -> pd.Series:
    sub = summary[(summary["task"] == task) & (summary["policy"] == policy) & (summary["op"] == op)]
    assert len(sub) == 1, (task, policy, op, summary[["task", "policy", "op"]])
    return sub.iloc[0]


def test_find_and_load(tree_dir: Path):
    assert len(find_run_dirs(tree_dir)) == 8
    tree = load_tree(tree_dir)
    assert len(tree.runs) == 8
    half = tree.runs[tree.runs["run_dir"].str.endswith("sweep/x/y/c")].iloc[0]
    assert not half["complete"] and half["samples"] == 3 and half["source"] == "samples.jsonl"
    # the directory name says snapkv-b999; the saved config says full cache
    full = tree.runs[tree.runs["run_dir"].str.endswith("snapkv-b999")].iloc[0]
    assert full["policy"] == "full" and full["op"] == "full" and full["method"] == "Full cache"
    assert set(tree.runs["op"]) == {"full", "B=64", "B=128"}


def test_summary_values_hand_computed(tree_dir: Path):
    s = summarize(load_tree(tree_dir))
    assert len(s) == 8
    expect = {  # (task, policy, op): (accuracy %, standard error %)
        ("gsm8k", "full", "full"): (50.0, 100 * 0.5 / math.sqrt(3)),
        ("gsm8k", "snapkv", "B=64"): (100 / 6, 100 / 6),
        ("gsm8k", "snapkv", "B=128"): (200 / 3, 100 / 6),
        ("gsm8k", "vase_attnv", "B=64"): (100.0, 0.0),
        ("math500", "full", "full"): (100.0, 0.0),
        ("math500", "snapkv", "B=64"): (25.0, 25.0),
        ("math500", "vase_attnv", "B=64"): (75.0, 25.0),
        ("math500", "vase_attnv", "B=128"): (100.0, 0.0),
    }
    for (task, pol, op), (acc, se) in expect.items():
        r = row(s, task, pol, op)
        assert r["accuracy"] == pytest.approx(acc), (task, pol, op)
        assert r["accuracy_se"] == pytest.approx(se), (task, pol, op)
    r = row(s, "gsm8k", "snapkv", "B=64")
    assert r["loop_rate"] == pytest.approx(100 * 2 / 6)
    assert r["garbage_rate"] == pytest.approx(100 / 6)
    assert r["truncated_rate"] == pytest.approx(100 / 6)
    assert r["ok_rate"] == pytest.approx(100 * 2 / 6)
    assert r["answered_rate"] == pytest.approx(100 / 6)
    assert r["mean_output_tokens"] == pytest.approx(350.0)
    assert r["decode_tokens_per_second"] == pytest.approx(2100 / 6)
    assert r["kv_cache_bytes"] == 64000 and r["peak_memory_bytes"] == 2**30 + 2
    assert r["evictions"] == 9 and r["complete"]
    half = row(s, "gsm8k", "vase_attnv", "B=64")
    assert not half["complete"] and half["samples"] == 3 and half["problems"] == 2
    # full cache first, then the paper order
    assert list(s[s["task"] == "gsm8k"]["policy"])[:2] == ["full", "snapkv"]


def test_accuracy_table_missing_run_and_incomplete(tree_dir: Path):
    s = summarize(load_tree(tree_dir))
    t64 = accuracy_table(s, "m", "B=64")
    assert list(t64.data["policy"]) == ["full", "snapkv", "vase_attnv"]
    assert list(t64.display.columns) == ["Method", "MATH", "GSM8K"]  # paper tasks first; no avg without all five
    t = accuracy_table(s, "m", "B=128")
    d = t.data.set_index("policy")
    assert math.isnan(d.loc["vase_attnv", "gsm8k"])  # the missing run
    assert d.loc["snapkv", "gsm8k"] == pytest.approx(200 / 3)
    assert math.isnan(d.loc["snapkv", "math500"])  # also missing at B=128
    assert d.loc["full", "gsm8k"] == pytest.approx(50.0)  # the full cache is in every operating point's table
    assert "avg" not in d  # only 1 of the 5 paper tasks
    disp = t.display.set_index("Method")
    assert disp.loc["VaSE-AttnV", "GSM8K"] == MISSING
    assert disp.loc["Full cache", "GSM8K"] == "50.00 ± 28.87"
    md = to_markdown(accuracy_table(s, "m", "B=64"))
    assert "100.00 ± 0.00 †" in md and "† incomplete" in md
    assert "| Full cache | 100.00 ± 0.00 | 50.00 ± 28.87 |" in md
    tex = to_latex(t64)
    assert r"\toprule" in tex and r"50.00 $\pm$ 28.87" in tex and r"\textbf{" in tex


def test_five_task_average(tmp_path: Path):
    root = tmp_path / "r"
    accs = {"aime25": [1, 0], "gpqa_diamond": [1, 1], "math500": [0, 0], "aime26": [1, 1], "hmmt25": [0, 1]}
    for task, (a, b) in accs.items():
        make_run(root, f"full/{task}", task, "full", 64, {"p0": [a, a], "p1": [b, b]})
        if task != "hmmt25":  # snapkv misses one task: no average
            make_run(root, f"snap/{task}", task, "snapkv", 64, {"p0": [a, 0], "p1": [b, b]})
        make_run(root, f"vase/{task}", task, "vase_attnv", 64, {"p0": [1, 0], "p1": [1, 1]})
    s = summarize(load_tree(root))
    t = accuracy_table(s, "m", "B=64")
    assert [c for c in t.display.columns] == ["Method", "AIME25", "GPQA-D", "MATH", "AIME26", "HMMT25", "Avg (5)"]
    d = t.data.set_index("policy")
    per_task = [50.0, 100.0, 0.0, 100.0, 50.0]
    assert d.loc["full", "avg"] == pytest.approx(np.mean(per_task))
    ses = [50.0, 0.0, 0.0, 0.0, 50.0]  # std of two per-problem accuracies {a, b}, / sqrt(2)
    assert d.loc["full", "avg_se"] == pytest.approx(math.sqrt(sum(e * e for e in ses)) / 5)
    assert math.isnan(d.loc["snapkv", "avg"])
    assert d.loc["vase_attnv", "avg"] == pytest.approx(75.0)
    assert t.display.set_index("Method").loc["SnapKV", "Avg (5)"] == MISSING


def test_policy_identity_from_varying_hyperparameters(tmp_path: Path):
    root = tmp_path / "abl"
    vals = {(16, 0.5): [1, 0], (16, 1.0): [1, 1], (32, 0.5): [0, 0], (32, 1.0): [1, 0]}
    for (n_protect, temp), cs in vals.items():
        make_run(
            root,
            f"run{n_protect}{temp}",
            "aime25",
            "vase_attnv",
            64,
            {"p0": cs},
            params={"n_protect": n_protect, "attn_temperature": temp, "sinks": 4},
        )
    make_run(root, "full", "aime25", "full", 64, {"p0": [1, 1]})
    tree = load_tree(root)
    labels = set(tree.runs["policy"])
    # attn_temperature=1.0 is VaSEAttnV's default: not part of the label; n_protect's default is None
    assert labels == {
        "full",
        "vase_attnv[attn_temperature=0.5,n_protect=16]",
        "vase_attnv[n_protect=16]",
        "vase_attnv[attn_temperature=0.5,n_protect=32]",
        "vase_attnv[n_protect=32]",
    }
    s = summarize(tree)
    assert row(s, "aime25", "vase_attnv[n_protect=16]", "B=64")["accuracy"] == 100.0
    res = FigureResult()
    figure_ablation_heatmap(s, res)
    assert list(res.figures) == ["ablation_m_aime25_vase_attnv_B64"]


def test_ratio_operating_point_matches_runner(tmp_path: Path):
    from vase.run.runner import resolve_budget

    for ref, ratio, window in [(256, 4, 16), (15325, 4, 64), (1000, 3, 64), (100, 8, 16)]:
        assert analysis_resolve_budget(ref, ratio, window) == resolve_budget(ref, ratio, window)
    root = tmp_path / "ratio"
    for ratio in (2, 4):
        budget = analysis_resolve_budget(256, ratio, 16)
        make_run(root, f"s{ratio}", "gsm8k", "snapkv", budget, {"p0": [1, 0]}, ratio=ratio, window=16, reference=256)
    make_run(root, "explicit", "gsm8k", "snapkv", 96, {"p0": [1, 1]}, ratio=4, window=16, reference=256)
    # an explicit budget equal to the ratio-derived one is ambiguous from config.yaml alone; budget_source decides
    d = make_run(root, "explicit64", "gsm8k", "snapkv", 64, {"p0": [1, 1]}, ratio=4, window=16, reference=256)
    cfg = yaml.safe_load((d / "config.yaml").read_text())
    (d / "config.yaml").write_text(yaml.safe_dump({**cfg, "budget_source": "explicit"}))
    tree = load_tree(root)
    assert sorted(tree.runs["op"]) == ["2x", "4x", "B=64", "B=96"]
    res = FigureResult()
    figure_accuracy_vs_budget(summarize(tree), res)
    assert list(res.figures) == ["accuracy_vs_ratio_m_gsm8k", "accuracy_vs_budget_m_gsm8k"]


def test_tables_written_and_csv_values(tree_dir: Path, tmp_path: Path):
    s = summarize(load_tree(tree_dir))
    tables = paper_tables(s)
    names = {t.name for t in tables}
    assert {"summary", "accuracy_m_B64", "accuracy_m_B128", "failures_m_B64", "efficiency_m_B128"} <= names
    out = tmp_path / "tables"
    for t in tables:
        for p in write_table(t, out):
            assert p.stat().st_size > 0
    csv = pd.read_csv(out / "accuracy_m_B64.csv").set_index("policy")
    assert csv.loc["snapkv", "gsm8k"] == pytest.approx(100 / 6)
    assert csv.loc["vase_attnv", "math500_se"] == pytest.approx(25.0)
    fail = pd.read_csv(out / "failures_m_B64.csv")
    snap = fail[(fail["task"] == "gsm8k") & (fail["policy"] == "snapkv")].iloc[0]
    assert snap["loop_rate"] == pytest.approx(100 / 3)


def test_report_renders_every_figure(tree_dir: Path, tmp_path: Path):
    from vase.run.kept_sets import KeptEvent, KeptSetRecorder, kept_sets_path

    event = KeptEvent("p0", 0, 0, np.array([0, 1]), np.array([[[0, 1], [0, 2]], [[0, 1], [3, 4]]]))
    KeptSetRecorder().dump(kept_sets_path(tree_dir / "gsm8k" / "a", "p0"), [event])
    # the GSM8K pilot shape: many policies at one budget
    make_run(tree_dir, "pilot/random", "gsm8k", "random", 64, {"p0": [0, 0], "p1": [1, 0], "p2": [0, 0]})
    for n in (16, 256):
        make_run(
            tree_dir,
            f"pilot/protect{n}",
            "gsm8k",
            "snapkv_protect",
            64,
            {"p0": [1, 0], "p1": [1, 1], "p2": [0, 0]},
            params={"n_protect": n},
        )
    out = tmp_path / "report"
    (out / "figures").mkdir(parents=True)
    (out / "figures" / "old_figure.png").write_bytes(b"stale")  # a rerun replaces the outputs
    report = build_report(tree_dir, out, formats=("png",))
    assert not (out / "figures" / "old_figure.png").exists()
    pngs = {p.stem: p for p in report.figure_paths}
    expected = {
        "accuracy_vs_budget_m_gsm8k",
        "accuracy_vs_budget_m_math500",
        "failure_modes_m_B64",
        "failure_modes_m_B128",
        "output_lengths_m_B64",
        "throughput_memory_m",
        "gsm8k_pilot_m_B64",
        "accuracy_bars_math500_m_B64",
        "cache_diversity",
    }
    assert expected <= set(pngs), set(pngs)
    for p in pngs.values():
        assert p.stat().st_size > 5000 and p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    div = pd.read_csv(out / "tables" / "diversity.csv")
    assert div.loc[0, "heads"] == pytest.approx((1 / 3 + 0.0) / 2)
    assert (out / "report.md").read_text().count("![") == len(pngs)
    pilot = report.summary[report.summary["task"] == "gsm8k"]
    assert {"snapkv_protect[n_protect=16]", "snapkv_protect[n_protect=256]"} <= set(pilot["policy"])


def test_report_pdf_and_skips(tmp_path: Path):
    root = tmp_path / "one"
    make_run(root, "a", "gsm8k", "full", 64, {"p0": [1, 0], "p1": [1, 1]})
    make_run(root, "b", "gsm8k", "snapkv", 64, {"p0": [1, 0], "p1": [0, 1]})
    report = build_report(root, tmp_path / "out", formats=("png", "pdf"))
    pdfs = [p for p in report.figure_paths if p.suffix == ".pdf"]
    assert pdfs and all(p.read_bytes()[:4] == b"%PDF" for p in pdfs)
    skipped = dict(report.skipped)
    assert "no policy at two budget values" in skipped["accuracy_vs_budget_m_gsm8k"]
    assert "cache_diversity" in skipped


def test_metrics_only_run(tmp_path: Path):
    """A run that kept only metrics.json (e.g. copied from elsewhere): its numbers are taken as saved."""
    root = tmp_path / "m"
    d = make_run(root, "a", "gsm8k", "snapkv", 64, {"p0": [1, 0]})
    (d / "samples.jsonl").unlink()
    (d / "batches.jsonl").unlink()
    saved = {
        "policy": "snapkv",
        "task": "gsm8k",
        "model": "m",
        "complete": True,
        "samples": 40,
        "problems": 20,
        "accuracy": 0.4,
        "accuracy_stderr": 0.05,
        "loop_rate": 0.1,
        "garbage_rate": 0.0,
        "truncation_rate": 0.2,
        "answered_rate": 0.9,
        "mean_output_tokens": 321.0,
        "compression_ratio": 3.0,
    }
    (d / "metrics.json").write_text(json.dumps(saved))
    s = summarize(load_tree(root))
    r = row(s, "gsm8k", "snapkv", "B=64")
    assert (r["accuracy"], r["accuracy_se"], r["loop_rate"], r["ok_rate"]) == pytest.approx((40, 5, 10, 70))
    assert r["samples"] == 40 and r["complete"] and math.isnan(r["decode_tokens_per_second"])
    assert {t.name for t in paper_tables(s)} >= {"summary", "accuracy_m_B64"}


def test_errors(tmp_path: Path):
    with pytest.raises(ValueError, match="no such directory"):
        load_tree(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no runs"):
        load_tree(tmp_path / "empty")


def test_report_script_and_wandb_offline(tmp_path: Path, monkeypatch):
    import importlib.util

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb_dir"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    spec = importlib.util.spec_from_file_location(
        "report", Path(__file__).resolve().parents[1] / "scripts" / "report.py"
    )
    report = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(report)
    tree_dir = tmp_path / "results"
    make_run(tree_dir, "a", "gsm8k", "full", 64, {"p0": [1, 0], "p1": [1, 1]}, group="sweep-a")
    make_run(tree_dir, "b", "gsm8k", "snapkv", 64, {"p0": [1, 0], "p1": [0, 1]}, group="sweep-a")
    make_run(tree_dir, "c", "gsm8k", "snapkv", 128, {"p0": [1, 1], "p1": [0, 1]}, group="sweep-a")
    out = tmp_path / "rep"
    assert report.main([str(tree_dir), "--out", str(out), "--formats", "png", "-q"]) == 0
    runs = list((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))
    assert (out / "tables" / "accuracy_m_B64.tex").exists()
    assert report.main([str(tmp_path / "missing"), "--wandb", "disabled"]) == 2
    assert os.environ["WANDB_MODE"] == "offline"
