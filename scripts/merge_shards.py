"""Merge the shard runs of one sharded task into a single run directory with recomputed metrics.

    python run.py task=math500 task.num_shards=4 task.shard=0   # ... shard=1,2,3 (e.g. as a SLURM array)
    python scripts/merge_shards.py results/math500/qwen3_4b/vase_attnv-b1024-1a2b3c-s0

The argument is the common prefix of the shard directories (``<prefix>-shard<i>of<n>``); the merged run goes to
``<prefix>``, the directory an unsharded run of the same protocol uses. Nothing computed is ever lost there:

* every shard must hold the same protocol, and a ``<prefix>`` that already holds a run must hold that protocol too
  (and the same data); anything else (another protocol, a directory that is not a vase run, a shard or the target
  being written right now) is refused in one line, exit code 2, before anything is written;
* ``samples.jsonl`` of ``<prefix>`` is only appended to: the samples it holds stay as they are (e.g. an unsharded run
  of a larger ``limit``), and each shard sample it does not hold yet, keyed by (problem, sample), is added. A sample is
  the same whatever limit or sharding produced it (it is seeded by its problem's id), so the union is the run. A
  shard (or the target) run by ``torchrun`` and killed holds part of its samples in rank part files (``ranks/``):
  they are read with its ``samples.jsonl`` (:func:`vase.run.results.read_samples`); the target's own parts stay where
  they are, for its run to fold in when it resumes;
* ``throughput.jsonl`` keeps ``<prefix>``'s own lines and gets each shard's lines (its parts' too), tagged
  ``merged_from``;
  ``config.yaml``, ``protocol.json``, ``manifest.json`` come from shard 0 when ``<prefix>`` has none;
* ``metrics.json`` is recomputed over every sample of ``<prefix>``; missing shards are reported and make it say
  ``complete: false``.

The merge holds ``<prefix>``'s writer's lock (:func:`vase.run.rundir.lock_run_dir`), and rerunning it after a shard
grew adds only the new samples.
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
    PROTOCOL,
    RESOLVED,
    SAMPLES,
    THROUGHPUT,
    append_jsonl,
    check_resolved,
    diff_protocol,
    read_json,
    read_samples,
    read_throughput,
    read_throughput_file,
    write_json,
)
from vase.run.rundir import check_run_dir, lock_run_dir, probe_lock  # noqa: E402


def merge(prefix: Path) -> dict:
    """Merge ``<prefix>-shard*of*`` into ``prefix`` (see the module docstring); return the merged metrics.

    Raises:
        ValueError: one line, before anything is written, for anything the merge would have to overwrite or drop.
    """
    prefix = Path(prefix)
    shards = sorted(
        (s for s in prefix.parent.glob(prefix.name + "-shard*of*") if re.search(r"-shard\d+of\d+$", s.name)),
        key=lambda s: int(re.search(r"shard(\d+)of", s.name).group(1)),
    )
    if not shards:
        raise ValueError(f"{prefix}: no shard directories match {prefix.name}-shard<i>of<n>; give the common prefix")
    totals = {int(re.search(r"of(\d+)$", s.name).group(1)) for s in shards}
    if len(totals) != 1:
        raise ValueError(f"{prefix}: the shard directories disagree on the number of shards ({sorted(totals)})")
    total = totals.pop()
    for s in shards:
        if not (s / PROTOCOL).is_file():
            raise ValueError(f"{s}: no {PROTOCOL}, so not a finished or started shard run; rerun that shard first")
        probe_lock(s)  # a shard still being written
    protocols = {s.name: read_json(s / PROTOCOL) for s in shards}
    first = protocols[shards[0].name]
    for name, proto in protocols.items():
        if proto != first:
            diffs = "; ".join(diff_protocol(first, proto))
            raise ValueError(f"{prefix.parent / name}: a different protocol from {shards[0].name} ({diffs})")
    check_run_dir(prefix, "the merge target")
    if (prefix / PROTOCOL).is_file():
        diffs = diff_protocol(read_json(prefix / PROTOCOL), first)
        if diffs:
            raise ValueError(
                f"{prefix}: already holds a run with another protocol ({'; '.join(diffs)}); nothing was merged, "
                "nothing changed. Merge into another directory: copy the shards to their own prefix"
            )
    # each shard's samples.jsonl and, for a shard run by torchrun and killed, its rank part files (the union)
    shard_rows = {s.name: read_samples(s, for_metrics=True) for s in shards}
    held = read_samples(prefix, for_metrics=True)  # validated before anything is written
    for s in shards:
        if (s / RESOLVED).is_file():
            check_resolved(prefix, read_json(s / RESOLVED), write=False)

    with lock_run_dir(prefix):
        for s in shards:  # under the lock: the data of every shard agrees with the target's, then it is recorded
            if (s / RESOLVED).is_file():
                check_resolved(prefix, read_json(s / RESOLVED))
        for name in (PROTOCOL, "config.yaml", "manifest.json"):
            if not (prefix / name).exists() and (shards[0] / name).exists():
                (prefix / name).write_bytes((shards[0] / name).read_bytes())
        # with the target's own rank parts, if a torchrun run there was killed
        held = read_samples(prefix, repair=True, for_metrics=True)
        have = {(r["problem_id"], r["sample"]) for r in held}
        new = []
        for s in shards:
            for r in shard_rows[s.name]:
                if (r["problem_id"], r["sample"]) not in have:
                    have.add((r["problem_id"], r["sample"]))
                    new.append(r)
        append_jsonl(prefix / SAMPLES, new)  # appended: what the target held stays, byte for byte
        own = [r for r in read_throughput_file(prefix / THROUGHPUT, repair=True) if "merged_from" not in r]
        merged = [{**r, "merged_from": s.name} for s in shards for r in read_throughput(s)]
        tmp = prefix / (THROUGHPUT + ".tmp")
        tmp.unlink(missing_ok=True)
        append_jsonl(tmp, own + merged)
        tmp.replace(prefix / THROUGHPUT)
        return _metrics(prefix, shards, total, first)


def _metrics(prefix: Path, shards: list[Path], total: int, protocol: dict) -> dict:
    present = {int(re.search(r"shard(\d+)of", s.name).group(1)) for s in shards}
    missing = sorted(set(range(total)) - present)
    shard_metrics = [read_json(s / "metrics.json") for s in shards if (s / "metrics.json").exists()]
    ids = sorted({r["problem_id"] for r in read_samples(prefix)})
    keys = ("policy", "task", "model", "budget", "window", "ratio")
    info = {k: shard_metrics[0].get(k) for k in keys} if shard_metrics else {}
    info["run_dir"] = str(prefix)
    info["shards_merged"] = sorted(present)
    expected = sum(m.get("problems_expected", 0) for m in shard_metrics)
    metrics = compute_metrics(prefix, ids, protocol["n_samples"], info, [1, 2, 4, 8, 16], restrict=True)
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
    try:
        m = merge(parser.parse_args().prefix)
    except ValueError as err:
        print(f"error: {' '.join(str(err).split())}", file=sys.stderr)
        sys.exit(2)
    print(json.dumps({k: m.get(k) for k in ("problems", "samples", "accuracy", "complete", "missing_shards")}))


if __name__ == "__main__":
    from vase.run.oneline import script_main

    script_main(main)
