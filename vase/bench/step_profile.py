"""Where a decode step's time goes, eager against compiled, at a fixed number of live rows.

A decode of ``rows`` equal-length prompts with EOS ignored, so every step covers exactly ``rows`` rows (no bucket
padding in the compiled step: ``rows`` a power of two, or ``generation.max_rows``), timed step by step through the
decoder's ``on_step`` hook and profiled by ``torch.profiler`` over a window of steady steps. The operators' self time
is grouped into matrix products, attention, the compiled graph's own kernels and the rest (:func:`op_shares`): on a
CPU where the products dominate, removing launch and Python overhead (what the compiled step is for) cannot buy more
than the rest's share. ``scripts/profile_step.py`` is the command line.

Imports only torch and the engine (see :mod:`vase.bench`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

logger = logging.getLogger(__name__)

#: operator groups by name (``torch.profiler`` key averages); the first group whose pattern a name contains wins
GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("matmul", ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "mkldnn", "aten::_weight_int")),
    ("attention", ("scaled_dot_product", "flash_attention", "efficient_attention")),
    ("compiled kernels", ("CompiledFxGraph", "Torch-Compiled Region", "TorchDynamo", "Pregraph", "cpp_fused")),
)


def op_group(name: str) -> str:
    """The group of an operator name (:data:`GROUPS`), ``"other"`` if none."""
    for group, patterns in GROUPS:
        if any(p in name for p in patterns):
            return group
    return "other"


def op_shares(events: Iterable) -> dict[str, float]:
    """Share of the total self CPU time per operator group (:func:`op_group`), summing to 1.

    Args:
        events: ``torch.profiler`` key averages (each with ``key`` and ``self_cpu_time_total`` in us).
    """
    totals: dict[str, float] = {g: 0.0 for g, _ in GROUPS} | {"other": 0.0}
    for ev in events:
        totals[op_group(ev.key)] += float(ev.self_cpu_time_total)
    whole = sum(totals.values())
    if whole <= 0:
        raise ValueError("op_shares: the profile holds no CPU time (no step ran inside the profiled window)")
    return {g: t / whole for g, t in totals.items()}


@dataclass
class StepProfile:
    """One decode's step times and, if profiled, its operator shares (``rows``: the live rows of every step)."""

    compile: str
    rows: int
    steps: int
    step_ms: list[float] = field(default_factory=list)
    shares: dict[str, float] | None = None
    top_ops: list[tuple[str, float]] = field(default_factory=list)

    @property
    def median_ms(self) -> float:
        """The median step time over the steady steps (the first 10 are left out: compiles, warm-up)."""
        tail = sorted(self.step_ms[10:] or self.step_ms)
        return tail[len(tail) // 2]

    @property
    def tokens_per_second(self) -> float:
        """``rows`` tokens per median step."""
        return self.rows / (self.median_ms / 1e3)


def profile_decode(
    model,
    policy,
    *,
    rows: int,
    prompt_len: int,
    new_tokens: int,
    compile: str,
    sampling=None,
    window: tuple[int, int] | None = None,
    seed: int = 0,
    live: int | None = None,
) -> StepProfile:
    """Decode ``rows`` random prompts of ``prompt_len`` tokens for ``new_tokens`` tokens each (EOS ignored).

    Args:
        model: a causal LM the engine supports.
        policy: a cache policy (a fresh one per call: policies hold per-run state).
        compile: ``generation.compile`` (``"off"`` or ``"on"``).
        window: ``(first, last)`` decode steps profiled with ``torch.profiler`` (``None``: not profiled).
        live: prompts decoded (default ``rows``); fewer than ``rows`` leaves slots free, so a compiled step pads
            ``live`` up to its row bucket (:func:`vase.engine.cache.row_bucket`) while an eager one covers ``live``.
    """
    from vase.engine import Decoder, Request, sample_seeds
    from vase.engine.cache import cache_capacity

    gen = torch.Generator().manual_seed(seed)
    vocab = int(model.config.get_text_config().vocab_size)
    live = rows if live is None else live
    if not 1 <= live <= rows:
        raise ValueError(f"live: must be between 1 and rows={rows}, got {live}")
    prompts = [torch.randint(100, min(vocab, 20000), (prompt_len,), generator=gen).tolist() for _ in range(live)]
    requests = [Request(p, sample_seeds(seed + i, 1), key=i) for i, p in enumerate(prompts)]
    out = StepProfile(compile=compile, rows=live, steps=0)
    stamps: list[float] = []
    prof: dict = {}

    def on_step(info) -> None:
        stamps.append(time.perf_counter())
        n = len(stamps)
        if window is not None and n == window[0]:
            from torch.profiler import ProfilerActivity, profile

            prof["p"] = profile(activities=[ProfilerActivity.CPU])
            prof["p"].__enter__()
        if window is not None and n == window[1] and "p" in prof:
            prof["p"].__exit__(None, None, None)

    dec = Decoder(
        model,
        policy,
        rows=rows,
        capacity=cache_capacity(policy, prompt_len, new_tokens),
        sampling=sampling,
        max_new_tokens=new_tokens,
        ignore_eos=True,
        compile=compile,
        on_step=on_step,
    )
    for _ in dec.run(requests):
        pass
    out.steps = len(stamps)
    out.step_ms = [1e3 * (b - a) for a, b in zip(stamps, stamps[1:], strict=False)]
    if "p" in prof:
        events = prof["p"].key_averages()
        out.shares = op_shares(events)
        ranked = sorted(events, key=lambda e: -e.self_cpu_time_total)[:8]
        out.top_ops = [(e.key, float(e.self_cpu_time_total) / 1e6) for e in ranked]
    logger.info("%s: %d rows, median step %.1f ms", compile, rows, out.median_ms)
    return out
