"""How much a run will decode, said before it starts: one line with the estimate for a large plan, and a question for
a paper-scale task on a CPU.

``python run.py task=aime`` on a CPU with the embedded 0.5B model would queue 30 problems x 16 samples x up to 32K
tokens (~15M tokens: weeks on two cores) without a word. :func:`check_scale`, called by the preflight
(:func:`vase.run.planning.plan`) once the prompts are measured, says how many tokens the plan decodes at most and the
full-length KV cache of one row (a warning above :data:`NOTE_TOKENS`), and on a CPU refuses a plan above
:data:`CPU_ASK_TOKENS` unless ``limit=`` and ``n_samples=`` were both set explicitly (a deliberate size).
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

#: tokens (samples x room for output) above which a run on a CPU is refused unless limit= and n_samples= are explicit
CPU_ASK_TOKENS = 2_000_000
#: tokens above which the plan's size is said in one line before the run starts (CPU; CUDA: x :data:`CUDA_FACTOR`)
NOTE_TOKENS = 100_000
CUDA_FACTOR = 100

_noted: set[tuple] = set()


def plan_tokens(work: list[tuple[int, int]], max_length: int) -> tuple[int, int]:
    """``(samples, tokens)``: the samples to decode and the most tokens they can generate, from ``work`` =
    ``[(prompt tokens, missing samples), ...]``; a prompt that leaves no room (recorded as too long) counts none."""
    samples = sum(n for _, n in work)
    tokens = sum(n * max(0, max_length - p) for p, n in work)
    return samples, tokens


def _count(n: int) -> str:
    for unit, scale in (("G", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return str(n)


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def check_scale(
    task: str,
    device: str,
    work: list[tuple[int, int]],
    max_length: int,
    row_kv_bytes: int | None,
    explicit: bool,
    machine: bool = True,
) -> None:
    """Say how large the plan is (one warning line) and refuse a paper-scale plan on a CPU that was not asked for.

    Args:
        task: the task's name (for the message).
        device: ``cpu``, ``cuda``, ``mps``: where the run decodes.
        work: ``[(prompt tokens, samples still to decode), ...]`` per problem.
        max_length: prompt + output tokens of a sample.
        row_kv_bytes: the KV cache of one row at ``max_length`` tokens with the full cache (``None``: unknown).
        explicit: ``limit=`` and ``n_samples=`` were both set (or ``task.problem_ids``): the size is deliberate.
        machine: the run decodes on this machine (``False``: a SLURM node checks it).

    Raises:
        ValueError: one line naming ``limit`` and ``n_samples`` (a CPU, above :data:`CPU_ASK_TOKENS`, not explicit).
    """
    samples, tokens = plan_tokens(work, max_length)
    kv = f"; the KV cache of one row at {max_length} tokens: {_size(row_kv_bytes)}" if row_kv_bytes else ""
    size = f"{samples} samples x up to {max_length - min(p for p, _ in work)} new tokens = {_count(tokens)} tokens"
    on_cpu = device == "cpu"
    if machine and on_cpu and tokens > CPU_ASK_TOKENS and not explicit:
        raise ValueError(
            f"limit, n_samples: task {task} on the CPU would decode {size} (days to weeks on a CPU){kv}; set both "
            "explicitly to run it: limit=2 n_samples=2 for a try, or the task's full size on purpose"
        )
    if tokens > NOTE_TOKENS * (1 if on_cpu else CUDA_FACTOR):
        key = (task, device, samples, tokens)
        if key not in _noted:
            _noted.add(key)
            logger.warning("plan: task %s on %s decodes %s at most%s", task, device, size, kv)
