"""The runner behind ``python run.py``: one (model, task, policy, budget) run, resumable, logged to disk and W&B.

Everything is built from the composed Hydra config with ``hydra.utils.instantiate`` (model spec, task, policy,
logger), so the runner never branches on types. Order of work, cheapest first, and nothing is written before every
input has been checked:

1-3. :func:`vase.run.planning.plan`: every setting, the run directory, the data, the model's config, the device, the
   prompts, the cache against the memory, a changed protocol / data / weights. It writes nothing (``run.py`` runs it
   for every cell of a command line before Hydra starts).
4. only then take the run directory's lock (one writer at a time: :func:`vase.run.rundir.lock_run_dir`), read the
   samples again under it (repairing a torn last line), write ``protocol.json`` / ``resolved.json`` /
   ``config.yaml``, and decode every missing sample (:func:`vase.run.decoding.decode`); each is graded inline or in
   worker processes (:mod:`vase.run.grading_pool`) and its line appended to ``samples.jsonl`` (fsynced) once graded;
5. write ``metrics.json`` from ``samples.jsonl`` + ``throughput.jsonl`` (the source of truth) and mirror to W&B.

Launched as several processes (torchrun, srun: :mod:`vase.run.distributed`), every rank calls :func:`run` with the
same config and the same order holds: rank 0 plans, takes the lock (held until its metrics are written) and opens the
directory; then the other ranks plan, read-only, on their own devices. Each rank decodes its round-robin share of the
samples still to decode and appends its lines to its part file ``ranks/rank<r>.samples.jsonl``; rank 0 then folds the
parts into ``samples.jsonl`` and writes the manifest and the metrics. Every phase ends in a collective: a failure on
any rank is raised on every rank, as the same one line.
"""

from __future__ import annotations

import json
import logging
import tempfile
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from vase.run.agreement import SAME_COMMAND, agree_on
from vase.run.decoding import decode
from vase.run.distributed import World, current_world
from vase.run.grading_pool import Grader, grade_workers
from vase.run.loggers import NullLogger
from vase.run.planning import RunPlan, build, plan, prepare, resolved_spec, still_to_do, with_dtype
from vase.run.preflight import tensor_of
from vase.run.protocol import comparable
from vase.run.records import compute_metrics
from vase.run.results import (
    check_protocol,
    check_resolved,
    fold_parts,
    read_samples,
    read_throughput,
    sample_file,
    stable_hash,
    write_json,
)
from vase.run.rundir import lock_run_dir
from vase.run.validate import planned_for

logger = logging.getLogger(__name__)

__all__ = ["plan", "prepare", "run"]


def run(cfg: DictConfig, progress: bool = True) -> dict:
    """Run (or resume) one configuration; return its metrics (every rank of a data-parallel run returns rank 0's, or
    raises the same error). See the module docstring."""
    world = current_world()
    agree_on(world, "the settings", _settings(cfg), SAME_COMMAND)  # before anything is written
    world.step("checking parallel.tensor", lambda: world.with_tensor(tensor_of(cfg)) and None)
    device = world.pick_device(str(cfg.model.get("device", "auto")))  # None with one process: model.device as set
    if world.tensor > 1:  # every rank builds the groups' mesh together (a collective), before any rank may skip
        world.tensor_mesh("cuda" if str(device).startswith("cuda") else "cpu")
    started: list = []  # the logger rank 0 started, to abort if anything after it fails
    with ExitStack() as held:  # rank 0 holds the run directory's lock until the metrics are written
        try:
            p, run_logger = world.leader_first(
                "opening the run", lambda leader: _open(cfg, device, held if leader else None, started)
            )
            _same_run(world, p)
            _same_work(world, p)
            share = world.share(p.work)  # the problems with samples to decode, dealt round-robin over the ranks
            sessions = world.step("decoding", lambda: _decode_share(p, share, world, run_logger, progress), wait=True)
            return world.leader("writing the metrics", lambda: _finish(p, sessions, run_logger))
        except BaseException:
            for opened in started:
                opened.abort()
            raise


def _open(cfg: DictConfig, device: str | None, held: ExitStack | None, started: list):
    """Plan (writes nothing), then, in the process that owns the directory (``held``: the one process, or rank 0),
    take the lock into ``held`` and open the run directory (:func:`_take`) and start the logger. The other ranks only
    plan, once rank 0 has opened the directory, and get a :class:`NullLogger`. Returns ``(plan, logger)``."""
    p = plan(cfg, device=device)
    if held is None:
        return p, NullLogger()
    held.enter_context(lock_run_dir(p.prep.run_dir))  # one writer; released on any exit, kill -9 included
    p = _take(p)
    run_dir = p.prep.run_dir
    run_logger = build(cfg.logger, "logger")
    run_id = stable_hash({"dir": str(run_dir.resolve()), "protocol": comparable(run_dir, p.prep.protocol)}, 16)
    run_logger.start(run_dir=run_dir, config=OmegaConf.to_container(cfg, resolve=True), run_id=run_id)
    started.append(run_logger)
    return p, run_logger


def _take(p: RunPlan) -> RunPlan:
    """Under the lock: read the samples again (another run may have added some since the plan; a torn last line, left
    by a kill mid-write, is cut off, in the rank part files too), then write the protocol, what was loaded and the
    config. Returns the plan with the samples done and the work as they are now."""
    prep, cfg, run_dir = p.prep, p.prep.cfg, p.prep.run_dir
    planned = planned_for(prep.task, p.problems, prep.n_samples)  # the samples the run plans: nothing else is counted
    done_rows = read_samples(run_dir, repair=True, for_metrics=True, planned=planned)
    work = still_to_do(p, done_rows)
    logger.info(
        "run dir %s: %d problems, %d samples done, %d problems to decode",
        run_dir,
        len(p.problems),
        len(done_rows),
        len(work),
    )
    check_protocol(run_dir, comparable(run_dir, with_dtype(prep, work)))
    check_resolved(run_dir, p.data)
    if work:  # the weights will load: record (or check again) what they resolve to
        check_resolved(run_dir, {"model": prep.model_spec.resolve()})
    config_file = run_dir / "config.yaml"
    if work or not config_file.exists():  # the configuration of the last invocation that decoded samples
        config_file.write_text(OmegaConf.to_yaml(cfg, resolve=True))
    read_throughput(run_dir, repair=True)
    return replace(p, done_rows=done_rows, work=work)


def _settings(cfg: DictConfig) -> dict:
    """The resolved settings every rank must share (Hydra's own node left out: each rank has its output dir)."""
    return {k: v for k, v in OmegaConf.to_container(cfg, resolve=True).items() if k != "hydra"}


def _same_run(world: World, p: RunPlan) -> None:
    """Every rank resolved the same run: the run directory (absolute), the protocol, the data it read (hashes, hub
    commits) and the weights; else every rank stops with the same one line naming the first difference."""
    if world.size == 1:
        return
    identity = {
        "run_dir": str(p.prep.run_dir.resolve()),
        "protocol": json.loads(json.dumps(p.prep.protocol, default=str)),
        "resolved": json.loads(json.dumps({**p.data, "model": p.prep.model_spec.resolve()}, default=str)),
    }
    agree_on(world, "the run", identity, SAME_COMMAND.replace("; nothing was written", ""))


def _same_work(world: World, p: RunPlan) -> None:
    """Every rank found the same samples to decode (the shares below depend on it); a rank that read other data is
    refused by its plan already, so this only guards the dealing itself."""
    if world.size == 1:
        return
    keys = world.step("sharing the work", lambda: stable_hash([(w.problem.id, w.missing) for w in p.work], 16))
    if len(set(keys)) > 1:
        raise RuntimeError(
            f"the ranks found different samples to decode ({keys}); rerun the same command (each rank reads the run "
            "directory rank 0 opened; check that every node sees the same run directory and data)"
        )


def _decode_share(p: RunPlan, share: list, world: World, run_logger, progress: bool) -> dict | None:
    """This rank's decoding and grading (the dtype from the whole run's work); ``None`` when it has nothing to do."""
    import torch

    if not share:
        return None
    prep = p.prep
    rank = None if world.size == 1 else world.rank
    spec, why = resolved_spec(prep, p.work)
    setting = prep.cfg.generation.get("grade_workers", "auto")
    workers = grade_workers(setting, spec.resolved_device().type, torch.get_num_threads(), world.local_size)
    mesh = world.tensor_mesh(spec.resolved_device().type)
    if not world.writes:  # a tensor-parallel follower: decodes in step with its group's first rank, writes nothing
        with tempfile.TemporaryDirectory(prefix="vase-tp-") as scratch:
            quiet = replace(prep, run_dir=Path(scratch))
            grader = Grader(prep.task, prep.thinking, sample_file(quiet.run_dir, rank), 0, record=False)
            return decode(quiet, share, p.done_rows, grader, NullLogger(), False, rank, (spec, why), mesh)
    grader = Grader(prep.task, prep.thinking, sample_file(prep.run_dir, rank), *workers)
    try:
        return decode(prep, share, p.done_rows, grader, run_logger, progress, rank, (spec, why), mesh)
    except BaseException as err:
        try:  # keep what was decoded: grade and write it (an interrupt: only the grades already running)
            grader.close(drain=isinstance(err, Exception))
        except Exception:
            logger.exception("grading the samples decoded before the error failed")
        raise


def _finish(p: RunPlan, sessions: list[dict | None], run_logger) -> dict:
    """Rank 0 (or the one process): fold the rank parts in, write ``manifest.json`` and ``metrics.json``."""
    prep, cfg, run_dir = p.prep, p.prep.cfg, p.prep.run_dir
    fold_parts(run_dir)
    decoded = [s for s in sessions if s is not None]
    if len(sessions) > 1 and decoded:  # a data-parallel session: one manifest, one entry per rank that decoded
        write_json(run_dir / "manifest.json", {**decoded[0], "ranks": [e for s in decoded for e in s["ranks"]]})
    info = {
        "budget_source": "explicit" if prep.explicit_budget else "ratio",
        # ratio=: the reference full-cache output length the budget came from, and which setting gave it
        "reference_tokens": (prep.reference or {}).get("tokens"),
        "reference_source": (prep.reference or {}).get("source"),
        "policy": prep.policy.name,
        "policy_kind": prep.policy.kind,
        "task": prep.task.name,
        "model": prep.model_spec.key,
        "budget": cfg.budget if prep.policy.kind != "none" else None,
        "window": cfg.window if prep.policy.kind != "none" else None,
        "ratio": cfg.ratio,
        "grader": prep.grader,
        "protocol": prep.protocol["protocol"]["name"],
        "run_dir": str(run_dir),
    }
    metrics = compute_metrics(run_dir, [q.id for q in p.problems], prep.n_samples, info, cfg.pass_k)
    write_json(run_dir / "metrics.json", metrics)
    run_logger.finish(metrics=metrics, run_dir=run_dir)
    return metrics
