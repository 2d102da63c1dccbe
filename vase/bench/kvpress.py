"""Our ``snapkv`` against kvpress's ``DecodingPress(SnapKVPress)``: same random model, same settings, same machine.

kvpress (PyPI ``kvpress``, NVIDIA) pins an older transformers than ours, so it runs from its own virtual environment;
this module drives both sides, each in a fresh process of :mod:`vase.bench.worker` (the kvpress side under the
venv's Python, which imports only this module, :mod:`~vase.bench.shapes` and :mod:`~vase.bench.measure`).

Equal settings on both sides:

* model: the same preset of :data:`vase.bench.shapes.PRESETS`, ``transformers`` ``Qwen3Config`` built from the same
  fields, random weights (``torch.manual_seed(seed)``; the two transformers versions may initialise differently,
  which does not change the speed), same dtype, ``sdpa`` attention, same number of torch threads;
* the same random prompt (:func:`vase.bench.shapes.random_prompt`: identical ids for a seed, same torch), ``--batch``
  rows, greedy decoding with EOS ignored, ``--output-len`` tokens; only the decode is timed (``output_len - 1`` forwards
  after the prefill), tokens/s = ``batch * output_len / decode seconds``, as ``scripts/bench_throughput.py``;
* kvpress: ``DecodingPress(base_press=SnapKVPress(window_size=W - 1, kernel_size=5), compression_interval=W,
  target_size=B)``: every ``W`` decode steps the cache (``DynamicCache``, which grows by concatenation) is compressed
  back to ``B`` tokens, so it oscillates between ``B`` and ``B + W`` as ours. ``SnapKVPress`` asserts that its
  observation window is shorter than the hidden states buffered since the last compression (``W``), hence ``W - 1``
  window queries (and ``W - 1`` protected recent tokens) against our ``W``;
* ours: ``conf/policy/snapkv.yaml`` with ``budget=B``, ``window=W`` through :class:`vase.bench.jobs.Job`.

Both sides run in fresh processes, ``--rounds`` times in the order ours, kvpress, kvpress, ours, ... (ABBA, so a load
drift on the shared machine hits both alike), each round ``--warmup`` untimed runs then ``--repeats`` timed runs;
tokens/s is the mean of all timed runs without their min and max. Peak memory is the process's peak RSS over the timed
runs (CPU; ``VmHWM`` reset) or CUDA max allocated.

Setup (once; torch is pinned FIRST so pip never pulls another torch build)::

    python scripts/bench_kvpress.py --setup-venv            # = the three commands below
    python -m venv /tmp/kvpress-venv
    /tmp/kvpress-venv/bin/pip install torch==2.13.0
    echo torch==2.13.0 > /tmp/kvpress-constraints.txt
    /tmp/kvpress-venv/bin/pip install -c /tmp/kvpress-constraints.txt kvpress==0.5.5

Run (the comparison recorded in scripts/BENCHMARKS.md)::

    python scripts/bench_kvpress.py --model cpu-small --batch 4 --prompt-len 128 --output-lens 512,2048 \\
        --budget 128 --window 32 --warmup 1 --repeats 3 --rounds 2 --out results/bench/kvpress_cpu_small
"""

from __future__ import annotations

import argparse
import csv
import inspect
import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from vase.bench import REPO
from vase.bench.measure import PeakMemory, load_1m, machine_info, trimmed_mean
from vase.bench.shapes import PRESETS, model_config_kwargs, random_prompt
from vase.bench.worker import run_isolated

logger = logging.getLogger(__name__)

KVPRESS_VERSION = "0.5.5"
TORCH_PIN = "torch==2.13.0"
DEFAULT_VENV = "/tmp/kvpress-venv"


def setup_venv(venv: str) -> None:
    """Create the kvpress venv: torch pinned first, then kvpress under a constraint pinning torch."""
    py = Path(venv) / "bin" / "python"
    if not py.exists():
        subprocess.run([sys.executable, "-m", "venv", venv], check=True)
    constraints = Path(venv) / "constraints.txt"
    constraints.write_text(TORCH_PIN + "\n")
    subprocess.run([str(py), "-m", "pip", "install", "-q", TORCH_PIN], check=True)
    subprocess.run(
        [str(py), "-m", "pip", "install", "-q", "-c", str(constraints), f"kvpress=={KVPRESS_VERSION}"], check=True
    )


# ---- the kvpress worker (runs inside the kvpress venv) --------------------------------------------------------
def cache_argument(model: torch.nn.Module) -> str:
    """The name of the forward's cache argument: ``cache`` in our transformers, ``past_key_values`` in older ones
    (the kvpress venv's), where ``cache`` does not exist."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def decode_greedy(
    model: torch.nn.Module,
    cache: object,
    tok: torch.Tensor,
    start: int,
    n_new: int,
    tokens: torch.Tensor | None = None,
    on_step: Callable[[int], object] | None = None,
) -> torch.Tensor:
    """The kvpress side's decode loop: ``n_new - 1`` greedy forwards after the prefill, explicit position ids.

    Args:
        tok: ``(batch,)`` the token chosen after the prefill (position ``start``).
        tokens: optional ``(batch, n_new)`` long tensor filled from column 1 (no host synchronisation per step).
        on_step: optional ``callback(i)`` after forward ``i``.

    Returns:
        ``(batch,)`` the last token.
    """
    cache_kw = cache_argument(model)
    positions = torch.arange(start, start + n_new, device=tok.device)
    for i in range(1, n_new):
        step_pos = positions[i - 1 : i].view(1, 1)
        out = model(input_ids=tok.view(-1, 1), position_ids=step_pos, use_cache=True, **{cache_kw: cache})
        tok = out.logits[:, -1].argmax(dim=-1)
        if tokens is not None:
            tokens[:, i] = tok
        if on_step is not None:
            on_step(i)
    return tok


def kvpress_worker(spec: dict) -> dict:
    """Decode with ``DecodingPress(SnapKVPress)`` on a fresh random model; return one row."""
    import kvpress
    import transformers
    from kvpress import DecodingPress, SnapKVPress
    from transformers import AutoModelForCausalLM, DynamicCache, Qwen3Config

    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    device = torch.device(spec["device"])
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[spec["dtype"]]
    p, n, batch, budget, window = (spec[k] for k in ("prompt_len", "output_len", "batch", "budget", "window"))
    config = Qwen3Config(**model_config_kwargs(spec["model"], p + n + 1))
    torch.manual_seed(spec.get("seed", 0))
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=dtype).eval()
    prompt = random_prompt(p, config.vocab_size, seed=spec.get("seed", 0)).to(device)
    press = DecodingPress(
        base_press=SnapKVPress(window_size=window - 1, kernel_size=5),
        compression_interval=window,
        target_size=budget,
    )

    @torch.inference_mode()
    def once(n_new: int) -> dict:
        cache = DynamicCache()
        ids = prompt.view(1, -1).expand(batch, -1)
        with press(model):
            t0 = time.perf_counter()
            out = model(input_ids=ids, use_cache=True, logits_to_keep=1, **{cache_argument(model): cache})
            tok = out.logits[:, -1].argmax(dim=-1)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            prefill = time.perf_counter() - t0
            tokens = torch.empty((batch, n_new), dtype=torch.long, device=device)
            tokens[:, 0] = tok
            t1, c1 = time.perf_counter(), time.process_time()
            decode_greedy(model, cache, tok, p, n_new, tokens)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            decode, cpu = time.perf_counter() - t1, time.process_time() - c1
        held = cache.get_seq_length()
        kv = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
        return dict(
            prefill_seconds=prefill,
            decode_seconds=decode,
            cpu_step_seconds=cpu / max(n_new - 1, 1),
            decode_tokens=batch * n_new,
            held=held,
            kv_bytes=kv,
        )

    for _ in range(spec["warmup"]):
        once(min(n, spec.get("warmup_steps") or n))
    runs = []
    with PeakMemory(device) as mem:
        for _ in range(spec["repeats"]):
            runs.append(once(n))
    return dict(
        side="kvpress",
        kvpress=kvpress.__version__ if hasattr(kvpress, "__version__") else KVPRESS_VERSION,
        transformers=transformers.__version__,
        torch=torch.__version__,
        threads=torch.get_num_threads(),
        tok_s_runs=[r["decode_tokens"] / r["decode_seconds"] for r in runs],
        step_ms_runs=[1e3 * r["decode_seconds"] / max(n - 1, 1) for r in runs],
        cpu_tok_s_runs=[r["decode_tokens"] / (max(n - 1, 1) * r["cpu_step_seconds"]) for r in runs]
        if device.type == "cpu"
        else [],
        held_tokens_end=runs[-1]["held"],
        kv_bytes_end=runs[-1]["kv_bytes"],
        peak_mem_bytes=mem.peak,
        peak_delta_bytes=(mem.peak - mem.baseline) if mem.baseline else None,
        peak_mem_source=mem.source,
    )


def ours_worker(spec: dict) -> dict:
    """Our ``snapkv`` through ``bench_throughput``'s machinery (a fresh process, like the kvpress side)."""
    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    bspec = dict(spec, policy="snapkv", protocol="full", attn_backend="sdpa")
    from vase.bench.jobs import Job

    job = Job(bspec)
    job.warm()
    with PeakMemory(job.device) as mem:
        for _ in range(spec["repeats"]):
            job.timed()
    job.mem = mem
    row = job.row()
    n = spec["output_len"]
    return dict(
        side="ours",
        torch=torch.__version__,
        threads=torch.get_num_threads(),
        tok_s_runs=[s["decode_tokens"] / s["decode_seconds"] for s in job.outs],
        step_ms_runs=[1e3 * s["decode_seconds"] / max(n - 1, 1) for s in job.outs],
        cpu_tok_s_runs=[s["decode_tokens"] / (max(n - 1, 1) * s["cpu_step_seconds"]) for s in job.outs]
        if all(s.get("cpu_step_seconds") for s in job.outs)
        else [],
        eviction_share=row.get("eviction_share"),
        held_tokens_mean=row.get("held_tokens"),
        kv_bytes_end=row.get("kv_cache_bytes"),
        kv_bytes_equal=row.get("kv_bytes_equal"),
        peak_mem_bytes=row.get("peak_mem_bytes"),
        peak_delta_bytes=row.get("peak_delta_bytes"),
        peak_mem_source=row.get("peak_mem_source"),
    )


def run_side(side: str, spec: dict, venv: str, timeout: float | None = None) -> dict:
    """One side (``ours`` or ``kvpress``) in a fresh process (:mod:`vase.bench.worker`); kvpress under its venv."""
    python = str(Path(venv) / "bin" / "python") if side == "kvpress" else sys.executable
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", TRANSFORMERS_VERBOSITY="error")
    out = run_isolated(side, spec, python=python, timeout=timeout, env=env)
    return dict(out, side=side) if "error" in out else out


def compare(args: argparse.Namespace) -> list[dict]:
    """Every output length of ``args``: both sides in ABBA rounds; write ``kvpress.csv`` and ``kvpress.json``."""
    venv_py = Path(args.venv) / "bin" / "python"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    info = machine_info(args.device)
    info["worker_threads"] = args.threads
    check = (
        subprocess.run(
            [
                str(venv_py),
                "-c",
                "import kvpress, transformers, torch; print(transformers.__version__, torch.__version__)",
            ],
            capture_output=True,
            text=True,
        )
        if venv_py.exists()
        else None
    )
    if check is None or check.returncode != 0:
        reason = f"kvpress venv {args.venv} missing (run --setup-venv)" if check is None else check.stderr[-500:]
        logger.error("kvpress unavailable: %s", reason)
        (out / "kvpress.json").write_text(json.dumps(dict(error=reason, machine=info), indent=2))
        return []
    info["kvpress_env"] = dict(zip(("transformers", "torch"), check.stdout.split()), kvpress=KVPRESS_VERSION)
    rows = []
    for n in args.output_lens:
        spec = dict(
            model=args.model,
            dtype=args.dtype,
            device=args.device,
            batch=args.batch,
            prompt_len=args.prompt_len,
            output_len=n,
            budget=args.budget,
            window=args.window,
            warmup=args.warmup,
            warmup_steps=args.warmup_steps,
            repeats=args.repeats,
            seed=args.seed,
            threads=args.threads,
        )
        res = {"ours": [], "kvpress": []}
        order = []
        for r in range(args.rounds):
            order += ["ours", "kvpress"] if r % 2 == 0 else ["kvpress", "ours"]
        errors = {}
        for side in order:
            if side in errors:
                continue
            t = time.perf_counter()
            got = run_side(side, spec, args.venv)
            if "error" in got:
                errors[side] = got["error"]
                logger.error("  N=%s %s: ERROR %s", n, side, got["error"])
                continue
            res[side].append(got)
            logger.info(
                "  N=%s %-8s %s tok/s  (%.0fs, load %.1f)",
                n,
                side,
                ", ".join(f"{x:.1f}" for x in got["tok_s_runs"]),
                time.perf_counter() - t,
                load_1m(),
            )
        row = dict(spec, load_1m_end=round(load_1m(), 2), errors=errors or None)
        for side in ("ours", "kvpress"):
            runs = [x for g in res[side] for x in g["tok_s_runs"]]
            steps = [x for g in res[side] for x in g["step_ms_runs"]]
            cpu = [x for g in res[side] for x in g.get("cpu_tok_s_runs", [])]
            row[f"{side}_cpu_tok_s"] = trimmed_mean(cpu) if cpu else None
            row[f"{side}_cpu_tok_s_runs"] = ";".join(f"{x:.2f}" for x in cpu)
            row[f"{side}_tok_s"] = trimmed_mean(runs) if runs else None
            row[f"{side}_tok_s_runs"] = ";".join(f"{x:.2f}" for x in runs)
            row[f"{side}_step_ms"] = trimmed_mean(steps) if steps else None
            last = res[side][-1] if res[side] else {}
            for k in (
                "peak_mem_bytes",
                "peak_delta_bytes",
                "kv_bytes_end",
                "held_tokens_end",
                "held_tokens_mean",
                "eviction_share",
                "kv_bytes_equal",
            ):
                row[f"{side}_{k}"] = last.get(k)
            if side == "kvpress" and last:
                info["kvpress_env"].update(threads=last.get("threads"))
        row["ratio_ours_vs_kvpress_cpu"] = (
            row["ours_cpu_tok_s"] / row["kvpress_cpu_tok_s"]
            if row["ours_cpu_tok_s"] and row["kvpress_cpu_tok_s"]
            else None
        )
        row["ratio_ours_vs_kvpress"] = (
            row["ours_tok_s"] / row["kvpress_tok_s"] if row["ours_tok_s"] and row["kvpress_tok_s"] else None
        )
        rows.append(row)
    info["loadavg_end"] = list(os.getloadavg())
    (out / "kvpress.json").write_text(json.dumps(dict(rows=rows, machine=info), indent=2, default=str))
    with open(out / "kvpress.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]), extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    hdr = (
        f"{'output':>7}{'ours tok/s':>12}{'kvpress tok/s':>15}{'ratio':>8}{'ratio cpu':>11}"
        f"{'ours peak MiB':>15}{'kvp peak MiB':>14}"
    )
    lines = [hdr]
    for r in rows:
        f = lambda v, s: format(v, s) if isinstance(v, (int, float)) else "-".rjust(int(s.split(".")[0]))
        mib = lambda v: v / 2**20 if isinstance(v, (int, float)) else None
        lines.append(
            f"{r['output_len']:>7}{f(r['ours_tok_s'], '12.1f')}{f(r['kvpress_tok_s'], '15.1f')}"
            f"{f(r['ratio_ours_vs_kvpress'], '8.2f')}{f(r['ratio_ours_vs_kvpress_cpu'], '11.2f')}"
            f"{f(mib(r['ours_peak_mem_bytes']), '15.1f')}{f(mib(r['kvpress_peak_mem_bytes']), '14.1f')}"
        )
    logger.info("%s", "\n".join(lines))
    logger.info("# wrote %s/kvpress.csv, kvpress.json", out)
    return rows


def main(argv: list[str] | None = None) -> int:
    """``scripts/bench_kvpress.py``: compare both sides (or ``--setup-venv``); 0 when every length has a ratio."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--setup-venv", action="store_true", help="create the kvpress venv (torch pinned first) and exit")
    ap.add_argument("--venv", default=DEFAULT_VENV)
    ap.add_argument("--model", default="cpu-small", choices=list(PRESETS))
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--device", default="auto")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-lens", default="512,2048")
    ap.add_argument("--budget", type=int, default=128)
    ap.add_argument("--window", type=int, default=32)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--warmup-steps", type=int, default=0, help="decode steps of a warm-up run (0: a full run)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2, help="fresh-process rounds per side, in ABBA order")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=-1, help="torch threads (-1: 1 on CPU, default on CUDA)")
    ap.add_argument("--out", default=str(REPO / "results" / "bench" / "kvpress"))
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    if args.setup_venv:
        setup_venv(args.venv)
        return 0
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.threads < 0:
        args.threads = 1 if args.device == "cpu" else 0
    args.output_lens = [int(x) for x in args.output_lens.split(",")]
    rows = compare(args)
    return 0 if rows and all(r["ratio_ours_vs_kvpress"] for r in rows) else 1
