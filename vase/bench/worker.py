"""One benchmark config in a fresh Python process: ``python -m vase.bench.worker KIND SPEC_JSON``.

A fresh process has a fresh allocator and its own peak-RSS mark, so memory freed by an earlier config but kept by the
allocator never counts. ``KIND`` is ``throughput`` (:func:`vase.bench.jobs.run_config`), ``ours`` or ``kvpress``
(the two sides of :mod:`vase.bench.kvpress`; ``kvpress`` runs under the kvpress venv's Python) or ``rows``
(:func:`vase.bench.rows.flat_worker`). The result is printed
as one line ``WORKER_TAG + json`` on stdout; everything else the config prints goes to stderr.

Imports only the standard library at import time (the kvpress venv runs it).
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys

from vase.bench import REPO

WORKER_TAG = "BENCH_ROW_JSON:"
KINDS = ("throughput", "ours", "kvpress", "rows")


def run_in_process(kind: str, spec: dict) -> dict:
    """The result of one ``kind`` config, computed in this process."""
    if kind == "throughput":
        from vase.bench.jobs import run_config

        return run_config(spec)
    if kind == "rows":
        from vase.bench.rows import flat_worker

        return flat_worker(spec)
    if kind in ("ours", "kvpress"):
        from vase.bench.kvpress import kvpress_worker, ours_worker

        return ours_worker(spec) if kind == "ours" else kvpress_worker(spec)
    raise ValueError(f"worker kind: unknown {kind!r}; choose one of {', '.join(KINDS)}")


def run_isolated(
    kind: str, spec: dict, python: str | None = None, timeout: float | None = None, env: dict | None = None
) -> dict:
    """Run one config in a fresh process of ``python`` (default: this interpreter), started in the repository root.

    Returns:
        the worker's result, or ``{"error": ...}`` (the timeout, or the last lines of its output).
    """
    cmd = [python or sys.executable, "-m", "vase.bench.worker", kind, json.dumps(spec)]
    try:
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"error": "timeout"}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(WORKER_TAG):
            return json.loads(line[len(WORKER_TAG) :])
    tail = (proc.stderr or proc.stdout).strip().splitlines()
    return {"error": " | ".join(tail[-3:])[:600] or f"exit {proc.returncode}"}


def main(argv: list[str] | None = None) -> int:
    """``python -m vase.bench.worker KIND SPEC_JSON``: print the result as one tagged JSON line."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or args[0] not in KINDS:
        print(f"usage: python -m vase.bench.worker {{{','.join(KINDS)}}} SPEC_JSON", file=sys.stderr)
        return 2
    spec = json.loads(args[1])
    if spec.get("threads"):
        import torch

        torch.set_num_threads(spec["threads"])
    with contextlib.redirect_stdout(sys.stderr):
        row = run_in_process(args[0], spec)
    print(WORKER_TAG + json.dumps(row, default=str), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
