"""Writing a policy (docs/policies.md): keep() called repeatedly with its state carried, what the engine passes a
stateful policy (ring positions, window positions, new-query counts), the per-token state helper, the H2O
walkthrough against a step-by-step reference, and the settings every eviction policy accepts."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

from baselines.h2o import H2O
from baselines.snapkv import SnapKV
from tests.policy_configs import ALL_CONFIGS, calibrate, configs_of_kind, small_config
from tests.scaffold import row_data, run_scaffold
from vase.engine import SamplingConfig, generate
from vase.engine.policy import EvictionPolicy
from vase.engine.token_state import TokenState, lookup
from vase.models import tiny_model

ROOT = Path(__file__).resolve().parents[1]
LAYOUTS = {"mha": (4, 4), "gqa": (2, 8)}  # (H, Hq)
BUDGET, WINDOW, DIM = 64, 16, 16


def _policy(name: str, hq: int):
    return calibrate(instantiate(small_config(name, BUDGET, WINDOW)), layers=1, q_heads=hq, head_dim=DIM)


# ---- the contract across calls ------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("name", configs_of_kind("eviction"))
def test_keep_across_calls_with_state_carried(name, layout):
    """Every eviction config, four evictions in a row with its state carried (the engine's scaffold): each answer is
    valid, sinks and the pinned prompt survive, every state entry keeps its per-row shape, and each row's choices
    equal the row's alone (its own state, its own stream) at every call."""
    h, hq = LAYOUTS[layout]
    policy = _policy(name, hq)
    seeds = [100, 101, 102]
    calls = run_scaffold(policy, seeds, h, hq, calls=4)
    alone = run_scaffold(_policy(name, hq), [101], h, hq, calls=4)
    first_shapes: dict = {}
    for i, (call, solo) in enumerate(zip(calls, alone)):
        idx, inp = call.keep, call.inputs
        n = inp.positions.shape[-1]
        assert idx.shape == (3, h, inp.n_keep) and idx.dtype == torch.int64, (name, i)
        assert idx.min() >= 0 and idx.max() < n
        assert (idx.sort(dim=-1).values.diff(dim=-1) > 0).all(), f"{name}: duplicate indices at call {i}"
        held = call.held_after
        for s in range(policy.sinks):
            assert (held == s).any(-1).all(), f"{name}: sink {s} evicted at call {i}"
        for key, shape in call.state_shapes.items():
            assert first_shapes.setdefault(key, shape) == shape, f"{name}: state[{key!r}] changed shape at call {i}"
        assert torch.equal(idx[1:2], solo.keep), f"{name}: row 1 depends on its batch-mates at call {i}"
    assert all(c.held_after.shape[-1] == BUDGET for c in calls)


@dataclass
class DuplicateKeeper(EvictionPolicy):
    """A wrong policy: keeps the first candidate twice."""

    name: ClassVar[str] = "test_duplicates"

    def keep(self, inputs):
        b, h, _, _ = inputs.shape
        idx = torch.arange(inputs.n_keep).expand(b, h, -1).clone()
        idx[..., 1] = 0
        return idx


def test_check_policy_output_refuses_duplicate_indices():
    model = tiny_model("qwen3")
    policy = DuplicateKeeper(budget=32, window=8)
    generate(model, list(range(1, 21)), policy, max_new_tokens=30, ignore_eos=True)  # unchecked: runs to the end
    with pytest.raises(RuntimeError, match="policy test_duplicates: keep\\(\\) returned duplicate indices"):
        generate(model, list(range(1, 21)), policy, max_new_tokens=30, ignore_eos=True, check_policy_output=True)


# ---- what the engine passes --------------------------------------------------------------------------------------
CALLS: list[dict] = []


@dataclass
class Recorder(SnapKV):
    """SnapKV that records what the engine hands it."""

    name: ClassVar[str] = "test_recorder"

    def keep(self, inputs):
        # an engine call folds every layer into the row axis: record each layer's rows as one call
        for layer in inputs.layer_ids.unique().tolist():
            rows = inputs.layer_ids == layer
            CALLS.append(
                {
                    "layer": layer,
                    "positions": inputs.positions[rows].clone(),
                    "window_positions": inputs.window_positions[rows].clone(),
                    "window_keys": inputs.window_keys[rows].clone(),
                    "query_positions": inputs.query_positions[rows].clone(),
                    "n_new": inputs.n_new_queries[rows].clone(),
                    "new": inputs.new_queries()[rows].clone(),
                    "queries": inputs.queries[rows].clone(),
                }
            )
        return super().keep(inputs)


@pytest.mark.parametrize("every", [4, 8, 16])
def test_the_engine_passes_ring_positions_window_positions_and_new_query_counts(every):
    """Through the engine (tiny model, 2 rows): the window's positions are the ``window`` newest; the ring's slot
    ``s`` holds the query of the newest position ``p % window == s`` (the same vector at every call that holds it);
    the new-query count is the whole ring at a row's first call, then ``min(E, window)``."""
    CALLS.clear()
    w = 8
    model = tiny_model("qwen3")
    generate(model, list(range(1, 21)), Recorder(budget=32, window=w, evict_every=every), n_samples=2,
             max_new_tokens=70, ignore_eos=True, sampling=SamplingConfig(1.0))  # fmt: skip
    layer0 = [c for c in CALLS if c["layer"] == 0]
    assert len(layer0) >= 3
    seen: dict[tuple[int, int], torch.Tensor] = {}
    for i, c in enumerate(layer0):
        wpos = c["window_positions"]  # (B, H, W)
        newest = wpos[:, 0, -1]
        want = newest[:, None] - torch.arange(w - 1, -1, -1)
        assert torch.equal(wpos, want[:, None].expand_as(wpos)), i  # the window newest positions, oldest first
        assert (c["positions"].amax(-1) < wpos[..., :1].squeeze(-1)).all()  # candidates are older
        qpos = c["query_positions"]
        assert torch.equal(qpos.sort(-1).values, want) and torch.equal(qpos % w, torch.arange(w).expand_as(qpos))
        assert torch.equal(c["n_new"], torch.full((2,), w if i == 0 else min(every, w)))
        assert torch.equal(c["new"], qpos > (newest - c["n_new"])[:, None])  # the n newest positions
        for r in range(2):
            for s in range(w):
                key = (r, int(qpos[r, s]))
                if key in seen:  # a query held by two calls is the same vector
                    assert torch.equal(seen[key], c["queries"][r, :, s]), key
                seen[key] = c["queries"][r, :, s]


# ---- the per-token state helper ------------------------------------------------------------------------------------
def test_lookup_equals_a_dictionary():
    g = torch.Generator().manual_seed(0)
    stored = torch.stack([torch.randperm(50, generator=g)[:12] for _ in range(6)]).view(2, 3, 12)
    stored[0, 0, :3] = -1  # empty slots
    values = torch.randn(2, 3, 12, generator=g)
    query = torch.stack([torch.randperm(50, generator=g)[:20] for _ in range(6)]).view(2, 3, 20)
    got = lookup(stored, values, query, fill=-7.0)
    for b in range(2):
        for h in range(3):
            table = {int(p): float(v) for p, v in zip(stored[b, h], values[b, h]) if p >= 0}
            want = [table.get(int(p), -7.0) for p in query[b, h]]
            assert got[b, h].tolist() == pytest.approx(want), (b, h)


def test_token_state_follows_tokens_through_an_eviction():
    """Values written for the kept candidates and the window are read back by position at the next call, whatever
    the storage order; tokens never stored read as ``fill``."""
    calls = run_scaffold(H2O(budget=BUDGET, window=WINDOW, evict_every=8), [7], 2, 4, calls=2)
    first, second = calls
    state = TokenState("probe", fill=-1.0)
    held = torch.cat([first.inputs.positions, first.inputs.window_positions], -1)
    state.write_kept(first.inputs, first.keep, held.float() * 10)  # value = 10 x position
    second.inputs.state.update(first.inputs.state)
    now = torch.cat([second.inputs.positions, second.inputs.window_positions], -1)
    got = state.read(second.inputs, now)
    known = torch.isin(now, first.held_after)
    assert torch.equal(got[known], now[known].float() * 10) and (got[~known] == -1.0).all() and (~known).any()


# ---- the H2O walkthrough: the policy against H2O step by step -----------------------------------------------------
def h2o_reference(data, row: int, head: int, group: int, prompt: int, budget: int, window: int, every: int,
                  ratio: float, calls: int) -> list[set[int]]:  # fmt: skip
    """H2O as published, one token at a time, in float64 dictionaries: each query adds the softmax it pays every
    held key (up to its own position) to that key's score; at an eviction the recent tokens and the highest scores
    stay. Counts the queries from the first eviction's window on (what the engine's ring can show)."""
    k = data.keys[row, head].double()
    q = data.queries[row, head * group : (head + 1) * group].double()
    scale = k.shape[-1] ** -0.5
    held, score, pos, last, out = list(range(prompt)), {}, prompt, None, []
    n_keep = budget - window
    n_recent = min(max(0, round(ratio * budget) - window), n_keep)
    while len(out) < calls:
        held.append(pos)
        pos += 1
        if not (len(held) > budget and pos % every == 0):
            continue
        fresh = window if last is None else min(pos - last, window)
        last = pos
        for t in range(pos - fresh, pos):
            keys = [p for p in held if p <= t]
            for j in range(group):
                logits = torch.stack([q[j, t] @ k[p] for p in keys]) * scale
                for p, a in zip(keys, logits.softmax(0).tolist()):
                    score[p] = score.get(p, 0.0) + a
        cands, recent = held[:-window], held[-window:]
        forced = sorted(cands)[len(cands) - n_recent :] if n_recent else []
        rest = sorted((p for p in cands if p not in forced), key=lambda p: -score[p])
        held = sorted(forced + rest[: n_keep - len(forced)]) + recent
        out.append(set(held))
    return out


@pytest.mark.parametrize("every,ratio", [(1, 0.5), (4, 0.5), (16, 0.0), (8, 0.75)])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_h2o_equals_the_step_by_step_reference(layout, every, ratio):
    h, hq = LAYOUTS[layout]
    policy = H2O(budget=48, window=8, evict_every=every, recent_ratio=ratio)
    seeds, n_calls, prompt = [3, 4], 6, 20
    calls = run_scaffold(policy, seeds, h, hq, calls=n_calls, prompt=prompt)
    data = row_data(seeds, h, hq, prompt + 48 + (n_calls + 2) * max(every, 8) + 8, 16)
    for r in range(len(seeds)):
        for head in range(h):
            want = h2o_reference(data, r, head, hq // h, prompt, 48, 8, every, ratio, n_calls)
            got = [set(c.held_after[r, head].tolist()) for c in calls]
            assert got == want, (r, head)


def test_the_walkthrough_in_the_docs_is_the_file():
    """docs/policies.md builds baselines/h2o.py step by step; its last code block is the file, word for word."""
    doc = (ROOT / "docs" / "policies.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", doc, flags=re.S)
    assert blocks[-1] == (ROOT / "baselines" / "h2o.py").read_text()


# ---- settings ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", configs_of_kind("eviction"))
def test_every_eviction_policy_takes_the_schedule_settings_without_a_plus(name, tmp_path):
    """``policy.evict_every`` and ``policy.compress_prefill`` are keys of every eviction YAML (README, Policies)."""
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(
            config_name="config",
            overrides=[
                f"policy={name}",
                "model=tiny",
                "budget=128",
                "window=16",
                "policy.evict_every=8",
                "policy.compress_prefill=true",
            ],  # fmt: skip
        )
    policy = instantiate(cfg.policy)
    assert policy.evict_every == 8 and policy.compress_prefill is True and policy.eviction_period == 8


def test_generation_check_policy_output_is_a_boolean_setting():
    from vase.run.checks import check_settings

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        ok = compose(config_name="config", overrides=["generation.check_policy_output=true"])
        bad = compose(config_name="config", overrides=["generation.check_policy_output=often"])
    assert ok.generation.check_policy_output is True
    check_settings(ok)
    with pytest.raises(ValueError, match="generation.check_policy_output: must be true or false"):
        check_settings(bad)


def test_a_class_declares_its_display_name():
    from vase.analysis.labels import policy_display_name

    assert policy_display_name("h2o", "baselines.h2o.H2O") == "H2O"
    assert policy_display_name("triattention", "baselines.triattention.TriAttention") == "TriAttention"
    assert policy_display_name("snapkv", "baselines.snapkv.SnapKV") == "SnapKV"  # the analysis's own label
    assert policy_display_name("test_recorder", "tests.test_policy_authoring.Recorder") == "test_recorder"
    assert policy_display_name("mine", "no.such.Module") == "mine"


def test_every_config_is_in_the_shared_matrices():
    assert {"h2o", "keydiff", "triattention"} <= set(configs_of_kind("eviction")) <= set(ALL_CONFIGS)


# ---- H2O on a model: every query counted, from the prompt on -------------------------------------------------------
class H2ORingOnly(H2O):
    """The former H2O: no prefill seed, no observation before the first eviction (only the ring's queries count)."""

    accumulates: ClassVar[bool] = False


def h2o_on_model(policy: H2O, prompt_len: int, total: int = 90) -> tuple[int, int]:
    """Decode tiny qwen3 in float64 greedily under ``policy`` while H2O runs beside it step by step, in float64: every
    query's softmax over the tokens held when it ran (recomputed from each layer's input: q_proj, q_norm, RoPE) added
    to those tokens' scores, prompt included; at each of the engine's evictions the reference keeps the newest
    ``recent_ratio * budget - window`` candidates and the highest scores of the others, and follows its own choice.

    Returns ``(cells, equal)``: (eviction event, layer, KV head) cells and those where the engine kept the same set.
    """
    from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

    model = tiny_model("qwen3", dtype=torch.float64)
    cfg = model.config
    hq, h, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    g, scale = hq // h, d**-0.5
    budget, window = policy.budget, policy.window
    n_recent = min(max(0, round(policy.recent_ratio * budget) - window), budget - window)
    keys = [{} for _ in range(cfg.num_hidden_layers)]  # layer -> {position: (H, D)}
    held = [None] * cfg.num_hidden_layers  # layer -> per KV head the reference's held positions
    score = [[{} for _ in range(h)] for _ in range(cfg.num_hidden_layers)]
    cells = [0, 0]

    def attend(layer: int, q: torch.Tensor, qpos: int) -> None:  # q: (Hq, D) of position qpos
        for kv in range(h):
            pos = sorted(p for p in held[layer][kv] if p <= qpos)
            k = torch.stack([keys[layer][p][kv] for p in pos])
            probs = (q[kv * g : (kv + 1) * g] @ k.T * scale).softmax(-1).sum(0)
            for p, w in zip(pos, probs.tolist()):
                score[layer][kv][p] = score[layer][kv].get(p, 0.0) + w

    def hook(layer: int):
        def fn(module, args, kwargs):
            hidden = args[0] if args else kwargs["hidden_states"]
            cos, sin = kwargs["position_embeddings"]
            t = hidden.shape[1]
            q = module.q_norm(module.q_proj(hidden).view(1, t, hq, d)).transpose(1, 2)
            k = module.k_norm(module.k_proj(hidden).view(1, t, h, d)).transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            start = len(keys[layer])
            for i in range(t):
                keys[layer][start + i] = k[0, :, i]
            if held[layer] is None:
                held[layer] = [set() for _ in range(h)]
            for i in range(t):  # one query at a time, over what is held at its position
                for kv in range(h):
                    held[layer][kv].add(start + i)
                attend(layer, q[0, :, i], start + i)

        return fn

    def on_evict(layer, rows, keep_idx, kept_positions) -> None:
        li = layer.layer_idx
        for kv in range(h):
            now = sorted(held[li][kv])
            recent, cand = now[-window:], now[:-window]
            by_recency = cand[-n_recent:] if n_recent else []
            rest = sorted((p for p in cand if p not in by_recency), key=lambda p: -score[li][kv][p])
            want = set(by_recency) | set(rest[: budget - window - len(by_recency)])
            cells[0] += 1
            cells[1] += set(kept_positions[0, kv].tolist()) == want
            held[li][kv] = want | set(recent)
            score[li][kv] = {p: v for p, v in score[li][kv].items() if p in held[li][kv]}

    handles = [layer.self_attn.register_forward_pre_hook(hook(i), with_kwargs=True)
               for i, layer in enumerate(model.model.layers)]  # fmt: skip
    prompt = torch.randint(0, cfg.vocab_size, (prompt_len,), generator=torch.Generator().manual_seed(5)).tolist()
    try:
        generate(model, prompt, policy, max_new_tokens=total - prompt_len, ignore_eos=True,
                 on_cache=lambda cache: setattr(cache, "on_evict", on_evict))  # fmt: skip
    finally:
        for handle in handles:
            handle.remove()
    return cells[0], cells[1]


@pytest.mark.parametrize("prompt_len", [16, 40])
def test_h2o_on_a_model_counts_every_query(prompt_len):
    """Tiny qwen3 in float64, budget 32, window 8, 90 tokens: a prompt shorter than the budget (the prefill seed and
    the observations before the first eviction both count) and one longer (the seed alone). The engine's H2O keeps
    the reference's set in every (event, layer, KV head) cell; the former H2O (the ring's queries only, no seed: the
    failing-first run, kept) does not."""
    cells, equal = h2o_on_model(H2O(budget=32, window=8), prompt_len)
    assert cells == 4 * (89 - max(prompt_len, 32)) and equal == cells, (equal, cells)  # the 90th token is not fed
    cells, equal = h2o_on_model(H2ORingOnly(budget=32, window=8), prompt_len)
    assert equal < cells, "the ring-only H2O kept the faithful set everywhere: the check cannot tell them apart"


@pytest.mark.parametrize("every", [16, 20])
def test_h2o_with_a_period_longer_than_the_window_counts_every_query(every):
    """``evict_every > window``: between two evictions more queries pass than the ring holds, so the engine also shows
    H2O the ring every ``window`` steps after its first eviction. It keeps the step-by-step reference's set in every
    cell (before this, only the ring's last ``window`` queries of each period counted: it kept it in 6 of 12 cells for
    16, 10 of 12 for 20)."""
    cells, equal = h2o_on_model(H2O(budget=32, window=8, evict_every=every), 16)
    assert cells == 4 * len(range(every * -(-33 // every), 89, every)) and equal == cells, (equal, cells)
