"""The embedded default (``python run.py``) under several variants, side by side in one run.

A variant is ``(label, git revision, OMP_NUM_THREADS, extra run.py arguments)``. Each revision is checked out once
into a ``git worktree`` in a temporary directory (``.`` = this checkout as it is, uncommitted changes included); every
run is a fresh ``python run.py <--run-args> <variant args> logger=none progress=false results_dir=<out>/runNN_<label>``
in that checkout with this interpreter (one Python environment for every revision), the variants in ABBA order over
``--rounds``. From each run directory: ``decode_tokens_per_second``, ``wall_seconds``, ``prefill_seconds`` (mean per
prompt) and ``accuracy`` (pass@1) of ``metrics.json``, the dtype and rows of ``manifest.json``, and the process's wall
time and peak RSS (``wait4``). The manifest's ``git_sha`` must be the revision asked for (the run imported that
checkout's code, not another).

    # (a) of issue 19: before (08d79e0) against after (HEAD), 1 and 2 threads
    python scripts/bench_variants.py --revs before=08d79e0,after=HEAD --threads 1,2 --rounds 2
    # any variants: LABEL:REV:THREADS[:RUN_ARGS]
    python scripts/bench_variants.py --variant inline:HEAD:1 --variant bg:HEAD:1:generation.grading=background
    # a smoke: one problem, one sample
    python scripts/bench_variants.py --revs before=08d79e0,after=HEAD --run-args "limit=1 n_samples=1" --rounds 1
"""

from __future__ import annotations

import argparse
import json
import logging
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from vase.bench import REPO
from vase.bench.runs import abba, last_line, markdown, read_run, spawn, thread_env, write_csv

logger = logging.getLogger(__name__)

COLUMNS = ["label", "rev", "threads", "runs", "decode_tok_s", "x_base", "wall_s", "prefill_s", "pass_at_1", "dtype"]
COLUMNS += ["rows", "tokens", "process_s", "peak_rss", "compile_s", "tok_s_after_compile"]


@dataclass
class Variant:
    """One variant: ``rev`` is a git revision or ``.`` (this checkout as it is)."""

    label: str
    rev: str
    threads: int = 1
    args: list[str] = field(default_factory=list)


def parse_variant(text: str) -> Variant:
    """``LABEL:REV:THREADS[:RUN_ARGS]`` (``RUN_ARGS`` space-separated ``run.py`` overrides)."""
    parts = text.split(":", 3)
    if len(parts) < 3 or not parts[0] or not parts[1]:
        raise ValueError(f"--variant {text!r}: expected LABEL:REV:THREADS[:RUN_ARGS], e.g. after:HEAD:1")
    try:
        threads = int(parts[2])
    except ValueError:
        raise ValueError(f"--variant {text!r}: THREADS must be an integer, got {parts[2]!r}") from None
    return Variant(parts[0], parts[1], threads, shlex.split(parts[3]) if len(parts) > 3 else [])


def plan(variants: list[str], revs: str | None, threads: str) -> list[Variant]:
    """The ``--variant`` s, or ``--revs LABEL=REV,...`` x ``--threads N,...`` (labels ``LABEL-tN``)."""
    out = [parse_variant(v) for v in variants]
    if revs:
        counts = [int(t) for t in threads.split(",")]
        for item in revs.split(","):
            label, _, rev = item.partition("=")
            if not rev:
                raise ValueError(f"--revs {item!r}: expected LABEL=REV, e.g. before=08d79e0")
            out += [Variant(f"{label}-t{n}" if len(counts) > 1 else label, rev, n) for n in counts]
    labels = [v.label for v in out]
    if not out or len(set(labels)) != len(labels):
        raise ValueError(f"variants: none given or labels repeated ({labels}); use --variant or --revs")
    return out


def resolve_rev(rev: str) -> str:
    """The full commit of ``rev`` in this repository (``.``: this checkout's HEAD)."""
    name = "HEAD" if rev == "." else rev
    cmd = ["git", "rev-parse", "--verify", f"{name}^{{commit}}"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        raise ValueError(f"revision {rev!r}: not a commit of {REPO} ({proc.stderr.strip()})")
    return proc.stdout.strip()


def checkout(rev: str, sha: str, tmp: Path) -> Path:
    """A detached ``git worktree`` of ``sha`` under ``tmp`` (``.``: this checkout itself)."""
    if rev == ".":
        return REPO
    path = tmp / f"wt-{sha[:10]}"
    if not path.exists():
        cmd = ["git", "worktree", "add", "--detach", str(path), sha]
        subprocess.run(cmd, cwd=REPO, check=True, capture_output=True)
    return path


def run_one(v: Variant, sha: str, root: Path, common: list[str], results: Path, log: Path, timeout: float) -> dict:
    """One ``run.py`` process of variant ``v`` in checkout ``root``; its row."""
    cmd = [sys.executable, "run.py", *common, *v.args, "logger=none", "progress=false", f"results_dir={results}"]
    got = spawn(cmd, thread_env(v.threads), root, timeout, log)
    row = dict(label=v.label, rev=v.rev, sha=sha[:10], threads=v.threads, args=" ".join(v.args))
    row.update(rc=got["rc"], process_s=got["seconds"], peak_rss=got["peak_rss"])
    try:
        run = read_run(results)
    except ValueError as err:
        return dict(row, error=f"exit {got['rc']}: {last_line(log) or err}")
    m, man = run["metrics"], run["manifest"]
    code_sha = man.get("git_sha") or ""
    row.update(
        decode_tok_s=m.get("decode_tokens_per_second"),
        compile_s=m.get("compile_seconds"),
        tok_s_after_compile=m.get("decode_tokens_per_second_after_compile"),
        wall_s=m.get("wall_seconds"),
        prefill_s=m.get("prefill_seconds"),
        pass_at_1=m.get("accuracy"),
        samples=run["samples"],
        tokens=run["tokens"],
        rows=m.get("rows_in_flight"),
        dtype=man.get("model", {}).get("dtype"),
        torch_threads=man.get("device", {}).get("torch_threads"),
        code_sha=code_sha,
        finish_reasons=run["finish_reasons"],
    )
    if not code_sha.startswith(sha):
        row["error"] = f"the run's code is {code_sha or 'unknown'}, not {sha[:10]}: it imported another checkout"
    return row


def summarise(runs: list[dict], variants: list[Variant], base: str | None) -> list[dict]:
    """One line per variant (medians over rounds; pass@1 averaged); ``x_base``: decode tok/s over the base's."""
    table = []
    for v in variants:
        rs = [r for r in runs if r["label"] == v.label and not r.get("error")]
        line = dict(label=v.label, rev=v.rev, threads=v.threads, args=" ".join(v.args), runs=len(rs))
        line["errors"] = [r["error"] for r in runs if r["label"] == v.label and r.get("error")] or None
        for col in (
            "decode_tok_s",
            "wall_s",
            "prefill_s",
            "tokens",
            "rows",
            "process_s",
            "peak_rss",
            "compile_s",
            "tok_s_after_compile",
        ):
            vals = [r[col] for r in rs if r.get(col) is not None]
            line[col] = statistics.median(vals) if vals else None
        acc = [r["pass_at_1"] for r in rs if r.get("pass_at_1") is not None]
        line["pass_at_1"] = statistics.mean(acc) if acc else None
        line["dtype"] = ",".join(sorted({str(r.get("dtype")) for r in rs})) or None
        table.append(line)
    ref = next((x for x in table if x["label"] == (base or table[0]["label"])), None)
    for line in table:
        ok = ref and ref.get("decode_tok_s") and line.get("decode_tok_s")
        line["x_base"] = line["decode_tok_s"] / ref["decode_tok_s"] if ok else None
    return table


def compare(args: argparse.Namespace) -> dict:
    """Every variant in ABBA rounds; writes ``variants.json``, ``variants.csv`` and ``table.md`` into ``args.out``."""
    from vase.bench.measure import machine_info

    variants = plan(args.variant, args.revs, args.threads)
    shas = {v.rev: resolve_rev(v.rev) for v in variants}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    common = shlex.split(args.run_args)
    runs = []
    with tempfile.TemporaryDirectory(prefix="bench_variants_") as tmp:
        roots = {rev: checkout(rev, sha, Path(tmp)) for rev, sha in shas.items()}
        try:
            for i, (rnd, v) in enumerate(abba(variants, args.rounds)):
                log = out / f"run{i:02d}_{v.label}.log"
                logger.info("round %d: %s (%s, %d thread(s)) %s", rnd + 1, v.label, v.rev, v.threads, " ".join(v.args))
                results = out / f"run{i:02d}_{v.label}"
                row = run_one(v, shas[v.rev], roots[v.rev], common, results, log, args.timeout)
                row["round"] = rnd + 1
                runs.append(row)
                logger.info("  %s", {k: row.get(k) for k in ("decode_tok_s", "wall_s", "pass_at_1", "error")})
        finally:
            for root in roots.values():
                if root != REPO:
                    subprocess.run(["git", "worktree", "remove", "--force", str(root)], cwd=REPO, capture_output=True)
    table = summarise(runs, variants, args.base)
    info = machine_info("cpu")
    info.update(run_args=common, revisions=shas)
    result = dict(machine=info, variants=[asdict(v) for v in variants], runs=runs, table=table)
    (out / "variants.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    write_csv(runs, out / "variants.csv")
    (out / "table.md").write_text(markdown(table, COLUMNS) + "\n")
    print(markdown(table, COLUMNS))
    return result


def main(argv: list[str] | None = None) -> int:
    """``scripts/bench_variants.py``."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--variant", action="append", default=[], help="LABEL:REV:THREADS[:RUN_ARGS] (repeatable)")
    ap.add_argument("--revs", default=None, help="LABEL=REV,... (with --threads: one variant per revision and count)")
    ap.add_argument("--threads", default="1", help="with --revs: comma list of OMP_NUM_THREADS")
    ap.add_argument("--run-args", default="", help='run.py overrides for every variant, e.g. "limit=1 n_samples=1"')
    ap.add_argument("--rounds", type=int, default=2, help="ABBA rounds (each variant once per round)")
    ap.add_argument("--base", default=None, help="the label the x_base column divides by (default: the first)")
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds per run")
    ap.add_argument("--out", default=None, help="default results/bench/variants_<time>")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    try:
        plan(args.variant, args.revs, args.threads)
    except ValueError as err:
        ap.error(str(err))
    args.out = (
        str(Path(args.out).resolve())
        if args.out
        else str(REPO / "results" / "bench" / f"variants_{time.strftime('%Y%m%d_%H%M%S')}")
    )
    result = compare(args)
    return 0 if result["runs"] and not any(r.get("error") for r in result["runs"]) else 1
