"""What the decode loop takes and gives: requests, finished samples, per-step info, totals (plain dataclasses).

See :mod:`vase.engine.decode` for the loop itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class Request:
    """A prompt and the samples to draw from it.

    Attributes:
        prompt_ids: the prompt's token ids ``(P,)``.
        seeds: one seed per sample (row ``i``'s token and eviction random keys derive from ``seeds[i]``).
        key: the caller's id for the prompt (e.g. the problem id); returned with each finished sample.
        samples: the caller's index of each sample (default ``0 .. len(seeds) - 1``).
        max_new_tokens: this prompt's output cap (default: the decoder's ``max_new_tokens``); ``max_length`` always
            applies too.
    """

    prompt_ids: Sequence[int] | torch.Tensor
    seeds: Sequence[int]
    key: Any = None
    samples: Sequence[int] | None = None
    max_new_tokens: int | None = None


@dataclass
class Finished:
    """One finished sample.

    Attributes:
        key, sample, seed: as in its :class:`Request`.
        tokens: generated token ids (the EOS token or the stop string's last token included, nothing after it).
        finish_reason: one of :data:`FINISH_REASONS`.
        prompt_len: prompt tokens.
        stats: ``decode_steps`` (forwards the row took part in), ``evictions`` (eviction events summed over layers),
            ``eviction_seconds`` (its share), ``held_tokens`` / ``held_tokens_max`` (mean / most tokens held per
            layer and KV head after its decode steps' appends: host-side lengths, no sync), ``attended_tokens``
            (selection policies: mean tokens attended per step, query head and layer), ``first_step`` /
            ``last_step`` (the decoder's step counter when it entered and ended).
    """

    key: Any
    sample: int
    seed: int
    tokens: list[int]
    finish_reason: str
    prompt_len: int
    stats: dict = field(default_factory=dict)


@dataclass
class StepInfo:
    """Passed to ``on_step`` after every decode step (wall times are exact on CPU; on CUDA they lag the device).

    Attributes:
        step: decode steps done by the decoder.
        active_rows: rows that took part in this step; ``rows`` their ids (the sample index for :func:`generate`,
            ``(key, sample)`` otherwise).
        tokens: ``(active_rows,)`` the tokens just sampled (on the device: reading them synchronises).
        cache_length: tokens held by the longest row (per layer and KV head) after this step's eviction check.
        evicted_rows: rows (positions in ``rows``) that evicted at this step.
    """

    step: int
    active_rows: int
    rows: list
    tokens: torch.Tensor
    cache_length: int
    evictions: int
    eviction_seconds: float
    wall_seconds: float
    evicted_rows: list[int] = field(default_factory=list)


@dataclass
class DecodeStats:
    """Totals of a :class:`Decoder` so far (throughput is ``tokens / decode_seconds``)."""

    prefills: int = 0
    prefill_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_steps: int = 0
    row_steps: int = 0  # tokens decoded by forwards (rows x steps), the discarded ones after a row's end included
    tokens: int = 0  # tokens of finished samples
    decode_seconds: float = 0.0
    samples: int = 0
    max_live_rows: int = 0
    # a compiled step: the first forward of each row bucket (dynamo's trace, inductor's compile or cache load, and that
    # one step), part of ``decode_seconds``
    compile_seconds: float = 0.0
    compiled_buckets: int = 0


@dataclass
class _Row:
    key: Any
    sample: int
    seed: int
    rid: Any
    limit: int
    prompt_len: int
    first_step: int
    tokens: list[int] = field(default_factory=list)
    produced: int = 0  # tokens sampled so far (the pending ones included)
    held_sum: int = 0
    held_max: int = 0  # the most tokens held (per layer and KV head) after any of its decode steps' appends
    steps: int = 0
