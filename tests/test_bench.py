"""The throughput benchmark (vase.bench, scripts/bench_throughput.py) on the tiny preset: columns, static KV size.

No timing assertions: speed on a shared CPU is not a property of the code.
"""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from vase.bench.kvpress import cache_argument, decode_greedy
from vase.bench.measure import trimmed_mean
from vase.bench.report import CSV_COLUMNS, check_targets
from vase.bench.shapes import PRESETS, static_capacity
from vase.bench.throughput import parse_args, run_benchmark
from vase.bench.worker import run_isolated

TINY = [
    "--model",
    "tiny",
    "--dtype",
    "float32",
    "--device",
    "cpu",
    "--prompt-len",
    "24",
    "--window",
    "8",
    "--batch",
    "2",
    "--warmup",
    "0",
    "--repeats",
    "1",
    "--isolate",
    "none",
]


def _csv(path: Path) -> list[dict]:
    with open(path) as f:
        return list(csv.DictReader(f))


def test_static_capacity_matches_method():
    # eviction: min(P + N, max(P, B) + W); otherwise P + N
    assert static_capacity("eviction", 24, 100, 32, 8) == 40
    assert static_capacity("eviction", 64, 100, 32, 8) == 72
    assert static_capacity("eviction", 24, 10, 32, 8) == 34
    assert static_capacity("none", 24, 100, 32, 8) == 124
    assert static_capacity("selection", 24, 100, 32, 8) == 124


def test_trimmed_mean_drops_min_and_max():
    assert trimmed_mean([1.0, 2.0, 3.0, 100.0]) == 2.5
    assert trimmed_mean([4.0, 2.0]) == 3.0


@pytest.mark.parametrize("schedule", ["interleaved", pytest.param("sequential", marks=pytest.mark.slow)])
def test_benchmark_writes_csv_and_kv_bytes_equal_static_size(tmp_path, schedule):
    out = tmp_path / "bench"
    args = parse_args(
        TINY
        + [
            "--policies",
            "full,streaming,snapkv,vase_dkv",
            "--budgets",
            "16",
            "--output-lens",
            "40,64",
            "--schedule",
            schedule,
            "--out",
            str(out),
        ]
    )
    rows = run_benchmark(args)
    table = _csv(out / "bench.csv")
    assert list(table[0].keys()) == CSV_COLUMNS
    assert (out / "machine.json").exists() and (out / "bench.png").exists() and (out / "bench.pdf").exists()
    assert len(rows) == len(table) == 2 * 4  # full once per output length (it ignores the budget)
    for r in rows:
        assert r["status"] == "ok", r
        assert r["kv_bytes_equal"] is True
        # the static size, recomputed here from the config: 2 layers, 2 KV heads, head_dim 16, float32
        cap = 24 + r["output_len"] if r["kind"] != "eviction" else min(24 + r["output_len"], max(24, 16) + 8)
        assert r["kv_cache_bytes"] == 2 * 2 * 2 * 2 * cap * 16 * 4
        assert r["decode_tok_s"] > 0 and r["step_ms"] > 0
        assert 0 <= r["eviction_share"] < 1
        assert r["peak_mem_bytes"] and r["peak_mem_bytes"] > 0
    by = {(r["policy"], r["output_len"]): r for r in rows}
    assert by[("full", 64)]["ratio_vs_full"] == pytest.approx(1.0)
    assert by[("streaming", 64)]["ratio_vs_streaming"] == pytest.approx(1.0)
    assert by[("snapkv", 64)]["evictions"] > 0 and by[("full", 64)]["evictions"] == 0


def test_steady_protocol_estimates_every_output_length(tmp_path):
    out = tmp_path / "steady"
    args = parse_args(
        TINY
        + [
            "--policies",
            "full,streaming,vase_attnv,quest",
            "--budgets",
            "16,32",
            "--output-lens",
            "64,96",
            "--protocol",
            "steady",
            "--steady-steps",
            "32",
            "--schedule",
            "sequential",
            "--out",
            str(out),
        ]
    )
    rows = run_benchmark(args)
    assert all(r["status"] == "ok" for r in rows)
    assert all(r["kv_bytes_equal"] for r in rows)
    by = {(r["policy"], r["budget"], r["output_len"]): r for r in rows}
    # eviction policies run once per budget with prompt = budget (cache full from the start), expanded to each length
    ev = by[("vase_attnv", 32, 64)]
    assert ev["run_prompt_len"] == 32 and ev["run_output_len"] == 32 and ev["capacity"] == 40
    assert by[("vase_attnv", 32, 96)]["step_ms"] == ev["step_ms"]
    # the full cache's probe has the capacity of the real P + N run
    assert by[("full", 0, 96)]["capacity"] == 24 + 96
    assert all(r["est_tok_s"] and r["est_tok_s"] > 0 for r in rows if "@" not in r["policy"])
    assert ("full@start", 0, 96) in by
    # a selection policy decodes after a prompt longer than its budget (P + N - S = 56 > 16)
    assert by[("quest", 16, 64)]["run_prompt_len"] == 24 + 64 - 32 and by[("quest", 16, 64)]["est_tok_s"] > 0


def test_targets_without_full_rows_do_not_judge_the_full_cache_target():
    rows = [
        dict(policy=name, status="ok", kind="eviction", budget=16, output_len=256, kv_bytes_equal=True,
             ratio_vs_streaming=ratio, ratio_vs_full=None)
        for name, ratio in (("streaming", 1.0), ("vase_attnv", 0.97), ("vase_dkv", 0.9))
    ]  # fmt: skip
    targets = {t["target"].split(" (")[0]: t for t in check_targets(rows)}
    assert not any("faster than full" in t for t in targets)
    assert targets["vase_attnv >= 0.95x streaming"]["met"] and not targets["vase_dkv >= 0.95x streaming"]["met"]
    rows.append(dict(rows[0], policy="full", kind="none", budget=0, ratio_vs_full=1.0))
    targets = [t for t in check_targets(rows) if "faster than full" in t["target"]]
    assert len(targets) == 1 and not targets[0]["met"]  # no eviction row has a ratio against full above 1


def test_paper14b_preset_settings():
    args = parse_args(["--preset", "paper14b", "--device", "cpu"])
    assert args.model == "qwen3-14b-shape" and args.batch == 16 and args.prompt_len == 256
    assert args.budgets == [2048, 4096, 6144] and args.output_lens == [16384, 32768]
    assert set(args.policies) == {"full", "streaming", "rkv", "vase_attnv", "vase_dkv"}
    shape = PRESETS["qwen3-14b-shape"]
    assert (shape["hidden_size"], shape["num_hidden_layers"], shape["num_attention_heads"]) == (5120, 40, 40)
    assert (shape["num_key_value_heads"], shape["head_dim"], shape["intermediate_size"]) == (8, 128, 17408)


def test_kvpress_side_decode_loop_is_plain_greedy_decoding():
    """bench_kvpress's decode loop (explicit positions, no press) yields the tokens of transformers' greedy generate."""
    import torch
    from transformers import DynamicCache

    from vase.models import tiny_model

    model = tiny_model("qwen3")
    prompt = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    want = model.generate(prompt, max_new_tokens=10, do_sample=False, min_new_tokens=10)[:, 12:]
    cache = DynamicCache()
    with torch.inference_mode():
        tok = model(input_ids=prompt, cache=cache, use_cache=True).logits[:, -1].argmax(-1)
        tokens = torch.empty((2, 10), dtype=torch.long)
        tokens[:, 0] = tok
        decode_greedy(model, cache, tok, 12, 10, tokens)
    assert torch.equal(tokens, want)


def test_cache_argument_follows_the_forward_signature():
    """Our transformers takes ``cache=``; the kvpress venv's older one only ``past_key_values=``."""
    import torch

    from vase.models import tiny_model

    class Old(torch.nn.Module):
        def forward(self, input_ids=None, past_key_values=None, use_cache=None):
            return input_ids

    assert cache_argument(tiny_model("qwen3")) == "cache"
    assert cache_argument(Old()) == "past_key_values"


@pytest.mark.slow  # CI's time budget
def test_isolated_worker_runs_one_config_in_a_fresh_process():
    """``--isolate subprocess``: ``python -m vase.bench.worker`` returns the same row fields as in-process."""
    spec = dict(
        model="tiny", dtype="float32", device="cpu", attn_backend="auto", window=8, batch=2, prompt_len=24, warmup=0,
        repeats=1, seed=0, protocol="full", steady_steps=0, warmup_steps=0, policy="snapkv", budget=16, output_len=40,
        threads=1,
    )  # fmt: skip
    row = run_isolated("throughput", spec, timeout=300)
    assert row["status"] == "ok", row
    assert row["kv_bytes_equal"] is True and row["evictions"] > 0
    assert row["peak_mem_bytes"] > 0 and row["peak_mem_source"]
    assert run_isolated("nonsense", spec, timeout=300)["error"]
