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
