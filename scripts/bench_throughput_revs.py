#!/usr/bin/env python
"""scripts/bench_throughput.py at several revisions, side by side (one process per revision, started together).

A before/after of the engine on the same random-weight shapes, measured under the same machine load: each revision
runs its own ``scripts/bench_throughput.py`` in a detached ``git worktree`` (``.`` = this checkout as it is) with
``OMP_NUM_THREADS`` threads each, all at once; the model presets of *this* checkout
(:data:`vase.bench.shapes.PRESETS`) are added to an older revision's, so a shape defined after it (e.g.
``qwen3-4b-kv``) runs there too. Each revision writes ``<out>/<label>/``; the table of both is printed and saved as
``<out>/table.md``. Issue 26's eviction overhead at Qwen3-4B's layer count::

    python scripts/bench_throughput_revs.py --revs before=c21127d,after=. --out results/bench/evict36 -- \\
        --model qwen3-4b-kv --dtype float32 --device cpu --policies vase_dkv --budgets 256 --window 32 --batch 4 \\
        --prompt-len 256 --output-lens 512 --protocol steady --steady-steps 128 --repeats 1 --warmup 0 \\
        --no-memory-pass
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

#: run in a revision's checkout: this checkout's presets added to its own, then its bench_throughput as __main__
BOOT = """
import json, runpy, sys
sys.path.insert(0, sys.argv[1])
import vase.bench.shapes as shapes
for name, shape in json.loads(sys.argv[2]).items():
    shapes.PRESETS.setdefault(name, shape)
sys.argv = [sys.argv[1] + "/scripts/bench_throughput.py", *sys.argv[3:]]
runpy.run_path(sys.argv[0], run_name="__main__")
"""
COLUMNS = ("label", "rev", "policy", "budget", "step_ms", "decode_tok_s", "evictions", "eviction_share", "load_1m")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    bench_args = argv[argv.index("--") + 1 :] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--revs", required=True, help="LABEL=REV,... (REV '.' = this checkout)")
    ap.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of each process")
    ap.add_argument("--out", required=True)
    ap.add_argument("--timeout", type=float, default=7200.0)
    args = ap.parse_args(own)
    if any(a == "--out" or a.startswith("--out=") or a == "--threads" for a in bench_args):
        raise ValueError("bench_throughput_revs: --out and --threads are set per revision; leave them out after --")
    from vase.bench.shapes import PRESETS
    from vase.bench.variants import checkout, resolve_rev

    revs = []
    for item in args.revs.split(","):
        label, sep, rev = item.partition("=")
        if not sep or not label or not rev:
            raise ValueError(f"--revs: LABEL=REV,... expected, got {item!r}")
        revs.append((label, rev, resolve_rev(rev)))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONPATH": ""}
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_revs_") as tmp:
        roots = {label: checkout(rev, sha, Path(tmp)) for label, rev, sha in revs}
        procs = {}
        try:
            for label, _rev, _ in revs:
                cmd = [sys.executable, "-c", BOOT, str(roots[label]), json.dumps(PRESETS), *bench_args,
                       "--threads", str(args.threads), "--out", str((out / label).resolve())]  # fmt: skip
                log = (out / f"{label}.log").open("w")
                procs[label] = (subprocess.Popen(cmd, cwd=roots[label], env=env, stdout=log, stderr=log), log)
            for label, rev, sha in revs:
                proc, log = procs[label]
                rc = proc.wait(timeout=args.timeout)
                log.close()
                if rc != 0:
                    raise ValueError(f"revision {label}={rev}: bench_throughput exited {rc}; see {out / label}.log")
                with (out / label / "bench.csv").open() as f:
                    for r in csv.DictReader(f):
                        rows.append({"label": label, "rev": sha[:10], **{k: r.get(k, "") for k in COLUMNS[2:]}})
        finally:
            for proc, _log in procs.values():
                if proc.poll() is None:
                    proc.kill()
            for label, rev, _ in revs:
                if rev != ".":
                    subprocess.run(["git", "worktree", "remove", "--force", str(roots[label])], cwd=ROOT,
                                   capture_output=True)  # fmt: skip
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(str(r[c]) for c in COLUMNS) + " |" for r in rows]
    (out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    from vase.run.oneline import script_main

    script_main(main)
