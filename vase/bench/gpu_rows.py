"""Tok/s against rows at equal KV memory on one GPU: a Qwen3-4B-shaped random model at a 16K context, vase_dkv
against the full cache (the claim of every eviction method: a 4x smaller cache lets ~4x the sequences share the
memory). Entry point ``scripts/gpu_bench_rows.py``; sized to finish in under 8 minutes on an 80-141 GB GPU.

Protocol (steady state, so that a 16K context does not need 16K decode steps per point):

* every point is one KV-memory level ``M``: the full cache gets ``M // row_bytes(full)`` rows whose capacity is the
  16K context plus the decoded steps; ``vase_dkv`` at ratio 4 (budget 4096, window 64) gets ``M // row_bytes(vase_dkv)``
  rows of ``budget + window`` slots — the static sizes of a real 16K-output run (``vase.engine.plan_rows``);
* rows decode ``--prompts`` different prompts (:func:`staggered_lengths`), never one prompt in lockstep: the full
  cache's prompts are spread over ``[(1 - stagger) * context, context]`` tokens (rows of different lengths: every
  step masks each row to its own tokens), the eviction policy's over ``(budget - window, budget]`` (rows reach
  ``budget + window`` and evict at ``--prompts`` different phases of the window: scattered eviction groups);
  row ``i`` decodes prompt ``i % prompts``;
* then ``--steps`` greedy decode steps are timed (EOS ignored), after ``--warmup`` untimed steps (default one
  window, so that every row of the eviction policy has evicted before the timing): wall time from the end of the
  warm-up (the device synchronised) to the end of the decode; tok/s = rows x steps / seconds.

``--dry-run`` runs the same code on the CPU with a tiny model and small sizes (checks the script).
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

import torch

from vase.bench.measure import TimeCap, deadline_hook, machine_info
from vase.bench.shapes import build_model, staggered_requests

logger = logging.getLogger(__name__)


def staggered_lengths(kind: str, *, prompts: int, context: int, budget: int, window: int, stagger: float) -> list[int]:
    """Prompt lengths of one point, longest first (see the module docstring).

    ``kind`` ``eviction``: ``budget - j * (window // prompts)`` (all within one window below the budget, so the
    capacity stays ``budget + window``); otherwise ``context`` down to ``(1 - stagger) * context``, evenly spaced.
    """
    if prompts < 1:
        raise ValueError(f"--prompts: must be >= 1, got {prompts}")
    if kind == "eviction":
        step = max(1, window // prompts)
        out = [budget - j * step for j in range(prompts)]
    else:
        span = int(stagger * context)
        out = [context - (j * span) // max(prompts - 1, 1) for j in range(prompts)]
    if min(out) < 1:
        raise ValueError(f"staggered prompts: lengths {out} (lower --prompts or --stagger)")
    return out


def point(
    model,
    policy,
    lengths: list[int],
    rows: int,
    steps: int,
    warmup: int,
    seed: int = 1,
    deadline: float | None = None,
) -> dict:
    """One timed point: ``rows`` rows over the prompts of ``lengths``, ``warmup`` + ``steps`` greedy decode steps."""
    from vase.engine import Decoder, SamplingConfig, cache_capacity

    total = warmup + steps
    lengths = lengths[:rows]  # the prompts the rows decode (fewer rows than prompts: the longest ones)
    dec = Decoder(
        model,
        policy,
        rows=rows,
        capacity=cache_capacity(policy, max(lengths), total + 1),
        sampling=SamplingConfig(temperature=0),
        max_new_tokens=total + 1,
        ignore_eos=True,
    )
    marks: dict = {"evict_steps": 0, "staggered": 0}

    def on_step(info) -> None:
        if info.step == warmup:
            if dec.device.type == "cuda":
                torch.cuda.synchronize(dec.device)
            marks["t"] = time.perf_counter()
        if info.evicted_rows:
            marks["evict_steps"] += 1
            marks["staggered"] += len(info.evicted_rows) < info.active_rows

    dec.on_step = deadline_hook(deadline, on_step)
    if dec.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dec.device)
    t0 = time.perf_counter()
    done = list(dec.run(staggered_requests(lengths, rows, model.config.vocab_size, seed)))
    if dec.device.type == "cuda":
        torch.cuda.synchronize(dec.device)
    seconds = time.perf_counter() - marks.get("t", t0)  # from the end of the warm-up (synchronised) to the end
    return {
        "rows": rows,
        "prompt_lens": lengths,
        "capacity": dec.geometry.capacity,
        "kv_allocated_gib": dec.cache.kv_bytes() / 2**30,
        "timed_steps": steps,
        "timed_seconds": seconds,
        "tok_s": rows * steps / seconds if seconds > 0 else float("nan"),
        "prefill_seconds": dec.stats.prefill_seconds,
        "evictions": dec.cache.evictions(),
        "eviction_steps": marks["evict_steps"],
        "staggered_eviction_steps": marks["staggered"],
        "peak_gib": torch.cuda.max_memory_allocated(dec.device) / 2**30 if dec.device.type == "cuda" else None,
        "samples": len(done),
        "nonfinite_samples": sum(f.finish_reason == "nonfinite" for f in done),
    }


def equal_memory(model, args: argparse.Namespace, deadline: float | None = None, progress=logger.info) -> list[dict]:
    """Every (memory level, policy) point of ``args`` (``full`` and ``args.policy``); skipped once ``deadline``
    would pass (the last point's cost is the estimate of the next one's)."""
    from vase.bench.jobs import make_policy
    from vase.engine import cache_capacity, model_geometry, plan_rows

    device = next(model.parameters()).device
    policies = {name: make_policy(name, args.budget, args.window) for name in ("full", args.policy)}
    table, last_cost = [], 0.0
    for mem_gib in [float(x) for x in str(args.kv_memory_gib).split(",")]:
        for name, policy in policies.items():
            if deadline is not None and time.perf_counter() + last_cost > deadline:
                table.append({"kv_memory_gib": mem_gib, "policy": name, "skipped": "time cap"})
                continue
            t = time.perf_counter()
            lengths = staggered_lengths(
                policy.kind,
                prompts=args.prompts,
                context=args.context,
                budget=args.budget,
                window=args.window,
                stagger=args.stagger,
            )
            total = args.warmup + args.steps + 1
            cap = cache_capacity(policy, max(lengths), total)
            plan = plan_rows(model_geometry(model, 1, cap), policy, kv_memory=int(mem_gib * 2**30))
            try:
                row = point(model, policy, lengths, plan.rows, args.steps, args.warmup, deadline=deadline)
            except torch.OutOfMemoryError:
                row = {"rows": plan.rows, "error": "OOM"}
            except TimeCap as err:
                row = {"rows": plan.rows, "skipped": str(err)}
            row.update(kv_memory_gib=mem_gib, policy=name, row_mib=plan.row_bytes / 2**20)
            progress(json.dumps(row, default=str))
            table.append(row)
            if device.type == "cuda":
                torch.cuda.empty_cache()
            last_cost = time.perf_counter() - t
    for mem in {r["kv_memory_gib"] for r in table}:
        pair = {r["policy"]: r for r in table if r["kv_memory_gib"] == mem}
        full, other = pair.get("full", {}), pair.get(args.policy, {})
        if full.get("tok_s") and other.get("tok_s"):
            other["vs_full"] = other["tok_s"] / full["tok_s"]
    return table


def run(args: argparse.Namespace) -> dict:
    """``scripts/gpu_bench_rows.py``: build the model, run :func:`equal_memory`."""
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    t_start = time.perf_counter()
    model = build_model(args.model, dtype, device, seed=0, max_tokens=args.context + args.steps + args.warmup + 8)
    deadline = t_start + args.time_limit if args.time_limit else None
    table = equal_memory(model, args, deadline)
    return {
        "settings": vars(args),
        "machine": machine_info(str(device)),
        "table": table,
        "seconds": time.perf_counter() - t_start,
    }


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The options of the equal-memory sweep (shared with ``scripts/gpu_smoke.sh``)."""
    ap.add_argument("--policy", default="vase_dkv")
    ap.add_argument("--context", type=int, default=16384, help="the full cache's longest held prompt")
    ap.add_argument("--budget", type=int, default=4096, help="ratio 4 of the context")
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--kv-memory-gib", default="20,40,80", help="the equal-memory levels")
    ap.add_argument("--prompts", type=int, default=4, help="different prompts per point (rows of different lengths)")
    ap.add_argument("--stagger", type=float, default=0.5, help="full cache: shortest prompt = (1 - stagger) context")
    ap.add_argument("--steps", type=int, default=128, help="timed decode steps per point")
    ap.add_argument("--warmup", type=int, default=64, help="untimed decode steps first (>= window: rows evicted)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--model", default="qwen3-4b-shape")
    add_arguments(ap)
    ap.add_argument("--time-limit", type=float, default=420.0, help="skip the points left after this many seconds")
    ap.add_argument("--dry-run", action="store_true", help="tiny model on CPU (checks the script)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.dry_run:
        args.device, args.dtype, args.model = "cpu", "float32", "tiny"
        args.context, args.budget, args.window, args.steps, args.warmup = 256, 64, 16, 24, 16
        args.kv_memory_gib, args.time_limit = "0.0005,0.001", 0
    result = run(args)
    text = json.dumps(result, indent=2, default=str)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "result.json").write_text(text + "\n")
    print(text)
    return 0
