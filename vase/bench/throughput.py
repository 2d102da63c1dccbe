"""Decode throughput and memory of every cache policy on a random-weight model (the paper's protocol, method.md §5).

Protocol, per (policy, budget, output length): a random prompt of ``--prompt-len`` tokens (seeded), ``--batch`` rows
decoded together (with ``--prompts K``, K random prompts from ``--prompt-len`` down to a window less, row ``i`` on
prompt ``i % K``: rows of different lengths, evicting at different steps; the ``paper14b`` preset uses 4), greedy, a
fixed output length with EOS ignored; ``--warmup`` untimed runs, then ``--repeats`` timed runs; decode tokens/s is
the mean of the repeats without their min and max (plain mean when fewer than 3 repeats). Only the decode is timed
(the decoder's ``decode_seconds``; the prefill is excluded).

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
import datetime as _dt
import json
import logging
import os
import sys
import time
from pathlib import Path

import torch

from vase.bench import REPO
from vase.bench.jobs import ALL_POLICIES, make_policy, run_config, run_interleaved, run_isolated, skipped_row
from vase.bench.measure import load_1m, machine_info
from vase.bench.report import add_estimates, add_ratios, check_targets, format_table, plot, reanalyze, write_csv
from vase.bench.shapes import PRESETS, build_model

logger = logging.getLogger(__name__)

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
    prompts=4,
)


def sweep_specs(args: argparse.Namespace) -> list[dict]:
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
        prompts=args.prompts,
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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The sweep's options (``--preset paper14b`` makes its settings the defaults; explicit options still win)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--preset", choices=["paper14b"], help="a predefined sweep (its settings become the defaults)")
    ap.add_argument("--model", default="cpu-small", choices=list(PRESETS), help="random-weight model shape")
    ap.add_argument("--dtype", default="bfloat16", help="bfloat16 | float16 | float32")
    ap.add_argument("--device", default="auto", help="auto (cuda when available) | cpu | cuda[:i]")
    ap.add_argument("--policies", default=",".join(ALL_POLICIES), help="comma list of conf/policy names")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument(
        "--prompts",
        type=int,
        default=1,
        help="different prompts per config: the rows decode prompts of the planned length and up to a window\n"
        "less (rows of different lengths, evicting at different steps); 1: every row the same prompt",
    )
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


def run_benchmark(args: argparse.Namespace) -> list[dict]:
    """Run the sweep of ``args`` (see :func:`parse_args`); write CSV, plot and machine info; return the rows."""
    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out or REPO / "results" / "bench" / f"{args.model}_{_dt.datetime.now():%Y%m%d_%H%M%S}")
    out.mkdir(parents=True, exist_ok=True)
    cpu = args.device == "cpu"
    schedule = args.schedule if args.schedule != "auto" else ("interleaved" if cpu else "sequential")
    isolate = args.isolate == "subprocess" or (args.isolate == "auto" and cpu)
    info = machine_info(args.device)
    info.update(schedule=schedule, isolate=isolate, settings=vars(args))
    specs = sweep_specs(args)
    for spec in specs:
        spec["threads"] = args.threads
    mem_note = ", each config in a fresh process" if isolate else ""
    if schedule == "interleaved":
        mem_note = f", memory pass{' in a fresh process per config' if isolate else ''}" if args.memory_pass else ""
    logger.info(
        "# %d configs, model %s %s on %s, %d thread(s), schedule %s%s; load %s",
        len(specs),
        args.model,
        args.dtype,
        args.device,
        torch.get_num_threads(),
        schedule,
        mem_note,
        info.get("loadavg"),
    )
    t0 = time.perf_counter()
    model = None
    if schedule == "interleaved" or not isolate:
        from vase.models import resolve_dtype

        longest = max(args.prompt_len, max(args.budgets)) + max(args.output_lens) + 1
        model = build_model(args.model, resolve_dtype(args.dtype), torch.device(args.device), args.seed, longest)

    def report(row: dict, cost: float) -> None:
        v, share, peak = row.get("decode_tok_s"), row.get("eviction_share"), row.get("peak_mem_bytes")
        text = f"{v:9.1f} tok/s" if v else str(row.get("status"))
        if isinstance(share, float):
            text += f"  evict {share:.1%}"
        text += f"  KV ok={row.get('kv_bytes_equal')}"
        if peak:
            text += f"  peak {peak / 2**20:.0f} MiB"
        logger.info(
            "  %-18s B=%-6s N=%-6s %s  (%.0fs, load %.1f)",
            row["policy"],
            row["budget"],
            row["output_len"],
            text,
            cost,
            load_1m(),
        )

    rows = []
    if schedule == "interleaved":
        rows = run_interleaved(specs, model, args.repeats)
        for row in rows:
            report(row, row.get("wall_s") or 0)
        if args.memory_pass:
            logger.info("# memory pass: one run per config%s", " in a fresh process" if isolate else "")
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
                rows.append(skipped_row(spec, "skipped (time limit)"))
                continue
            tc = time.perf_counter()
            try:
                row = run_isolated(spec) if isolate else run_config(spec, model)
            except Exception as err:  # noqa: BLE001 - a failed config is recorded, the sweep goes on
                row = skipped_row(spec, f"error: {type(err).__name__}: {err}"[:200])
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
    table = format_table(rows)
    logger.info("%s", table)
    (out / "table.txt").write_text(table + "\n")
    (out / "targets.json").write_text(json.dumps(check_targets(rows), indent=2))
    try:
        plot(rows, out / "bench")
    except Exception as err:  # noqa: BLE001 - the plot is a convenience; the CSV is the result
        logger.error("plot failed: %s", err)
    logger.info(
        "# wrote %s: bench.csv/png/pdf, machine.json, table.txt, targets.json (%.0fs)", out, time.perf_counter() - t0
    )
    return rows


def main(argv: list[str] | None = None) -> int:
    """``scripts/bench_throughput.py``: run the sweep (or ``--reanalyze`` one); 0 when every config ran."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    if args.reanalyze:
        rows = reanalyze(Path(args.reanalyze))
    else:
        rows = run_benchmark(args)
    return 0 if all(r.get("status") == "ok" for r in rows) else 1
