"""Whole processes as benchmark runs: spawn one with its threads and measure it; read a ``run.py`` run directory.

Shared by :mod:`vase.bench.vllm` (vLLM against ``run.py``) and :mod:`vase.bench.variants` (``run.py`` at several
revisions and settings). Every run is a fresh process, in ABBA order (:func:`abba`), with its own
``OMP_NUM_THREADS`` (:func:`thread_env`); its peak resident set size comes from ``wait4`` on it (:func:`spawn`), the
same measurement whatever runs inside.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from vase.schema import Unparseable, check_sample, loads


def abba(items: list, rounds: int) -> list[tuple[int, object]]:
    """``(round, item)`` in ABBA order: the listed order in even rounds, reversed in odd ones."""
    return [(r, x) for r in range(rounds) for x in (items if r % 2 == 0 else list(reversed(items)))]


def thread_env(threads: int, base: dict | None = None) -> dict:
    """``base`` (default: this environment) with ``threads`` OpenMP/MKL threads, the hub offline, W&B disabled."""
    n = str(threads)
    return dict(
        os.environ if base is None else base,
        OMP_NUM_THREADS=n,
        MKL_NUM_THREADS=n,
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        WANDB_MODE="disabled",
        TOKENIZERS_PARALLELISM="false",
    )


def spawn(cmd: list[str], env: dict, cwd: Path, timeout: float, log: Path) -> dict:
    """Run ``cmd`` to completion (killed after ``timeout`` s), stderr into ``log``.

    Returns:
        ``{"rc", "seconds", "peak_rss", "stdout"}``; ``peak_rss`` in bytes (``ru_maxrss`` of ``wait4`` on it).
    """
    with open(log, "w") as err, tempfile.TemporaryFile("w+") as out:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=err, text=True)
        timer = threading.Timer(timeout, proc.kill)
        timer.start()
        try:
            _, status, usage = os.wait4(proc.pid, 0)
        finally:
            timer.cancel()
        proc.returncode = os.waitstatus_to_exitcode(status)
        seconds = time.perf_counter() - t0
        out.seek(0)
        text = out.read()
    return dict(rc=proc.returncode, seconds=seconds, peak_rss=usage.ru_maxrss * 1024, stdout=text)


def last_line(log: Path) -> str:
    """The last non-empty line of a log (a failed run's one-line reason)."""
    lines = [x for x in log.read_text(errors="replace").splitlines() if x.strip()] if log.exists() else []
    return lines[-1].strip()[:300] if lines else ""


def _jsonl(path: Path) -> list[dict]:
    """The lines of a JSONL file a benchmark's run wrote (:func:`vase.schema.loads`: bounded nesting); a line that is
    not JSON vase writes is a one-line ``ValueError`` naming the file and the line."""
    if not path.exists():
        return []
    rows = []
    for i, x in enumerate(path.read_bytes().split(b"\n"), 1):
        if x.strip():
            try:
                rows.append(loads(x))
            except (Unparseable, json.JSONDecodeError, UnicodeDecodeError) as err:
                raise ValueError(f"{path}: line {i} is not a line vase writes ({' '.join(str(err).split())})") from None
    return rows


def read_run(results: Path) -> dict:
    """The one run directory under ``results`` (a ``run.py`` ``results_dir``): its numbers.

    Keys: ``run_dir``, ``metrics`` (``metrics.json``), ``manifest``, and from ``throughput.jsonl`` the totals
    ``tokens``, ``prefills``, ``prefill_s`` (sum of the prefill forwards), ``decode_s``; from ``samples.jsonl``
    ``samples``, ``prompt_tokens`` (problem id -> prompt tokens) and ``finish_reasons`` (reason -> count).
    Raises ``ValueError`` when there is not exactly one complete run directory.
    """
    found = sorted(results.rglob("metrics.json"))
    if len(found) != 1:
        raise ValueError(f"{results}: expected one run directory with metrics.json, found {len(found)}")
    run_dir = found[0].parent
    lines = _jsonl(run_dir / "throughput.jsonl")
    samples = _jsonl(run_dir / "samples.jsonl")
    for i, row in enumerate(samples, 1):  # the one schema every reader of sample lines applies (vase.schema)
        check_sample(row, run_dir / "samples.jsonl", i, for_metrics=True)
    reasons: dict[str, int] = {}
    for s in samples:
        reasons[s["finish_reason"]] = reasons.get(s["finish_reason"], 0) + 1
    manifest = run_dir / "manifest.json"
    return dict(
        run_dir=str(run_dir),
        metrics=loads(found[0].read_bytes()),
        manifest=loads(manifest.read_bytes()) if manifest.exists() else {},
        tokens=sum(x["tokens"] for x in lines),
        prefills=sum(x["prefills"] for x in lines),
        prefill_s=sum(x["prefill_seconds"] for x in lines),
        decode_s=sum(x["decode_seconds"] for x in lines),
        samples=len(samples),
        prompt_tokens={s["problem_id"]: s["prompt_tokens"] for s in samples},
        finish_reasons=reasons,
    )


def write_csv(rows: list[dict], path: Path, skip: tuple[str, ...] = ()) -> None:
    """One CSV row per dict (columns in order of first appearance; nested values as JSON)."""
    import csv

    cols: list[str] = []
    for r in rows:
        cols += [k for k in r if k not in cols and k not in skip]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: json.dumps(v) if isinstance(v, dict | list) else v for k, v in r.items()})


def markdown(rows: list[dict], cols: list[str]) -> str:
    """``rows`` as a Markdown table of ``cols`` (floats with 2 decimals, ``peak_rss`` in GiB, ``pass@1`` in %)."""
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for line in rows:
        cells = []
        for c in cols:
            v = line.get(c)
            if c == "peak_rss" and v is not None:
                v = f"{v / 2**30:.2f} GiB"
            elif c == "pass_at_1" and v is not None:
                v = f"{100 * v:.1f} %"
            elif isinstance(v, float):
                v = f"{v:.2f}"
            cells.append("–" if v is None else str(v))
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)
