"""Merge the shard runs of one sharded task into a single run directory with recomputed metrics.

    python run.py task=math500 task.num_shards=4 task.shard=0   # ... shard=1,2,3 (e.g. as a SLURM array)
    python scripts/merge_shards.py results/math500/qwen3_4b/vase_attnv-b1024-1a2b3c-s0

The argument is the common prefix of the shard directories (``<prefix>-shard<i>of<n>``); the merged run goes to
``<prefix>`` (``samples.jsonl``, ``throughput.jsonl``, ``config.yaml`` and ``protocol.json`` of shard 0,
``metrics.json``).
Every shard must hold the same protocol; missing shards are reported and the merged metrics say ``complete: false``.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from vase.run.records import compute_metrics  # noqa: E402
from vase.run.results import (  # noqa: E402
    SAMPLES,
    THROUGHPUT,
    append_jsonl,
    read_jsonl_tolerant,
    read_samples,
    read_throughput,
    write_json,
)


def merge(prefix: Path) -> dict:
    """Merge ``<prefix>-shard*of*`` into ``prefix``; return the merged metrics."""
    shards = sorted(prefix.parent.glob(prefix.name + "-shard*of*"))
    if not shards:
        raise SystemExit(f"error: no shard directories match {prefix}-shard*of*")
    totals = {int(re.search(r"of(\d+)$", s.name).group(1)) for s in shards}
    if len(totals) != 1:
        raise SystemExit(f"error: shard directories disagree on the number of shards: {sorted(totals)}")
    total = totals.pop()
    protocols = {s.name: json.loads((s / "protocol.json").read_text()) for s in shards}
    first = next(iter(protocols.values()))
    for name, proto in protocols.items():
        if proto != first:
            raise SystemExit(f"error: {name} has a different protocol from {shards[0].name}")
    present = {int(re.search(r"shard(\d+)of", s.name).group(1)) for s in shards}
    missing = sorted(set(range(total)) - present)
    prefix.mkdir(parents=True, exist_ok=True)
    for name, read in ((SAMPLES, read_samples), (THROUGHPUT, read_throughput)):
        (prefix / name).unlink(missing_ok=True)
        for s in shards:
            append_jsonl(prefix / name, read(s))  # a shard run by torchrun and killed: its rank parts too
    for name in ("config.yaml", "protocol.json", "manifest.json"):
        if (shards[0] / name).exists():
            (prefix / name).write_text((shards[0] / name).read_text())
    shard_metrics = [json.loads((s / "metrics.json").read_text()) for s in shards if (s / "metrics.json").exists()]
    ids = sorted({r["problem_id"] for r in read_jsonl_tolerant(prefix / SAMPLES)})
    info = (
        {k: shard_metrics[0].get(k) for k in ("policy", "task", "model", "budget", "window", "ratio")}
        if shard_metrics
        else {}
    )
    info["run_dir"] = str(prefix)
    info["shards_merged"] = sorted(present)
    expected = sum(m.get("problems_expected", 0) for m in shard_metrics)
    metrics = compute_metrics(prefix, ids, first["n_samples"], info, [1, 2, 4, 8, 16], restrict=True)
    metrics["problems_expected"] = max(expected, len(ids))
    metrics["complete"] = (
        bool(metrics.get("complete"))
        and not missing
        and len(shard_metrics) == len(shards)
        and all(m.get("complete") for m in shard_metrics)
    )
    if missing:
        metrics["missing_shards"] = missing
    write_json(prefix / "metrics.json", metrics)
    return metrics


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("prefix", type=Path, help="common prefix of the shard directories")
    m = merge(parser.parse_args().prefix)
    print(json.dumps({k: m.get(k) for k in ("problems", "samples", "accuracy", "complete", "missing_shards")}))


if __name__ == "__main__":
    main()
