"""Token sampling: pure tensor math, no model or cache (tested against obviously correct references).

* :class:`SamplingConfig` — temperature / top-k / top-p, or greedy (``temperature=0``).
* :func:`candidate_distribution` — the warped distribution, restricted to the top-k candidates first.
* :func:`sample_tokens` — one token per row by an exponential race whose noise is one batched counter-based draw
  (:mod:`vase.engine.rng`: row ``b``'s noise is a hash of its token key and the token's position), so a row's token
  never depends on the other rows of the batch and the draw costs the same for 1 row or 1000.
* :func:`sample_seeds` — the per-row seed stream of a prompt's samples.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vase.engine.rng import RowRNG


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
    ids = None
    if cfg.top_k and cfg.top_k < logits.shape[-1]:
        # sorted, descending; on the raw logits (a positive temperature keeps the order), so only the k candidates
        # are converted and scaled: ~2% of a CPU decode step at 16 rows and a 152K vocabulary
        logits, ids = logits.topk(cfg.top_k, dim=-1)
    logits = logits.float()
    # Scaled after subtracting the row max, so no finite logit overflows however small the temperature (1e-300:
    # every token but the row's best goes to -inf, never NaN); 1 / T saturates at float32's largest finite value.
    logits = (logits - logits.amax(dim=-1, keepdim=True)) * min(1.0 / cfg.temperature, torch.finfo(torch.float32).max)
    if cfg.top_p < 1.0:
        if ids is None:
            logits, ids = logits.sort(dim=-1, descending=True)
        probs = logits.softmax(dim=-1)
        # Drop a token when the mass strictly before it already reaches top_p (the top token always stays).
        drop = (probs.cumsum(dim=-1) - probs) >= cfg.top_p
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(dim=-1), ids


def sample_tokens(logits: torch.Tensor, cfg: SamplingConfig, rng: RowRNG) -> torch.Tensor:
    """Pick one token per row from ``logits (B, V)``: argmax, or an exponential race with per-row noise.

    The race ``argmax(p / E)``, ``E ~ Exp(1)`` i.i.d., samples exactly from ``p``. ``E`` is one draw of ``rng``
    (row ``b``'s noise depends only on its key and counter: the engine keys it by the row's seed and the position of
    the token being sampled), so a row's token never depends on the other rows. Returns ``(B,)`` int64.
    """
    if cfg.is_greedy:
        # Same first-maximum index as argmax; torch's CPU max-with-indices is ~4x faster on (16, 32K) bf16 logits.
        return logits.max(dim=-1).indices
    probs, ids = candidate_distribution(logits, cfg)
    noise = rng.exponential(probs.shape[-1])
    choice = (probs / noise).argmax(dim=-1)
    return choice if ids is None else ids.gather(-1, choice.unsqueeze(-1)).squeeze(-1)
