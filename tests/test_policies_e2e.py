"""Every policy config end to end through the engine: a tiny random Qwen3 (GQA) model and the real offline model (slow).

Each run must finish without error, actually evict (eviction policies) or attend to fewer tokens than it holds
(Quest, SeerAttention-R), and never lose a sink token.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

from vase.engine import SamplingConfig, generate

CONF = Path(__file__).resolve().parents[1] / "conf" / "policy"
ALL_CONFIGS = sorted(p.stem for p in CONF.glob("*.yaml"))
SAMPLING = SamplingConfig(temperature=0.6, top_p=0.95, top_k=20)


def load_policy(name: str, budget: int, window: int, model=None, tmp_path: Path | None = None):
    """Config ``name`` at ``budget``/``window``. With ``model``: a policy that loads a checkpoint (SeerAttention-R) gets
    random gates of the model's geometry (16-token blocks); dense layers leave at least one sparse layer."""
    cfg = OmegaConf.load(CONF / f"{name}.yaml")
    cfg.budget, cfg.window = budget, window
    if cfg.get("evict_every") is not None:  # a declared period (R-KV's 128) scales with the test's small budget
        cfg.evict_every = 2 * window
    if model is not None and "gate_path" in cfg:
        from tests.seer_reference import write_random_gates

        cfg.gate_path = str(write_random_gates(tmp_path / "gates", model.config, block_size=16))
        cfg.block_size = 16
    if model is not None and "dense_layers" in cfg:  # the tiny models have 2 layers, Quest keeps 2 dense
        cfg.dense_layers = min(cfg.dense_layers, model.config.num_hidden_layers - 1)
    return instantiate(cfg)


@pytest.fixture(scope="module")
def tiny():
    from vase.models import tiny_model

    model = tiny_model("qwen3")
    assert model.config.num_attention_heads > model.config.num_key_value_heads  # GQA
    return model


def run_and_check(model, prompt: list[int], name: str, budget: int, window: int, new_tokens: int, tmp_path: Path):
    policy = load_policy(name, budget, window, model, tmp_path)
    if policy.kind == "eviction" and policy.keep_prompt and len(prompt) + window >= budget:
        with pytest.raises(ValueError, match="policy.keep_prompt"):  # refused before decoding
            generate(model, prompt, policy, max_new_tokens=new_tokens)
        return None
    caches = []
    out = generate(
        model,
        prompt,
        policy,
        n_samples=2,
        sampling=SAMPLING,
        max_new_tokens=new_tokens,
        seed=0,
        ignore_eos=True,
        check_policy_output=True,
        on_cache=caches.append,
    )
    assert [len(t) for t in out.tokens] == [new_tokens, new_tokens]
    stats = out.stats
    if policy.kind == "eviction":
        assert stats["evictions"] > 0
        every, p = policy.eviction_period, len(prompt)
        want = max(p, budget + every) if policy.compress_prefill else max(p, budget) + every
        assert stats["capacity"] == min(p + new_tokens, want)
        # Sinks survive every eviction, in every layer, row and KV head; a kept prompt stays whole, in place.
        for layer in caches[0].layers:
            held = layer.positions[: layer.n_rows, :, : layer.length]
            for s in range(policy.sinks):
                assert (held == s).any(dim=-1).all(), f"{name}: sink {s} evicted in layer {layer.layer_idx}"
            if policy.keep_prompt:
                assert torch.equal(held[..., :p], torch.arange(p).expand(*held.shape[:2], p)), name
    elif policy.kind == "selection":
        assert stats["evictions"] == 0
        assert stats["attended_tokens"] is not None and stats["attended_tokens"] < stats["held_tokens"]
        assert stats["capacity"] == len(prompt) + new_tokens  # selection keeps everything: no memory saving
    else:
        assert stats["evictions"] == 0
    return out


@pytest.mark.parametrize("name", ALL_CONFIGS)
def test_policy_runs_on_tiny_model(tiny, name, tmp_path):
    prompt = torch.randint(0, tiny.config.vocab_size, (20,), generator=torch.Generator().manual_seed(0)).tolist()
    run_and_check(tiny, prompt, name, budget=32, window=8, new_tokens=100, tmp_path=tmp_path)  # ~10 evictions per layer


@pytest.mark.parametrize("name", ALL_CONFIGS)
def test_policy_runs_with_prompt_longer_than_budget(tiny, name, tmp_path):
    """A prompt of 70 tokens against budget 32: eviction starts at the prompt, Quest selects from the first step."""
    prompt = torch.randint(0, tiny.config.vocab_size, (70,), generator=torch.Generator().manual_seed(1)).tolist()
    run_and_check(tiny, prompt, name, budget=32, window=8, new_tokens=40, tmp_path=tmp_path)


@pytest.mark.parametrize("name", ["vase_attnv", "vase_dkv"])
def test_stochastic_policies_are_reproducible_end_to_end(tiny, name, tmp_path):
    prompt = list(range(1, 21))
    a = run_and_check(tiny, prompt, name, budget=32, window=8, new_tokens=40, tmp_path=tmp_path)
    b = run_and_check(tiny, prompt, name, budget=32, window=8, new_tokens=40, tmp_path=tmp_path)
    assert a.tokens == b.tokens


@pytest.fixture(scope="module")
def real():
    from vase.models import load_model

    try:
        return load_model("qwen2.5_coder_0.5b")
    except ValueError as err:  # the wheels are not installed
        pytest.skip(str(err))


@pytest.mark.slow
@pytest.mark.parametrize("name", ALL_CONFIGS)
def test_policy_runs_on_real_model(real, name, tmp_path):
    model, tok = real
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "Write a Python function that checks whether a number is prime."}],
        add_generation_prompt=True,
        tokenize=True,
    )
    prompt = list(prompt["input_ids"] if isinstance(prompt, dict) or hasattr(prompt, "keys") else prompt)
    run_and_check(model, prompt, name, budget=64, window=16, new_tokens=120, tmp_path=tmp_path)
