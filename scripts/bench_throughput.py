#!/usr/bin/env python
"""Decode throughput and memory of every cache policy on a random-weight model (the paper's protocol, method.md §5).

Protocol, per (policy, budget, output length): a random prompt of ``--prompt-len`` tokens (seeded), ``--batch`` rows
decoded together, greedy, a fixed output length with EOS ignored; ``--warmup`` untimed runs, then ``--repeats`` timed
runs; decode tokens/s is the mean of the repeats without their min and max (plain mean when fewer than 3 repeats).
Only the decode is timed (``vase.engine.decode.generate``'s ``decode_seconds``; the prefill is excluded).

Reported per config (CSV ``bench.csv``, plot ``bench.png``/``bench.pdf``, machine info ``machine.json``):

* ``decode_tok_s``: decode tokens / decode seconds (``batch * output_len`` tokens; the first token of each row comes
  from the prefill, so a run makes ``output_len - 1`` decode forwards); ``step_ms``: decode seconds per forward.
* ``eviction_share``: eviction seconds (scoring + gather, timed by the engine) / decode seconds, over the repeats.
* ``kv_cache_bytes`` (what the engine allocated) against ``kv_bytes_static`` computed here from the model config:
  ``2 * layers * batch * kv_heads * capacity * head_dim * itemsize`` with ``capacity = min(P + N, max(P, B) + W)``
  for eviction policies and ``P + N`` otherwise; ``kv_bytes_equal`` says whether they match to the byte.
* ``peak_mem_bytes``: CUDA ``max_memory_allocated`` over the timed repeats (peak stats reset after the warm-up);
  on CPU the peak resident set size (``VmHWM``) of the timed repeats: the kernel's high-water mark is reset through
  ``/proc/self/clear_refs`` after the warm-up, and by default every config runs in a fresh subprocess
  (``--isolate auto``), so memory freed by an earlier config but kept by the allocator never counts. Both include
  the weights (as the paper's "peak = max allocated memory"); ``peak_delta_bytes`` is the peak minus the memory in
  use just before the timed repeats (weights, prompt, allocator caches), i.e. what decoding itself added.
* ``ratio_vs_full`` / ``ratio_vs_streaming``: tokens/s against ``full`` (same output length) and against ``streaming``
  (same budget and output length: the same static cache with no scoring, the floor for any eviction policy).

Command lines::

    # the CPU run recorded in scripts/BENCHMARKS.md (about 15 minutes on 2 cores)
    python scripts/bench_throughput.py --model cpu-small --budgets 128 --window 32 --output-lens 512,1024,2048 \\
        --batch 4 --prompt-len 128 --warmup 1 --repeats 5 --out results/bench/cpu_small

    # a quick look (tiny model, two policies)
    python scripts/bench_throughput.py --model tiny --policies full,streaming,vase_attnv --output-lens 64 \\
        --budgets 32 --window 16 --repeats 1 --warmup 0 --out /tmp/bench_tiny

    # the paper's table (Qwen3-14B-shaped random model, batch 16, FA2) on one GPU in ~8 minutes, steady-state protocol
    python scripts/bench_throughput.py --preset paper14b --out results/bench/paper14b    # see scripts/gpu_bench_14b.sh

``--protocol steady`` (the ``paper14b`` preset uses it) measures instead of full-length runs:

* each eviction policy with ``prompt = budget`` (the cache starts full; it evicts every ``window`` steps from the
  first one and its capacity is ``budget + window``, the capacity of the full-length run) for ``--steady-steps``
  decode steps: the steady-state step latency, eviction share, KV bytes and peak memory of a long run;
* the full cache (and selection policies) with ``prompt = P + N - S`` and ``S = --steady-steps`` decode steps: the
  capacity, KV bytes and peak memory of the real ``P + N`` run and its last (slowest) steps, plus one probe with the
  real prompt ``P`` (its first steps);

and estimates the full-length tokens/s (``est_tok_s``) assuming the step latency of a growing cache is linear in its
length between the probes: full cache = the mean of its first and last step latencies; an eviction policy = the
growing phase (``P`` to ``budget + window`` held tokens, no eviction, on the full cache's line) plus the remaining
steps at its steady-state latency. ``--protocol full`` (default) runs every config at full length, as the paper.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import gc
import json
import math
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

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

# The paper's throughput table (method.md §5), shortened to fit ~8 minutes on one H200 (see the module docstring).
PAPER14B = dict(
    model="qwen3-14b-shape",
    dtype="bfloat16",
    device="cuda",
    batch=16,
    prompt_len=256,
    output_lens="16384,32768",
    budgets="2048,4096,6144",
    window=64,
    policies="streaming,vase_attnv,vase_dkv,rkv,full",
    warmup=1,
    repeats=2,
    protocol="steady",
    steady_steps=192,
    warmup_steps=72,
    time_limit=380.0,
    attn_backend="auto",
)

ALL_POLICIES = sorted(p.stem for p in (REPO / "conf" / "policy").glob("*.yaml"))

CSV_COLUMNS = [
    "model",
    "dtype",
    "device",
    "attn_backend",
    "protocol",
    "policy",
    "kind",
    "budget",
    "window",
    "batch",
    "prompt_len",
    "output_len",
    "run_prompt_len",
    "run_output_len",
    "warmup",
    "repeats",
    "status",
    "decode_tok_s",
    "decode_tok_s_runs",
    "step_ms",
    "prefill_s",
    "eviction_share",
    "evictions",
    "held_tokens",
    "kv_cache_bytes",
    "kv_bytes_static",
    "kv_bytes_equal",
    "aux_bytes",
    "capacity",
    "peak_mem_bytes",
    "peak_delta_bytes",
    "peak_mem_source",
    "est_tok_s",
    "ratio_vs_full",
    "ratio_vs_streaming",
    "ratio_vs_full_paired",
    "ratio_vs_streaming_paired",
    "cpu_tok_s",
    "cpu_tok_s_runs",
    "cpu_step_ms",
    "ratio_vs_full_cpu",
    "ratio_vs_streaming_cpu",
    "load_1m",
    "wall_s",
]


# ---- small helpers (stdlib + torch only: bench_kvpress.py imports them inside the kvpress environment) -----------
def trimmed_mean(xs: list[float]) -> float:
    """Mean without the min and the max (the paper's protocol); the plain mean for fewer than 3 values."""
    xs = sorted(xs)
    if len(xs) >= 3:
        xs = xs[1:-1]
    return sum(xs) / len(xs) if xs else float("nan")


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


def build_model(name: str, dtype: torch.dtype, device: torch.device, seed: int = 0, max_tokens: int = 0, **overrides):
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


def static_kv_bytes(cfg, batch: int, capacity: int, dtype: torch.dtype) -> int:
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


def proc_status_bytes(field: str) -> int | None:
    """``VmRSS`` / ``VmHWM`` of this process in bytes (Linux), or None."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark (``VmHWM``) of this process; False where unsupported."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class PeakMemory:
    """Peak memory over a block: CUDA max allocated, or the process's peak RSS on CPU (see the module docstring)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.peak = self.baseline = None
        self.source = ""

    def __enter__(self):
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.baseline = torch.cuda.memory_allocated(self.device)
            self.source = "cuda_max_memory_allocated"
        else:
            self.baseline = proc_status_bytes("VmRSS")
            self.source = "VmHWM(reset)" if reset_peak_rss() else "ru_maxrss(process lifetime)"
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device)
        elif self.source.startswith("VmHWM"):
            self.peak = proc_status_bytes("VmHWM")
        else:
            self.peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return False


def load_1m() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:
        return float("nan")


def machine_info(device: str) -> dict:
    """What the numbers were measured on."""
    info = {
        "time": _dt.datetime.now().isoformat(timespec="seconds"),
        "host": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "loadavg": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "argv": sys.argv,
    }
    try:
        with open("/proc/cpuinfo") as f:
            info["cpu_model"] = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), None)
    except OSError:
        pass
    mem = proc_meminfo_total()
    if mem:
        info["mem_total_bytes"] = mem
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    if torch.cuda.is_available() and str(device).startswith("cuda"):
        info["cuda_device"] = torch.cuda.get_device_name()
        info["cuda_version"] = torch.version.cuda
        try:
            import flash_attn

            info["flash_attn"] = flash_attn.__version__
        except ImportError:
            info["flash_attn"] = None
    try:
        info["git_commit"] = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "vase", "baselines"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        info["engine_files_modified"] = dirty.splitlines() if dirty else []
    except (OSError, subprocess.SubprocessError):
        pass
    return info


def proc_meminfo_total() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


# ---- one config ----------------------------------------------------------------------------------------------
def make_policy(name: str, budget: int, window: int):
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


class Job:
    """One config ready to run: its policy, prompt, planned lengths and the static KV size computed from the config."""

    def __init__(self, spec: dict, model=None):
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
        self.capacity = static_capacity(self.policy.kind, self.run_p, self.run_n, spec["budget"], spec["window"])
        self.outs: list = []  # timed runs' stats
        self.mem: PeakMemory | None = None
        self.t_start = time.perf_counter()

    def once(self, n_new: int | None = None):
        """One generation (greedy, EOS ignored); ``n_new`` defaults to the planned output length."""
        from vase.engine.decode import SamplingConfig, generate

        s = self.spec
        marks: dict = {}

        def on_step(info) -> None:  # CPU only: process CPU time after decode forwards 1 and n - 1
            t = time.process_time()
            if info.step == 1:
                marks["t1"] = t
            marks["t"], marks["step"] = t, info.step

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
        if marks.get("step", 0) > 1:
            out.stats["cpu_step_seconds"] = (marks["t"] - marks["t1"]) / (marks["step"] - 1)
        return out

    def warm(self) -> None:
        for _ in range(self.spec["warmup"]):
            self.once(min(self.run_n, self.spec.get("warmup_steps") or self.run_n))

    def timed(self) -> None:
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


def run_config(spec: dict, model=None) -> dict:
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


def run_interleaved(specs: list[dict], model, repeats: int, progress=print) -> list[dict]:
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
    return [job.row() if isinstance(job, Job) else _skipped(spec, job) for job, spec in zip(jobs, specs)]


WORKER_TAG = "BENCH_ROW_JSON:"


def run_isolated(spec: dict, timeout: float | None = None) -> dict:
    """Run one config in a fresh Python process (fresh allocator, own peak-RSS mark)."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(spec)]
    try:
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {**spec, "status": "timeout"}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(WORKER_TAG):
            return json.loads(line[len(WORKER_TAG) :])
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
    return {**spec, "status": f"error: {tail[0][:200]}"}


# ---- the sweep -----------------------------------------------------------------------------------------------
def sweep_specs(args) -> list[dict]:
    """Every config of the sweep, in run order (the full cache once per output length: it ignores the budget)."""
    base = dict(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        attn_backend=args.attn_backend,
        window=args.window,
        batch=args.batch,
        prompt_len=args.prompt_len,
        warmup=args.warmup,
        repeats=args.repeats,
        seed=args.seed,
        protocol=args.protocol,
        steady_steps=args.steady_steps,
        warmup_steps=args.warmup_steps,
    )
    kinds = {name: make_policy(name, max(args.budgets), args.window).kind for name in args.policies}
    specs = []
    for budget in args.budgets:
        for name in args.policies:
            if kinds[name] == "none" and budget != args.budgets[0]:
                continue
            if args.protocol == "steady" and kinds[name] == "eviction":
                # steady state does not depend on the output length: one run per budget, reused for every length
                specs.append(dict(base, policy=name, budget=budget, output_len=max(args.output_lens)))
                continue
            for n in args.output_lens:
                specs.append(dict(base, policy=name, budget=budget if kinds[name] != "none" else 0, output_len=n))
    if args.protocol == "steady":  # the growing cache's first steps (the real prompt): one probe, run first (cheap)
        specs.insert(0, dict(base, policy="full", budget=0, output_len=max(args.output_lens), probe="start"))
    return specs


def add_ratios(rows: list[dict], output_lens: list[int]) -> None:
    """``ratio_vs_full`` (same output length) and ``ratio_vs_streaming`` (same budget and output length).

    Also ``*_paired``: with the interleaved schedule, run ``i`` of every config belongs to the same round, so the
    per-round ratios are paired samples (a load drift between rounds cancels); their mean without min and max.
    ``*_cpu``: the same from CPU time (CPU runs; robust to other processes taking the cores), paired when the runs
    are. With ``--protocol steady`` the ratio against ``streaming`` compares the measured steady states (same budget,
    same held lengths: the growing phase before the first eviction is identical for both) and the ratio against
    ``full`` the estimated full-length tokens/s.
    """

    def tput(r, ref_name):
        if r is None or r.get("status") != "ok":
            return None
        steady_est = r.get("protocol") == "steady" and ref_name == "full"
        return r.get("est_tok_s") if steady_est else r.get("decode_tok_s")

    def runs(r, key):
        text = r.get(key) if r and r.get("status") == "ok" else None
        return [float(x) for x in str(text).split(";")] if text else []

    full = {r["output_len"]: r for r in rows if r["policy"] == "full"}
    stream = {(r["budget"], r["output_len"]): r for r in rows if r["policy"] == "streaming"}
    for r in rows:
        for name, ref in (
            ("full", full.get(r["output_len"])),
            ("streaming", stream.get((r["budget"], r["output_len"]))),
        ):
            v, f = tput(r, name), tput(ref, name)
            r[f"ratio_vs_{name}"] = v / f if v and f else None
            comparable = r.get("protocol") != "steady" or name == "streaming"  # same run lengths on both sides
            for key, col in (("decode_tok_s_runs", "paired"), ("cpu_tok_s_runs", "cpu")):
                a, b = runs(r, key), runs(ref, key)
                ok = comparable and len(a) == len(b) and len(a) > (1 if col == "paired" else 0)
                r[f"ratio_vs_{name}_{col}"] = trimmed_mean([x / y for x, y in zip(a, b)]) if ok else None


def add_estimates(rows: list[dict], output_lens: list[int]) -> list[dict]:
    """Steady protocol: expand eviction rows to every output length and estimate full-length tokens/s (docstring)."""
    start = next((r for r in rows if r["policy"] == "full@start" and r.get("status") == "ok"), None)
    ends = {(r["policy"], r["output_len"]): r for r in rows if r.get("kind") != "eviction" and r.get("status") == "ok"}
    out = []
    for r in rows:
        if r["policy"] == "full@start":
            out.append(r)
            continue
        for n in output_lens if r.get("kind") == "eviction" else [r["output_len"]]:
            e = dict(r, output_len=n)
            e["est_tok_s"] = _estimate(e, start, ends) if r.get("status") == "ok" else None
            out.append(e)
    return out


def _line(start: dict | None, end: dict | None):
    """Step latency (s) of a growing cache as a function of held tokens: linear through two probes."""
    if start is None or end is None:
        return None
    l0 = start["run_prompt_len"] + start["run_output_len"] / 2
    l1 = end["run_prompt_len"] + end["run_output_len"] / 2
    t0, t1 = start["step_ms"] / 1e3, end["step_ms"] / 1e3
    slope = (t1 - t0) / (l1 - l0) if l1 != l0 else 0.0
    return lambda length: t0 + slope * (length - l0)


def _estimate(r: dict, start: dict | None, ends: dict) -> float | None:
    """Estimated decode tokens/s of an ``n``-token output from prompt ``P`` (see the module docstring).

    Non-eviction policies: linear between the full cache's first steps (``start``) and the policy's own last steps.
    Eviction policies: the growing phase on the full cache's line, then the measured steady-state step latency.
    """
    p, batch, n = r["prompt_len"], r["batch"], r["output_len"]
    if r["kind"] != "eviction":
        line = _line(start, ends.get((r["policy"], n)))
        if line is None:
            return None
        return batch * n / ((n - 1) * (line(p) + line(p + n - 1)) / 2)
    full_end = ends.get(("full", n)) or next((ends[k] for k in sorted(ends, reverse=True) if k[0] == "full"), None)
    line = _line(start, full_end)
    if line is None:
        return None
    grow = max(0, min(n - 1, max(p, r["budget"]) + r["window"] - p))  # steps before the first eviction
    t_grow = grow * (line(p) + line(p + grow)) / 2
    t_ss = r["step_ms"] / 1e3
    return batch * n / (t_grow + (n - 1 - grow) * t_ss)


def _ratio(r: dict, ref: str) -> float | None:
    """The ratio the targets use: CPU time when measured (load-robust), else paired rounds, else trimmed means."""
    for key in (f"ratio_vs_{ref}_cpu", f"ratio_vs_{ref}_paired", f"ratio_vs_{ref}"):
        if r.get(key) is not None:
            return r[key]
    return None


def check_targets(rows: list[dict], kvpress_ratio: float | None = None) -> list[dict]:
    """The issue's targets, evaluated on the rows of one sweep (``full`` protocol, or ``est_tok_s`` when steady).

    * ``vase_attnv`` / ``vase_dkv`` tokens/s >= 0.95x ``streaming`` at equal budget (every budget and output length);
    * at output >= 8x budget every eviction policy faster than ``full``;
    * allocated KV bytes == the static size from the config, every row;
    * peak memory growth <= 2% between outputs of 4x and 16x the budget, every eviction policy (needs both lengths).
    """
    ok = [r for r in rows if r.get("status") == "ok" and "@" not in r["policy"]]
    out = []

    def timer(ref: str) -> str:
        for suffix, label in (("cpu", "paired CPU-time"), ("paired", "paired wall-clock")):
            if any(r.get(f"ratio_vs_{ref}_{suffix}") is not None for r in ok):
                return label
        return "wall-clock" if ref == "streaming" or not any(r.get("est_tok_s") for r in ok) else "estimated"

    for name in ("vase_attnv", "vase_dkv"):
        vals = [(r["budget"], r["output_len"], _ratio(r, "streaming")) for r in ok if r["policy"] == name]
        vals = [v for v in vals if v[2] is not None]
        if vals:
            worst = min(vals, key=lambda v: v[2])
            out.append(
                dict(
                    target=f"{name} >= 0.95x streaming ({timer('streaming')} ratios)",
                    met=worst[2] >= 0.95,
                    detail=f"min ratio {worst[2]:.3f} (B={worst[0]}, N={worst[1]}); all: "
                    + ", ".join(f"{v[2]:.3f}" for v in vals),
                )
            )
    long = [r for r in ok if r["kind"] == "eviction" and r["output_len"] >= 8 * r["budget"]]
    if long and not any(r["policy"] == "full" for r in ok):
        long = []  # no full-cache row in this sweep (--policies without full): the target is not evaluated
    if long:
        slow = [r for r in long if not (_ratio(r, "full") or 0) > 1]
        worst = min(long, key=lambda r: _ratio(r, "full") or 0)
        out.append(
            dict(
                target=f"output >= 8x budget: every eviction policy faster than full ({timer('full')})",
                met=not slow,
                detail=f"min ratio {_ratio(worst, 'full') or float('nan'):.3f} ({worst['policy']}, "
                f"B={worst['budget']}, N={worst['output_len']})"
                + (f"; slower: {', '.join(r['policy'] for r in slow)}" if slow else ""),
            )
        )
    bad = [r for r in ok if r.get("kv_bytes_equal") is not True]
    out.append(
        dict(
            target="allocated KV bytes == static size",
            met=not bad and bool(ok),
            detail=f"{len(ok) - len(bad)}/{len(ok)} rows equal to the byte",
        )
    )
    growth = []
    for r in ok:
        if r["kind"] != "eviction" or r["output_len"] != 16 * r["budget"]:
            continue
        base = next(
            (
                q
                for q in ok
                if q["policy"] == r["policy"] and q["budget"] == r["budget"] and q["output_len"] == 4 * r["budget"]
            ),
            None,
        )
        if base and base.get("peak_mem_bytes") and r.get("peak_mem_bytes"):
            growth.append(
                (
                    r["policy"],
                    r["peak_mem_bytes"] / base["peak_mem_bytes"] - 1,
                    (r.get("peak_delta_bytes") or 0) - (base.get("peak_delta_bytes") or 0),
                )
            )
    if growth:
        worst = max(growth, key=lambda g: g[1])
        out.append(
            dict(
                target="peak memory growth 4x -> 16x budget <= 2%",
                met=worst[1] <= 0.02,
                detail=f"max {100 * worst[1]:+.2f}% ({worst[0]}); per policy: "
                + ", ".join(f"{g[0]} {100 * g[1]:+.2f}% ({g[2] / 2**20:+.1f} MiB)" for g in growth),
            )
        )
    if kvpress_ratio is not None:
        out.append(
            dict(
                target="snapkv >= 2x kvpress DecodingPress(SnapKVPress)",
                met=kvpress_ratio >= 2,
                detail=f"ratio {kvpress_ratio:.2f}",
            )
        )
    for t in out:
        print(f"[{'MET' if t['met'] else 'NOT MET'}] {t['target']}: {t['detail']}", flush=True)
    return out


def write_csv(rows: list[dict], path: Path) -> None:
    import csv

    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_COLUMNS, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: _fmt(r.get(k)) for k in CSV_COLUMNS})


def _fmt(v):
    if isinstance(v, float):
        return f"{v:.6g}"
    return "" if v is None else v


def plot(rows: list[dict], path_stem: Path) -> list[Path]:
    """Tokens/s against output length (one panel per budget) and peak memory at the longest output."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r.get("status") == "ok"]
    budgets = sorted({r["budget"] for r in ok if r["kind"] != "none"}) or [0]
    key = "est_tok_s" if any(r.get("protocol") == "steady" for r in ok) else "decode_tok_s"
    fig, axes = plt.subplots(len(budgets), 2, figsize=(13, 4.2 * len(budgets)), squeeze=False)
    for i, b in enumerate(budgets):
        ax, axm = axes[i]
        sel = [r for r in ok if (r["budget"] == b or r["kind"] == "none") and "@" not in r["policy"]]
        for name in sorted({r["policy"] for r in sel}):
            pts = sorted((r["output_len"], r.get(key)) for r in sel if r["policy"] == name and r.get(key))
            if pts:
                style = "--" if name in ("full", "streaming") else "-"
                ax.plot([x for x, _ in pts], [y for _, y in pts], style, marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("output tokens")
        ax.set_ylabel("decode tokens/s" + (" (estimated)" if key == "est_tok_s" else ""))
        ax.set_title(f"budget {b}" if b else "")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
        longest = max((r["output_len"] for r in sel), default=0)
        last = sorted(
            [r for r in sel if r["output_len"] == longest and r.get("peak_mem_bytes")], key=lambda r: r["policy"]
        )
        axm.barh([r["policy"] for r in last], [r["peak_mem_bytes"] / 2**20 for r in last], color="tab:gray")
        axm.barh(
            [r["policy"] for r in last],
            [r["kv_cache_bytes"] / 2**20 for r in last],
            color="tab:blue",
            label="allocated KV",
        )
        axm.set_xlabel("MiB (gray: peak memory, blue: allocated KV)")
        axm.set_title(f"memory at {longest} output tokens")
        axm.tick_params(axis="y", labelsize=7)
    fig.tight_layout()
    paths = [path_stem.with_suffix(".png"), path_stem.with_suffix(".pdf")]
    for p in paths:
        fig.savefig(p, dpi=120)
    plt.close(fig)
    return paths


def _cell(v, spec: str, width: int) -> str:
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and not (isinstance(v, float) and math.isnan(v))
    return format(format(v, spec) if ok else "-", f">{width}")


def print_table(rows: list[dict]) -> str:
    """The human-readable table: tokens/s, ratios, eviction share, KV bytes check, peak memory."""
    steady = any(r.get("protocol") == "steady" for r in rows)
    key = "est_tok_s" if steady else "decode_tok_s"
    cols = [
        ("policy", 18),
        ("budget", 7),
        ("output", 7),
        ("est tok/s" if steady else "tok/s", 10),
        ("step ms", 9),
        ("x full", 8),
        ("x strm", 8),
        ("cpu tok/s", 10),
        ("xfull cpu", 10),
        ("xstrm cpu", 10),
        ("evict%", 8),
        ("KV MiB", 9),
        ("KV=static", 10),
        ("peak MiB", 10),
        ("dpeak MiB", 10),
    ]
    hdr = "".join(name.ljust(w) if i == 0 else name.rjust(w) for i, (name, w) in enumerate(cols)) + "  status"
    lines = [hdr, "-" * len(hdr)]
    mib = lambda v: v / 2**20 if isinstance(v, (int, float)) else None
    order = lambda r: (r["budget"] if r.get("kind") != "none" else -1, r["output_len"], r["policy"])
    for r in sorted(rows, key=order):
        share = r.get("eviction_share")
        lines.append(
            f"{r['policy']:<18}{r['budget']:>7}{r['output_len']:>7}"
            + _cell(r.get(key), ".1f", 10)
            + _cell(r.get("step_ms"), ".2f", 9)
            + _cell(r.get("ratio_vs_full"), ".2f", 8)
            + _cell(r.get("ratio_vs_streaming"), ".3f", 8)
            + _cell(r.get("cpu_tok_s"), ".1f", 10)
            + _cell(r.get("ratio_vs_full_cpu"), ".3f", 10)
            + _cell(r.get("ratio_vs_streaming_cpu"), ".3f", 10)
            + _cell(100 * share if isinstance(share, float) else None, ".1f", 8)
            + _cell(mib(r.get("kv_cache_bytes")), ".2f", 9)
            + f"{str(r.get('kv_bytes_equal', '-')):>10}"
            + _cell(mib(r.get("peak_mem_bytes")), ".1f", 10)
            + _cell(mib(r.get("peak_delta_bytes")), ".1f", 10)
            + f"  {r.get('status')}"
        )
    text = "\n".join(lines)
    print(text, flush=True)
    return text


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--preset", choices=["paper14b"], help="a predefined sweep (its settings become the defaults)")
    ap.add_argument("--model", default="cpu-small", choices=list(PRESETS), help="random-weight model shape")
    ap.add_argument("--dtype", default="bfloat16", help="bfloat16 | float16 | float32")
    ap.add_argument("--device", default="auto", help="auto (cuda when available) | cpu | cuda[:i]")
    ap.add_argument("--policies", default=",".join(ALL_POLICIES), help="comma list of conf/policy names")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-lens", default="512,1024,2048", help="comma list of output lengths (EOS ignored)")
    ap.add_argument("--budgets", default="128", help="comma list of budgets (tokens per layer/row/KV head)")
    ap.add_argument("--window", type=int, default=32)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--attn-backend", default="auto", help="auto | sdpa | eager | flash_attn")
    ap.add_argument("--protocol", default="full", choices=["full", "steady"], help="see the module docstring")
    ap.add_argument("--steady-steps", type=int, default=256, help="decode steps per run with --protocol steady")
    ap.add_argument("--warmup-steps", type=int, default=0, help="decode steps of a warm-up run (0: a full run)")
    ap.add_argument(
        "--schedule",
        default="auto",
        choices=["auto", "interleaved", "sequential"],
        help="interleaved: warm-ups, then rounds of one timed run per config, all in this process, then\n"
        "a memory pass; sequential: config after config (auto: interleaved on CPU)",
    )
    ap.add_argument(
        "--isolate",
        default="auto",
        choices=["auto", "subprocess", "none"],
        help="measure memory in a fresh process per config (auto: on CPU, where peak RSS needs it)",
    )
    ap.add_argument(
        "--no-memory-pass",
        dest="memory_pass",
        action="store_false",
        help="interleaved schedule: skip the memory pass (no peak memory reported)",
    )
    ap.add_argument("--time-limit", type=float, default=0.0, help="skip the configs left after this many seconds")
    ap.add_argument(
        "--threads",
        type=int,
        default=-1,
        help="torch CPU threads (-1: 1 on CPU, torch's default on CUDA; 0: torch's default). On a shared\n"
        "CPU, OpenMP threads waiting for a descheduled sibling make small decode steps 10x slower",
    )
    ap.add_argument("--out", default=None, help="output directory (default results/bench/<model>_<time>)")
    ap.add_argument(
        "--reanalyze", default=None, metavar="DIR", help="recompute ratios/targets/CSV/plot of DIR/rows.json"
    )
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    pre, _ = ap.parse_known_args(argv)
    if pre.preset == "paper14b":  # the preset's values become the defaults; explicit options still win
        ap.set_defaults(**PAPER14B)
    args = ap.parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.threads < 0:
        args.threads = 1 if args.device == "cpu" else 0
    args.policies = [p.strip() for p in str(args.policies).split(",") if p.strip()]
    args.output_lens = [int(x) for x in str(args.output_lens).split(",")]
    args.budgets = [int(x) for x in str(args.budgets).split(",")]
    if args.protocol == "steady" and any(n < args.steady_steps for n in args.output_lens):
        ap.error("--protocol steady: every output length must be >= --steady-steps")
    return args


def run_benchmark(args) -> list[dict]:
    """Run the sweep of ``args`` (see :func:`parse_args`); write CSV, plot and machine info; return the rows."""
    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out or REPO / "results" / "bench" / f"{args.model}_{_dt.datetime.now():%Y%m%d_%H%M%S}")
    out.mkdir(parents=True, exist_ok=True)
    cpu = args.device == "cpu"
    schedule = args.schedule if args.schedule != "auto" else ("interleaved" if cpu else "sequential")
    isolate = args.isolate == "subprocess" or (args.isolate == "auto" and cpu)
    info = machine_info(args.device)
    info.update(schedule=schedule, isolate=isolate, settings={k: v for k, v in vars(args).items() if k != "worker"})
    specs = sweep_specs(args)
    for spec in specs:
        spec["threads"] = args.threads
    mem_note = ", each config in a fresh process" if isolate else ""
    if schedule == "interleaved":
        mem_note = f", memory pass{' in a fresh process per config' if isolate else ''}" if args.memory_pass else ""
    print(
        f"# {len(specs)} configs, model {args.model} {args.dtype} on {args.device}, {torch.get_num_threads()} "
        f"thread(s), schedule {schedule}{mem_note}; "
        f"load {info.get('loadavg')}",
        flush=True,
    )
    t0 = time.perf_counter()
    model = None
    if schedule == "interleaved" or not isolate:
        from vase.models import resolve_dtype

        longest = max(args.prompt_len, max(args.budgets)) + max(args.output_lens) + 1
        model = build_model(args.model, resolve_dtype(args.dtype), torch.device(args.device), args.seed, longest)

    def report(row, cost):
        v, share, peak = row.get("decode_tok_s"), row.get("eviction_share"), row.get("peak_mem_bytes")
        text = f"{v:9.1f} tok/s" if v else str(row.get("status"))
        if isinstance(share, float):
            text += f"  evict {share:.1%}"
        text += f"  KV ok={row.get('kv_bytes_equal')}"
        if peak:
            text += f"  peak {peak / 2**20:.0f} MiB"
        print(
            f"  {row['policy']:<18} B={row['budget']:<6} N={row['output_len']:<6} {text}  ({cost:.0f}s, "
            f"load {load_1m():.1f})",
            flush=True,
        )

    rows = []
    if schedule == "interleaved":
        rows = run_interleaved(specs, model, args.repeats, progress=lambda m: print(m, flush=True))
        for row in rows:
            report(row, row.get("wall_s") or 0)
        if args.memory_pass:
            print("# memory pass: one run per config" + (" in a fresh process" if isolate else ""), flush=True)
            for spec, row in zip(specs, rows):
                tc = time.perf_counter()
                mspec = dict(spec, warmup=0, repeats=1)
                m = run_isolated(mspec) if isolate else run_config(mspec, model)
                for k in ("peak_mem_bytes", "peak_delta_bytes", "peak_mem_source"):
                    row[k] = m.get(k)
                if m.get("status") == "ok":
                    row["kv_bytes_equal"] = bool(row.get("kv_bytes_equal")) and bool(m.get("kv_bytes_equal"))
                else:
                    row["peak_mem_source"] = f"memory pass: {m.get('status')}"
                report(row, time.perf_counter() - tc)
    else:
        last_cost = 0.0
        for spec in specs:
            if args.time_limit and time.perf_counter() - t0 + last_cost > args.time_limit:
                rows.append(_skipped(spec, "skipped (time limit)"))
                continue
            tc = time.perf_counter()
            try:
                row = run_isolated(spec) if isolate else run_config(spec, model)
            except Exception as err:  # noqa: BLE001 - a failed config is recorded, the sweep goes on
                row = _skipped(spec, f"error: {type(err).__name__}: {err}"[:200])
            last_cost = time.perf_counter() - tc
            rows.append(row)
            report(row, last_cost)
    if args.protocol == "steady":
        rows = add_estimates(rows, args.output_lens)
    add_ratios(rows, args.output_lens)
    write_csv(rows, out / "bench.csv")
    info["loadavg_end"] = list(os.getloadavg())
    info["wall_seconds"] = round(time.perf_counter() - t0, 1)
    (out / "machine.json").write_text(json.dumps(info, indent=2, default=str))
    (out / "rows.json").write_text(json.dumps(rows, indent=2, default=str))
    table = print_table(rows)
    (out / "table.txt").write_text(table + "\n")
    (out / "targets.json").write_text(json.dumps(check_targets(rows), indent=2))
    try:
        plot(rows, out / "bench")
    except Exception as err:  # noqa: BLE001 - the plot is a convenience; the CSV is the result
        print(f"plot failed: {err}", file=sys.stderr)
    print(
        f"# wrote {out}: bench.csv/png/pdf, machine.json, table.txt, targets.json ({time.perf_counter() - t0:.0f}s)",
        flush=True,
    )
    return rows


def _skipped(spec: dict, status: str) -> dict:
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


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        spec = json.loads(args.worker)
        if spec.get("threads"):
            torch.set_num_threads(spec["threads"])
        with contextlib.redirect_stdout(sys.stderr):
            row = run_config(spec)
        print(WORKER_TAG + json.dumps(row, default=str), flush=True)
        return 0
    if args.reanalyze:
        rows = reanalyze(Path(args.reanalyze))
    else:
        rows = run_benchmark(args)
    return 0 if all(r.get("status") == "ok" for r in rows) else 1


def reanalyze(out: Path) -> list[dict]:
    """Recompute ratios, targets, CSV, table and plot from a finished sweep's ``rows.json`` (no new measurement)."""
    rows = json.loads((out / "rows.json").read_text())
    lens = sorted({r["output_len"] for r in rows})
    add_ratios(rows, lens)
    write_csv(rows, out / "bench.csv")
    (out / "rows.json").write_text(json.dumps(rows, indent=2, default=str))
    (out / "table.txt").write_text(print_table(rows) + "\n")
    (out / "targets.json").write_text(json.dumps(check_targets(rows), indent=2))
    plot(rows, out / "bench")
    return rows


if __name__ == "__main__":
    sys.exit(main())
