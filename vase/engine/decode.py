"""The decode loop (ours, not ``generate``): prefill once, then decode ``n`` samples of one prompt as one batch.

* The prompt is prefilled once (batch 1) and shared by every row of the static cache; no padding ever.
* Position ids come from the true token count (``prompt_len + step``), never from the cache length.
* Sampling: temperature / top-k / top-p, or greedy (``temperature=0``). Each row has its own seeded generators
  (one for tokens, one for the policy's eviction randomness), so a row's output does not depend on the other rows.
* EOS tokens, stop strings and a max-length limit; finished rows leave the batch (the cache compacts in place),
  so they stop costing compute.
* Host synchronisation: generated tokens are copied to the host every ``sync_every`` steps only (1 on CPU, where
  it is free; 16 on CUDA). Rows that finished in between decode a few extra tokens that are discarded.
* Per-step measurement hook ``on_step(StepInfo)``.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from vase.engine.attention import ATTN_NAME, resolve_backend
from vase.engine.cache import CacheGeometry, VaseCache, cache_capacity
from vase.engine.policy import Policy
from vase.models import check_architecture

logger = logging.getLogger(__name__)


@dataclass
class SamplingConfig:
    """Token sampling settings. ``temperature=0`` (or ``greedy=True``) means greedy decoding.

    Attributes:
        temperature: softmax temperature (> 0), or 0 for greedy.
        top_p: nucleus mass in (0, 1]; 1 disables it.
        top_k: keep the k most likely tokens; 0 disables it.
        greedy: force argmax decoding.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    greedy: bool = False

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"generation.temperature: must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"generation.top_p: must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"generation.top_k: must be >= 0 (0 = off), got {self.top_k}")

    @property
    def is_greedy(self) -> bool:
        return self.greedy or self.temperature == 0


def sample_seeds(seed: int, n: int) -> list[int]:
    """The per-row seed stream of a generation: row ``i`` of seed ``s`` always gets the same seed."""
    return [(seed * 1_000_003 + i) % (2**63 - 1) for i in range(n)]


def candidate_distribution(logits: torch.Tensor, cfg: SamplingConfig) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Temperature, then top-k, then top-p (on the renormalised top-k mass), as in transformers' warpers.

    Args:
        logits: ``(B, V)``.

    Returns:
        ``probs (B, C)`` over ``C`` candidate tokens and their vocabulary ids ``(B, C)`` (``None`` when the
        candidates are the whole vocabulary in order). Restricting to the top-k first keeps sampling cheap with
        large vocabularies.
    """
    logits = logits.float() / cfg.temperature
    ids = None
    if cfg.top_k and cfg.top_k < logits.shape[-1]:
        logits, ids = logits.topk(cfg.top_k, dim=-1)  # sorted, descending
    if cfg.top_p < 1.0:
        if ids is None:
            logits, ids = logits.sort(dim=-1, descending=True)
        probs = logits.softmax(dim=-1)
        # Drop a token when the mass strictly before it already reaches top_p (the top token always stays).
        drop = (probs.cumsum(dim=-1) - probs) >= cfg.top_p
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(dim=-1), ids


def sample_tokens(logits: torch.Tensor, cfg: SamplingConfig, generators: Sequence[torch.Generator]) -> torch.Tensor:
    """Pick one token per row from ``logits (B, V)``: argmax, or an exponential race with per-row noise.

    The race ``argmax(p / E)``, ``E ~ Exp(1)`` drawn from row ``b``'s generator, samples exactly from ``p``; a row's
    draw never depends on the other rows. Returns ``(B,)`` int64.
    """
    if cfg.is_greedy:
        # Same first-maximum index as argmax; torch's CPU max-with-indices is ~4x faster on (16, 32K) bf16 logits.
        return logits.max(dim=-1).indices
    probs, ids = candidate_distribution(logits, cfg)
    noise = torch.empty_like(probs)
    for row, g in enumerate(generators):
        if g.device == noise.device:
            noise[row].exponential_(generator=g)
        else:
            noise[row] = torch.empty(probs.shape[-1], device=g.device).exponential_(generator=g).to(noise.device)
    choice = (probs / noise).argmax(dim=-1)
    return choice if ids is None else ids.gather(-1, choice.unsqueeze(-1)).squeeze(-1)


@dataclass
class StepInfo:
    """Passed to ``on_step`` after every decode step (wall times are exact on CPU; on CUDA they lag the device).

    Attributes:
        step: decode steps done (the token fed by this step sits at position ``prompt_len + step - 1``).
        active_rows: rows still decoding; ``rows`` their sample indices.
        tokens: ``(active_rows,)`` the tokens just sampled (on the device: reading them synchronises).
        cache_length: tokens held per (layer, row, KV head) after this step's eviction check.
    """

    step: int
    active_rows: int
    rows: list[int]
    tokens: torch.Tensor
    cache_length: int
    evictions: int
    eviction_seconds: float
    wall_seconds: float


@dataclass
class GenerationOutput:
    """Result of :func:`generate`.

    Attributes:
        tokens: generated token ids per sample (stop string / EOS token included, nothing after it).
        finish_reasons: per sample, ``"eos"``, ``"stop"`` or ``"length"``.
        prompt_len: prompt tokens.
        stats: ``prefill_seconds``, ``decode_seconds``, ``decode_tokens``, ``kv_cache_bytes``, ``aux_bytes``,
            ``capacity``, ``evictions``, ``eviction_seconds``, ``attended_tokens`` (mean per step, row, KV head and
            layer; selection policies), ``held_tokens`` (mean held per layer/row/head over decode steps),
            ``finish_step`` per sample.
    """

    tokens: list[list[int]]
    finish_reasons: list[str]
    prompt_len: int
    stats: dict = field(default_factory=dict)


@contextlib.contextmanager
def vase_attention(model):
    """Temporarily switch ``model`` to the ``"vase"`` attention implementation."""
    previous = model.config._attn_implementation
    model.set_attn_implementation(ATTN_NAME)
    try:
        yield model
    finally:
        model.set_attn_implementation(previous)


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


@torch.inference_mode()
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
    """Decode ``n_samples`` continuations of one prompt under ``policy``.

    Args:
        model: a Qwen3 / Qwen2 / Llama causal LM (transformers).
        prompt_ids: the prompt's token ids ``(P,)``.
        policy: the cache policy (its ``budget``/``window`` define the static cache).
        n_samples: rows decoded together.
        sampling: see :class:`SamplingConfig` (default: temperature 1).
        max_new_tokens / max_length: output cap and/or prompt + output cap (the smaller wins).
        eos_token_ids: tokens that end a sample; ignored with ``ignore_eos`` (benchmarks).
        stop_strings: strings that end a sample (needs ``tokenizer``).
        seed / seeds: the per-row seed stream (``seeds`` overrides; see :func:`sample_seeds`).
        attn_backend: ``auto`` | ``sdpa`` | ``eager`` | ``flash_attn``.
        sync_every: copy tokens to the host every k steps (default 1 on CPU, 16 on CUDA).
        on_step: per-step measurement hook.
        on_cache: called once with the cache after it is built (analyses: e.g. set ``cache.on_evict``).
        on_logits: called after every forward with ``(step, logits (active_rows, V))``; step 0 is the prefill.
        check_policy_output: validate every eviction's indices (debug; syncs per eviction).
    """
    sampling = sampling or SamplingConfig()
    prompt = torch.as_tensor(prompt_ids, dtype=torch.long).flatten()
    limit = validate_generation(model, prompt.numel(), policy, n_samples, max_new_tokens, max_length)
    if stop_strings and tokenizer is None:
        raise ValueError("stop_strings: a tokenizer is needed to match stop strings")
    seeds = list(seeds) if seeds is not None else sample_seeds(seed, n_samples)
    if len(seeds) != n_samples:
        raise ValueError(f"seeds: {len(seeds)} seeds for n_samples={n_samples}")
    device = next(model.parameters()).device
    backend = resolve_backend(attn_backend, device)
    sync_every = sync_every or (16 if device.type == "cuda" else 1)
    eos = set() if ignore_eos else {int(t) for t in eos_token_ids}

    cfg = model.config
    p = prompt.numel()
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    geometry = CacheGeometry(
        num_layers=cfg.num_hidden_layers,
        num_kv_heads=cfg.num_key_value_heads,
        num_q_heads=cfg.num_attention_heads,
        head_dim=head_dim,
        rows=n_samples,
        prompt_len=p,
        capacity=cache_capacity(policy, p, limit),
        dtype=next(model.parameters()).dtype,
        device=device,
    )
    tok_gens = [torch.Generator(device=device).manual_seed(s) for s in seeds]
    evict_gens = [torch.Generator(device=device).manual_seed(s ^ 0x5EED_CAFE) for s in seeds]
    cache = VaseCache(
        geometry,
        policy,
        scaling=head_dim**-0.5,
        evict_generators=evict_gens,
        attn_backend=backend,
        check_policy_output=check_policy_output,
    )
    if on_cache is not None:
        on_cache(cache)

    out_tokens: list[list[int]] = [[] for _ in range(n_samples)]
    reasons = ["length"] * n_samples
    finish_step = [limit] * n_samples
    rows = list(range(n_samples))  # original sample index of each live row
    max_stop = max((len(s) for s in stop_strings), default=0)

    with vase_attention(model):
        t0 = time.perf_counter()
        logits = model(
            input_ids=prompt.view(1, -1).to(device),
            position_ids=torch.arange(p, device=device).view(1, -1),
            cache=cache,
            use_cache=True,
            logits_to_keep=1,
            vase_cache=cache,
        ).logits[:, -1]
        cache.advance(p)
        if on_logits is not None:
            on_logits(0, logits)
        logits = logits.expand(n_samples, -1)
        next_tok = sample_tokens(logits, sampling, [tok_gens[r] for r in rows])
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        prefill_seconds = time.perf_counter() - t0

        buf = torch.empty((n_samples, sync_every), dtype=torch.long, device=device)
        positions = torch.arange(p, p + limit + 1, device=device)
        t_dec = time.perf_counter()
        held_sum = 0
        row_steps = 0
        step = 0
        pending = 0
        decoded = 0
        while True:
            buf[: len(rows), pending] = next_tok
            pending += 1
            step += 1
            done_now = step >= limit
            if pending == sync_every or done_now:
                host = buf[: len(rows), :pending].tolist()
                finished = []
                for j, r in enumerate(rows):
                    for tok in host[j]:
                        out_tokens[r].append(tok)
                        if tok in eos:
                            reasons[r] = "eos"
                        elif max_stop and _hits_stop(tokenizer, out_tokens[r], stop_strings, max_stop):
                            reasons[r] = "stop"
                        else:
                            continue
                        finish_step[r] = len(out_tokens[r])
                        finished.append(j)
                        break
                decoded += pending * len(rows)
                pending = 0
                if done_now:
                    break
                if finished:
                    keep = [j for j in range(len(rows)) if j not in set(finished)]
                    if not keep:
                        break
                    index = torch.tensor(keep, dtype=torch.long, device=device)
                    cache.select_rows(index)
                    next_tok = next_tok.index_select(0, index)
                    rows = [rows[j] for j in keep]
            logits = model(
                input_ids=next_tok.view(-1, 1),
                position_ids=positions[step - 1 : step].view(1, 1),
                cache=cache,
                use_cache=True,
                vase_cache=cache,
            ).logits[:, -1]
            cache.advance(1)
            if on_logits is not None:
                on_logits(step, logits)
            held_sum += cache.length * len(rows)
            row_steps += len(rows)
            cache.evict_if_due()
            next_tok = sample_tokens(logits, sampling, [tok_gens[r] for r in rows])
            if on_step is not None:
                on_step(
                    StepInfo(
                        step,
                        len(rows),
                        list(rows),
                        next_tok,
                        cache.length,
                        cache.evictions(),
                        cache.eviction_seconds(),
                        time.perf_counter() - t_dec,
                    )
                )
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        decode_seconds = time.perf_counter() - t_dec

    for r in range(n_samples):
        del out_tokens[r][finish_step[r] :]
    attended = cache.attended_tokens()
    denom = row_steps * cfg.num_key_value_heads * cfg.num_hidden_layers
    stats = {
        "prefill_seconds": prefill_seconds,
        "decode_seconds": decode_seconds,
        "decode_tokens": sum(len(t) for t in out_tokens),
        "decode_steps_rows": decoded,
        "kv_cache_bytes": cache.kv_bytes(),
        "kv_cache_bytes_expected": geometry.kv_bytes,
        "aux_bytes": cache.aux_bytes(),
        "capacity": geometry.capacity,
        "evictions": cache.evictions(),
        "eviction_seconds": cache.eviction_seconds(),
        "attended_tokens": (attended / denom) if attended is not None and denom else None,
        "held_tokens": held_sum / row_steps if row_steps else float(p),
        "finish_step": finish_step,
        "attn_backend": backend,
    }
    return GenerationOutput(tokens=out_tokens, finish_reasons=reasons, prompt_len=p, stats=stats)


def _hits_stop(tokenizer, tokens: list[int], stop_strings: Sequence[str], max_stop: int) -> bool:
    """Whether the decoded tail of ``tokens`` contains a stop string (decodes only the last few tokens)."""
    tail = tokenizer.decode(tokens[-(max_stop + 8) :], skip_special_tokens=False)
    return any(s in tail for s in stop_strings)
