"""The one-prompt form of the decoder: ``n_samples`` continuations of one prompt decoded together.

:func:`generate` checks every setting before the model runs, sizes a cache of ``n_samples`` rows for the prompt and
its output cap, and returns the samples in order with the decode's statistics (:class:`GenerationOutput`). The
continuous-batching decoder it wraps is :class:`vase.engine.decode.Decoder`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from vase.engine.cache import VaseCache, cache_capacity
from vase.engine.decode import Decoder, Request, StepInfo
from vase.engine.policy import Policy
from vase.engine.sampling import SamplingConfig, sample_seeds
from vase.models import check_architecture


@dataclass
class GenerationOutput:
    """Result of :func:`generate`.

    Attributes:
        tokens: generated token ids per sample (stop string / EOS token included, nothing after it).
        finish_reasons: per sample, one of :data:`FINISH_REASONS`.
        prompt_len: prompt tokens.
        stats: ``prefill_seconds``, ``decode_seconds``, ``decode_tokens``, ``decode_steps_rows``, ``kv_cache_bytes``
            (allocated), ``kv_cache_bytes_expected`` (rows × capacity), ``aux_bytes``, ``capacity``, ``evictions``
            (events summed over rows and layers), ``eviction_seconds``, ``attended_tokens`` (mean per step, row, query
            head and layer; selection policies), ``held_tokens`` (mean held per layer/row/head over decode steps),
            ``finish_step`` per sample, ``attn_backend``, ``per_sample`` (each :class:`Finished`'s stats).
    """

    tokens: list[list[int]]
    finish_reasons: list[str]
    prompt_len: int
    stats: dict = field(default_factory=dict)


def validate_generation(
    model, prompt_len: int, policy: Policy, n_samples: int, max_new_tokens: int | None, max_length: int | None
) -> int:
    """Check every setting before any model computation; return the number of new tokens allowed."""
    check_architecture(model.config)
    policy.validate()
    if n_samples < 1:
        raise ValueError(f"n_samples: must be >= 1, got {n_samples}")
    if prompt_len < 1:
        raise ValueError("prompt: empty prompt")
    if max_new_tokens is None and max_length is None:
        raise ValueError("max_length: set max_length (prompt + output tokens) or max_new_tokens")
    if max_length is not None and prompt_len >= max_length:
        raise ValueError(
            f"max_length: the prompt has {prompt_len} tokens, not less than max_length={max_length}; "
            "raise max_length or shorten the prompt"
        )
    if max_new_tokens is not None and max_new_tokens < 1:
        raise ValueError(f"max_new_tokens: must be >= 1, got {max_new_tokens}")
    limit = max_new_tokens if max_new_tokens is not None else max_length - prompt_len
    if max_length is not None:
        limit = min(limit, max_length - prompt_len)
    return limit


def generate(
    model,
    prompt_ids: Sequence[int] | torch.Tensor,
    policy: Policy,
    *,
    n_samples: int = 1,
    sampling: SamplingConfig | None = None,
    max_new_tokens: int | None = None,
    max_length: int | None = None,
    eos_token_ids: Sequence[int] = (),
    stop_strings: Sequence[str] = (),
    tokenizer=None,
    seed: int = 0,
    seeds: Sequence[int] | None = None,
    attn_backend: str = "auto",
    sync_every: int | None = None,
    ignore_eos: bool = False,
    on_step: Callable[[StepInfo], None] | None = None,
    on_cache: Callable[[VaseCache], None] | None = None,
    on_logits: Callable[[int, torch.Tensor], None] | None = None,
    check_policy_output: bool = False,
) -> GenerationOutput:
    """Decode ``n_samples`` continuations of one prompt under ``policy`` (its samples decoded together).

    Args:
        model: a Qwen3 / Qwen2 / Llama causal LM (transformers).
        prompt_ids: the prompt's token ids ``(P,)``.
        policy: the cache policy (its ``budget``/``window`` define the static cache).
        n_samples: rows decoded together.
        seed / seeds: the per-row seed stream (``seeds`` overrides; see :func:`sample_seeds`).
        Others: as :class:`Decoder`; in hooks a row is named by its sample index.
    """
    prompt = torch.as_tensor(prompt_ids, dtype=torch.long).flatten()
    limit = validate_generation(model, prompt.numel(), policy, n_samples, max_new_tokens, max_length)
    if stop_strings and tokenizer is None:
        raise ValueError("stop_strings: a tokenizer is needed to match stop strings")
    seeds = list(seeds) if seeds is not None else sample_seeds(seed, n_samples)
    if len(seeds) != n_samples:
        raise ValueError(f"seeds: {len(seeds)} seeds for n_samples={n_samples}")
    p = prompt.numel()
    dec = Decoder(
        model,
        policy,
        rows=n_samples,
        capacity=cache_capacity(policy, p, limit),
        sampling=sampling,
        max_new_tokens=limit,
        eos_token_ids=eos_token_ids,
        stop_strings=stop_strings,
        tokenizer=tokenizer,
        attn_backend=attn_backend,
        sync_every=sync_every,
        ignore_eos=ignore_eos,
        on_step=on_step,
        on_logits=on_logits,
        on_cache=on_cache,
        check_policy_output=check_policy_output,
        row_id=lambda key, sample: sample,
    )
    dec.geometry.prompt_len = p
    done = sorted(dec.run([Request(prompt, seeds)]), key=lambda f: f.sample)
    cache, g = dec.cache, dec.geometry
    row_steps = sum(f.stats["decode_steps"] for f in done)
    attended = [f.stats["attended_tokens"] * f.stats["decode_steps"] for f in done if f.stats["attended_tokens"]]
    stats = {
        "prefill_seconds": dec.stats.prefill_seconds,
        "decode_seconds": dec.stats.decode_seconds,
        "decode_tokens": sum(len(f.tokens) for f in done),
        "decode_steps_rows": dec.stats.row_steps,
        "kv_cache_bytes": cache.kv_bytes(),
        "kv_cache_bytes_expected": g.kv_bytes,
        "aux_bytes": cache.aux_bytes(),
        "capacity": g.capacity,
        "evictions": cache.evictions(),
        "eviction_seconds": cache.eviction_seconds(),
        "attended_tokens": sum(attended) / row_steps if attended and row_steps else None,
        "held_tokens": (
            sum(f.stats["held_tokens"] * f.stats["decode_steps"] for f in done) / row_steps if row_steps else float(p)
        ),
        "finish_step": [len(f.tokens) for f in done],
        "attn_backend": dec.backend,
        "per_sample": [f.stats for f in done],
    }
    return GenerationOutput(
        tokens=[f.tokens for f in done], finish_reasons=[f.finish_reason for f in done], prompt_len=p, stats=stats
    )
