#!/usr/bin/env python
"""Where one policy's decode time goes: ``torch.profiler`` over a greedy decode on a random-weight preset model.

Prints the decode and eviction seconds of the engine and the top operators by self CPU time (the eviction profile in
scripts/BENCHMARKS.md)::

    python scripts/profile_decode.py --policy snapkv --batch 16 --prompt-len 2048 --budget 2048 --window 64 --steps 130
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from vase.bench.jobs import Job  # noqa: E402
from vase.bench.shapes import PRESETS  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--policy", default="snapkv", help="a conf/policy name")
    ap.add_argument("--model", default="cpu-small", choices=list(PRESETS))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=2048)
    ap.add_argument("--budget", type=int, default=2048)
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--steps", type=int, default=130, help="decode steps profiled (after an 8-step warm-up)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", type=int, default=25, help="operators listed")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    spec = dict(
        model=args.model, dtype=args.dtype, device=args.device, attn_backend="auto", window=args.window,
        batch=args.batch, prompt_len=args.prompt_len, warmup=0, repeats=1, seed=0, protocol="full", steady_steps=0,
        warmup_steps=None, policy=args.policy, budget=args.budget, output_len=args.steps,
    )  # fmt: skip
    job = Job(spec)  # raises one ValueError naming --policies for an unknown policy
    job.once(8)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        stats = job.once(args.steps).stats
    dec, ev = stats["decode_seconds"], stats.get("eviction_seconds") or 0.0
    share = 100 * ev / dec
    print(f"{args.policy}: decode {dec:.2f} s, eviction {ev:.2f} s ({share:.1f}%), {stats['evictions']} evictions")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))
    return 0


if __name__ == "__main__":
    from vase.run.oneline import script_main

    script_main(main)
