"""Tok/s against rows at equal KV memory on one GPU: a Qwen3-4B-shaped random model at a 16K context, vase_dkv
against the full cache (the claim of every eviction method: a 4x smaller cache lets ~4x the sequences share the
memory). Entry point ``scripts/gpu_bench_rows.py``; sized to finish in under 8 minutes on an 80-141 GB GPU.

Protocol (steady state, so that a 16K context does not need 16K decode steps per point):

* every point is one KV-memory level ``M``: the full cache gets ``M // row_bytes(full)`` rows whose capacity is the
  16K context plus the timed steps; ``vase_dkv`` at ratio 4 (budget 4096, window 64) gets ``M // row_bytes(vase_dkv)``
  rows of ``budget + window`` slots — the static sizes of a real 16K-output run (``vase.engine.memory.plan_rows``);
* the full cache is prefilled with a 16K-token prompt (it then holds what a 16K-output run holds at its end); the
  eviction policy is prefilled with ``budget`` tokens, so it holds what it holds at any point of a long run (between
  ``budget`` and ``budget + window``, evicting every ``window`` steps; the per-step cost does not depend on the
  absolute position);
* then ``--steps`` greedy decode steps are timed (EOS ignored), after ``--warmup`` untimed steps: wall time from the
  end of the warm-up (the device synchronised) to the end of the decode; tok/s = rows x steps / seconds.

``--dry-run`` runs the same code on the CPU with a tiny model and small sizes (checks the script).
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

import torch

from vase.bench.measure import machine_info
from vase.bench.shapes import build_model, random_prompt

logger = logging.getLogger(__name__)


def _point(model, policy, prompt_len: int, rows: int, steps: int, warmup: int, vocab: int, seed: int) -> dict:
    from vase.engine import Decoder, Request, SamplingConfig, cache_capacity, sample_seeds

    prompt = random_prompt(prompt_len, vocab, seed=seed)
    total = warmup + steps
    dec = Decoder(
        model,
        policy,
        rows=rows,
        capacity=cache_capacity(policy, prompt_len, total + 1),
        sampling=SamplingConfig(temperature=0),
        max_new_tokens=total + 1,
        ignore_eos=True,
    )
    marks: dict = {}

    def on_step(info):
        if info.step == warmup:
            if dec.device.type == "cuda":
                torch.cuda.synchronize(dec.device)
            marks["t"] = time.perf_counter()

    dec.on_step = on_step
    if dec.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dec.device)
    t0 = time.perf_counter()
    done = list(dec.run([Request(prompt, sample_seeds(seed, rows))]))
    if dec.device.type == "cuda":
        torch.cuda.synchronize(dec.device)
    seconds = time.perf_counter() - marks.get("t", t0)  # from the end of the warm-up (synchronised) to the end
    return {
        "rows": rows,
        "capacity": dec.geometry.capacity,
        "kv_allocated_gib": dec.cache.kv_bytes() / 2**30,
        "timed_steps": steps,
        "timed_seconds": seconds,
        "tok_s": rows * steps / seconds if seconds > 0 else float("nan"),
        "prefill_seconds": dec.stats.prefill_seconds,
        "evictions": dec.cache.evictions(),
        "peak_gib": torch.cuda.max_memory_allocated(dec.device) / 2**30 if dec.device.type == "cuda" else None,
        "samples": len(done),
    }


def run(args: argparse.Namespace) -> dict:
    from vase.bench.jobs import make_policy
    from vase.engine import cache_capacity, model_geometry, plan_rows

    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    model = build_model(args.model, dtype, device, seed=0, max_tokens=args.context + args.steps + args.warmup + 8)
    vocab = model.config.vocab_size
    policies = {
        "full": make_policy("full", args.budget, args.window),
        args.policy: make_policy(args.policy, args.budget, args.window),
    }
    prompts = {"full": args.context, args.policy: args.budget}
    table, t_start = [], time.perf_counter()
    for mem_gib in [float(x) for x in args.kv_memory_gib.split(",")]:
        for name, policy in policies.items():
            if args.time_limit and time.perf_counter() - t_start > args.time_limit:
                table.append({"kv_memory_gib": mem_gib, "policy": name, "skipped": "time limit"})
                continue
            total = args.warmup + args.steps + 1
            cap = cache_capacity(policy, prompts[name], total)
            plan = plan_rows(model_geometry(model, 1, cap), policy, kv_memory=int(mem_gib * 2**30))
            try:
                row = _point(model, policy, prompts[name], plan.rows, args.steps, args.warmup, vocab, seed=1)
            except torch.OutOfMemoryError:
                row = {"rows": plan.rows, "error": "OOM"}
                torch.cuda.empty_cache()
            row.update(kv_memory_gib=mem_gib, policy=name, row_mib=plan.row_bytes / 2**20)
            logger.info("%s", json.dumps(row, default=str))
            table.append(row)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    for mem in {r["kv_memory_gib"] for r in table}:
        pair = {r["policy"]: r for r in table if r["kv_memory_gib"] == mem}
        full, other = pair.get("full", {}), pair.get(args.policy, {})
        if full.get("tok_s") and other.get("tok_s"):
            other["vs_full"] = other["tok_s"] / full["tok_s"]
    return {
        "settings": vars(args),
        "machine": machine_info(str(device)),
        "table": table,
        "seconds": time.perf_counter() - t_start,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--model", default="qwen3-4b-shape")
    ap.add_argument("--policy", default="vase_dkv")
    ap.add_argument("--context", type=int, default=16384, help="the full cache's held tokens (output length)")
    ap.add_argument("--budget", type=int, default=4096, help="ratio 4 of the context")
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--kv-memory-gib", default="20,40,80", help="the equal-memory levels")
    ap.add_argument("--steps", type=int, default=128, help="timed decode steps per point")
    ap.add_argument("--warmup", type=int, default=16)
    ap.add_argument("--time-limit", type=float, default=420.0, help="skip the points left after this many seconds")
    ap.add_argument("--dry-run", action="store_true", help="tiny model on CPU (checks the script)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.dry_run:
        args.device, args.dtype, args.model = "cpu", "float32", "tiny"
        args.context, args.budget, args.window, args.steps, args.warmup = 256, 64, 16, 24, 4
        args.kv_memory_gib, args.time_limit = "0.0005,0.001", 0
    result = run(args)
    text = json.dumps(result, indent=2, default=str)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "result.json").write_text(text + "\n")
    print(text)
    return 0
