"""The pilot table (vase.analysis.pilot): pass@1 ± SE, the paired difference to the full cache, the generated block."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from tests.test_analysis import make_run
from tests.test_tasks import SHARED, needs_shared
from vase.analysis.pilot import (
    pilot_comparisons,
    pilot_markdown,
    pilot_regime,
    pilot_table,
    reasoning_markdown,
    selection_table,
)

ROOT = Path(__file__).resolve().parents[1]


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


# --------------------------------------------------------------------------------------------------------------------
# The second pilot (the paper's regime): regime, paired comparisons, the full cache on other problem sets, its block

FULL = {"p0": [1, 1], "p1": [1, 1], "p2": [1, 0], "p3": [0, 0]}
REASONING = {  # (policy, params) -> per-problem correct samples; every run at budget 64, window 16
    ("random", None): {"p0": [1, 0], "p1": [0, 0], "p2": [0, 0], "p3": [0, 0]},
    ("random_keep_prompt", None): {"p0": [1, 1], "p1": [1, 0], "p2": [1, 0], "p3": [0, 0]},
    ("evict_large_value", None): {"p0": [0, 0], "p1": [0, 0], "p2": [0, 0], "p3": [0, 0]},
    ("snapkv", None): {"p0": [1, 0], "p1": [0, 1], "p2": [0, 0], "p3": [0, 0]},
    ("snapkv", True): {"p0": [1, 1], "p1": [1, 1], "p2": [0, 0], "p3": [0, 0]},
    ("snapkv_sample", None): {"p0": [1, 1], "p1": [0, 1], "p2": [0, 0], "p3": [0, 0]},
    ("vase_attnv", None): {"p0": [1, 1], "p1": [1, 1], "p2": [1, 0], "p3": [0, 0]},
    ("curdkv", None): {"p0": [1, 1], "p1": [0, 0], "p2": [0, 0], "p3": [0, 0]},
    ("vase_dkv", None): {"p0": [1, 1], "p1": [1, 0], "p2": [1, 0], "p3": [1, 0]},
}


def _paired_by_hand(a: dict, b: dict) -> tuple[float, float]:
    d = [100 * (sum(a[p]) - sum(b[p])) / len(a[p]) for p in a]
    mean = sum(d) / len(d)
    return mean, math.sqrt(sum((x - mean) ** 2 for x in d) / (len(d) - 1)) / math.sqrt(len(d))


@pytest.fixture
def reasoning_tree(tmp_path: Path) -> Path:
    root = tmp_path / "pilot_reasoning"
    # prompts are 10 tokens (make_run); the full cache writes 152 tokens: 64 - 10 - 16 = 38 slots, 152 / 38 = 4x
    make_run(root, "full", "humaneval", "full", 64, FULL, tokens=[152] * 8, window=16)
    for (policy, keep), correct in REASONING.items():
        params = None if keep is None else {"keep_prompt": keep}
        name = policy + ("-keep" if keep else "")
        make_run(root, name, "humaneval", policy, 64, correct, params=params, window=16)
    return root


def test_reasoning_regime_is_measured_on_the_full_cache(reasoning_tree: Path):
    r = pilot_regime(reasoning_tree).iloc[0]
    assert (r["budget"], r["window"], r["problems"]) == (64, 16, 4)
    assert r["prompt_mean"] == 10 and r["prompt_max"] == 10 and r["full_output_mean"] == 152
    assert r["gen_slots"] == pytest.approx(38.0) and r["gen_compression"] == pytest.approx(4.0)
    assert bool(r["holds_prompts"])  # 64 >= 10 + 16


def test_reasoning_comparisons_by_hand(reasoning_tree: Path):
    comp = pilot_comparisons(reasoning_tree).set_index("comparison")
    cases = {
        "sampling instead of top-k": (("snapkv_sample", None), ("snapkv", None)),
        "value protection on top of sampling": (("vase_attnv", None), ("snapkv_sample", None)),
        "a resampled sketch (VaSE-DKV vs CurDKV)": (("vase_dkv", None), ("curdkv", None)),
        "keeping the prompt: SnapKV": (("snapkv", True), ("snapkv", None)),
        "keeping the prompt: random": (("random_keep_prompt", None), ("random", None)),
        "Random Attention vs VaSE-AttnV": (("random_keep_prompt", None), ("vase_attnv", None)),
        "Random Attention vs SnapKV + keep prompt": (("random_keep_prompt", None), ("snapkv", True)),
        "evicting the large values vs random": (("evict_large_value", None), ("random", None)),
    }
    for what, (a, b) in cases.items():
        mean, se = _paired_by_hand(REASONING[a], REASONING[b])
        assert comp.loc[what, "delta"] == pytest.approx(mean), what
        assert comp.loc[what, "delta_se"] == pytest.approx(se), what
        assert comp.loc[what, "problems"] == 4
    assert comp.loc["keeping the prompt: SnapKV", "delta"] == pytest.approx(25.0)
    assert comp.loc["sampling instead of top-k", "paper_gsm8k"] == pytest.approx(6.6)
    assert "keeping the prompt: VaSE-AttnV" not in comp.index  # no vase_attnv + keep_prompt run in the tree
    # the two SnapKV runs are two rows of the policy table, the kept-prompt one named by its setting
    table = pilot_table(reasoning_tree)
    snap = table[table["policy"].str.startswith("snapkv[") | (table["policy"] == "snapkv")]
    assert len(snap) == 2 and any("keep_prompt=True" in m for m in snap["method"])


def test_random_attention_as_random_with_keep_prompt_is_paired_too(tmp_path: Path):
    # Random Attention written as random eviction with keep_prompt=true (not its own policy) is the same side
    root = tmp_path / "pilot_reasoning"
    make_run(root, "full", "humaneval", "full", 64, FULL, window=16)
    make_run(root, "random", "humaneval", "random", 64, REASONING[("random", None)], window=16)
    keep = REASONING[("random_keep_prompt", None)]
    make_run(root, "random-keep", "humaneval", "random", 64, keep, params={"keep_prompt": True}, window=16)
    comp = pilot_comparisons(root).set_index("comparison")
    mean, se = _paired_by_hand(keep, REASONING[("random", None)])
    assert comp.loc["keeping the prompt: random", "delta"] == pytest.approx(mean)
    assert comp.loc["keeping the prompt: random", "delta_se"] == pytest.approx(se)


def test_reasoning_block_with_selection_and_control(reasoning_tree: Path, tmp_path: Path):
    selection = tmp_path / "select"
    # the selection run covered more problems (its seed differs); only the pilot's selected ones are reported
    make_run(selection, "full", "humaneval", "full", 64, {**FULL, "p9": [0, 0]}, seed=1000, window=16)
    control = tmp_path / "control"
    make_run(control, "full", "humaneval", "full", 64, {"c0": [1, 1], "c1": [0, 0], "c2": [0, 1]}, window=16)
    text = reasoning_markdown(reasoning_tree, control=control, selection=selection, command="make pilot-reasoning")
    assert "B − P̄ − W = 38" in text and "152 / 38 = 4.0×" in text and "holds every prompt" in text
    assert "| SnapKV + sampling | 64 | 37.5 ±" in text and "| Random, prompt kept | 64 | 50.0 ±" in text
    assert "| sampling instead of top-k | SnapKV + sampling |" in text
    sel = next(line for line in text.splitlines() if line.startswith("- the selection run"))
    assert "62.5" in sel and "4 problems × 2 samples" in sel and "seed 1000" in sel  # p9 left out
    ctl = next(line for line in text.splitlines() if "unselected control" in line)
    assert "50.0 ± 28.9 %" in ctl and "3 problems × 2 samples" in ctl


@pytest.mark.slow  # CI's time budget
def test_selection_keeps_the_problems_between_floor_and_ceiling(tmp_path: Path):
    root = tmp_path / "select"
    correct = {"p0": [1, 1, 1, 1], "p1": [1, 0, 0, 0], "p2": [0, 0, 0, 0], "p3": [1, 1, 0, 1], "p4": [0, 1, 1, 0]}
    make_run(root, "full", "humaneval", "full", 64, correct, seed=1000)
    make_run(root, "snap", "humaneval", "snapkv", 64, {p: [0, 0, 0, 0] for p in correct}, seed=1000)  # not read
    t = selection_table(root, 0.25, 0.75).set_index("problem_id")
    assert list(t["correct"]) == [4, 1, 0, 3, 2] and list(t["samples"]) == [4] * 5
    assert list(t.index[t["selected"]]) == ["p1", "p3", "p4"]
    assert list(selection_table(root, 0.5, 1.0).query("selected")["problem_id"]) == ["p0", "p3", "p4"]
    script = Path(__file__).resolve().parents[1] / "scripts" / "pilot_select.py"
    out = subprocess.run([sys.executable, str(script), str(root)], capture_output=True, text=True, check=True).stdout
    assert 'problem_ids: ["p1", "p3", "p4"]' in out and "0: 1, 1: 1, 2: 1, 3: 1, 4: 1" in out
    bad = subprocess.run([sys.executable, str(script), str(root), "--low", "0.9", "--high", "0.1"], capture_output=True)
    assert bad.returncode == 2 and b"--low/--high" in bad.stderr


# --------------------------------------------------------------------------------------------------------------------
# The second pilot's sweeps: one protocol, the committed problem sets


def _sweep(name: str, *overrides: str):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose(config_name="config", overrides=[f"sweep={name}", *overrides], return_hydra_config=True)


def test_reasoning_pilot_sweeps_share_one_protocol():
    main = _sweep("pilot_reasoning")
    keep = _sweep("pilot_reasoning_keep_prompt", "policy=snapkv")
    control = _sweep("pilot_reasoning_control")
    select = _sweep("pilot_reasoning_select")
    protocol = ("model.key", "task.name", "n_samples", "budget", "window", "generation.max_length")
    for other in (keep, control, select):
        same = protocol[:-1] if other is select else protocol
        assert [OmegaConf.select(other, k) for k in same] == [OmegaConf.select(main, k) for k in same]
        assert other.generation.stop_on_loop is True
    # the committed selection was run with a longer limit than the pilot's (docs/pilot.md says why it is the same)
    assert select.generation.max_length >= main.generation.max_length
    assert main.budget % main.window == 0
    # the same seed for the pilot, its prompt-keeping variants and the control; the selection has its own
    assert main.seed == keep.seed == control.seed != select.seed
    assert main.results_dir == keep.results_dir
    assert len({main.results_dir, control.results_dir, select.results_dir}) == 3
    policies = main.hydra.sweeper.params.policy.split(",")
    assert policies[0] == "full" and {"random", "random_keep_prompt", "snapkv", "vase_attnv"} <= set(policies)
    assert keep.policy.keep_prompt is True and "full" not in keep.hydra.sweeper.params.policy.split(",")
    assert control.policy._target_.endswith("FullCache") and select.policy._target_.endswith("FullCache")
    chosen, pool, ctl = (list(c.task.problem_ids) for c in (main, select, control))
    assert set(chosen) <= set(pool)  # chosen from the selection pool...
    assert not set(ctl) & set(pool) and len(ctl) == len(chosen)  # ...the control from the other half, as many
    assert keep.task.problem_ids == main.task.problem_ids


@needs_shared
def test_reasoning_pilot_problem_ids_exist_in_the_local_math500():
    from tasks.math_tasks import MATH500

    for name in ("pilot_reasoning", "pilot_reasoning_control", "pilot_reasoning_select"):
        ids = list(_sweep(name).task.problem_ids)
        problems = MATH500(data_dir=str(SHARED), problem_ids=ids).load()
        assert sorted(p.id for p in problems) == sorted(ids)
        assert {p.meta["level"] for p in problems} <= {1, 2}


def test_the_gsm8k_pilots_vase_attnv_rows_and_the_random_row_say_what_their_numbers_are(tmp_path: Path):
    """85.2 is the authors' variant without sinks (the row runs sinks=0), the 4-sink mode of bfa2692 is shown beside
    it with its development-table number, and 53.2 says that it cannot be matched to the authors' code."""
    from vase.analysis.paper import GSM8K_PILOT

    no_sink, sinks = GSM8K_PILOT.row("vase_attnv"), GSM8K_PILOT.row("vase_attnv_sinks")
    assert (no_sink.settings["sinks"], no_sink.accuracy, no_sink.published) == (0, 85.2, True)
    assert (sinks.settings["sinks"], sinks.accuracy, sinks.published) == (4, 84.45, False)
    assert "small_range_sample_attn" in no_sink.authors and "range_sink_sample_attn" in sinks.authors
    assert "cannot be matched to the authors' code" in GSM8K_PILOT.row("random").note
    root = tmp_path / "results"
    last = {"p0": [1, 1], "p1": [1, 0]}
    base = {"n_protect": 256, "sample": True, "value_stat": "range", "smooth_kernel": 5, "smooth_along": "storage"}
    for name, n_sinks in (("attnv0", 0), ("attnv4", 4)):
        make_run(root, name, "gsm8k", "vase_attnv", 512, last, params={**base, "sinks": n_sinks}, protocol="paper")
    make_run(root, "random", "gsm8k", "random", 512, last, params={"sinks": 0}, protocol="paper")
    t = pilot_table(root)
    assert dict(zip(t["paper_row"], t["paper_gsm8k"])) == {
        "vase_attnv": 85.2,
        "vase_attnv_sinks": 84.45,
        "random": 53.2,
    }
    text = pilot_markdown(t)
    assert "| 85.2 * |" in text and "| 84.45 ‡ * |" in text and "| 53.2 * |" in text
    notes = [line for line in text.splitlines() if line.startswith("\\*")]
    assert len(notes) == 3 and any("53.20: 53.2 cannot be matched to the authors' code" in n for n in notes)
    assert "‡ not in the paper" in text and "8e1453a" in text


def test_the_comparisons_carry_a_bootstrap_ci_and_holm_adjusted_sign_flip_p(reasoning_tree: Path):
    """The CI, p and Holm columns of the pilot's paired comparisons, recomputed by hand from the per-problem
    differences (exact sign flips over 4 problems; Holm over the comparisons of the budget)."""
    import itertools

    import numpy as np

    comp = pilot_comparisons(reasoning_tree).set_index("comparison")
    a, b = REASONING[("snapkv", True)], REASONING[("snapkv", None)]
    d = np.array([100 * (sum(a[p]) - sum(b[p])) / len(a[p]) for p in a])
    boot = d[np.random.default_rng(0).integers(0, d.size, size=(2000, d.size))].mean(axis=1)
    low, high = np.quantile(boot, [0.025, 0.975])
    row = comp.loc["keeping the prompt: SnapKV"]
    assert (row["ci_low"], row["ci_high"]) == pytest.approx((low, high))
    flips = [abs(np.dot(s, d) / d.size) >= abs(d.mean()) - 1e-9 for s in itertools.product((1, -1), repeat=d.size)]
    assert row["p"] == pytest.approx(np.mean(flips))
    p = comp["p"].to_numpy()
    order = np.argsort(p)
    m = np.isfinite(p).sum()
    adjusted = np.maximum.accumulate(np.minimum(1, (m - np.arange(m)) * p[order]))
    assert comp["p_holm"].to_numpy()[order] == pytest.approx(adjusted)
    text = pilot_markdown(pilot_table(reasoning_tree), comparisons=pilot_comparisons(reasoning_tree))
    assert "| keeping the prompt: SnapKV |" in text and "95 % CI" in text and "p (Holm)" in text


@pytest.mark.parametrize(
    "expected, delta, p, want",
    [
        ("< 0", -25.0, 0.001, "reproduces"),
        ("< 0", -5.0, 0.3, "expected sign, not separated"),
        ("> 0", -15.6, 0.055, "opposite sign, not separated"),
        ("> 0 (RA)", -15.6, 0.01, "opposite sign, separated"),
        ("> 0", 0.0, 1.0, "no difference"),
        ("≈ 0", 14.1, 0.021, "separated: not level"),
        ("≈ 0 (RA)", -3.1, 0.9, "level (not separated)"),
        ("> 0", float("nan"), float("nan"), "–"),
    ],
)
def test_a_comparisons_verdict_reads_its_sign_and_holm_p(expected, delta, p, want):
    """The verdict column: the sign against the expectation, "separated" at Holm-adjusted p < 0.05 (the boundary
    itself is not separated)."""
    from vase.analysis.pilot import verdict

    assert verdict(expected, delta, p) == want
    assert verdict("< 0", -1.0, 0.05) == "expected sign, not separated"
