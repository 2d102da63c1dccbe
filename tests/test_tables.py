"""The published tables: the compact results (vase.analysis.slim) give the pilot generators' Markdown digit for digit,
``make tables`` (vase.analysis.published) regenerates docs/pilot.md's and the README's blocks from them, and the
committed tables are what the generators write from the committed compact results."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from tests.test_analysis import make_run
from tests.test_pilot import FULL, REASONING
from vase.analysis.load import load_tree
from vase.analysis.pilot import (
    BLOCKS,
    pilot_comparisons,
    pilot_markdown,
    pilot_table,
    reasoning_markdown,
    summary_markdown,
)
from vase.analysis.published import (
    DATA,
    PUBLISHED,
    README_BLOCKS,
    archive,
    stale_tables,
    write_tables,
)
from vase.analysis.slim import DROPPED_FIELDS, MAX_ANSWER, open_slim, slim_info, slim_sample, slim_tree
from vase.run.results import read_samples
from vase.schema import METRIC_FIELDS, SAMPLE_FIELDS

ROOT = Path(__file__).resolve().parents[1]


def _pilot(root: Path) -> Path:
    """A first-pilot tree: the full cache and three policies, uneven tokens and decode times, one machine."""
    snap = {"p0": [1, 0], "p1": [0, 1], "p2": [1, 0], "p3": [0, 0]}
    make_run(root, "full", "humaneval", "full", 64, FULL, tokens=[90, 130, 77, 101, 64, 200, 150, 33])
    make_run(root, "snap", "humaneval", "snapkv", 64, snap, decode_seconds=[1.5, 2.25, 0.75, 3.0])
    make_run(root, "attnv", "humaneval", "vase_attnv", 64, REASONING[("vase_attnv", None)], params={"sinks": 4})
    make_run(root, "dkv", "humaneval", "vase_dkv", 64, REASONING[("vase_dkv", None)], complete=False)
    (root / "snap" / "manifest.json").write_text(json.dumps({"device": {"cpus": 2}, "git_sha": "abc"}))
    return root


def _reasoning(root: Path) -> Path:
    """A reasoning-pilot tree (every comparison's two sides) with its control and selection trees beside it."""
    make_run(root / "pilot_reasoning", "full", "math500", "full", 64, FULL, tokens=[152] * 8, window=16)
    for (policy, keep), correct in REASONING.items():
        params = None if keep is None else {"keep_prompt": keep}
        name = policy + ("-keep" if keep else "")
        make_run(root / "pilot_reasoning", name, "math500", policy, 64, correct, params=params, window=16)
    control = {"c0": [1, 1], "c1": [0, 0], "c2": [0, 1]}
    make_run(root / "pilot_reasoning_control", "full", "math500", "full", 64, control, window=16)
    make_run(root / "pilot_reasoning_select", "full", "math500", "full", 64, {**FULL, "p9": [0, 0]}, seed=1000)
    return root


def _slim_all(results: Path, data: Path, wall: float | None = 4980.0) -> None:
    for name in ("pilot", "pilot_reasoning", "pilot_reasoning_control", "pilot_reasoning_select"):
        if (results / name).is_dir():
            slim_tree(results / name, archive(data, name), wall_seconds=wall if name.count("_") < 2 else None)


@pytest.fixture
def results(tmp_path: Path) -> Path:
    root = tmp_path / "results"
    _pilot(root / "pilot")
    _reasoning(root)
    return root


def test_the_slim_form_gives_the_generators_markdown_digit_for_digit(results: Path, tmp_path: Path):
    data = tmp_path / "data"
    _slim_all(results, data)
    full = results / "pilot"
    with open_slim(archive(data, "pilot")) as slim:
        for frame in (pilot_table, pilot_comparisons):
            pd.testing.assert_frame_equal(frame(slim), frame(full))
        want = pilot_markdown(pilot_table(full), 60.0, "x", comparisons=pilot_comparisons(full))
        assert pilot_markdown(pilot_table(slim), 60.0, "x", comparisons=pilot_comparisons(slim)) == want
        assert slim_info(slim)["wall_seconds"] == 4980.0 and slim_info(slim)["runs"] == 4
        assert (slim / "snap" / "manifest.json").read_bytes() == (full / "snap" / "manifest.json").read_bytes()
        for run in ("full", "snap", "attnv", "dkv"):  # what a validator of samples.jsonl requires is still there
            rows = read_samples(slim / run, for_metrics=True)
            assert rows and all(set(SAMPLE_FIELDS + METRIC_FIELDS) <= set(r) for r in rows)
            assert not any(set(DROPPED_FIELDS) & set(r) for r in rows)
    with (
        open_slim(archive(data, "pilot_reasoning")) as slim,
        open_slim(archive(data, "pilot_reasoning_control")) as control,
        open_slim(archive(data, "pilot_reasoning_select")) as select,
    ):
        want = reasoning_markdown(
            results / "pilot_reasoning",
            control=results / "pilot_reasoning_control",
            selection=results / "pilot_reasoning_select",
        )
        assert reasoning_markdown(slim, control=control, selection=select) == want
        assert "95 % CI" in want and "p (Holm)" in want and "unselected control" in want


def test_slim_samples_drop_the_text_and_cut_long_answers_only():
    row = {"problem_id": "p", "sample": 0, "output": "long text", "grade_detail": "ok", "correct": True}
    row |= {"extracted": "x" * (MAX_ANSWER + 50), "extracted_strict": "42", "output_tokens": 7}
    slim = slim_sample(row)
    assert list(slim) == ["problem_id", "sample", "correct", "extracted", "extracted_strict", "output_tokens"]
    assert slim["extracted"] == "x" * MAX_ANSWER and slim["extracted_strict"] == "42" and slim["output_tokens"] == 7


def test_the_archive_is_deterministic_and_refuses_bad_input(results: Path, tmp_path: Path):
    a, b = tmp_path / "a" / "pilot.tar.xz", tmp_path / "b" / "pilot.tar.xz"
    slim_tree(results / "pilot", a)
    slim_tree(results / "pilot", b)
    assert a.read_bytes() == b.read_bytes()
    with pytest.raises(ValueError, match="no such results directory"):
        slim_tree(tmp_path / "nowhere", a)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no vase runs"):
        slim_tree(tmp_path / "empty", a)
    with pytest.raises(ValueError, match=r"must end in \.tar\.xz"):
        slim_tree(results / "pilot", tmp_path / "pilot.zip")
    assert a.read_bytes() == b.read_bytes()  # nothing written over a good archive


def _repo(tmp_path: Path, readme_blocks=("pilot", "reasoning")) -> Path:
    repo = tmp_path / "repo"
    (repo / "docs").mkdir(parents=True)
    doc = "# Pilot\n\nintro\n\n" + "".join(f"{b}\nold {name}\n{e}\n\ntext\n\n" for name, (b, e) in BLOCKS.items())
    (repo / "docs" / "pilot.md").write_text(doc)
    readme = "# vase\n\n" + "".join("{}\nhand copy\n{}\n\n".format(*README_BLOCKS[n]) for n in readme_blocks)
    (repo / "README.md").write_text(readme + "the end\n")
    return repo


def test_make_tables_writes_every_block_and_a_changed_digit_is_caught(results: Path, tmp_path: Path):
    repo = _repo(tmp_path)
    _slim_all(results, repo / DATA)
    written, absent = write_tables(repo)
    assert absent == [] and len(written) == 4
    doc, readme = (repo / "docs" / "pilot.md").read_text(), (repo / "README.md").read_text()
    assert "old pilot" not in doc and "hand copy" not in readme and "intro" in doc and "the end" in readme
    assert stale_tables(repo) == ([], [])
    assert "Produced by `make tables`" in doc and "Wall time of the command that produced it: 83.0 min" in doc
    assert "`docs/data/pilot_reasoning_control.tar.xz`" in doc
    # the README's rows are the full table's cells, digit for digit
    rows = [line for line in readme.splitlines() if line.startswith("| ") and not line.startswith("| policy")]
    full_rows = [line.split(" | ") for line in doc.splitlines() if line.startswith("| ")]
    assert len(rows) == 4 + 10  # every policy of both pilots
    for short in rows:
        cells = short.split(" | ")
        assert any(cells[:4] == long[:4] and cells[-1] == long[-1] for long in full_rows), short
    rows = [line for line in rows if line.startswith("| SnapKV |")]
    # a hand edit of one digit is stale; make tables puts it back
    (repo / "README.md").write_text(readme.replace(rows[0], rows[0].replace("37.5", "37.6", 1)))
    stale, _ = stale_tables(repo)
    assert stale == [f"{repo / 'README.md'}: {README_BLOCKS['pilot'][0]} differs from `make tables`"]
    write_tables(repo)
    assert (repo / "README.md").read_text() == readme and stale_tables(repo) == ([], [])


def test_make_tables_without_compact_results_says_which_command_makes_them(results: Path, tmp_path: Path):
    repo = _repo(tmp_path, readme_blocks=())  # a README without markers is left alone
    before = (repo / "README.md").read_text()
    script = ROOT / "scripts" / "make_tables.py"
    out = subprocess.run([sys.executable, str(script), "--repo", str(repo)], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout == ""
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("docs/data/pilot.tar.xz: no compact results")
    assert "`make pilot` produces them" in lines[0] and "`make pilot-reasoning` produces them" in lines[1]
    assert "`make slim` (python scripts/slim_results.py results/pilot docs/data/pilot.tar.xz)" in lines[0]
    slim_tree(results / "pilot", archive(repo / DATA, "pilot"))  # one pilot only
    out = subprocess.run([sys.executable, str(script), "--repo", str(repo)], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.count("wrote") == 1 and "pilot_reasoning.tar.xz" in out.stderr
    assert (repo / "README.md").read_text() == before and "old reasoning" in (repo / "docs" / "pilot.md").read_text()
    check = [sys.executable, str(script), "--repo", str(repo), "--check"]
    assert subprocess.run(check, capture_output=True).returncode == 0
    doc = repo / "docs" / "pilot.md"
    doc.write_text(doc.read_text().replace("| SnapKV | 64 | 37.5", "| SnapKV | 64 | 37.4"))
    bad = subprocess.run(check, capture_output=True, text=True)
    assert bad.returncode == 1 and "stale:" in bad.stderr and "run make tables" in bad.stderr


@pytest.mark.parametrize("pub", PUBLISHED, ids=[p.block for p in PUBLISHED])
def test_the_committed_tables_are_what_make_tables_writes(pub):
    """README.md and docs/pilot.md hold exactly what the generators write from the committed compact results."""
    assert archive(ROOT / DATA, pub.name).is_file(), (
        f"{(DATA / pub.name).as_posix()}.tar.xz is missing: the committed tables come from it; `{pub.make}` makes it"
    )
    stale, _ = stale_tables(ROOT)
    mine = [*BLOCKS[pub.block], *README_BLOCKS[pub.block]]
    assert [s for s in stale if any(m in s for m in mine)] == [], "run `make tables` and commit the docs"


def test_the_paper_delta_of_a_comparison_uses_the_rows_the_runs_match(tmp_path: Path):
    """The 4-sink VaSE-AttnV (the policy's default) meets the authors' 4-sink number (84.45) in the comparisons too,
    never the sink-free 85.2 (E12: the old table hard-coded 85.2 - 70.9 = +14.3); the sink-free run meets 85.2."""
    attnv = {"n_protect": 256, "sample": True, "value_stat": "range", "smooth_kernel": 5, "smooth_along": "storage"}
    deltas = {}
    for sinks in (4, 0):
        root = tmp_path / f"sinks{sinks}"
        make_run(root, "full", "math500", "full", 64, FULL, window=16)
        make_run(root, "sample", "math500", "snapkv_sample", 64, REASONING[("snapkv_sample", None)], window=16)
        params = {**attnv, "sinks": sinks}
        make_run(root, "attnv", "math500", "vase_attnv", 64, REASONING[("vase_attnv", None)], params=params, window=16)
        comp = pilot_comparisons(root).set_index("comparison").loc["value protection on top of sampling"]
        deltas[sinks] = comp["paper_gsm8k"]
        table = pilot_table(root)
        text = pilot_markdown(table, comparisons=pilot_comparisons(root))
        row = next(line for line in text.splitlines() if line.startswith("| value protection on top of sampling"))
        assert row.endswith("| +13.55 ‡ |" if sinks else "| +14.3 |"), row
        assert len(table) == 3
    assert deltas == {4: pytest.approx(84.45 - 70.9), 0: pytest.approx(85.2 - 70.9)}


def test_the_readme_summary_states_each_paper_reference_once(results: Path):
    """One paper cell per row; a qualified number (* / ‡) has its note under the table, once."""
    text = summary_markdown(pilot_table(results / "pilot"), "docs/pilot.md")
    row = next(line for line in text.splitlines() if line.startswith("| VaSE-AttnV |"))
    assert row.endswith("| 84.45 ‡ * |")
    notes = [line for line in text.splitlines() if line.startswith("\\*")]
    assert len(notes) == 1 and "84.45" in notes[0] and "4 sinks" in notes[0]
    assert text.count("‡ not in the paper") == 1 and "85.2" not in text


@pytest.mark.slow  # three runs of the real runner on the tiny model (~40 s); the fast twin is the first test above
def test_the_slim_form_of_a_real_runners_tree_gives_the_same_tables(tmp_path: Path):
    from hydra import compose, initialize_config_dir

    from vase.run.runner import run

    results = tmp_path / "results"
    for policy in ("full", "snapkv", "vase_attnv"):
        overrides = ["model=tiny", "task=gsm_symbolic", "logger=none", "limit=2", "n_samples=2", "budget=32"]
        overrides += ["window=16", "generation.max_length=100", "progress=false", f"results_dir={results}"]
        with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
            run(compose(config_name="config", overrides=[*overrides, f"policy={policy}"]), progress=False)
    slim_tree(results, tmp_path / "pilot.tar.xz", wall_seconds=1.0)
    with open_slim(tmp_path / "pilot.tar.xz") as slim:
        for frame in (pilot_table, pilot_comparisons):
            pd.testing.assert_frame_equal(frame(slim), frame(results))
        assert pilot_markdown(pilot_table(slim), comparisons=pilot_comparisons(slim)) == pilot_markdown(
            pilot_table(results), comparisons=pilot_comparisons(results)
        )
        assert reasoning_markdown(slim) == reasoning_markdown(results)
        machines = set(load_tree(slim).runs["machine"])
        assert machines and None not in machines  # the manifest's machine survives


def _tables_outside_blocks(text: str, markers: list[tuple[str, str]]) -> list[str]:
    """The header lines of the Markdown tables of ``text`` with a pass@1 column outside every ``(begin, end)`` block."""
    for begin, end in markers:
        while begin in text and end in text.split(begin, 1)[1]:
            head, rest = text.split(begin, 1)
            text = head + rest.split(end, 1)[1]
    return [line for line in text.splitlines() if line.startswith("|") and "pass@1" in line]


def test_no_results_table_is_copied_by_hand():
    """Every pilot results table in README.md and docs/pilot.md sits in a block `make tables` writes (a hand copy of
    a table, the old README's way, fails here), and the check finds a table outside the blocks."""
    markers = [*BLOCKS.values(), *README_BLOCKS.values()]
    for path in (ROOT / "README.md", ROOT / "docs" / "pilot.md"):
        assert _tables_outside_blocks(path.read_text(), markers) == [], f"{path.name}: a results table outside a block"
    hand = "| policy | budget | pass@1 % ± SE | Δ vs full ± paired SE |\n|---|---|---|---|\n"
    inside = "{}\n{}{}\n".format(BLOCKS["pilot"][0], hand, BLOCKS["pilot"][1])
    assert _tables_outside_blocks(inside, markers) == [] and len(_tables_outside_blocks(inside + hand, markers)) == 1


def test_the_tables_say_where_the_runs_ran(tmp_path: Path):
    """The generated block names the machine from the runs' manifests (the CPU, its kernels, native bf16, dtype,
    threads, rows in flight, versions); manifests that predate ``device.cpu`` take the slim step's words, else say
    the model was not recorded."""
    from vase.analysis.published import machine_line

    new = {"cpus": 2, "torch_threads": 1, "cpu": "AMD EPYC", "cpu_capability": "AVX512", "cpu_bf16": True}
    for name, device in (("a", new), ("b", {**new, "torch_threads": 2})):
        (tmp_path / name).mkdir()
        manifest = {"device": device, "ranks": [{"dtype": "torch.bfloat16", "rows_in_flight": 128}],
                    "libraries": {"torch": "2.13.0+cpu", "transformers": "5.25.0"}}  # fmt: skip
        (tmp_path / name / "manifest.json").write_text(json.dumps(manifest))
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "manifest.json").write_text('{"device": ')  # damaged: skipped with a warning, never a crash
    line = machine_line(tmp_path)
    assert line.startswith("Ran on: 2-core AMD EPYC (AVX512, native bf16); bfloat16; 1 / 2 torch thread(s) and 128 ")
    assert "torch 2.13.0+cpu, transformers 5.25.0 (2 manifests)" in line
    for name in ("a", "b", "c"):
        (tmp_path / name / "manifest.json").write_text(json.dumps({"device": {"cpus": 2}}))
    assert machine_line(tmp_path, "a 2-vCPU AMD EPYC").startswith("Ran on: a 2-vCPU AMD EPYC; ?;")
    assert "its model not recorded" in machine_line(tmp_path) and machine_line(tmp_path / "a" / "x") == ""
