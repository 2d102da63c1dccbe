"""Hybrid linear-attention models (issue 27): ``qwen3_5``, ``qwen3_5_moe`` and ``qwen3_next``.

Three of every four layers of these checkpoints are Gated DeltaNet (linear attention: a fixed-size conv and recurrent
state per row, :mod:`vase.engine.linear_state`), every fourth full attention (an output gate, RoPE on 25 % of the head
dim). Each family as a tiny random model (fp32, initializer_range 0.3, no downloads; on the CPU the gated delta rule
and the causal conv run transformers' torch fallbacks). What must hold on each:

* ``policy=full``, greedy: the same tokens as transformers' own ``generate`` with its own (hybrid) cache, for rows of
  prompts of different lengths (one shorter than the conv kernel) under continuous batching, 64+ new tokens;
* a linear layer's state follows its row: each sample decoded among batch-mates admitted and released mid-run (rows
  moved into holes) equals the same sample decoded alone, sampled with its seed, for ``full`` and an eviction policy;
  the check fails when ``move_row`` leaves the state behind;
* eviction equals masking on the full-attention layers (the proof of tests/test_engine.py); the eviction event and
  the policies see only those layers, the budget applies to them;
* no host sync in a decode step; the compiled step (graph-counting backend) has no recompiles and equals eager;
* the state bytes per row equal transformers' own cache's, and the run's row size counts them;
* ``model=tiny_<family>`` runs offline through the runner; presets for real checkpoints compose.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from tests.policy_configs import load_small
from tests.test_continuous import decode_all, prompts
from tests.test_engine import _MASKS  # and the masked reference attention it registers
from vase.engine import Decoder, Request, SamplingConfig, generate, sample_seeds
from vase.engine.cache import cache_capacity
from vase.engine.geometry import config_geometry, model_geometry, partial_rope
from vase.engine.linear_state import LinearLayer, LinearShape, LinearStates
from vase.engine.memory import row_bytes
from vase.engine.policy import FullCache
from vase.models import check_architecture, tiny_config, tiny_model

FAMILIES = ["qwen3_5", "qwen3_5_moe", "qwen3_next"]
#: the MoE families' tiny models run ~5x slower on the CPU: beyond greedy == generate, their checks are ``slow``
SLOW_FAMILIES = ["qwen3_5"] + [pytest.param(a, marks=pytest.mark.slow) for a in FAMILIES[1:]]
#: the checkpoints' layout: three linear layers, then one full-attention layer
THREE_TO_ONE = dict(num_hidden_layers=4, full_attention_interval=4)
#: two full-attention layers (linear, full, linear, full): evictions on more than one KV layer
TWO_KV = dict(num_hidden_layers=4)
SAMPLING = SamplingConfig(temperature=1.0, top_p=0.95, top_k=50)


def full_layers(config) -> list[int]:
    """The model's indices of its full-attention layers (``CacheGeometry.full_layers``, from the config alone)."""
    return config_geometry(config, 1, 1, torch.float32, torch.device("cpu")).full_layers


def test_tiny_configs_are_hybrid():
    for arch in FAMILIES:
        cfg = tiny_config(arch, **THREE_TO_ONE)
        check_architecture(cfg)
        assert cfg.layer_types == ["linear_attention"] * 3 + ["full_attention"], arch
        assert "partial_rotary_factor" in (partial_rope(cfg) or ""), arch
        model = tiny_model(arch, **THREE_TO_ONE)
        assert type(model.model.layers[0].linear_attn).__name__.endswith("GatedDeltaNet"), arch
        assert hasattr(model.model.layers[3], "self_attn"), arch
    assert tiny_config("qwen3_5").model_type == "qwen3_5_text"
    assert type(tiny_model("qwen3_next", **TWO_KV).model.layers[0].mlp).__name__ == "Qwen3NextSparseMoeBlock"


def test_a_multimodal_checkpoint_config_is_checked_on_its_language_model():
    """Qwen3.5 checkpoints are ``qwen3_5`` (vision + text); AutoModelForCausalLM loads the text model."""
    from transformers import AutoConfig

    text = tiny_config("qwen3_5", **THREE_TO_ONE).to_dict()
    composite = AutoConfig.for_model("qwen3_5", text_config=text)
    check_architecture(composite)
    assert full_layers(composite) == [3]
    bad = AutoConfig.for_model("qwen3_5", text_config={**text, "layer_types": ["linear_attention"] * 4})
    with pytest.raises(ValueError, match="no full_attention layer") as err:
        check_architecture(bad)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("arch", FAMILIES)
def test_full_cache_greedy_equals_transformers_generate_under_continuous_batching(arch):
    """Four prompts (3 to 27 tokens: one shorter than the conv kernel) with output caps of 64 to 80 through 2 rows:
    rows end at different steps, the next prompts take their slots mid-run, the last row moves into a hole; each
    sample's tokens equal transformers' generate of it alone (its own hybrid cache)."""
    model = tiny_model(arch, **THREE_TO_ONE)
    caps = [64, 80, 70, 66]
    reqs = [Request(p, [0], key=i, max_new_tokens=caps[i]) for i, p in enumerate(prompts((11, 27, 19, 3)))]
    moved = []
    original = LinearStates.move_row

    def spy(self, src, dst):
        moved.append((src, dst))
        original(self, src, dst)

    LinearStates.move_row = spy
    try:
        _, done = decode_all(model, FullCache(), reqs, rows=2, max_new=max(caps), sampling=SamplingConfig(0))
    finally:
        LinearStates.move_row = original
    assert len({f.stats["first_step"] for f in done.values()}) > 2, "prompts should be admitted at different steps"
    assert moved, "a row should have moved into a hole"
    for r in reqs:
        f = done[(r.key, 0)]
        assert len(f.tokens) == r.max_new_tokens
        ids = r.prompt_ids.view(1, -1)
        gen = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=r.max_new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
        assert f.tokens == gen[0, ids.shape[1] :].tolist(), (arch, r.key)


def _batched_and_alone(model, name: str):
    """Each sample of 4 prompts x 2 samples decoded with 3 rows in flight (EOS ends rows early: slots refilled, rows
    moved) and alone, sampled with its seed."""
    policy = load_small(name, 32, 8, model)
    reqs = [Request(p, sample_seeds(100 + i, 2), key=i) for i, p in enumerate(prompts())]
    _, batched = decode_all(model, policy, reqs, rows=3, max_new=60, sampling=SAMPLING, eos=range(0, 12))
    alone = {}
    for r in reqs:
        for s, seed in enumerate(r.seeds):
            out = generate(
                model,
                r.prompt_ids,
                load_small(name, 32, 8, model),
                n_samples=1,
                sampling=SAMPLING,
                max_new_tokens=60,
                eos_token_ids=range(0, 12),
                seeds=[seed],
            )
            alone[(r.key, s)] = out.tokens[0]
    return batched, alone


@pytest.mark.parametrize("name", ["full", "vase_dkv"])
@pytest.mark.parametrize("arch", SLOW_FAMILIES)
def test_a_linear_layer_s_state_follows_its_row(arch, name):
    model = tiny_model(arch, **TWO_KV)
    batched, alone = _batched_and_alone(model, name)
    assert len(batched) == 8 and len({len(f.tokens) for f in batched.values()}) > 1
    if name != "full":
        assert sum(f.stats["evictions"] for f in batched.values()) > 0
    for key, f in batched.items():
        assert f.tokens == alone[key], (arch, name, key)


def test_the_row_check_fails_when_the_state_stays_behind(monkeypatch):
    """The check above can fail: a ``move_row`` that leaves the linear state in the old slot changes a sample."""
    model = tiny_model("qwen3_5", **TWO_KV)
    monkeypatch.setattr(LinearStates, "move_row", lambda self, src, dst: None)
    batched, alone = _batched_and_alone(model, "full")
    assert any(f.tokens != alone[key] for key, f in batched.items())


def masking_model(arch: str):
    """The tiny hybrid model of the stepwise masking proof: linear, full, linear, full; 4 query heads, 2 KV heads."""
    return tiny_model(arch, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=4)


# qwen3_5's cells are in tests/test_family_matrix.py (every eviction config); the MoE families' here
@pytest.mark.slow
@pytest.mark.parametrize("name", ["vase_dkv", "snapkv"])
@pytest.mark.parametrize("arch", FAMILIES[1:])
def test_eviction_equals_masking_on_the_attention_layers(arch, name, tmp_path):
    check_stepwise_eviction_equals_masking(masking_model(arch), name, tmp_path)


def check_stepwise_eviction_equals_masking(model, name: str, tmp_path) -> None:
    """tests/test_engine.py's proof on the KV layers: each step's logits equal the unmodified model's, decoding the
    same tokens with transformers' own cache (its linear layers step token by token, as ours), with a per-(KV layer,
    KV head) mask hiding exactly what was evicted before that step.

    (tests/test_engine.py's one forward over the whole sequence runs the linear layers' chunked algorithm instead:
    equal to the recurrent one up to fp32 rounding that grows past its 2e-5 tolerance over 90 tokens.)"""
    prompt = torch.randint(0, 256, (20,), generator=torch.Generator().manual_seed(1))
    rows, new = 2, 70
    policy = load_small(name, 32, 8, model, tmp_path)
    kv_ids = full_layers(model.config)
    snapshots, logits, holder = {}, {}, {}

    def on_step(info):
        layers = holder["cache"].evicting_layers  # the full-attention layers, in the model's order
        snapshots[info.step] = [layer.positions[: layer.n_rows, :, : layer.length].clone() for layer in layers]

    out = generate(
        model,
        prompt,
        policy,
        n_samples=rows,
        sampling=SamplingConfig(temperature=1.0),
        max_new_tokens=new,
        seed=3,
        ignore_eos=True,
        on_cache=lambda c: holder.__setitem__("cache", c),
        on_step=on_step,
        on_logits=lambda s, lg: logits.__setitem__(s, lg.clone()),
        check_policy_output=True,
    )
    assert out.stats["evictions"] >= 3 * len(kv_ids)
    p, heads = prompt.numel(), model.config.num_key_value_heads
    seq = torch.stack([torch.cat([prompt, torch.tensor(t[: new - 1])]) for t in out.tokens])  # (rows, p + new - 1)
    hf = DynamicCache(config=model.config)
    evicted_something = False
    model.set_attn_implementation("vase_test_masked")
    try:
        for mi in kv_ids:
            _MASKS[mi] = torch.ones(p, p, dtype=torch.bool).tril().expand(rows, heads, p, p)
        ref = model(input_ids=seq[:, :p], cache=hf, use_cache=True).logits[:, -1]
        assert (logits[0] - ref).abs().max() <= 2e-5 * max(1.0, ref.abs().max().item())
        for step in range(1, new):
            i = p + step - 1  # the query position of this step's token
            for layer, mi in enumerate(kv_ids):
                mask = torch.zeros(rows, heads, 1, i + 1, dtype=torch.bool)
                if step == 1:
                    mask[..., : i + 1] = True
                else:
                    mask[:, :, 0].scatter_(-1, snapshots[step - 1][layer], True)  # held before this forward
                    mask[..., i] = True
                    evicted_something |= snapshots[step - 1][layer].shape[-1] < i
                _MASKS[mi] = mask
            pos = torch.full((rows, 1), i)
            ref = model(input_ids=seq[:, i : i + 1], position_ids=pos, cache=hf, use_cache=True).logits[:, -1]
            diff = (logits[step] - ref).abs().max().item()
            assert diff <= 2e-5 * max(1.0, ref.abs().max().item()), (step, diff)
    finally:
        model.set_attn_implementation("sdpa")
    assert evicted_something


def test_the_stepwise_masking_reference_detects_a_wrong_mask():
    """The reference above can fail: hiding one more entry of the KV layer changes the logits."""
    model = tiny_model("qwen3_5", **THREE_TO_ONE)
    seq = torch.randint(0, 256, (1, 30), generator=torch.Generator().manual_seed(2))
    (mi,) = full_layers(model.config)
    heads = model.config.num_key_value_heads
    model.set_attn_implementation("vase_test_masked")
    try:
        _MASKS[mi] = torch.ones(30, 30, dtype=torch.bool).tril().expand(1, heads, 30, 30).clone()
        a = model(input_ids=seq).logits[0, -1]
        _MASKS[mi][0, 0, -1, 5] = False
        b = model(input_ids=seq).logits[0, -1]
    finally:
        model.set_attn_implementation("sdpa")
    assert (a - b).abs().max() > 1e-4


def test_policies_see_only_the_full_attention_layers(tmp_path):
    """The eviction event folds the full-attention layers only (``layer_ids``: their model indices), a selection
    policy is asked once per full layer and step (``layer_idx``: the model's), and the budget is what every full
    layer holds after an eviction."""
    model = tiny_model("qwen3_5", **THREE_TO_ONE)  # one full-attention layer among four: layer 3
    kv = len(full_layers(model.config))
    seen_evict, seen_select = set(), []
    policy = load_small("vase_dkv", 32, 8, model)
    keep = policy.keep

    def spy_keep(inputs):
        seen_evict.update(inputs.layer_ids.tolist())
        assert inputs.keys.shape[0] % kv == 0
        return keep(inputs)

    policy.keep = spy_keep
    caches = []
    out = generate(model, torch.arange(20), policy, n_samples=2, max_new_tokens=60, seed=1, on_cache=caches.append)
    assert out.stats["evictions"] > 0 and seen_evict == {3}
    cache = caches[0]
    assert len(cache.evicting_layers) == kv == cache.storage.layers and len(cache.layers) == 4
    assert cache.attention_layers == cache.evicting_layers == [cache.layers[3]] and cache.layers[3].store_idx == 0
    assert all(isinstance(layer, LinearLayer) and layer.kind == "linear_attention" for layer in cache.layers[:3])
    assert cache.geometry.full_layers == [3] and cache.geometry.layers_of("linear_attention") == [0, 1, 2]
    assert cache.evicting_layers[0].length <= policy.budget + policy.window
    quest = load_small("quest", 32, 8, model, dense_layers=0)
    select = quest.select

    def spy_select(inputs):
        seen_select.append(inputs.layer_idx)
        return select(inputs)

    quest.select = spy_select
    out = generate(model, torch.arange(20), quest, n_samples=1, max_new_tokens=40, seed=1)
    assert set(seen_select) == {3} and len(seen_select) == 39  # one full layer, every decode step after the first
    assert out.stats["attended_tokens"] < out.stats["held_tokens"]


def test_quest_dense_layers_are_the_model_s_first_layers(tmp_path):
    """A policy's layer index is the model's (as on a sliding model): Quest's first ``dense_layers`` layers of the
    model attend densely, whatever their type; here layer 3 is the only full-attention one."""
    model = tiny_model("qwen3_5", **THREE_TO_ONE)
    with pytest.raises(ValueError, match=r"dense_layers: must be <= the model's num_hidden_layers = 4, got 5"):
        load_small("quest", 32, 8, model, dense_layers=5).check_model(model.config)
    stats = {}
    for dense in (3, 4):  # layer 3 sparse, then dense
        quest = load_small("quest", 32, 8, model, dense_layers=dense)
        quest.check_model(model.config)
        stats[dense] = generate(model, torch.arange(40), quest, n_samples=1, max_new_tokens=30, seed=1).stats
    assert stats[3]["attended_tokens"] < stats[3]["held_tokens"]
    assert stats[4]["attended_tokens"] == stats[4]["held_tokens"]


# Every policy config end to end on qwen3_5 (or refused in one line: TriAttention and SeerAttention-R on its partial
# RoPE): tests/test_family_matrix.py.


@pytest.mark.parametrize("arch", FAMILIES)
def test_state_bytes_equal_transformers_cache(arch):
    """The state bytes per row (the accounting's ``linear_attention`` entry, ``CacheGeometry.kv_bytes_by_type``)
    equal what transformers' own cache holds for one sequence; the cache allocates exactly rows x that once, and the
    planned row size counts it beside the full layers' K/V."""
    model = tiny_model(arch, **THREE_TO_ONE)
    hf = DynamicCache(config=model.config)
    model(input_ids=torch.arange(9).view(1, -1), cache=hf, use_cache=True)
    want = sum(
        layer.conv_states[0].nbytes + layer.recurrent_states[0].nbytes
        for layer in hf.layers
        if getattr(layer, "conv_states", None)
    )
    geometry = model_geometry(model, rows=3, capacity=64)
    per_row = geometry.kv_bytes_by_type["linear_attention"]
    assert per_row == geometry.linear_bytes_per_row == want > 0
    full = geometry.kv_bytes_by_type["full_attention"]
    assert geometry.num_layers == 4 and geometry.full_layers == [3] and full == 64 * geometry.bytes_per_token_of_layer
    assert geometry.kv_bytes_per_row == full + per_row
    held = geometry.held_bytes_by_type(10, 50)  # a linear layer holds its state whatever the length
    assert held == {"full_attention": 10 * geometry.bytes_per_token, "linear_attention": per_row}
    heads = model.config.num_key_value_heads
    assert row_bytes(geometry, FullCache()) == full + per_row + 64 * 1 * heads * 8  # + the full layer's positions
    dec = Decoder(model, FullCache(), rows=3, capacity=64, max_new_tokens=8)
    assert dec.cache.storage.linear.nbytes == 3 * per_row
    assert LinearShape.of(tiny_config("qwen3")) is None
    assert LinearShape.of(model.config).bytes_per_row(torch.bfloat16) < per_row  # the conv state in the model's dtype


def test_a_linear_layer_answers_what_transformers_asks_of_it():
    """What transformers >= 5.25 asks of a linear layer, on any release: ``Cache.get_seq_length`` reads layer 0 (a
    linear layer here), which answers what the full-attention layers answer; ``increase_count`` (called at every
    single-token conv update) counts nothing; a list of recurrent states is taken at its last."""
    model = tiny_model("qwen3_5", **THREE_TO_ONE)
    dec = Decoder(model, FullCache(), rows=2, capacity=64, max_new_tokens=8)
    cache = dec.cache
    linear = [layer for layer in cache.layers if isinstance(layer, LinearLayer)]
    full = [layer for layer in cache.layers if not isinstance(layer, LinearLayer)]
    assert isinstance(cache.layers[0], LinearLayer) and len(full) == 1
    for layer in linear:
        layer.increase_count(0)
        assert layer.get_seq_length() == full[0].get_seq_length()
    assert cache.get_seq_length() == full[0].get_seq_length()
    cache.prefilling = [0]
    try:
        states = [torch.full_like(linear[0].recurrent[:1], float(i)) for i in (1, 2)]
        linear[0].update_recurrent_state(states)
    finally:
        cache.prefilling = None
    assert torch.equal(linear[0].recurrent[0], states[1][0])


@pytest.mark.parametrize("name", ["vase_dkv", pytest.param("full", marks=pytest.mark.slow)])
def test_no_host_sync_in_a_decode_step(name, monkeypatch, tmp_path):
    """tests/test_gpu_path.py's detector on a hybrid model: the linear layers' reads and writes are device ops."""
    from tests.test_gpu_path import run_detected

    model = tiny_model("qwen3_5", num_attention_heads=8, num_key_value_heads=2, num_hidden_layers=4)
    policy = load_small(name, 32, 8, model, tmp_path)
    detector, steps, _ = run_detected(model, policy, monkeypatch)
    assert detector.step_syncs() == {}, name
    assert "tolist" in detector.syncs["between"]
    assert name == "full" or any(s["evicted"] for s in steps.values())


@pytest.mark.slow  # ~130 s on the shared CPU (two staggered decodes of >= 120 steps, one traced by dynamo)
def test_compiled_step_on_a_hybrid_model():
    """tests/test_compiled.py's check: one graph per row bucket at most, static addresses (the linear states
    included), tokens equal to the eager run over a >= 300-step staggered decode."""
    from tests.test_compiled import GraphCounter, staggered

    model = tiny_model("qwen3_5", num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=4)
    # this random model ends rows at EOS sooner than tests/test_compiled.py's Qwen3: >= 120 steps, not 300
    _, want, _, _ = staggered(model, "vase_dkv", "off", steps_at_least=120)
    counter = GraphCounter()
    dec, got, buckets, addresses = staggered(model, "vase_dkv", "on", backend=counter, steps_at_least=120)
    assert dec.compiled and dec.cache.bucketed and len(buckets) > 2, buckets
    assert 1 <= len(counter.graphs) <= len(buckets), (len(counter.graphs), sorted(buckets))
    assert counter.inputs_tensors_only
    assert all(a == addresses[0] for a in addresses), "a buffer of the compiled step moved"
    assert {"linear0.conv", "linear0.recurrent", "linear2.recurrent"} <= set(addresses[0])
    assert {k: f.tokens for k, f in got.items()} == {k: f.tokens for k, f in want.items()}
    assert sum(f.stats["evictions"] for f in want.values()) > 0


def test_capacity_is_the_kv_layers_only():
    """A hybrid row's capacity is sized by the policy as for any model: the linear layers need no slots."""
    policy = load_small("vase_dkv", 32, 8)
    assert cache_capacity(policy, 20, 500) == 32 + 8


@pytest.mark.parametrize("arch", FAMILIES)
def test_tiny_preset_loads_the_family(arch):
    from hydra.utils import instantiate

    from tests.conftest import compose
    from vase.run.preflight import model_config

    spec = instantiate(compose([f"model=tiny_{arch}"]).model)
    assert spec.key == f"tiny_{arch}" and spec.name == f"tiny:{arch}"
    assert model_config(spec).layer_types == ["linear_attention", "full_attention"] * 2
    model, tokenizer = spec.load()
    assert model.config.vocab_size == len(tokenizer) and full_layers(model.config) == [1, 3]


@pytest.mark.parametrize(  # qwen3_5 in the default suite, the others in -m slow (CI's time budget)
    "arch", [a if a == "qwen3_5" else pytest.param(a, marks=pytest.mark.slow) for a in FAMILIES]
)
def test_a_short_offline_run_per_family(arch, tmp_path):
    """``python run.py model=tiny_<family> policy=vase_dkv`` on one gsm_symbolic problem, two samples: it finishes,
    evicts and records the linear state in the manifest's engine section."""
    import json
    from pathlib import Path

    from tests.conftest import TINY_RUN, compose
    from vase.run.runner import run

    overrides = [o for o in TINY_RUN if not o.startswith("model=")]
    cfg = compose([*overrides, f"model=tiny_{arch}", "policy=vase_dkv", "limit=1", f"results_dir={tmp_path}"])
    metrics = run(cfg, progress=False)
    assert metrics["complete"] and metrics["samples"] == 2 and metrics["evictions"] > 0
    assert f"tiny_{arch}" in metrics["run_dir"]
    engine = json.loads((Path(metrics["run_dir"]) / "manifest.json").read_text())["engine"]
    assert engine["kv_allocated_bytes_by_type"]["linear_attention"] > 0
    assert engine["layer_types"] == {"linear_attention": 2, "full_attention": 2}


@pytest.mark.parametrize(
    "preset,temperature", [("qwen3_5_27b", 1.0), ("qwen3_5_35b_a3b", 1.0), ("qwen3_next_80b_a3b_thinking", 0.6)]
)
def test_hub_presets_compose(preset, temperature):
    """The presets of real checkpoints: hub id, ``main`` (resolved and recorded at run time), the model card's
    sampling, thinking on (no download here)."""
    from hydra.utils import instantiate

    from tests.conftest import compose

    spec = instantiate(compose([f"model={preset}"]).model)
    assert spec.key == preset and spec.name.startswith("Qwen/Qwen3") and spec.revision == "main" and spec.thinking
    assert (spec.temperature, spec.top_p, spec.top_k) == (temperature, 0.95, 20)


def test_preflight_row_size_counts_the_linear_state():
    """The preflight's memory check (before any weight loads) sizes a hybrid row as the engine allocates it: the KV
    layers' K/V and positions plus the linear layers' state; a multimodal checkpoint's config is read through."""
    from transformers import AutoConfig

    from vase.run.preflight import check_memory

    model = tiny_model("qwen3_5", **THREE_TO_ONE)
    per_row = row_bytes(model_geometry(model, rows=1, capacity=64), FullCache())
    composite = AutoConfig.for_model("qwen3_5", text_config=model.config.to_dict())
    args = dict(dtype="float32", device=torch.device("cpu"), capacity=64, rows=1, rows_reason="max_rows")
    for config in (model.config, composite):
        check_memory(config, FullCache(), **args, kv_memory=per_row, length_setting="max_length", machine=False)
        with pytest.raises(ValueError, match=f"hold no row of the cache \\({per_row} bytes"):
            check_memory(config, FullCache(), **args, kv_memory=per_row - 1, length_setting="x", machine=False)


def test_value_analysis_reads_the_full_attention_layers():
    """``scripts/value_analysis.py``'s capture on a hybrid model: the full-attention layers' values (by model layer
    index); a linear-attention layer, which keeps no per-token values, is refused in one line."""
    from vase.analysis.value_analysis import capture_values

    model = tiny_model("qwen3_5", **TWO_KV)  # linear, full, linear, full
    capture = capture_values(model, list(range(12)), [1, 3], max_new_tokens=6)
    assert set(capture.values) == {1, 3} and capture.values[3].shape[::2] == (2, 16)  # (H, tokens, D)
    with pytest.raises(ValueError, match=r"layers: \[0\] are linear-attention layers .* \[1, 3\]"):
        capture_values(model, list(range(12)), [0, 1], max_new_tokens=6)
