"""The benchmark's random-weight model presets (Qwen3 shapes) and the static KV size computed from a config.

Imports only the standard library and torch at import time (see :mod:`vase.bench`).
"""

from __future__ import annotations

import torch

# Qwen3 shapes (vocab, hidden, layers, heads, head_dim, intermediate) from the models' config.json; random weights.
COMMON = dict(max_position_embeddings=40960, initializer_range=0.02, rms_norm_eps=1e-6)
PRESETS: dict[str, dict] = {
    "tiny": dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=False,
    ),
    "cpu-small": dict(
        vocab_size=32000,
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        tie_word_embeddings=False,
    ),
    "qwen3-0.6b-shape": dict(
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        tie_word_embeddings=True,
    ),
    "qwen3-4b-shape": dict(
        vocab_size=151936,
        hidden_size=2560,
        intermediate_size=9728,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        tie_word_embeddings=True,
    ),
    # Qwen3-4B's KV geometry (36 layers, 32 query / 8 KV heads, head_dim 128) with a small hidden size, MLP and
    # vocabulary: an eviction event does Qwen3-4B's work while the forward is cheap, so on a CPU the eviction share
    # is visible (an upper bound of the real model's, whose step is seconds of matmuls)
    "qwen3-4b-kv": dict(
        vocab_size=4096,
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        tie_word_embeddings=False,
    ),
    "qwen3-14b-shape": dict(
        vocab_size=151936,
        hidden_size=5120,
        intermediate_size=17408,
        num_hidden_layers=40,
        num_attention_heads=40,
        num_key_value_heads=8,
        head_dim=128,
        tie_word_embeddings=False,
    ),
}


def model_config_kwargs(name: str, max_tokens: int = 0) -> dict:
    """The config fields of preset ``name`` (``max_position_embeddings`` raised to ``max_tokens`` if needed)."""
    if name not in PRESETS:
        raise ValueError(f"--model: unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    kw = {**COMMON, **PRESETS[name]}
    kw["max_position_embeddings"] = max(kw["max_position_embeddings"], max_tokens)
    return kw


def random_prompt(length: int, vocab: int, seed: int = 0) -> torch.Tensor:
    """The benchmark's random prompt: ``length`` token ids, identical for a seed across environments."""
    return torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(seed))


def build_model(
    name: str, dtype: torch.dtype, device: torch.device, seed: int = 0, max_tokens: int = 0, **overrides
) -> torch.nn.Module:
    """A random-weight Qwen3 model of preset ``name``, built directly in ``dtype`` on ``device``.

    Same config as ``vase.models.tiny_model("qwen3", **shape)`` (``vase.models.tiny_config``); built under a device
    context instead of on the host then moved, so that a 14B-shaped model never needs a float32 copy in host memory.
    """
    from transformers import AutoModelForCausalLM

    from vase.models import check_architecture, tiny_config

    config = tiny_config("qwen3", **{**model_config_kwargs(name, max_tokens), **overrides})
    check_architecture(config)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=dtype)
    return model.eval()


def static_kv_bytes(cfg: object, batch: int, capacity: int, dtype: torch.dtype) -> int:
    """``2 * layers * batch * kv_heads * capacity * head_dim * itemsize`` from a model config."""
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    itemsize = torch.tensor([], dtype=dtype).element_size()
    return 2 * cfg.num_hidden_layers * batch * cfg.num_key_value_heads * capacity * head_dim * itemsize


def static_capacity(kind: str, prompt_len: int, output_len: int, budget: int, window: int) -> int:
    """Token slots per (layer, row, KV head): computed here, independently of the engine (method.md §2)."""
    full = prompt_len + output_len
    if kind != "eviction":
        return full
    return min(full, max(prompt_len, budget) + window)


def staggered_requests(
    lengths: list[int], rows: int, vocab: int, seed: int, max_new_tokens: list[int] | None = None
) -> list:
    """``rows`` samples over the prompts of ``lengths`` (sample ``i`` decodes prompt ``i % len(lengths)``): rows of
    different lengths that evict at different steps, never one prompt in lockstep.

    Prompt ``j`` is a random prompt of ``lengths[j]`` tokens (seed ``seed + j``); ``max_new_tokens[j]`` its output
    cap (default: the decoder's). Returns the :class:`vase.engine.Request` s, one per prompt with samples.
    """
    from vase.engine import Request, sample_seeds

    seeds = sample_seeds(seed, rows)
    reqs = []
    for j, n in enumerate(lengths):
        mine = list(range(j, rows, len(lengths)))
        if not mine:
            continue
        cap = None if max_new_tokens is None else max_new_tokens[j % len(max_new_tokens)]
        prompt = random_prompt(n, vocab, seed=seed + j)
        reqs.append(Request(prompt, [seeds[i] for i in mine], key=j, samples=mine, max_new_tokens=cap))
    return reqs


def window_stagger(longest: int, prompts: int, window: int) -> list[int]:
    """``prompts`` lengths from ``longest`` down, ``window // prompts`` apart: rows that hold different lengths and
    reach an eviction at different steps of the window, within one window of the planned capacity."""
    step = max(1, window // max(prompts, 1))
    out = [longest - j * step for j in range(prompts)]
    if min(out) < 1:
        raise ValueError(f"--prompts: {prompts} prompts {step} tokens apart from {longest} leave an empty one")
    return out
