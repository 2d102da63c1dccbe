"""One job of ``run.py`` and the sweep it belongs to: errors as one line, and a sweep that survives a bad cell.

* :func:`run_job` — the body of ``run.py``'s task function. A single run that fails prints one line (``error: ...``)
  and exits 2 (bad input: a ``ValueError``, a missing package) or 1 (the machine: disk full, permissions); a bug keeps
  its traceback. In a multirun a failed job never stops the sweep: its one line goes to the terminal, its outcome to
  ``<job dir>/vase_job.json``, and the next job starts. ``raise_errors=true`` re-raises everything (tracebacks for
  debugging). Ctrl-C is never caught here: it stops the run (or the whole sweep) and ``run.py`` exits 130 with the
  resume command.
* :class:`SweepSummary` — a Hydra callback (``hydra.callbacks.vase_sweep`` in ``conf/config.yaml``): at the end of a
  multirun it gathers every job's outcome into ``<sweep dir>/sweep_summary.json``, prints one line per failed job and
  a count, and leaves :data:`last_summary` for ``run.py``, which exits 1 when a job failed. It runs in the launching
  process for every launcher (basic, submitit local and SLURM: the job files are on the sweep directory's shared disk);
  a job that left no outcome (killed, out of memory) is reported as such.

``sweep_summary.json``: ``{"sweep_dir", "jobs", "ok", "failed", "results": [{"num", "overrides", "status"
("ok" | "failed" | "no outcome"), "error" (one line), "kind" ("bad input" | "busy" | "machine" | "bug" | "rank
failed" | "killed"), "run_dir", "accuracy", "complete", "job_dir"}]}``.

Several processes (``torchrun``, :mod:`vase.run.distributed`): every rank runs every job, and a job that fails fails
on every rank with the same one line (another rank's failure is :class:`vase.run.distributed.RankFailed` there, kind
``rank failed``). Rank 0 alone records outcomes (``vase_job.json``), prints the summary and prints a run's metrics;
every rank exits 1 when a job failed. The other ranks' Hydra directories (``rank<r>/`` under rank 0's) are not jobs.

Only the standard library and Hydra/OmegaConf are imported at module level (Hydra instantiates the callback in every
``run.py`` process).
"""

from __future__ import annotations

import json
import logging
import re
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from vase.schema import loads

logger = logging.getLogger("vase")

JOB_FILE = "vase_job.json"
SUMMARY_FILE = "sweep_summary.json"
TRACEBACK_FILE = "traceback.txt"
#: the outcome of the last multirun in this process (set by :class:`SweepSummary`), read by ``run.py``
last_summary: dict | None = None
_failed_here = 0  # jobs of the current multirun that failed in this process (every rank counts its own)


def is_leader() -> bool:
    """Rank 0 of a multi-process launch, or the one process (read from the environment; no process group needed)."""
    from vase.run.distributed import launch_from_env

    try:
        launch = launch_from_env()
    except ValueError:
        return True
    return launch is None or launch.rank == 0


def one_line(text: object) -> str:
    """``text`` on one line."""
    return " ".join(str(text).split())


def classify(err: BaseException) -> tuple[str, str, int]:
    """``(kind, one line, exit code)`` of an error a job raised."""
    from vase.run.distributed import RankFailed
    from vase.run.rundir import RunDirBusy

    if isinstance(err, RunDirBusy):
        return "busy", one_line(err), 2
    if isinstance(err, RankFailed):  # another rank's error (its traceback is in that rank's log), or a lost rank
        return "rank failed", one_line(err), 1
    if isinstance(err, ModuleNotFoundError):
        from vase.run.preflight import missing_package

        return "bad input", str(missing_package(err, "run")), 2
    if isinstance(err, ValueError):
        return "bad input", one_line(err), 2
    if isinstance(err, OSError):
        where = f"{err.filename}: " if err.filename else ""
        return (
            "machine",
            f"{where}{err.strerror or one_line(err)}; fix the disk or permissions, then rerun the same command to "
            "resume (every finished sample is kept)",
            1,
        )
    return "bug", f"{type(err).__name__}: {one_line(err)}", 1


def _is_multirun() -> bool:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def _job_dir() -> Path | None:
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return None
    return Path(HydraConfig.get().runtime.output_dir)


def run_job(cfg: DictConfig, report: Callable[[dict], None]) -> float | None:
    """Run one configuration (:func:`vase.run.runner.run`) as the module docstring says; ``report`` prints the
    metrics of a successful run. Returns the accuracy (Hydra's job return value), ``None`` for a failed job."""
    from vase.run.runner import run

    global _failed_here
    multirun = _is_multirun()
    try:
        metrics = run(cfg, progress=cfg.progress)
    except Exception as err:
        if cfg.get("raise_errors", False):
            raise
        kind, line, code = classify(err)
        if kind == "bug":
            where = _write_traceback()
            line += f" (an unexpected error: the traceback is in {where}; rerun with raise_errors=true to see it)"
        logger.error("error: %s", line)
        if not multirun:
            from vase.run.agreement import record_for_torchrun

            record_for_torchrun(f"error: {line}")
            sys.exit(code)
        _failed_here += 1
        _write_outcome({"status": "failed", "error": line, "kind": kind})
        return None
    if not is_leader():  # rank 0 reports the run, once
        return metrics.get("accuracy")
    report(metrics)
    if multirun:
        keys = ("run_dir", "accuracy", "complete", "samples")
        _write_outcome({"status": "ok", **{k: metrics.get(k) for k in keys}})
    return metrics.get("accuracy")


def _write_traceback() -> str:
    job_dir = _job_dir()
    text = traceback.format_exc()
    if job_dir is None:
        return "the log above"
    try:
        job_dir.mkdir(parents=True, exist_ok=True)
        (job_dir / TRACEBACK_FILE).write_text(text)
    except OSError:
        return "the log above"
    return str(job_dir / TRACEBACK_FILE)


def _write_outcome(outcome: dict) -> None:
    from hydra.core.hydra_config import HydraConfig

    job_dir = _job_dir()
    if job_dir is None or not is_leader():  # recorded once, by rank 0
        return
    hc = HydraConfig.get()
    outcome = {"num": hc.job.num, "overrides": list(hc.overrides.task), **outcome}
    try:
        job_dir.mkdir(parents=True, exist_ok=True)
        (job_dir / JOB_FILE).write_text(json.dumps(outcome, indent=2, default=str) + "\n")
    except OSError as err:  # the sweep directory itself is gone or full: the terminal line is all there is
        logger.error("error: cannot record job %s's outcome in %s (%s)", hc.job.num, job_dir, err.strerror)


class SweepSummary(Callback):
    """Gathers the jobs' outcomes of a multirun (see the module docstring)."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        global last_summary, _failed_here
        last_summary, _failed_here = None, 0
        sweep_dir = Path(str(config.hydra.sweep.dir))
        if sweep_dir.is_dir():  # a reused sweep directory: outcomes of an earlier sweep are not this one's
            for stale in sweep_dir.rglob(JOB_FILE):
                stale.unlink(missing_ok=True)

    def on_job_end(self, config: DictConfig, job_return: Any, **kwargs: Any) -> None:
        from hydra.core.utils import JobStatus

        # an exception that left the task function (raise_errors=true): record it like any failed job
        if _is_multirun() and getattr(job_return, "status", None) == JobStatus.FAILED:
            global _failed_here
            _failed_here += 1
            err = job_return._return_value
            kind, line, _ = classify(err) if isinstance(err, BaseException) else ("bug", one_line(err), 1)
            _write_outcome({"status": "failed", "error": line, "kind": kind})

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        global last_summary
        if not is_leader():  # rank 0 writes and prints the summary; this rank's exit code follows its own jobs
            last_summary = {"jobs": None, "ok": None, "failed": _failed_here, "results": []}
            return
        last_summary = summarize(Path(str(config.hydra.sweep.dir)))
        results = last_summary["results"]
        failed = [r for r in results if r["status"] != "ok"]
        common = set.intersection(*(set(r.get("overrides") or []) for r in results)) if len(results) > 1 else set()
        for r in failed:  # each with what sets it apart: the swept values
            shown = " ".join(o for o in r.get("overrides") or [] if o not in common) or r.get("job_dir", "?")
            print(f"sweep: job #{r.get('num', '?')} ({shown}) {r['status']}: {r.get('error')}", file=sys.stderr)
        n = last_summary["jobs"]
        print(
            f"sweep: {n} jobs, {last_summary['ok']} ok, {len(failed)} failed; summary in "
            f"{Path(str(config.hydra.sweep.dir)) / SUMMARY_FILE}",
            file=sys.stderr,
            flush=True,
        )


def summarize(sweep_dir: Path) -> dict:
    """Every job's outcome under ``sweep_dir`` (a job directory is one holding Hydra's ``.hydra/`` or a job file),
    written to ``sweep_dir/sweep_summary.json`` and returned."""
    job_dirs = {p.parent.parent for p in sweep_dir.rglob(".hydra/overrides.yaml")}
    job_dirs |= {p.parent for p in sweep_dir.rglob(JOB_FILE)}
    job_dirs = {d for d in job_dirs if ".submitit" not in d.parts}
    # the Hydra directories of the other ranks of a torchrun launch (rank<r>/ under rank 0's) hold no jobs of their own
    job_dirs = {
        d for d in job_dirs if not any(re.fullmatch(r"rank\d+", part) for part in d.relative_to(sweep_dir).parts)
    }
    results = []
    for job_dir in sorted(job_dirs, key=lambda d: (len(d.parts), str(d))):
        path = job_dir / JOB_FILE
        try:
            outcome = loads(path.read_bytes()) if path.is_file() else None  # nesting bounded (vase.schema.loads)
        except (OSError, ValueError):  # damaged (JSON or not, too deep): the job's outcome is unknown
            outcome = None
        if outcome is not None and not isinstance(outcome, dict):
            outcome = None
        if outcome is None:
            overrides = _overrides(job_dir)
            outcome = {
                "status": "no outcome",
                "error": "the job ended without recording an outcome (killed, out of memory, or its launcher failed); "
                "see its log in the job directory",
                "kind": "killed",
                "overrides": overrides,
                "num": job_dir.name,
            }
        results.append({**outcome, "job_dir": str(job_dir)})
    results.sort(key=lambda r: (int(r["num"]) if str(r.get("num", "")).isdigit() else 1 << 30, r["job_dir"]))
    ok = sum(r["status"] == "ok" for r in results)
    summary = {"sweep_dir": str(sweep_dir), "jobs": len(results), "ok": ok, "failed": len(results) - ok}
    summary["results"] = results
    if sweep_dir.is_dir():
        (sweep_dir / SUMMARY_FILE).write_text(json.dumps(summary, indent=2, default=str) + "\n")
    return summary


def _overrides(job_dir: Path) -> list[str]:
    path = job_dir / ".hydra" / "overrides.yaml"
    if not path.is_file():
        return []
    try:
        import yaml

        return [str(o) for o in yaml.safe_load(path.read_text()) or []]
    except Exception:
        return []
