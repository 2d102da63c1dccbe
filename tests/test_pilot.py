"""The pilot table (vase.analysis.pilot): pass@1 ± SE, the paired difference to the full cache, the generated block."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tests.test_analysis import make_run
from vase.analysis.pilot import BEGIN, END, pilot_markdown, pilot_table, update_block


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    root = tmp_path / "results"
    # four problems x 2 samples; snapkv loses exactly one sample on each of p0 and p1
    full = {"p0": [1, 1], "p1": [1, 1], "p2": [1, 0], "p3": [0, 0]}
    snap = {"p0": [1, 0], "p1": [0, 1], "p2": [1, 0], "p3": [0, 0]}
    make_run(root, "full", "humaneval", "full", 64, full)
    make_run(root, "snap", "humaneval", "snapkv", 64, snap)
    return root


def test_pilot_table_by_hand(tree: Path):
    t = pilot_table(tree).set_index("policy")
    assert t.loc["full", "accuracy"] == pytest.approx(100 * 5 / 8)
    assert t.loc["snapkv", "accuracy"] == pytest.approx(100 * 3 / 8)
    # per-problem differences (%): -50, -50, 0, 0 -> mean -25, paired SE = std / sqrt(4)
    d = [-50.0, -50.0, 0.0, 0.0]
    sd = math.sqrt(sum((x + 25) ** 2 for x in d) / 3)
    assert t.loc["snapkv", "delta_vs_full"] == pytest.approx(-25.0)
    assert t.loc["snapkv", "delta_se"] == pytest.approx(sd / 2)
    assert math.isnan(t.loc["full", "delta_vs_full"])
    assert t.loc["snapkv", "paper_gsm8k"] == 64.3 and t.loc["full", "paper_gsm8k"] == 88.0
    assert list(t.index) == ["full", "snapkv"]  # the paper pilot's order


def test_markdown_and_generated_block(tree: Path, tmp_path: Path):
    text = pilot_markdown(pilot_table(tree), wall_seconds=120.0, command="make pilot")
    assert "| SnapKV | 64 | 37.5 ±" in text and "-25.0 ±" in text and "2.0 min" in text
    doc = tmp_path / "pilot.md"
    doc.write_text(f"# Pilot\nbefore\n{BEGIN}\nold\n{END}\nafter\n")
    update_block(doc, text)
    content = doc.read_text()
    assert "old" not in content and "before" in content and "after" in content and "SnapKV" in content
    with pytest.raises(ValueError, match="generated block"):
        (tmp_path / "bad.md").write_text("no markers")
        update_block(tmp_path / "bad.md", text)


def test_both_grader_rules_and_the_paper_rows_of_the_gsm8k_pilot(tmp_path: Path):
    """A GSM8K-pilot tree under protocol=paper: the ladder rows find their own paper numbers, both rules are shown."""
    from vase.analysis.paper import GSM8K_PILOT
    from vase.run.records import compute_metrics

    root = tmp_path / "results"
    # 2 problems x 2 samples; `correct` is the last_boxed rule (the run's grader), strict reads one answer fewer
    last = {"p0": [1, 1], "p1": [1, 0]}
    strict = {"p0": [1, 0], "p1": [1, 0]}
    make_run(root, "full", "gsm8k", "full", 512, last, rules={"last_boxed": last, "strict": strict}, protocol="paper")
    for n in (16, 256):
        make_run(
            root,
            f"protect{n}",
            "gsm8k",
            "snapkv_protect",
            512,
            last,
            params={"n_protect": n, "sample": False, "smooth_kernel": 5, "smooth_along": "storage"},
            rules={"last_boxed": last, "strict": strict},
            protocol="paper",
        )
    t = pilot_table(root)
    by_row = dict(zip(t["paper_row"], t["paper_gsm8k"]))
    assert by_row == {"full": 88.0, "snapkv_protect16": 73.3, "snapkv_protect256": 80.5}
    assert GSM8K_PILOT.row("snapkv_protect16").accuracy == 73.3
    r = t[t["paper_row"] == "snapkv_protect16"].iloc[0]
    assert r["accuracy_last_boxed"] == pytest.approx(75.0) and r["accuracy_strict"] == pytest.approx(50.0)
    text = pilot_markdown(t)
    assert "strict % | last-boxed % |" in text and "| 50.0 | 75.0 |" in text and GSM8K_PILOT.source in text
    # the runner's metrics from the same samples.jsonl: both rules, with pass@k and stderr
    m = compute_metrics(root / "protect16", ["p0", "p1"], 2, {}, [1, 2])
    assert m["accuracy_strict"] == 0.5 and m["accuracy_last_boxed"] == 0.75 and m["pass@2_strict"] == 1.0
    assert m["accuracy_strict_stderr"] == 0.0 and m["answered_rate_strict"] == 0.5
