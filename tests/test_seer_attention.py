"""SeerAttention-R (baselines/seer_attention.py, baselines/seer_gates.py) against small references, offline.

* the checkpoint format: random gates written under the published names, shapes and dtype (``config.json`` +
  ``attn_gate_weights.pth``, or safetensors) load back unchanged; bad checkpoints and mismatched models are refused in
  one line; the hub path reads a local hub cache;
* the gate: block logits after a prompt and decode steps equal a token-by-token reference of ``AttnGate`` (pre-RoPE
  queries and keys, pooled blocks, projections, norms, RoPE positions), whatever the rows' lengths;
* the oracle: with a gate that scores every block by its true attention mass, the engine's attention over the
  policy's mask equals exact top-block attention;
* the budget: ``budget // block_size`` blocks plus the current one, per KV head; all blocks when they fit;
* a short ``run.py`` on the tiny model with random gates.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from baselines.seer_attention import SeerAttentionR, rope_inv_freq, rotate
from baselines.seer_gates import GATES, WEIGHTS_FILE, GateConfig, load_gates, weight_name
from tests.seer_reference import gate_config, reference_logits, write_random_gates
from tests.tolerance import close
from vase.engine.attention import eager_attention, selection_key_mask
from vase.engine.policy import SelectionInputs
from vase.models import tiny_config

ROOT = Path(__file__).resolve().parents[1]
BS = 8  # block size of the tensor-level tests


def model_config(layers: int = 2, heads: int = 8, kv_heads: int = 2, head_dim: int = 16, hidden: int = 64):
    return tiny_config("qwen3", num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                       head_dim=head_dim, hidden_size=hidden)  # fmt: skip


def make_policy(gate_dir: Path, config, budget: int = 3 * BS, **kw) -> SeerAttentionR:
    policy = SeerAttentionR(budget=budget, window=8, block_size=BS, gate_path=str(gate_dir), **kw)
    policy.setup(config)
    return policy


def step_inputs(policy, q_nope, k_nope, length, state, layer_idx=0, lengths=None, capacity=None) -> SelectionInputs:
    """Engine-like inputs at a decode step: post-RoPE keys/queries of tokens 0..length-1 (positions = slots)."""
    b, h, t, d = k_nope.shape
    lengths = [length] * b if lengths is None else lengths
    pos = torch.arange(length)
    inv = policy._inv_freq
    keys = rotate(k_nope[:, :, :length], pos, inv)
    query = torch.stack([rotate(q_nope[i], torch.tensor(n - 1), inv) for i, n in enumerate(lengths)])[:, :, None]
    return SelectionInputs(
        query=query,
        keys=keys,
        length=length,
        lengths=torch.tensor(lengths),
        lengths_host=list(lengths),
        capacity=capacity or t,
        n_new=1,
        layer_idx=layer_idx,
        state=state,
        positions=pos.expand(b, h, length).clone(),
    )


# ---- the checkpoint format -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["pth", "safetensors"])
def test_random_gates_round_trip_in_the_published_format(tmp_path, fmt):
    cfg = model_config()
    write_random_gates(tmp_path, cfg, seed=3, fmt=fmt, block_size=BS)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["seerattn_k_seq_pooling_type"] == "Kmaxminavg" and raw["seerattn_q_head_pooling_type"] == "Qproj"
    if fmt == "pth":
        state = torch.load(tmp_path / WEIGHTS_FILE, weights_only=True)
        assert sorted(state) == sorted(
            weight_name(i, n)
            for i in range(2)
            for n in ("attngate_linear_q", "attngate_linear_k", "attngate_qnorm", "attngate_knorm")
        )
        assert state[weight_name(1, "attngate_linear_q")].shape == (2, 4, 16, 16)  # (H, Hq // H, D, gate_hidden)
        assert state[weight_name(1, "attngate_linear_k")].shape == (2, 48, 16)  # (H, 3 D, gate_hidden)
        assert all(t.dtype == torch.bfloat16 for t in state.values())
    gates = load_gates(tmp_path)
    assert gates.config == GateConfig.from_dict(raw, "x")
    assert (gates.config.block_size, gates.config.gate_hidden, gates.config.k_pooling) == (
        BS,
        16,
        ("max", "min", "avg"),
    )
    again = load_gates(write_random_gates(tmp_path / "again", cfg, seed=3, fmt="pth", block_size=BS))
    for a, b in zip(gates.layers, again.layers):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) and a[k].dtype == torch.bfloat16 for k in a)


def test_published_gate_shapes_have_the_published_sizes():
    """The README's sizes (66.1 / 66.1 / 83.9 MB) follow from the tensor shapes in bf16 for Qwen3-4B/8B/14B."""
    sizes = [((36, 32, 8, 2560), 66.1), ((36, 32, 8, 4096), 66.1), ((40, 40, 8, 5120), 83.9)]
    for (layers, heads, kv, hidden), mb in sizes:
        raw = gate_config(model_config(layers, heads, kv, 128, hidden))
        cfg = GateConfig.from_dict(raw, "x")
        n = sum(torch.Size(s).numel() for s in cfg.shapes().values()) * layers
        assert round(2 * n / 1e6, 1) == mb
    assert set(GATES) == {"Qwen/Qwen3-4B", "Qwen/Qwen3-8B", "Qwen/Qwen3-14B"}


def test_bad_checkpoints_are_refused_in_one_line(tmp_path):
    cfg = model_config()
    d = write_random_gates(tmp_path / "ok", cfg)
    state = torch.load(d / WEIGHTS_FILE, weights_only=True)
    cases = {
        "missing": {k: v for k, v in state.items() if "layers.1.self_attn.attn_gate.attngate_linear_k" not in k},
        "shape": {**state, weight_name(0, "attngate_linear_k"): torch.zeros(2, 32, 16)},
        "extra": {**state, "model.layers.0.self_attn.q_proj.weight": torch.zeros(4, 4)},
    }
    messages = {
        "missing": "has no tensor 'model.layers.1.self_attn.attn_gate.attngate_linear_k.weight'",
        "shape": "has shape (2, 32, 16), expected (2, 48, 16)",
        "extra": "tensors that are not gate weights",
    }
    for name, bad in cases.items():
        target = tmp_path / name
        target.mkdir()
        (target / "config.json").write_text((d / "config.json").read_text())
        torch.save(bad, target / WEIGHTS_FILE)
        with pytest.raises(ValueError, match=re.escape(messages[name])) as err:
            load_gates(target)
        assert "\n" not in str(err.value)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="policy.gate_path: .* is not a gate checkpoint directory"):
        SeerAttentionR(budget=64, window=8, gate_path=str(tmp_path / "empty"))


def test_a_mismatched_model_is_refused_in_one_line(tmp_path):
    d = write_random_gates(tmp_path, model_config(), block_size=BS)
    for other, what in [
        (model_config(layers=3), "3 layers"),
        (model_config(kv_heads=4), "4 KV heads"),
        (model_config(hidden=128), "hidden_size 128"),
    ]:
        with pytest.raises(ValueError, match=f"trained for Qwen/Qwen3-4B .*not this model .*{what}") as err:
            make_policy(d, other)
        assert "\n" not in str(err.value)
    with pytest.raises(
        ValueError, match="policy.block_size: 16, but the gates .* blocks of 8; set policy.block_size=8"
    ):
        SeerAttentionR(budget=64, window=8, block_size=16, gate_path=str(d)).setup(model_config())


def test_gates_are_chosen_by_model_and_refused_for_another_before_anything_loads(tmp_path):
    p = SeerAttentionR(budget=4096, window=64, model_name="Qwen/Qwen3-8B")
    assert p.gate_repo is None and p.describe()["model_name"] == "Qwen/Qwen3-8B"
    with pytest.raises(ValueError, match="policy.gate_repo: these gates were trained for Qwen/Qwen3-4B, not model"):
        SeerAttentionR(budget=4096, window=64, model_name="Qwen/Qwen3-8B", gate_repo=GATES["Qwen/Qwen3-4B"])
    with pytest.raises(ValueError, match="policy.gate_repo: no SeerAttention-R gates are published for model 'tiny:"):
        SeerAttentionR(budget=4096, window=64, model_name="tiny:qwen3")
    d = write_random_gates(tmp_path, model_config(), base_model="Qwen/Qwen3-14B")
    with pytest.raises(ValueError, match="policy.gate_path: these gates were trained for Qwen/Qwen3-14B"):
        SeerAttentionR(budget=4096, window=64, model_name="Qwen/Qwen3-4B", gate_path=str(d))
    SeerAttentionR(budget=4096, window=64, model_name="tiny:qwen3", gate_path=str(d))  # a local model: checked at setup


def test_gates_load_from_the_hub_cache_offline_and_fail_in_one_line_when_absent(tmp_path, monkeypatch, caplog):
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    repo = GATES["Qwen/Qwen3-4B"]
    cfg = model_config()
    with pytest.raises(ValueError, match=f"cannot load gates {repo}@main .*policy.gate_path") as err:
        SeerAttentionR(budget=64, window=8, model_name="Qwen/Qwen3-4B", block_size=BS).setup(cfg)
    assert "\n" not in str(err.value)
    sha = "ab" * 20
    base = tmp_path / f"models--{repo.replace('/', '--')}"
    write_random_gates(base / "snapshots" / sha, cfg, block_size=BS)
    (base / "refs").mkdir()
    (base / "refs" / "main").write_text(sha)
    policy = SeerAttentionR(budget=64, window=8, model_name="Qwen/Qwen3-4B", block_size=BS)
    with caplog.at_level("WARNING"):
        policy.setup(cfg)
    assert policy._gates.source == f"{repo}@{sha}" and f"pin them with policy.gate_revision={sha}" in caplog.text


# ---- the gate against a reference ---------------------------------------------------------------------------------


@pytest.mark.parametrize("position", ["last", "first"])
@pytest.mark.parametrize("q_pooling,qk_norm", [("Qproj", True), ("Qavgproj", False), ("Qavg", True)])
def test_gate_logits_equal_the_reference_over_prompt_and_decode_steps(tmp_path, position, q_pooling, qk_norm):
    cfg = model_config()
    d = write_random_gates(tmp_path, cfg, seed=1, block_size=BS, q_pooling=q_pooling, qk_norm=qk_norm)
    policy = make_policy(d, cfg, decode_block_position=position)
    layer = policy._gates.layers[1]
    g = torch.Generator().manual_seed(0)
    b, t, prompt = 2, 45, 13
    k_nope = torch.randn(b, 2, t, 16, generator=g)
    state: dict = {}
    for length in range(prompt + 1, t + 1):  # one call per decode step, as the engine makes
        q_nope = torch.randn(b, 8, 16, generator=g)
        inputs = step_inputs(policy, q_nope, k_nope, length, state, layer_idx=1, capacity=48)
        policy.update_state(inputs)
        got = policy.block_logits(inputs)
        for i in range(b):
            want = reference_logits(policy._gates.config, layer, q_nope[i], k_nope[i, :, :length], prompt, position)
            torch.testing.assert_close(got[i], want, rtol=1e-4, atol=1e-4)
    assert state["kc"].shape == (b, 2, 6, 16) and state["pmax"].shape == (b, 2, 16)


def test_rows_of_different_lengths_equal_each_row_alone(tmp_path):
    cfg = model_config()
    policy = make_policy(write_random_gates(tmp_path, cfg, seed=2, block_size=BS), cfg)
    g = torch.Generator().manual_seed(4)
    k_nope = torch.randn(3, 2, 60, 16, generator=g)
    starts = [50, 31, 20]  # three rows admitted together at different lengths, then decoded for 10 steps
    state: dict = {}
    alone = [{} for _ in starts]
    for step in range(10):
        lengths = [s + step for s in starts]
        q_nope = torch.randn(3, 8, 16, generator=g)
        mask = policy.select(step_inputs(policy, q_nope, k_nope, max(lengths), state, lengths=lengths, capacity=64))
        for i, n in enumerate(lengths):
            one = policy.select(step_inputs(policy, q_nope[i : i + 1], k_nope[i : i + 1], n, alone[i], capacity=64))
            want = torch.ones(1, 2, n, dtype=torch.bool) if one is None else one
            assert torch.equal(mask[i : i + 1, :, :n], want), (step, i)


def test_budget_counts_blocks_and_adds_the_current_one(tmp_path):
    cfg = model_config()
    policy = make_policy(write_random_gates(tmp_path, cfg, seed=5, block_size=BS), cfg, budget=3 * BS)
    g = torch.Generator().manual_seed(6)
    k_nope = torch.randn(2, 2, 70, 16, generator=g)
    assert policy.select(step_inputs(policy, torch.randn(2, 8, 16), k_nope, 3 * BS, {})) is None  # 3 blocks fit
    mask = policy.select(step_inputs(policy, torch.randn(2, 8, 16, generator=g), k_nope, 67, {}))
    assert mask.shape == (2, 2, 67)  # per KV head
    blocks = torch.nn.functional.pad(mask, (0, 5)).view(2, 2, 9, BS)
    assert (blocks[:, :, :8].all(-1) | ~blocks[:, :, :8].any(-1)).all(), "whole blocks are chosen"
    assert mask[..., 64:].all(), "the current block (tokens 64..66) is always attended"
    chosen = blocks.any(-1).sum(-1)
    assert ((chosen == 3) | (chosen == 4)).all()  # the top 3 blocks, plus the current one when it is not among them


# ---- the oracle: exact top-block attention --------------------------------------------------------------------------


class OracleSeer(SeerAttentionR):
    """SeerAttention-R whose gate scores each block by its true attention mass (max over the group's query heads)."""

    def block_logits(self, inputs):
        logits = torch.einsum("bhgd,bhld->bhgl", _grouped(inputs.query), inputs.keys.float()) * 16**-0.5
        probs = logits.softmax(-1)  # (B, H, G, L): every row holds all L tokens here
        n_blocks = -(-inputs.length // self.block_size)
        mass = torch.nn.functional.pad(probs, (0, n_blocks * self.block_size - inputs.length))
        mass = mass.view(*probs.shape[:3], n_blocks, self.block_size).sum(-1).amax(2)  # (B, H, NB)
        return mass.log()


def _grouped(query: torch.Tensor) -> torch.Tensor:
    b, hq, _, d = query.shape
    return query.float().view(b, 2, hq // 2, d)


def reference_top_block_attention(query, keys, values, budget_blocks, bs):
    """Per (row, KV head): the ``budget_blocks`` blocks of largest attention mass (max over the group's heads) plus
    the current block; each query head attends to exactly those tokens. Loops, explicit softmax."""
    b, hq, _, d = query.shape
    h, length = keys.shape[1], keys.shape[2]
    g = hq // h
    out = torch.zeros(b, hq, 1, d)
    n_blocks = -(-length // bs)
    for i in range(b):
        for k in range(h):
            mass = [0.0] * n_blocks
            for j in range(k * g, (k + 1) * g):
                p = (keys[i, k] @ query[i, j, 0] * d**-0.5).softmax(-1)
                for blk in range(n_blocks):
                    mass[blk] = max(mass[blk], float(p[blk * bs : (blk + 1) * bs].sum()))
            top = sorted(range(n_blocks), key=lambda x: -mass[x])[:budget_blocks]
            chosen = sorted(set(top) | {n_blocks - 1})
            idx = torch.cat([torch.arange(c * bs, min((c + 1) * bs, length)) for c in chosen])
            for j in range(k * g, (k + 1) * g):
                w = (keys[i, k, idx] @ query[i, j, 0] * d**-0.5).softmax(-1)
                out[i, j, 0] = w @ values[i, k, idx]
    return out


@pytest.mark.parametrize("length", [61, 64, 65])
def test_oracle_gate_gives_exact_top_block_attention(tmp_path, length):
    cfg = model_config()
    d = write_random_gates(tmp_path, cfg, block_size=BS)
    policy = OracleSeer(budget=3 * BS, window=8, block_size=BS, gate_path=str(d))
    policy.setup(cfg)
    g = torch.Generator().manual_seed(length)
    k_nope = torch.randn(2, 2, length, 16, generator=g) * 2
    inputs = step_inputs(policy, torch.randn(2, 8, 16, generator=g) * 2, k_nope, length, {})
    values = torch.randn(2, 2, length, 16, generator=g)
    mask = policy.select(inputs)
    got = eager_attention(inputs.query, inputs.keys, values, 16**-0.5, causal=False, mask=selection_key_mask(mask, 8))
    want = reference_top_block_attention(inputs.query, inputs.keys, values, 3, BS)
    torch.testing.assert_close(got, want, **close(torch.float32, 16 + length, scale=want.abs().max().item()))
    full = eager_attention(inputs.query, inputs.keys, values, 16**-0.5, causal=False)
    assert (got - full).abs().max() > 1e-4, "the selection must matter here"


def test_inverse_rope_undoes_the_models_rope():
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding, apply_rotary_pos_emb

    cfg = model_config()
    rotary = Qwen3RotaryEmbedding(cfg)
    x = torch.randn(1, 2, 30, 16)
    pos = torch.arange(100, 130)[None]
    cos, sin = rotary(x, pos)
    rotated, _ = apply_rotary_pos_emb(x, x, cos, sin)
    inv = rope_inv_freq(cfg.rope_parameters["rope_theta"], 16)
    torch.testing.assert_close(rotate(rotated, pos[0], inv, inverse=True), x, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rotate(x, pos[0], inv), rotated, rtol=1e-5, atol=1e-5)


# ---- a run --------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_offline_run_on_the_tiny_model_with_random_gates(tmp_path):
    from vase.models import tiny_config as tc

    gates = write_random_gates(tmp_path / "gates", tc("qwen3", num_hidden_layers=2), block_size=16)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "disabled"}
    r = subprocess.run(
        [sys.executable, "run.py", "model=tiny", "policy=seer_attention_r", f"policy.gate_path={gates}",
         "policy.block_size=16", "task=gsm_symbolic", "logger=none", "limit=1", "n_samples=1", "budget=32",
         "window=16", "generation.max_length=200", "progress=false", f"results_dir={tmp_path / 'results'}"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    (metrics_file,) = (tmp_path / "results").rglob("metrics.json")
    metrics = json.loads(metrics_file.read_text())
    assert metrics["policy"] == "seer_attention_r" and metrics["policy_kind"] == "selection"
    # every layer sparse: per step and query head at most budget // block_size blocks plus the current one
    assert 0 < metrics["attended_tokens"] <= 32 + 16 < metrics["held_tokens"]
    protocol = json.loads((metrics_file.parent / "protocol.json").read_text())
    assert protocol["policy"]["gate_path"] == str(gates) and protocol["policy"]["model_name"] == "tiny:qwen3"
