"""The engine: the static cache, the attention function and the decode loop, on tiny random models (fp32, CPU)."""

from __future__ import annotations

import pytest
import torch
from transformers import AttentionInterface, DynamicCache
from transformers.masking_utils import AttentionMaskInterface

from baselines.random import RandomEviction
from baselines.streaming import Streaming
from tests.policy_configs import configs_of_kind, load_small
from tests.tolerance import close
from vase.engine import SamplingConfig, generate, sample_seeds, vase_attention
from vase.engine.attention import eager_attention
from vase.engine.policy import FullCache
from vase.models import tiny_model

ARCHS = ["qwen3", "qwen2", "llama"]


def _prompt(n: int = 24, seed: int = 1, vocab: int = 256) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def _reference_logits(model, prompt: torch.Tensor, tokens: list[int]) -> list[torch.Tensor]:
    """Decode the same tokens with the unmodified model and its default cache; logits of every step."""
    cache = DynamicCache(config=model.config)
    out = model(input_ids=prompt.view(1, -1), cache=cache, use_cache=True)
    logits = [out.logits[0, -1]]
    for i, tok in enumerate(tokens[:-1]):
        pos = torch.tensor([[prompt.numel() + i]])
        out = model(input_ids=torch.tensor([[tok]]), position_ids=pos, cache=cache, use_cache=True)
        logits.append(out.logits[0, -1])
    return logits


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("backend", ["sdpa", "eager"])
@pytest.mark.parametrize("policy", [FullCache(), Streaming(budget=256, window=16)], ids=["full", "big_budget"])
def test_logits_equal_unmodified_model_when_budget_exceeds_sequence(arch, backend, policy):
    model = tiny_model(arch, attn_implementation=backend)
    prompt = _prompt()
    ours: list[torch.Tensor] = []
    out = generate(
        model,
        prompt,
        policy,
        n_samples=1,
        sampling=SamplingConfig(temperature=0),
        max_new_tokens=40,
        attn_backend=backend,
        on_logits=lambda step, lg: ours.append(lg[0].clone()),
    )
    assert out.stats["evictions"] == 0
    ref = _reference_logits(model, prompt, out.tokens[0])
    assert len(ours) == len(ref) == 40
    diff = max((a - b).abs().max().item() for a, b in zip(ours, ref))
    scale = max(b.abs().max().item() for b in ref)
    # fp32 rounding only: the decode packs each KV group's query heads into one SDPA call (attention.decode_attention),
    # which sums in another order than transformers' per-head call (~1e-6 of the largest logit)
    assert diff <= 1e-5 * max(1.0, scale), (diff, scale)
    # and greedy decoding agrees with transformers' own generate
    gen = model.generate(prompt.view(1, -1), max_new_tokens=40, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert gen[0, prompt.numel() :].tolist() == out.tokens[0]


# ---- eviction == masking ------------------------------------------------------------------------------------
_MASKS: dict[int, torch.Tensor] = {}


def _masked_reference_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Eager attention over the whole sequence with a per-(row, KV head, query, key) mask from ``_MASKS`` (and the
    model's attention sinks, if it has them)."""
    mask = _MASKS[module.layer_idx]  # (B, H, L, L) bool
    groups = query.shape[1] // key.shape[1]
    full = mask.repeat_interleave(groups, dim=1)
    sinks = kwargs.get("s_aux", kwargs.get("sinks"))
    out = eager_attention(query, key, value, scaling, causal=False, mask=full, sinks=sinks)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register("vase_test_masked", _masked_reference_attention)
AttentionMaskInterface.register("vase_test_masked", lambda *a, **k: None)


@pytest.mark.parametrize(
    "arch,name", [("qwen3", n) for n in configs_of_kind("eviction")] + [("llama", "random")]
)  # every eviction config (conf/policy/*.yaml), and one on a second architecture
def test_eviction_equals_masking(arch, name, tmp_path):
    """After several evictions, every step's logits equal the unmodified model on the whole sequence with a
    per-(layer, KV head) mask that hides exactly the entries evicted before that step."""
    check_eviction_equals_masking(
        tiny_model(arch, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3), name, tmp_path
    )


def check_eviction_equals_masking(model, name, tmp_path, tol: float = 2e-5):
    """The proof of :func:`test_eviction_equals_masking` on ``model`` with policy config ``name`` (reused by
    tests/test_model_families.py for every family): each step's logits within ``tol`` of the reference's, relative
    to the largest of them (fp32 rounding: 2e-5; a float64 model, whose reference softmax and sink correction are
    float64 too, agrees to ~1e-15)."""
    prompt = _prompt(20)
    rows, window, budget, new = 2, 8, 32, 70
    policy = load_small(name, budget, window, model, tmp_path)
    snapshots: dict[int, list[torch.Tensor]] = {}
    logits: dict[int, torch.Tensor] = {}
    holder = {}

    def on_step(info):
        cache = holder["cache"]
        snapshots[info.step] = [
            layer.positions[: layer.n_rows].clone()
            if layer.is_sliding
            else layer.positions[: layer.n_rows, :, : layer.length].clone()
            for layer in cache.attention_layers  # the K/V layers (a hybrid model's linear layers hold no K/V)
        ]

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
    cache = holder["cache"]
    full_layers = [layer.layer_idx for layer in cache.evicting_layers]
    assert out.stats["evictions"] >= 3 * len(full_layers)
    p = prompt.numel()
    total = p + new - 1  # the last sampled token is never fed
    seq = torch.stack([torch.cat([prompt, torch.tensor(t[: new - 1])]) for t in out.tokens])  # (rows, total)
    heads = model.config.num_key_value_heads
    for layer, vase_layer in enumerate(cache.attention_layers):
        model_idx = vase_layer.layer_idx
        window = vase_layer.window  # a sliding layer's: query i sees (i - window, i] of what its ring holds
        mask = torch.zeros(rows, heads, total, total, dtype=torch.bool)
        causal = torch.ones(p, p, dtype=torch.bool).tril()
        mask[:, :, :p, :p] = causal if window is None else causal & ~causal.tril(-window)
        for i in range(p, total):  # query position i = token fed at decode step i - p + 1
            step = i - p
            if step == 0:
                mask[:, :, i, : i + 1] = True
                if window is not None:
                    mask[:, :, i, : max(0, i + 1 - window)] = False
            else:
                held = snapshots[step][layer]  # (rows, H, length) positions held before this forward
                if window is not None:  # the ring's written slots that stay in the window after this step's write
                    held = torch.where((held >= 0) & (held > i - window), held, i)
                mask[:, :, i].scatter_(-1, held, True)
                mask[:, :, i, i] = True
        _MASKS[model_idx] = mask
    ref_model = model
    previous = ref_model.config._attn_implementation
    ref_model.set_attn_implementation("vase_test_masked")
    try:
        ref = ref_model(input_ids=seq, position_ids=torch.arange(total).view(1, -1)).logits
    finally:
        ref_model.set_attn_implementation(previous)
    evicted_something = False
    for step in range(1, new):
        i = p + step - 1
        diff = (logits[step] - ref[:, i]).abs().max().item()
        # fp32 rounding of ~10-sized logits after 3 layers (the same check in float64 agrees to 1e-12:
        # tests/test_attention_kernels.py::test_eviction_equals_masking_in_float64)
        assert diff <= tol * max(1.0, ref[:, i].abs().max().item()), (step, diff)
        if step > 1 and snapshots[step - 1][full_layers[0]].shape[-1] < i:
            evicted_something = True
    assert evicted_something


def test_masking_reference_detects_a_wrong_mask():
    """The masking test can fail: hiding one extra entry changes the logits."""
    model = tiny_model("qwen3", num_hidden_layers=1)
    seq = _prompt(30).view(1, -1)
    mask = torch.ones(30, 30, dtype=torch.bool).tril().expand(1, model.config.num_key_value_heads, 30, 30).clone()
    _MASKS[0] = mask
    model.set_attn_implementation("vase_test_masked")
    try:
        a = model(input_ids=seq).logits[0, -1]
        mask[0, 0, -1, 5] = False
        b = model(input_ids=seq).logits[0, -1]
    finally:
        model.set_attn_implementation("sdpa")
    assert (a - b).abs().max() > 1e-4


# ---- static memory -----------------------------------------------------------------------------------------
def test_static_storage_never_reallocated_and_bounded():
    model = tiny_model("qwen3", num_attention_heads=8, num_key_value_heads=2)
    policy = Streaming(budget=32, window=8)
    holder, ptrs, lengths = {}, set(), []

    def on_step(info):
        cache = holder["cache"]
        ptrs.add(tuple((layer.keys.data_ptr(), layer.values.data_ptr()) for layer in cache.layers))
        lengths.append(cache.length)
        for layer in cache.layers:
            assert layer.keys.shape[1] == model.config.num_key_value_heads
            assert layer.keys.shape[2] == policy.budget + policy.window

    out = generate(
        model,
        _prompt(20),
        policy,
        n_samples=3,
        max_new_tokens=200,
        ignore_eos=True,
        on_cache=lambda c: holder.__setitem__("cache", c),
        on_step=on_step,
    )
    assert out.stats["evictions"] > 10
    assert len(ptrs) == 1
    assert max(lengths) <= policy.budget + policy.window
    assert min(lengths[50:]) >= policy.budget
    assert out.stats["kv_cache_bytes"] == out.stats["kv_cache_bytes_expected"]


def test_finished_rows_leave_the_batch_without_reallocation():
    model = tiny_model("qwen3")
    holder, active, ptrs = {}, [], set()

    def on_step(info):
        active.append(info.active_rows)
        ptrs.add(holder["cache"].layers[0].keys.data_ptr())

    prompt = _prompt(10)
    # every token id < 128 ends a sample: rows finish at different steps
    out = generate(
        model,
        prompt,
        Streaming(budget=16, window=8),
        n_samples=4,
        max_new_tokens=60,
        eos_token_ids=range(0, 128),
        on_cache=lambda c: holder.__setitem__("cache", c),
        on_step=on_step,
    )
    assert all(r == "eos" for r in out.finish_reasons) or "length" in out.finish_reasons
    assert active == sorted(active, reverse=True) and len(set(active)) > 1
    assert len(ptrs) == 1
    for toks, reason in zip(out.tokens, out.finish_reasons):
        if reason == "eos":
            assert toks[-1] < 128 and all(t >= 128 for t in toks[:-1])


# ---- determinism and batch independence ------------------------------------------------------------------
def test_same_seed_same_tokens_and_batch_rows_equal_alone():
    model = tiny_model("qwen3", num_attention_heads=4, num_key_value_heads=2)
    prompt = _prompt(16)
    policy = RandomEviction(budget=24, window=8)
    kw = dict(sampling=SamplingConfig(temperature=1.0, top_p=0.9, top_k=50), max_new_tokens=60, ignore_eos=True)
    a = generate(model, prompt, policy, n_samples=3, seed=7, **kw)
    b = generate(model, prompt, policy, n_samples=3, seed=7, **kw)
    c = generate(model, prompt, policy, n_samples=3, seed=8, **kw)
    assert a.tokens == b.tokens
    assert a.tokens != c.tokens
    assert a.stats["evictions"] > 0
    seeds = sample_seeds(7, 3)
    for i in range(3):
        alone = generate(model, prompt, policy, n_samples=1, seeds=[seeds[i]], **kw)
        assert alone.tokens[0] == a.tokens[i]


def test_stop_strings_and_max_length():
    class CharTok:
        def decode(self, ids, skip_special_tokens=False):
            return "".join(chr(97 + (i % 26)) for i in ids)

    model = tiny_model("llama")
    prompt = _prompt(12)
    out = generate(model, prompt, FullCache(), n_samples=2, max_length=40, seed=1)
    assert [len(t) for t in out.tokens] == [28, 28] and out.finish_reasons == ["length", "length"]
    text = CharTok().decode(out.tokens[0])
    stop = text[10:12]
    out2 = generate(
        model, prompt, FullCache(), n_samples=2, max_length=40, seed=1, stop_strings=[stop], tokenizer=CharTok()
    )
    assert out2.finish_reasons[0] == "stop"
    assert CharTok().decode(out2.tokens[0]).endswith(stop) and len(out2.tokens[0]) <= 12


# ---- bad settings fail before any model computation -------------------------------------------------------
@pytest.fixture
def forbidden_model():
    model = tiny_model("qwen3")

    def boom(*args, **kwargs):
        raise AssertionError("the model ran before the settings were validated")

    handle = model.register_forward_pre_hook(boom)
    yield model
    handle.remove()


@pytest.mark.parametrize(
    "make, setting",
    [
        (lambda: Streaming(budget=64, window=64), "policy.budget"),
        (lambda: Streaming(budget=32, window=0), "policy.window"),
        (lambda: Streaming(budget=100, window=64), "policy.budget"),
        (lambda: Streaming(budget=128, window=64, sinks=-1), "policy.sinks"),
    ],
)
def test_bad_policy_settings(make, setting):
    with pytest.raises(ValueError, match=setting):
        make()


def test_prompt_longer_than_max_length(forbidden_model):
    with pytest.raises(ValueError, match="max_length"):
        generate(forbidden_model, _prompt(50), FullCache(), max_length=50)


@pytest.mark.parametrize(
    "kwargs, setting",
    [
        (dict(n_samples=0, max_new_tokens=5), "n_samples"),
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(), "max_length"),
        (dict(max_new_tokens=5, attn_backend="flash_attn"), "attn_backend"),
        (dict(max_new_tokens=5, attn_backend="nope"), "attn_backend"),
        (dict(max_new_tokens=5, stop_strings=["x"]), "stop_strings"),
    ],
)
def test_bad_generation_settings(forbidden_model, kwargs, setting):
    with pytest.raises(ValueError, match=setting):
        generate(forbidden_model, _prompt(8), FullCache(), **kwargs)


def test_unsupported_architecture():
    from transformers import MistralConfig, MistralForCausalLM

    cfg = MistralConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    model = MistralForCausalLM(cfg).eval()
    model.register_forward_pre_hook(lambda *a, **k: (_ for _ in ()).throw(AssertionError("ran")))
    # MistralConfig's default 4096-token window on every layer: refused before anything runs (no full-attention
    # layer for a budget; a null window, or layer_types mixing full and sliding layers, is supported)
    with pytest.raises(ValueError, match="every layer of this mistral config is sliding-window .sliding_window=4096"):
        generate(model, _prompt(8, vocab=64), FullCache(), max_new_tokens=4)


def test_sampling_settings_are_validated():
    with pytest.raises(ValueError, match="generation.top_p"):
        SamplingConfig(top_p=0)
    with pytest.raises(ValueError, match="generation.temperature"):
        SamplingConfig(temperature=-1)


def test_model_attention_restored_after_generation():
    model = tiny_model("qwen2")
    generate(model, _prompt(8), FullCache(), max_new_tokens=3)
    assert model.config._attn_implementation == "sdpa"
    with vase_attention(model):
        # without a vase cache the registered function behaves like SDPA
        a = model(input_ids=_prompt(8).view(1, -1)).logits
    b = model(input_ids=_prompt(8).view(1, -1)).logits
    c = model.config  # two attention paths: the same float32 sums over the widths, maybe in other orders
    width, depth = c.hidden_size + c.intermediate_size, c.num_hidden_layers + 1
    tol = close(torch.float32, width, scale=b.abs().max().item(), depth=depth)
    torch.testing.assert_close(a, b, **tol)
