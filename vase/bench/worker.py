"""One benchmark config in a fresh Python process: ``python -m vase.bench.worker KIND SPEC_JSON``.

A fresh process has a fresh allocator and its own peak-RSS mark, so memory freed by an earlier config but kept by the
allocator never counts; it may also be another virtual environment's Python (kvpress, vLLM), which imports only the
benchmark's own module.

``KIND`` is a key of :data:`WORKERS`, the one dispatch table: it names each worker function as ``"module:function"``
text, so this module imports no benchmark and no benchmark imports another to run its workers (a benchmark is one
module plus its row here). The result is printed as one line ``WORKER_TAG + json`` on stdout; everything else the
config prints goes to stderr.

Imports only the standard library at import time (the kvpress and vLLM venvs run it).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import subprocess
import sys
from collections.abc import Callable

from vase.bench import REPO

WORKER_TAG = "BENCH_ROW_JSON:"

#: kind -> ``"module:function"``: the function takes the spec (a JSON dict) and returns one JSON-able dict.
WORKERS: dict[str, str] = {
    "throughput": "vase.bench.jobs:run_config",  # scripts/bench_throughput.py, one config
    "ours": "vase.bench.kvpress:ours_worker",  # scripts/bench_kvpress.py, our side
    "kvpress": "vase.bench.kvpress:kvpress_worker",  # scripts/bench_kvpress.py, kvpress (its venv)
    "rows": "vase.bench.rows:flat_worker",  # scripts/bench_rows.py flat, one point
    "vllm": "vase.bench.vllm:vllm_worker",  # scripts/bench_vllm.py, vLLM's side (its venv)
}


def resolve(kind: str) -> Callable[[dict], dict]:
    """The worker function of ``kind`` (imported now: only the benchmark's own module loads)."""
    if kind not in WORKERS:
        raise ValueError(f"worker kind: unknown {kind!r}; choose one of {', '.join(WORKERS)}")
    module, name = WORKERS[kind].split(":")
    return getattr(importlib.import_module(module), name)


def run_in_process(kind: str, spec: dict) -> dict:
    """The result of one ``kind`` config, computed in this process."""
    return resolve(kind)(spec)


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
    if len(args) != 2 or args[0] not in WORKERS:
        print(f"usage: python -m vase.bench.worker {{{','.join(WORKERS)}}} SPEC_JSON", file=sys.stderr)
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
