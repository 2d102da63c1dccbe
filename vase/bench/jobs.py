"""One benchmark config: its policy, random prompt, planned lengths and static KV size, and its timed runs.

A config (``spec``) is a plain dict — model, dtype, device, attn_backend, policy, budget, window, batch, prompt_len,
output_len, warmup, repeats, seed, protocol (``full`` | ``steady``), steady_steps, warmup_steps, probe (None |
``"start"``), prompts — so that it travels to a worker process as JSON. With ``prompts`` = 1 every row decodes the
same prompt through :func:`vase.engine.generate`; with more, the rows decode that many prompts of different lengths
(:func:`vase.bench.shapes.window_stagger`: the planned prompt length and up to a window less), so each step masks
rows to their own lengths and rows evict at different steps, through :class:`vase.engine.Decoder`. Greedy, EOS
ignored; only the decode is timed.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from vase.bench import REPO
from vase.bench.measure import PeakMemory, load_1m, trimmed_mean
from vase.bench.shapes import (
    build_model,
    random_prompt,
    staggered_requests,
    static_capacity,
    static_kv_bytes,
    window_stagger,
)

if TYPE_CHECKING:
    from vase.engine import GenerationOutput
    from vase.engine.policy import Policy

logger = logging.getLogger(__name__)

ALL_POLICIES = sorted(p.stem for p in (REPO / "conf" / "policy").glob("*.yaml"))


def make_policy(name: str, budget: int, window: int) -> Policy:
    """Instantiate ``conf/policy/<name>.yaml`` with ``budget`` and ``window`` set."""
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    path = REPO / "conf" / "policy" / f"{name}.yaml"
    if not path.exists():
        raise ValueError(f"--policies: no policy config {path.name}; choose from {', '.join(ALL_POLICIES)}")
    cfg = OmegaConf.load(path)
    cfg.budget = budget
    cfg.window = window
    return instantiate(cfg)


def plan_run(kind: str, spec: dict) -> tuple[int, int]:
    """``(prompt length, output length)`` actually decoded for a config under ``spec["protocol"]``."""
    p, n = spec["prompt_len"], spec["output_len"]
    if spec.get("protocol", "full") != "steady":
        return p, n
    s = spec["steady_steps"]
    if spec.get("probe") == "start":
        return p, s
    if kind == "eviction":
        return max(p, spec["budget"]), s
    return p + n - s, s


class CpuStepClock:
    """Process CPU time per decode step, from after forward 1 to after forward ``n - 1`` (an ``on_step`` hook; CPU
    only: on CUDA the process clock does not see the device's work)."""

    def __init__(self):
        self.first: float | None = None
        self.last: float | None = None
        self.step = 0

    def on_step(self, info) -> None:
        t = time.process_time()
        if info.step == 1:
            self.first = t
        self.last, self.step = t, info.step

    def seconds_per_step(self) -> float | None:
        if self.step <= 1 or self.first is None:
            return None
        return (self.last - self.first) / (self.step - 1)


class Job:
    """One config ready to run: its policy, prompt, planned lengths and the static KV size computed from the config."""

    def __init__(self, spec: dict, model: torch.nn.Module | None = None) -> None:
        from vase.models import resolve_dtype

        self.spec = spec
        self.device = torch.device(spec["device"])
        self.dtype = resolve_dtype(spec["dtype"])
        self.policy = make_policy(spec["policy"], spec["budget"], spec["window"])
        self.run_p, self.run_n = plan_run(self.policy.kind, spec)
        if model is None:
            model = build_model(
                spec["model"], self.dtype, self.device, seed=spec.get("seed", 0), max_tokens=self.run_p + self.run_n + 1
            )
        self.model = model
        self.prompt = random_prompt(self.run_p, model.config.vocab_size, seed=spec.get("seed", 0))
        self.lengths = window_stagger(self.run_p, spec.get("prompts") or 1, spec["window"])
        self.capacity = static_capacity(self.policy.kind, self.run_p, self.run_n, spec["budget"], spec["window"])
        self.outs: list = []  # timed runs' stats
        self.mem: PeakMemory | None = None
        self.t_start = time.perf_counter()

    def once(self, n_new: int | None = None) -> GenerationOutput:
        """One generation (greedy, EOS ignored); ``n_new`` defaults to the planned output length."""
        from vase.engine import SamplingConfig, generate

        if len(self.lengths) > 1:
            return self.once_staggered(n_new or self.run_n)

        s = self.spec
        clock = CpuStepClock()
        on_step = clock.on_step

        out = generate(
            self.model,
            self.prompt,
            self.policy,
            n_samples=s["batch"],
            sampling=SamplingConfig(temperature=0),
            max_new_tokens=n_new or self.run_n,
            ignore_eos=True,
            attn_backend=s.get("attn_backend", "auto"),
            seed=s.get("seed", 0),
            on_step=on_step if self.device.type == "cpu" else None,
        )
        if clock.seconds_per_step() is not None:
            out.stats["cpu_step_seconds"] = clock.seconds_per_step()
        return out

    def once_staggered(self, n_new: int) -> GenerationOutput:
        """:meth:`once` with the rows over prompts of :attr:`lengths` (the same stats as ``generate``'s)."""
        from vase.engine import Decoder, GenerationOutput, SamplingConfig, cache_capacity

        s = self.spec
        clock = CpuStepClock()
        on_step = clock.on_step

        dec = Decoder(
            self.model,
            self.policy,
            rows=s["batch"],
            capacity=cache_capacity(self.policy, self.run_p, n_new),
            sampling=SamplingConfig(temperature=0),
            max_new_tokens=n_new,
            ignore_eos=True,
            attn_backend=s.get("attn_backend", "auto"),
            on_step=on_step if self.device.type == "cpu" else None,
        )
        reqs = staggered_requests(self.lengths, s["batch"], self.model.config.vocab_size, seed=s.get("seed", 0))
        done = list(dec.run(reqs))
        cache, steps = dec.cache, dec.stats.row_steps
        held = sum(f.stats["held_tokens"] * f.stats["decode_steps"] for f in done)
        stats = {
            "prefill_seconds": dec.stats.prefill_seconds,
            "decode_seconds": dec.stats.decode_seconds,
            "decode_tokens": sum(len(f.tokens) for f in done),
            "kv_cache_bytes": cache.kv_bytes(),
            "aux_bytes": cache.aux_bytes(),
            "capacity": dec.geometry.capacity,
            "evictions": cache.evictions(),
            "eviction_seconds": cache.eviction_seconds(),
            "held_tokens": held / steps if steps else float(self.run_p),
            "attn_backend": dec.backend,
            "prompt_lens": self.lengths,
        }
        if clock.seconds_per_step() is not None:
            stats["cpu_step_seconds"] = clock.seconds_per_step()
        return GenerationOutput(
            tokens=[f.tokens for f in done],
            finish_reasons=[f.finish_reason for f in done],
            prompt_len=self.run_p,
            stats=stats,
        )

    def warm(self) -> None:
        """The untimed warm-up runs (``warmup_steps`` decode steps each when set)."""
        for _ in range(self.spec["warmup"]):
            self.once(min(self.run_n, self.spec.get("warmup_steps") or self.run_n))

    def timed(self) -> None:
        """One timed run; its stats are kept for :meth:`row`."""
        self.outs.append(self.once().stats)

    def row(self, status: str = "ok") -> dict:
        """The CSV row of this config from its timed runs (and ``self.mem``, the peak memory over them)."""
        spec = self.spec
        row = {
            k: spec.get(k)
            for k in (
                "model",
                "dtype",
                "device",
                "protocol",
                "policy",
                "budget",
                "window",
                "batch",
                "prompt_len",
                "output_len",
                "warmup",
                "repeats",
            )
        }
        if spec.get("probe"):
            row["policy"] = f"{spec['policy']}@{spec['probe']}"
        row.update(
            prompts=len(self.lengths),
            kind=self.policy.kind,
            run_prompt_len=self.run_p,
            run_output_len=self.run_n,
            capacity=self.capacity,
            status=status,
            load_1m=round(load_1m(), 2),
            kv_bytes_static=static_kv_bytes(self.model.config, spec["batch"], self.capacity, self.dtype),
            wall_s=round(time.perf_counter() - self.t_start, 1),
        )
        st = self.outs
        if status != "ok" or not st:
            return row
        tok_s = [s["decode_tokens"] / s["decode_seconds"] for s in st]
        steps = max(self.run_n - 1, 1)
        dec = sum(s["decode_seconds"] for s in st)
        row.update(
            attn_backend=st[0]["attn_backend"],
            decode_tok_s=trimmed_mean(tok_s),
            decode_tok_s_runs=";".join(f"{x:.2f}" for x in tok_s),
            step_ms=trimmed_mean([1e3 * s["decode_seconds"] / steps for s in st]),
            prefill_s=trimmed_mean([s["prefill_seconds"] for s in st]),
            eviction_share=sum(s["eviction_seconds"] for s in st) / dec if dec > 0 else float("nan"),
            evictions=st[0]["evictions"],
            held_tokens=round(st[0]["held_tokens"], 1),
            kv_cache_bytes=st[0]["kv_cache_bytes"],
            aux_bytes=st[0]["aux_bytes"],
        )
        if all(s.get("cpu_step_seconds") for s in st):
            # tokens per CPU second, same definition as decode_tok_s: batch * n tokens over n - 1 forwards
            cpu = [s["decode_tokens"] / (steps * s["cpu_step_seconds"]) for s in st]
            row.update(
                cpu_tok_s=trimmed_mean(cpu),
                cpu_tok_s_runs=";".join(f"{x:.2f}" for x in cpu),
                cpu_step_ms=trimmed_mean([1e3 * s["cpu_step_seconds"] for s in st]),
            )
        row["kv_bytes_equal"] = row["kv_cache_bytes"] == row["kv_bytes_static"] and st[0]["capacity"] == self.capacity
        if self.mem is not None and self.mem.peak is not None:
            row.update(
                peak_mem_bytes=self.mem.peak,
                peak_mem_source=self.mem.source,
                peak_delta_bytes=self.mem.peak - self.mem.baseline if self.mem.baseline is not None else None,
            )
        return row


def run_config(spec: dict, model: torch.nn.Module | None = None) -> dict:
    """Benchmark one config: ``warmup`` runs, then ``repeats`` timed runs under a peak-memory probe; one CSV row.

    ``spec`` keys: model, dtype, device, attn_backend, policy, budget, window, batch, prompt_len, output_len, warmup,
    repeats, seed, protocol (full | steady), steady_steps, warmup_steps, probe (None | "start").
    """
    job = Job(spec, model)
    oom = False
    try:
        job.warm()
        with PeakMemory(job.device) as mem:
            for _ in range(spec["repeats"]):
                job.timed()
        job.mem = mem
    except torch.cuda.OutOfMemoryError:
        oom = True  # clean up outside the handler: its traceback still references the cache
    if oom:
        job.outs = []
        row = job.row("OOM")
        del job
        gc.collect()
        torch.cuda.empty_cache()
        return row
    return job.row()


def run_interleaved(
    specs: list[dict], model: torch.nn.Module | None, repeats: int, progress: Callable[[str], None] = logger.info
) -> list[dict]:
    """Timing with the configs interleaved: every config's warm-up, then ``repeats`` rounds of one run of each.

    On a shared machine the load drifts; round-robin rounds spread the drift over every config instead of biasing
    whichever ran in a busy minute, so the ratios between policies are fair. Peak memory is not measured here.
    """
    jobs: list[Job | str] = []
    for spec in specs:
        try:
            jobs.append(Job(spec, model))
        except Exception as err:  # noqa: BLE001 - a config that cannot be built is recorded, the sweep goes on
            jobs.append(f"error: {type(err).__name__}: {err}"[:200])

    def attempt(i: int, fn) -> None:
        try:
            fn()
        except Exception as err:  # noqa: BLE001 - a failing config is recorded and dropped from later rounds
            jobs[i] = f"error: {type(err).__name__}: {err}"[:200]

    for i, job in enumerate(jobs):
        if isinstance(job, Job):
            attempt(i, job.warm)
    for r in range(repeats):
        t = time.perf_counter()
        for i, job in enumerate(jobs):
            if isinstance(job, Job):
                attempt(i, job.timed)
        progress(f"  round {r + 1}/{repeats} done in {time.perf_counter() - t:.0f}s (load {load_1m():.1f})")
    return [job.row() if isinstance(job, Job) else skipped_row(spec, job) for job, spec in zip(jobs, specs)]


def run_isolated(spec: dict, timeout: float | None = None) -> dict:
    """Run one config in a fresh Python process (fresh allocator, own peak-RSS mark): :mod:`vase.bench.worker`."""
    from vase.bench.worker import run_isolated as run_worker

    out = run_worker("throughput", spec, timeout=timeout)
    if "error" in out:
        return {**spec, "status": out["error"] if out["error"] == "timeout" else f"error: {out['error'][:200]}"}
    return out


def skipped_row(spec: dict, status: str) -> dict:
    """The CSV row of a config that did not run (``status`` says why)."""
    row = {
        k: spec.get(k)
        for k in (
            "model",
            "dtype",
            "device",
            "protocol",
            "policy",
            "budget",
            "window",
            "batch",
            "prompt_len",
            "output_len",
            "warmup",
            "repeats",
        )
    }
    if spec.get("probe"):
        row["policy"] = f"{spec['policy']}@{spec['probe']}"
    row.update(kind="?", status=status)
    try:
        row["kind"] = make_policy(spec["policy"], spec["budget"] or 2 * spec["window"], spec["window"]).kind
    except Exception:  # noqa: BLE001
        pass
    return row
