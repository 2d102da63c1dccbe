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
from vase.analysis.figures import (
    FigureResult,
    figure_ablation_grid,
    figure_accuracy_vs_budget,
    figure_failure_modes,
    figure_throughput_memory,
)
from vase.analysis.labels import MISSING
from vase.analysis.load import find_run_dirs, load_tree
from vase.analysis.load import resolve_budget as analysis_resolve_budget
from vase.analysis.report import build_report
from vase.analysis.tables import (
    accuracy_table,
    efficiency_table,
    failure_table,
    paper_tables,
    to_latex,
    to_markdown,
    write_table,
)

TARGETS = {
    "full": "vase.engine.policy.FullCache",
    "snapkv": "baselines.snapkv.SnapKV",
    "vase_attnv": "vase.policies.attnv.VaSEAttnV",
    "snapkv_protect": "baselines.snapkv.SnapKVProtect",
    "random": "baselines.random.RandomEviction",
    "random_keep_prompt": "baselines.random.RandomKeepPrompt",
    "snapkv_sample": "baselines.snapkv.SnapKVSample",
    "curdkv": "baselines.curdkv.CurDKV",
    "vase_dkv": "vase.policies.dkv.VaSEDKV",
    "evict_large_value": "baselines.evict_large_value.EvictLargeValue",
    "quest": "baselines.quest.Quest",
}
KINDS = {"full": "none", "quest": "selection"}


BYTES_PER_TOKEN = 100  # K/V bytes of one token over every layer in the synthetic runs
PROMPT_TOKENS = 10


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
    finish: list[str] | None = None,
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
    throughput: bool = True,
    rules: dict[str, dict[str, list[int]]] | None = None,
    protocol: str | None = None,
) -> Path:
    """Write one synthetic run directory in the runner's format (``vase.run.records``: ``samples.jsonl`` and one
    ``throughput.jsonl`` line per problem, as if each problem had decoded in its own stretch).

    Per sample: prompt 10 tokens, ``tokens[i]`` output tokens (default 100), finish reason ``finish[i]`` (default
    ``length`` for a ``truncated`` class, else ``eos``), an evicting policy holds ``min(total, budget)`` tokens at the
    end, 100 bytes per token, evictions ``1 + sample`` (0 for the full cache). Per problem ``j`` (a throughput line):
    rows = its samples, 500 · budget allocated bytes per row, decode seconds ``decode_seconds[j]`` (default 1), peak
    memory ``2**30 + j``. ``rules``: grader rule -> per-problem verdicts, stored apart (``correct_<rule>``) as a
    boxed-answer task's runner does; ``protocol``: the preset's name in ``protocol.json``.
    """
    d = root / dirname
    d.mkdir(parents=True)
    pol = {"_target_": TARGETS[policy], "budget": budget, "window": window}
    if policy != "full":
        pol.update({"sinks": 0} | (params or {}))
    evicts = KINDS.get(policy, "eviction") == "eviction"
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
    proto: dict = {"policy": {"name": policy, "kind": KINDS.get(policy, "eviction")}}
    if protocol is not None:
        proto["protocol"] = {"name": protocol}
    (d / "protocol.json").write_text(json.dumps(proto))
    rows, lines = [], []
    i = 0
    for j, (pid, cs) in enumerate(correct.items()):
        for s, c in enumerate(cs):
            cls = (classes or [])[i] if classes else "ok"
            reason = (finish or [])[i] if finish else ("length" if cls == "truncated" else "eos")
            if reason in ("nonfinite", "prompt_too_long"):
                cls = reason
            n_out = 0 if reason == "prompt_too_long" else ((tokens or [])[i] if tokens else 100)
            total = PROMPT_TOKENS + n_out
            held = min(total, budget) if evicts else total
            n_evict = 1 + s if evicts and n_out else 0
            rows.append(
                {
                    "problem_id": pid,
                    "sample": s,
                    "seed": 1000 * seed + 10 * j + s,
                    "output": "x",
                    "grader": "strict",
                    "extracted": "1" if c else None,
                    "correct": bool(c),
                    "grade_detail": "",
                    **{
                        key: value
                        for rule, by_pid in (rules or {}).items()
                        for key, value in (
                            (f"extracted_{rule}", "1" if by_pid[pid][s] else None),
                            (f"correct_{rule}", bool(by_pid[pid][s])),
                        )
                    },
                    "finish_reason": reason,
                    "error": "non-finite logits" if reason == "nonfinite" else None,
                    "cut_by_limit": reason == "length",
                    "cut_in_thinking": cls == "truncated",
                    "loop_class": cls,
                    "prompt_tokens": PROMPT_TOKENS,
                    "output_tokens": n_out,
                    "budget": budget if policy != "full" else None,
                    "held_tokens_end": held,
                    "held_tokens_mean": 40.0 if n_out else float(PROMPT_TOKENS),
                    "held_tokens_max": held,
                    "compression_ratio": total / held,
                    "compression_ratio_full_layers": total / held,
                    "kv_held_bytes_end": held * BYTES_PER_TOKEN,
                    "kv_held_bytes_end_by_type": {"full_attention": held * BYTES_PER_TOKEN},
                    "kv_full_bytes_end": total * BYTES_PER_TOKEN,
                    "kv_retained_bytes_mean": (40.0 if n_out else float(PROMPT_TOKENS)) * BYTES_PER_TOKEN,
                    "kv_retained_bytes_peak": held * BYTES_PER_TOKEN,
                    "decode_steps": max(0, n_out - 1),
                    "evictions": n_evict,
                    "eviction_seconds": 0.01 * n_evict,
                    "attended_tokens": None,
                    "meta": {},
                }
            )
            i += 1
        mine = [r for r in rows if r["problem_id"] == pid]
        dec = decode_seconds[j] if decode_seconds else 1.0
        lines.append(
            {
                "prefills": 1,
                "prefill_tokens": PROMPT_TOKENS,
                "prefill_seconds": 0.1,
                "decode_steps": max(r["decode_steps"] for r in mine),
                "row_steps": sum(r["decode_steps"] for r in mine),
                "tokens": sum(r["output_tokens"] for r in mine),
                "decode_seconds": dec,
                "samples": len(mine),
                "rows": len(mine),
                "wall_seconds": dec + 0.1,
                "kv_allocated_bytes": 500 * budget * len(mine),
                "kv_allocated_bytes_per_row": 500 * budget,
                "capacity_per_row": budget + window,
                "peak_memory_bytes": 2**30 + j,
                "time": 1.7e9 + j,
            }
        )
    with open(d / "samples.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
        if torn:
            f.write('{"problem_id": "p1", "sample": 1, "corr')
    if throughput:
        with open(d / "throughput.jsonl", "w") as f:
            for line in lines:
                f.write(json.dumps(line) + "\n")
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
    assert r["decode_tokens_per_second"] == pytest.approx(2100 / 6)  # Σ tokens / Σ decode seconds
    assert r["kv_allocated_bytes"] == 64000 and r["peak_memory_bytes"] == 2**30 + 2
    assert r["evictions"] == 9 and r["complete"]
    # per-sample quantities (samples.jsonl): outputs 100..600 + a 10-token prompt, B = 64, 100 bytes per token
    assert r["kv_held_bytes_mean"] == pytest.approx(64 * 100)  # every sample is longer than the budget
    assert r["kv_full_bytes_mean"] == pytest.approx(360 * 100) and r["kv_full_bytes_max"] == 610 * 100
    assert r["compression_ratio"] == pytest.approx(360 / 64)
    assert r["eviction_seconds"] == pytest.approx(0.09) and r["held_tokens"] == pytest.approx(40.0)
    assert r["cut_by_limit_rate"] == pytest.approx(100 / 6) and r["cut_in_thinking_rate"] == pytest.approx(100 / 6)
    assert r["nonfinite_rate"] == 0 and r["prompt_too_long_rate"] == 0
    # wall-clock quantities (throughput.jsonl, one line per problem): 2 rows each, 500 * 64 bytes per row
    assert r["rows_in_flight"] == 2 and r["kv_allocated_bytes_per_row"] == 32000
    steps = [99, 199, 299, 399, 499, 599]  # decode steps per sample (the first token comes from the prefill)
    assert r["rows_in_flight_mean"] == pytest.approx(sum(steps) / (199 + 399 + 599))
    assert r["prefill_seconds"] == pytest.approx(0.1) and r["decode_seconds"] == pytest.approx(6.0)
    full = row(s, "gsm8k", "full", "full")
    assert full["compression_ratio"] == 1.0 and full["evictions"] == 0
    assert full["kv_held_bytes_mean"] == full["kv_full_bytes_mean"] == pytest.approx(110 * 100)
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
    # attn_temperature=1.0 is VaSEAttnV's default, and the cells there keep their label like the others
    cells = [
        "vase_attnv[attn_temperature=0.5,n_protect=16]",
        "vase_attnv[attn_temperature=0.5,n_protect=32]",
        "vase_attnv[attn_temperature=1,n_protect=16]",
        "vase_attnv[attn_temperature=1,n_protect=32]",
    ]
    assert labels == {"full", *cells}
    s = summarize(tree)
    assert list(s["policy"]) == ["full", *cells]  # sorted by their values
    assert set(s.loc[s["policy"] != "full", "short"]) == {
        f"VaSE-AttnV T={t} P={p}" for t in ("0.5", "1") for p in (16, 32)
    }
    assert row(s, "aime25", "vase_attnv[attn_temperature=1,n_protect=16]", "B=64")["accuracy"] == 100.0
    res = FigureResult()
    figure_ablation_grid(s, res)
    assert list(res.figures) == ["ablation_m_aime25_vase_attnv_B64"]


def test_ratio_operating_point_matches_runner(tmp_path: Path):
    from vase.run.planning import resolve_budget

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
    assert "nonfinite_rate" not in fail and "prompt_too_long_rate" not in fail  # no such sample in this tree
    eff = efficiency_table(s, "m", "B=64")
    assert list(eff.display.columns) == [
        "Task",
        "Method",
        "Budget",
        "Compression",
        "Decode tok/s",
        "Rows in flight",
        "Mean rows",
        "Allocated KV MiB",
        "KV held / sample MiB",
        "Full KV / sample MiB",
        "Retained KV mean MiB",
        "Retained KV peak MiB",
        "Tokens / correct",
        "Decode s / correct",
        "Peak GiB",
        "Evictions",
    ]
    disp = eff.display.set_index(["Task", "Method"]).loc[("GSM8K", "SnapKV")]
    assert (disp["Decode tok/s"], disp["Rows in flight"], disp["Compression"]) == ("350.0", "2", "5.62×")
    assert disp["Allocated KV MiB"] == f"{64000 / 2**20:.1f}" and disp["KV held / sample MiB"] == f"{6400 / 2**20:.2f}"
    assert disp["Full KV / sample MiB"] == f"{36000 / 2**20:.2f}" and disp["Peak GiB"] == "1.00"
    csv = pd.read_csv(out / "efficiency_m_B64.csv")
    snap = csv[(csv["task"] == "gsm8k") & (csv["policy"] == "snapkv")].iloc[0]
    assert snap["kv_allocated_bytes"] == 64000 and snap["kv_full_bytes_mean"] == pytest.approx(36000)


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
    (d / "throughput.jsonl").unlink()
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
    res = FigureResult()
    figure_throughput_memory(load_tree(root), s, res)
    assert "no throughput.jsonl" in dict(res.skipped)["throughput_memory_m"]
    # with the runner's efficiency metrics saved, they are taken as saved too (decode seconds weight the tok/s)
    d2 = make_run(root, "b", "gsm8k", "snapkv", 64, {"p0": [1, 0]}, seed=1)
    (d2 / "samples.jsonl").unlink()
    (d2 / "throughput.jsonl").unlink()
    eff = {
        "decode_tokens_per_second": 20.0,
        "decode_seconds": 30.0,
        "kv_allocated_bytes": 4096,
        "rows_in_flight": 8,
        "kv_held_bytes_mean": 100.0,
        "kv_full_bytes_mean": 400.0,
        "peak_memory_bytes": 2**31,
        "evictions": 7,
        "nonfinite_samples": 2,
    }
    (d2 / "metrics.json").write_text(json.dumps({**saved, **eff}))
    (d / "metrics.json").write_text(json.dumps({**saved, "decode_tokens_per_second": 10.0, "decode_seconds": 10.0}))
    r = row(summarize(load_tree(root)), "gsm8k", "snapkv", "B=64")
    assert r["decode_tokens_per_second"] == pytest.approx((10 * 10 + 20 * 30) / 40)
    assert (r["kv_allocated_bytes"], r["rows_in_flight"], r["peak_memory_bytes"], r["evictions"]) == (4096, 8, 2**31, 7)
    assert r["kv_held_bytes_mean"] == pytest.approx(100.0) and r["samples"] == 80
    assert r["nonfinite_rate"] == pytest.approx(100 * 2 / 80) and r["ok_rate"] == pytest.approx(70 - 2.5)


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


def test_samples_not_decoded_to_the_end_are_their_own_classes(tmp_path: Path):
    """nonfinite / prompt_too_long samples get their own rates (never loops), appear in the failure table and figure
    only when present, and stay out of the per-sample KV means (as in the runner's metrics)."""
    root = tmp_path / "nd"
    make_run(root, "full", "gsm8k", "full", 64, {"p0": [1, 1], "p1": [1, 0]})
    make_run(
        root,
        "snap",
        "gsm8k",
        "snapkv",
        64,
        {"p0": [1, 0], "p1": [0, 0]},
        classes=["ok", "loop", "ok", "ok"],
        tokens=[100, 200, 300, 400],
        finish=["eos", "eos", "nonfinite", "prompt_too_long"],
    )
    s = summarize(load_tree(root))
    r = row(s, "gsm8k", "snapkv", "B=64")
    assert (r["loop_rate"], r["nonfinite_rate"], r["prompt_too_long_rate"], r["ok_rate"]) == (25, 25, 25, 25)
    assert (r["nonfinite_samples"], r["prompt_too_long_samples"]) == (1, 1)
    assert r["kv_held_bytes_mean"] == pytest.approx(6400)  # the two decoded samples only
    assert r["kv_full_bytes_mean"] == pytest.approx((110 + 210) / 2 * 100)
    t = failure_table(s, "m", "B=64")
    assert list(t.display.columns)[3:9] == ["Loop %", "Garbage %", "Truncated %", "OK %", "Non-finite %"] + [
        "Prompt too long %"
    ]
    d = t.data.set_index("policy")
    assert d.loc["snapkv", "nonfinite_rate"] == 25 and d.loc["full", "nonfinite_rate"] == 0
    assert any("Never counted as a loop" in n and "Prompt too long:" in n for n in t.notes)
    res = FigureResult()
    figure_failure_modes(s, res)
    (ax,) = [a for a in res.figures["failure_modes_m_B64"].axes if a.get_visible()]
    assert [h.get_label() for h in ax.get_legend_handles_labels()[0]] == [
        "Loop",
        "Garbage",
        "Truncated",
        "OK",
        "Non-finite",
        "Prompt too long",
    ]
    # without such samples the table and the figure keep the four classes
    clean = s[s["policy"] == "full"]
    assert "Non-finite %" not in failure_table(clean, "m", "full").display.columns
    res = FigureResult()
    figure_failure_modes(clean, res)
    (ax,) = [a for a in res.figures["failure_modes_m_full"].axes if a.get_visible()]
    assert [h.get_label() for h in ax.get_legend_handles_labels()[0]] == ["Loop", "Garbage", "Truncated", "OK"]


def test_summary_agrees_with_the_runners_metrics(tmp_path: Path):
    """One run's summary row equals the runner's compute_metrics on the same directory (rates in %)."""
    from vase.run.records import compute_metrics

    d = make_run(
        tmp_path,
        "run",
        "gsm8k",
        "snapkv",
        64,
        {"p0": [1, 0, 1], "p1": [0, 0, 1], "p2": [1, 1, 0]},
        classes=["ok", "loop", "truncated", "garbage", "ok", "ok", "ok", "ok", "ok"],
        tokens=[30, 200, 300, 400, 50, 60, 700, 80, 90],
        finish=["eos", "eos", "length", "eos", "nonfinite", "eos", "eos", "prompt_too_long", "eos"],
        decode_seconds=[1.5, 2.0, 0.5],
    )
    m = compute_metrics(d, ["p0", "p1", "p2"], 3, {}, [1])
    r = row(summarize(load_tree(tmp_path)), "gsm8k", "snapkv", "B=64")
    pct = {"accuracy": "accuracy", "accuracy_se": "accuracy_stderr", "answered_rate": "answered_rate"}
    pct |= {f"{c}_rate": f"{c}_rate" for c in ("loop", "garbage", "nonfinite", "cut_by_limit", "cut_in_thinking")}
    pct["truncated_rate"] = "truncation_rate"
    for ours, theirs in pct.items():
        assert r[ours] == pytest.approx(100 * m[theirs]), ours
    same = [
        "samples",
        "problems",
        "nonfinite_samples",
        "prompt_too_long_samples",
        "mean_output_tokens",
        "compression_ratio",
        "evictions",
        "eviction_seconds",
        "kv_held_bytes_mean",
        "kv_full_bytes_mean",
        "kv_full_bytes_max",
        "held_tokens",
        "decode_tokens_per_second",
        "decode_seconds",
        "wall_seconds",
        "prefill_seconds",
        "rows_in_flight",
        "rows_in_flight_mean",
        "kv_allocated_bytes",
        "kv_allocated_bytes_per_row",
        "peak_memory_bytes",
    ]
    for key in same:
        assert r[key] == pytest.approx(m[key]), key
    assert m["nonfinite_samples"] == 1 and m["kv_held_bytes_mean"] < m["kv_full_bytes_mean"]


def test_make_run_writes_the_runners_sample_schema(tmp_path: Path):
    """The synthetic samples carry exactly the keys of the runner's sample row (vase.run.records.sample_row)."""
    from types import SimpleNamespace

    from vase.run.records import sample_row

    stats = {"held_tokens": 40.0, "decode_steps": 4, "evictions": 1, "eviction_seconds": 0.01, "attended_tokens": None}
    finished = SimpleNamespace(finish_reason="eos", prompt_len=10, tokens=[1] * 5, stats=stats, sample=0, seed=1)
    from tasks.base import Grade

    grade = Grade("1", True, False, "")
    real = sample_row(
        SimpleNamespace(id="p0", meta={}),
        finished,
        "x",
        grade,
        thinking=False,
        budget=64,
        window=32,
        evicts=True,
        bytes_per_token=100,
        max_length=100,
    )
    d = make_run(tmp_path, "r", "gsm8k", "snapkv", 64, {"p0": [1]})
    ours = json.loads((d / "samples.jsonl").read_text().splitlines()[0])
    assert set(ours) == set(real)


def test_run_written_before_continuous_batching_loads_with_a_warning(tmp_path: Path, caplog):
    d = make_run(tmp_path, "old", "gsm8k", "snapkv", 64, {"p0": [1, 0]}, throughput=False)
    (d / "batches.jsonl").write_text(json.dumps({"problem_id": "p0", "kv_cache_bytes": 1}) + "\n")
    with caplog.at_level("WARNING"):
        r = row(summarize(load_tree(tmp_path)), "gsm8k", "snapkv", "B=64")
    assert "batches.jsonl" in caplog.text and "throughput.jsonl" in caplog.text
    assert r["accuracy"] == 50.0 and math.isnan(r["decode_tokens_per_second"]) and math.isnan(r["kv_allocated_bytes"])


@pytest.mark.slow
def test_report_of_a_real_run_directory(tmp_path: Path):
    """The real runner on a tiny random model (2 problems x 2 samples), then the report: the efficiency table holds
    the runner's own metrics.json numbers."""
    from hydra import compose, initialize_config_dir

    from vase.run.runner import run

    overrides = ["model=tiny", "task=gsm_symbolic", "logger=none", "limit=2", "n_samples=2", "budget=32", "window=16"]
    overrides += ["generation.max_length=120", "progress=false", f"results_dir={tmp_path / 'results'}"]
    with initialize_config_dir(config_dir=str(Path(__file__).resolve().parents[1] / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides)
    metrics = run(cfg, progress=False)
    report = build_report(tmp_path / "results", tmp_path / "report", formats=("png",))
    (eff,) = [t for t in report.tables if t.name.startswith("efficiency_")]
    r = eff.data.iloc[0]
    for key in ("decode_tokens_per_second", "rows_in_flight", "kv_allocated_bytes", "kv_held_bytes_mean"):
        assert r[key] == pytest.approx(metrics[key]), key
    assert r["kv_full_bytes_mean"] == pytest.approx(metrics["kv_full_bytes_mean"])
    assert r["peak_memory_bytes"] == metrics["peak_memory_bytes"] and r["compression_ratio"] > 1
    assert "throughput_memory_tiny" in {p.stem for p in report.figure_paths}


def test_throughput_memory_figure_draws_the_summary(tree_dir: Path):
    """One bar per (policy, operating point) and task in each panel, at the summary's values; the spread of the
    decode rate over rounds (throughput.jsonl lines) and the machine are shown."""
    tree = load_tree(tree_dir)
    s = summarize(tree)
    res = FigureResult()
    figure_throughput_memory(tree, s, res)
    fig = res.figures["throughput_memory_m"]
    axes = [a for a in fig.axes if a.get_visible()]
    assert [a.get_xlabel().split("\n")[0].split(" (")[0].split(",")[0] for a in axes] == [
        "decode tokens/s",
        "KV per sample",
        "allocated KV",
        "peak memory",
    ]
    assert "machine not recorded" in fig.get_suptitle()
    ticks = [t.get_text() for t in axes[0].get_yticklabels()]
    assert ticks == ["Full cache", "SnapKV (B=64)", "SnapKV (B=128)", "VaSE-AttnV (B=64)", "VaSE-AttnV (B=128)"]

    def bars(ax, label: str) -> list[float]:
        (c,) = [c for c in ax.containers if c.get_label() == label]
        return [p.get_width() for p in c.patches]

    # GSM8K: 600 tokens / 3 s (full), 2100 / 6 (B=64), 1800 / 3 (B=128), 300 / 2 (VaSE, torn run), no VaSE at B=128
    assert bars(axes[0], "GSM8K") == pytest.approx([200, 350, 600, 150, float("nan")], nan_ok=True)
    # SnapKV B=64 on GSM8K: three throughput.jsonl lines (300/1, 700/2, 1100/3 tokens/s): a range from 300 to 366.7
    ranges = [tuple(line.get_xdata()) for line in axes[0].get_lines()]
    assert (300.0, pytest.approx(1100 / 3)) in ranges
    # retained KV per sample: held_tokens_mean (40) x bytes per token (100), a run written before the field
    assert bars(axes[1], "GSM8K")[:2] == pytest.approx([40 * 100 / 2**20, 40 * 100 / 2**20])
    assert bars(axes[2], "GSM8K")[:3] == pytest.approx([64000 / 2**20, 64000 / 2**20, 128000 / 2**20])


def test_accuracy_under_both_grader_rules_and_two_protocols_kept_apart(tmp_path: Path):
    from vase.analysis.tables import paper_tables

    root = tmp_path / "r"
    ok, half = {"p0": [1, 1], "p1": [1, 0]}, {"p0": [1, 0], "p1": [0, 0]}
    make_run(root, "a", "math500", "snapkv", 64, ok, rules={"strict": half, "last_boxed": ok}, protocol="paper")
    make_run(root, "b", "math500", "snapkv", 64, half, rules={"strict": half, "last_boxed": ok})
    make_run(root, "c", "humaneval", "snapkv", 64, half)  # one grader: no per-rule columns
    s = summarize(load_tree(root))
    paper = s[s["policy"] == "snapkv[protocol=paper]"].iloc[0]
    default = s[s["policy"] == "snapkv[protocol=default]"].iloc[0]
    assert paper["accuracy"] == 75.0 and paper["accuracy_last_boxed"] == 75.0 and paper["accuracy_strict"] == 25.0
    assert default["accuracy"] == 25.0 and default["accuracy_strict"] == 25.0
    code = s[s["task"] == "humaneval"].iloc[0]
    assert math.isnan(code["accuracy_strict"]) and code["grader"] == "strict"
    names = {t.name for t in paper_tables(s)}
    assert {"accuracy_m_B64", "accuracy_m_B64_strict", "accuracy_m_B64_last_boxed"} <= names
    strict = next(t for t in paper_tables(s) if t.name == "accuracy_m_B64_strict")
    assert "grader: strict" in strict.caption and set(strict.data["policy"]) == set(s["policy"][s["task"] == "math500"])


def test_read_json_ignores_a_nonfinite_number_or_a_metric_out_of_range(tmp_path, caplog):
    """A run's JSON file holding NaN / Infinity (any file) or a metric out of its range (``metrics.json``) is ignored
    with one warning naming why; a good one is read."""
    from vase.analysis.load import _read_json

    (tmp_path / "protocol.json").write_text('{"a": {"b": NaN}}')
    (tmp_path / "metrics.json").write_text('{"accuracy": 1.5}')
    (tmp_path / "manifest.json").write_text('{"accuracy": 1.5, "n": 3}')  # no metric ranges outside metrics.json
    with caplog.at_level("WARNING", logger="vase.analysis.load"):
        assert _read_json(tmp_path / "protocol.json") is None
        assert _read_json(tmp_path / "metrics.json") is None
        assert _read_json(tmp_path / "manifest.json") == {"accuracy": 1.5, "n": 3}
    assert "holds a.b, not a finite number" in caplog.text
    assert "key accuracy must be" in caplog.text
