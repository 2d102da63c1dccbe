#!/usr/bin/env python
"""Where kvpress spends its decode time: ms/step per 64-step block, with and without its press.

Runs inside the kvpress venv (see ``scripts/bench_kvpress.py --setup-venv``); the same random model, prompt and loop as
``bench_kvpress.py``'s kvpress worker. ``--mode press`` decodes under ``DecodingPress(SnapKVPress)`` (the cache
oscillates between the budget and budget + 63), ``--mode nopress`` with a plain growing ``DynamicCache`` (prompt + N
held at the end). The difference is the cost of the press: its compressions and per-step hooks.

    /tmp/kvpress-venv/bin/python scripts/kvpress_step_profile.py --mode press
    /tmp/kvpress-venv/bin/python scripts/kvpress_step_profile.py --mode nopress
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
# vase.bench.kvpress and vase.bench.shapes import only the standard library and torch (this runs in the kvpress venv)
from vase.bench.kvpress import cache_argument, decode_greedy  # noqa: E402
from vase.bench.shapes import PRESETS, model_config_kwargs, random_prompt  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mode", choices=["press", "nopress"], default="press")
    ap.add_argument("--model", default="cpu-small", choices=list(PRESETS))
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--budget", type=int, default=2048, help="also the prompt length")
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=512)
    ap.add_argument("--runs", type=int, default=2, help="the first one warms up")
    args = ap.parse_args()

    from kvpress import DecodingPress, SnapKVPress
    from transformers import AutoModelForCausalLM, DynamicCache, Qwen3Config

    torch.set_num_threads(1)
    p, n, batch = args.budget, args.output_len, args.batch
    config = Qwen3Config(**model_config_kwargs(args.model, p + n + 1))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.bfloat16).eval()
    prompt = random_prompt(p, config.vocab_size, seed=0)
    press = DecodingPress(
        base_press=SnapKVPress(window_size=args.window - 1, kernel_size=5),
        compression_interval=args.window,
        target_size=args.budget,
    )
    for run in range(args.runs):
        cache = DynamicCache()
        ids = prompt.view(1, -1).expand(batch, -1)
        with torch.inference_mode(), press(model) if args.mode == "press" else contextlib.nullcontext():
            out = model(input_ids=ids, use_cache=True, logits_to_keep=1, **{cache_argument(model): cache})
            tok = out.logits[:, -1].argmax(-1)
            marks = [time.perf_counter()]
            decode_greedy(model, cache, tok, p, n, on_step=lambda i, m=marks: i % 64 or m.append(time.perf_counter()))
            blocks = [(b - a) / 64 * 1e3 for a, b in zip(marks, marks[1:])]
        print(
            f"run {run} mode {args.mode}: held {cache.get_seq_length()} at the end; ms/step per 64-step block: "
            + " ".join(f"{b:.0f}" for b in blocks),
            flush=True,
        )


if __name__ == "__main__":
    from vase.run.oneline import script_main

    script_main(main)
