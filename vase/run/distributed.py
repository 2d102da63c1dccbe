"""Data parallel over the GPUs of a node, or the tasks of a SLURM job step: one run, or a ``-m`` sweep, on N ranks.

    torchrun --nproc-per-node 8 run.py task=aime25 model=qwen3_4b          # one run on the 8 GPUs of this node
    torchrun --nproc-per-node 8 run.py -m sweep=main_table model=qwen3_4b  # the sweep, each cell on the 8 GPUs
    srun --ntasks-per-node 8 --gpus-per-node 8 python run.py ...           # the same inside a SLURM allocation

The ranks come from the environment: ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK`` (torchrun), else ``SLURM_PROCID`` /
``SLURM_STEP_NUM_TASKS`` / ``SLURM_LOCALID`` (a job step of ``srun``, e.g. ``hydra/launcher=slurm`` with
``hydra.launcher.tasks_per_node=8``; ``MASTER_ADDR`` / ``MASTER_PORT`` are then derived from the step's first node and
the job id). torch.distributed does the rest (a gloo process group: only small Python objects travel, never
tensors, so no NCCL). One process is :class:`World` of size 1 and runs exactly the single-process code.

Long module: the launch environment, the bounded rendezvous, the ranks' collectives and the device choice are one
protocol (each step's failure must reach every rank as one line), read together.

How a run is shared (:func:`vase.run.runner.run`):

* every rank builds the same config, loads the same problems and measures the same prompts (deterministic);
* rank 0 owns the run directory: it takes its lock, checks and writes the protocol, repairs torn lines, and is the
  only writer of ``samples.jsonl``, ``metrics.json``, ``manifest.json`` and the W&B run;
* the problems with samples still to decode are dealt round-robin (``work[rank::world]``, as ``task.shard`` does);
  each rank decodes its share on its own device (``cuda:<local rank>``) and appends each graded sample to its part
  file ``ranks/rank<r>.samples.jsonl`` (fsynced);
* when every rank is done, rank 0 folds the parts into ``samples.jsonl`` (append, fsync, then delete:
  :func:`vase.run.results.fold_parts`), writes ``manifest.json`` with one entry per rank and ``metrics.json``, and
  sends the metrics to the other ranks. The directory is then the one a single process writes, under the same name.

Resume: readers take the union of ``samples.jsonl`` and the parts, so a relaunch (any number of ranks) decodes only
the samples that are in no file: those that were in flight or being graded when a rank died.

Start: the ranks meet at ``MASTER_ADDR:MASTER_PORT`` (:func:`_rendezvous`) and wait at most :data:`JOIN_ENV`
seconds (60 by default) for each other, saying every 10 s which ranks they wait for: a rank that never starts is one
line on every rank that did, naming it and how many joined, never a silent wait ending in a traceback. Then every
rank compares its command line, settings and run with rank 0's
(:mod:`vase.run.agreement`): ranks started with different settings all stop with the same line naming the first.

Failure: every phase ends in a collective (:meth:`World.step`) where each rank reports success or its error; if any
rank failed, every rank raises the same one-line error (a ``ValueError`` stays a ``ValueError``; anything else is
:class:`RankFailed` on the other ranks, the original with its traceback on the rank it happened on), so a ``-m``
sweep's ranks agree that a cell failed and go on to the same next cell. A rank that dies (``kill -9``, OOM killer)
closes its sockets, and the others fail at once at their next collective; torchrun stops the others anyway. A rank
that hangs is given up after :data:`TIMEOUT_ENV` seconds (setup and metrics) or :data:`WAIT_ENV` seconds (waiting
for the slowest rank to finish decoding).

Hydra: every rank runs Hydra. Rank 0 resolves Hydra's output directory (its ``${now:}``) and sends it to the others
(:func:`hydra_overrides`): rank 0 writes its Hydra files and log there, rank ``r`` in its subdirectory ``rank<r>/``
(rank-local files, nothing written twice). Under torchrun only Hydra's basic launcher makes sense (the ranks walk the
sweep's jobs in the same order); a submitit launcher is refused.
"""

from __future__ import annotations

import atexit
import logging
import os
import re
import socket
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: seconds a rank waits for the others at a collective of setup or metrics (default 30 min).
TIMEOUT_ENV = "VASE_DIST_TIMEOUT_S"
#: seconds a rank that finished decoding waits for the slowest one (default 6 h; nothing is lost past it: relaunch).
WAIT_ENV = "VASE_DIST_WAIT_S"
#: seconds the ranks wait for each other to start (the rendezvous; default 60, at most :data:`TIMEOUT_ENV`'s): a
#: missing rank is one line naming it within a minute, not after the collectives' 30 minutes.
JOIN_ENV = "VASE_DIST_JOIN_S"
DEFAULT_TIMEOUT_S = 1800
DEFAULT_JOIN_S = 60
#: seconds between the lines a rank prints while it waits for the others to join
JOIN_NOTE_EVERY_S = 10.0
DEFAULT_WAIT_S = 6 * 3600
BASIC_LAUNCHER = "hydra._internal.core_plugins.basic_launcher.BasicLauncher"


class RankFailed(RuntimeError):
    """Another rank failed (or stopped answering): the one-line reason, the same on every rank."""


@dataclass(frozen=True)
class Launch:
    """Where this process stands in a multi-process launch, read from the environment."""

    rank: int
    size: int
    local_rank: int | None
    source: str  # "torchrun" (RANK/WORLD_SIZE) or "slurm" (an srun job step)


def launch_from_env(env: Mapping[str, str] | None = None) -> Launch | None:
    """The launch this process belongs to, or ``None`` for a plain single process.

    ``RANK`` + ``WORLD_SIZE`` (torchrun, or set by hand) come first; otherwise an ``srun`` job step with several
    tasks (``SLURM_STEP_NUM_TASKS`` > 1, ``SLURM_PROCID``). A batch script's own shell (``sbatch --ntasks=8`` running
    ``python run.py`` without ``srun``) is one process, whatever ``SLURM_NTASKS`` says.
    """
    env = os.environ if env is None else env

    def integer(name: str) -> int | None:
        value = env.get(name)
        if value is None or value == "":
            return None
        try:
            return int(value)
        except ValueError:
            raise ValueError(f"{name}={value!r}: not an integer; fix the launcher's environment") from None

    if env.get("RANK") is not None and env.get("WORLD_SIZE") is not None:
        rank, size, local = integer("RANK"), integer("WORLD_SIZE"), integer("LOCAL_RANK")
        source = "torchrun"
    elif integer("SLURM_STEP_NUM_TASKS") and env.get("SLURM_PROCID") is not None:
        rank, size, local = integer("SLURM_PROCID"), integer("SLURM_STEP_NUM_TASKS"), integer("SLURM_LOCALID")
        source = "slurm"
    else:
        return None
    assert rank is not None and size is not None
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"rank {rank} of world size {size}: not a valid rank; fix the launcher's environment")
    return Launch(rank, size, local, source)


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list: ``gpu[03-05,9],cpu1`` -> ``gpu03``."""
    head = re.match(r"[^,\[]*(\[[^\]]*\])?", nodelist.strip())
    text = head.group(0) if head else nodelist
    if "[" not in text:
        return text
    prefix, ranges = text.split("[", 1)
    return prefix + re.split(r"[-,\]]", ranges, maxsplit=1)[0]


def _slurm_rendezvous(launch: Launch) -> None:
    """``MASTER_ADDR`` / ``MASTER_PORT`` for an srun step that has none: its first node, a port from the job id."""
    if "MASTER_ADDR" not in os.environ:
        nodes = os.environ.get("SLURM_STEP_NODELIST") or os.environ.get("SLURM_JOB_NODELIST")
        if not nodes:
            raise ValueError("SLURM_STEP_NODELIST is not set: set MASTER_ADDR to the first node of the job step")
        os.environ["MASTER_ADDR"] = first_host(nodes)
    if "MASTER_PORT" not in os.environ:
        job = int(os.environ.get("SLURM_JOB_ID", "0") or 0)
        step = int(os.environ.get("SLURM_STEP_ID", "0") or 0)
        os.environ["MASTER_PORT"] = str(20000 + (job * 31 + step) % 30000)


def _seconds(name: str, default: int) -> float:
    value = os.environ.get(name)
    if not value:
        return float(default)
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if seconds <= 0:
        raise ValueError(f"{name}={value!r}: must be a number of seconds > 0, e.g. {name}={default}")
    return seconds


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split()) or type(err).__name__


@dataclass
class World:
    """This process's rank among ``size`` processes (size 1: a plain single-process run, no process group).

    Attributes:
        rank, size: global rank and world size.
        local_rank, local_size: rank among the processes of this machine, and how many there are.
        source: ``single``, ``torchrun`` or ``slurm``.
    """

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    local_size: int = 1
    source: str = "single"
    _wait_group: Any = None

    @property
    def is_leader(self) -> bool:
        """Rank 0: the owner of the run directory."""
        return self.rank == 0

    def share(self, items: Sequence[T]) -> list[T]:
        """This rank's round-robin share of ``items`` (every ``size``-th from ``rank``, as ``task.shard`` does)."""
        return list(items[self.rank :: self.size])

    # ------------------------------------------------------------------------------------------------ collectives

    def _gather(self, obj: Any, phase: str, wait: bool) -> list[Any]:
        import torch.distributed as dist

        out: list[Any] = [None] * self.size
        try:
            dist.all_gather_object(out, obj, group=self._wait_group if wait else None)
        except Exception as err:  # a timeout, or a peer that died (its sockets closed)
            limit = _seconds(WAIT_ENV, DEFAULT_WAIT_S) if wait else _seconds(TIMEOUT_ENV, DEFAULT_TIMEOUT_S)
            raise RankFailed(
                f"rank {self.rank}: lost the other ranks while {phase} ({_one_line(err)[:300]}); a rank died or "
                f"did not answer within {limit:.0f} s (see its log); rerun the same command to resume"
            ) from None
        return out

    def _agree(self, phase: str, error: Exception | None, payload: Any, wait: bool = False) -> list[Any]:
        """Gather ``(error, payload)`` of every rank; raise the first rank's error on every rank if any failed."""
        mine = None if error is None else (type(error).__name__, isinstance(error, ValueError), _one_line(error))
        gathered = self._gather((mine, payload), phase, wait) if self.size > 1 else [(mine, payload)]
        failed = [(r, status) for r, (status, _) in enumerate(gathered) if status is not None]
        if failed:
            rank, (kind, is_value_error, message) = failed[0]
            if error is not None and rank == self.rank:
                raise error
            if error is not None:
                logger.error("rank %d also failed while %s: %s", self.rank, phase, _one_line(error))
            if is_value_error:
                raise ValueError(message)
            raise RankFailed(f"rank {rank} failed while {phase}: {kind}: {message}")
        return [payload for _, payload in gathered]

    def step(self, phase: str, fn: Callable[[], T], wait: bool = False) -> list[T]:
        """Run ``fn`` on every rank; return every rank's result (in rank order), or raise on every rank together.

        ``wait``: this collective may wait long for the slowest rank (:data:`WAIT_ENV`), e.g. the end of decoding.
        """
        if self.size == 1:
            return [fn()]
        try:
            result, error = fn(), None
        except Exception as err:
            result, error = None, err
        return self._agree(phase, error, result, wait)

    def leader(self, phase: str, fn: Callable[[], T]) -> T:
        """Run ``fn`` on rank 0 only; every rank returns its result (or raises its error)."""
        if self.size == 1:
            return fn()
        result, error = None, None
        if self.is_leader:
            try:
                result = fn()
            except Exception as err:
                error = err
        return self._agree(phase, error, result)[0]

    def leader_first(self, phase: str, fn: Callable[[bool], T]) -> T:
        """``fn(True)`` on rank 0 (it writes), then, once it succeeded, ``fn(False)`` on the others (they read).

        Returns this rank's own result; any failure is raised on every rank.
        """
        if self.size == 1:
            return fn(True)
        result: Any = None
        error: Exception | None = None
        if self.is_leader:
            try:
                result = fn(True)
            except Exception as err:
                error = err
        self._agree(phase, error, None)
        if not self.is_leader:
            try:
                result = fn(False)
            except Exception as err:
                error = err
        self._agree(phase, error, None)
        return result

    # ------------------------------------------------------------------------------------------------ devices

    def pick_device(self, requested: str) -> str | None:
        """This rank's device for ``model.device=requested``, or ``None`` with one process (nothing changes).

        ``auto`` / ``cuda``: ``cuda:<local rank>`` (or ``cuda:0`` when each rank sees one GPU of its own, e.g.
        ``srun --gpus-per-task=1``); ``auto`` without CUDA: the CPU. Two ranks on one GPU are refused (the check is
        on the devices' UUIDs), as is a fixed ``cuda:<i>``.
        """
        if self.size == 1:
            return None
        requested = str(requested)

        def choose() -> tuple[str, tuple[str, str] | None]:
            import torch

            if requested == "cpu":
                return "cpu", None
            if requested.startswith("cuda:"):
                raise ValueError(
                    f"model.device={requested}: with {self.size} ranks every rank would use that one GPU; set "
                    "model.device=auto (rank r of a node takes cuda:<r>)"
                )
            if not torch.cuda.is_available():
                if requested == "cuda":
                    raise ValueError(f"model.device=cuda: rank {self.rank} sees no CUDA device; check the launcher")
                return "cpu", None
            count = torch.cuda.device_count()
            if count >= self.local_size:
                index = self.local_rank
            elif count == 1:
                index = 0
            else:
                raise ValueError(
                    f"{self.local_size} ranks on {socket.gethostname()} but {count} GPUs visible to each; start at "
                    f"most {count} ranks per node (torchrun --nproc-per-node {count})"
                )
            torch.cuda.set_device(index)
            uuid = str(getattr(torch.cuda.get_device_properties(index), "uuid", index))
            return f"cuda:{index}", (socket.gethostname(), uuid)

        chosen = self.step("choosing devices", choose)
        seen: dict[tuple[str, str], int] = {}
        for rank, (_, ident) in enumerate(chosen):
            if ident is None:
                continue
            if ident in seen:
                raise ValueError(
                    f"ranks {seen[ident]} and {rank} are on the same GPU of {ident[0]}: give each rank its own GPU "
                    "(torchrun --nproc-per-node <GPUs>; under SLURM --gpus-per-task=1 or --gpus-per-node=<tasks>)"
                )
            seen[ident] = rank
        return chosen[self.rank][0]


_WORLD: World | None = None


def current_world() -> World:
    """This process's :class:`World`; the process group is started on the first call of a multi-process launch."""
    global _WORLD
    if _WORLD is None:
        launch = launch_from_env()
        _WORLD = World() if launch is None or launch.size == 1 else _start(launch)
    return _WORLD


def shutdown() -> None:
    """Destroy this process's process groups (at exit): alive, their threads abort the teardown (exit -6,
    ``terminate called without an active exception``; 4 of 30 ranks). Local to the rank: no collective."""
    global _WORLD
    import torch.distributed as dist

    _WORLD = None
    try:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    except Exception as err:  # a group already torn down by a failure
        logger.debug("destroying the process groups: %s", err)


def _start(launch: Launch) -> World:
    import torch.distributed as dist

    if not dist.is_available():
        raise ValueError("this torch build has no torch.distributed: run one process per GPU without torchrun")
    if launch.source == "slurm":
        _slurm_rendezvous(launch)
    timeout = timedelta(seconds=_seconds(TIMEOUT_ENV, DEFAULT_TIMEOUT_S))
    if not dist.is_initialized():
        store = _rendezvous(launch, join_seconds())
        dist.init_process_group("gloo", store=store, rank=launch.rank, world_size=launch.size, timeout=timeout)
        atexit.register(shutdown)
    wait = dist.new_group(backend="gloo", timeout=timedelta(seconds=_seconds(WAIT_ENV, DEFAULT_WAIT_S)))
    hosts: list[Any] = [None] * launch.size
    dist.all_gather_object(hosts, socket.gethostname())
    here = [r for r, h in enumerate(hosts) if h == hosts[launch.rank]]
    local_rank = launch.local_rank if launch.local_rank is not None else here.index(launch.rank)
    world = World(launch.rank, launch.size, local_rank, len(here), launch.source, wait)
    logger.info("rank %d of %d (%s, local rank %d of %d)", world.rank, world.size, world.source, local_rank, len(here))
    return world


def join_seconds() -> float:
    """How long the ranks wait for each other to start: :data:`JOIN_ENV` if set, else :data:`DEFAULT_JOIN_S` (60 s)
    or :data:`TIMEOUT_ENV`'s value when that is shorter."""
    if os.environ.get(JOIN_ENV):
        return _seconds(JOIN_ENV, DEFAULT_JOIN_S)
    return min(float(DEFAULT_JOIN_S), _seconds(TIMEOUT_ENV, DEFAULT_TIMEOUT_S))


def _missing_ranks(store: Any, prefix: str, size: int) -> list[int]:
    """The ranks that have not checked in at ``prefix`` (each rank sets ``<prefix>/<rank>``); ``[]`` if unknown."""
    try:
        return [r for r in range(size) if not store.check([f"{prefix}/{r}"])]
    except Exception:  # the store went away
        return []


def _reachable(addr: str, port: int) -> bool:
    """Whether something accepts TCP connections at ``addr:port`` (rank 0's store, once it is up)."""
    try:
        with socket.create_connection((addr, port), timeout=1.0):
            return True
    except OSError:
        return False


def _rendezvous(launch: Launch, seconds: float) -> Any:
    """The store the process group starts from, once every rank has joined it; a bounded wait otherwise.

    As torch's ``env://`` rendezvous: under torchrun every rank is a client of the agent's store
    (``TORCHELASTIC_USE_AGENT_STORE``), else rank 0 hosts it at ``MASTER_ADDR:MASTER_PORT``. Each rank then counts
    itself in and waits until all ``size`` have, for at most ``seconds`` (:func:`join_seconds`): a rank that never
    starts is one line on every rank that did, naming how many joined (:class:`RankFailed`), not a hang of the default
    30 minutes ending in a traceback.
    """
    import time

    import torch.distributed as dist

    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not addr or not port or not port.isdigit():
        raise ValueError(
            f"rank {launch.rank} of {launch.size}: MASTER_ADDR / MASTER_PORT are not set (got {addr!r}, {port!r}); "
            "start the ranks with torchrun or srun, or set both to rank 0's host and a free port"
        )
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    master = launch.rank == 0 and not agent
    where = f"{addr}:{port}"
    limit = f"{seconds:g} s ({JOIN_ENV})"
    deadline = time.monotonic() + seconds
    if not master:  # wait for rank 0 here, quietly (torch's client logs every failed try with a C++ stack)
        while not _reachable(addr, int(port)):
            if time.monotonic() >= deadline:
                raise RankFailed(
                    f"rank {launch.rank}: could not reach rank 0 at {where} within {limit}; start rank 0 (every one "
                    f"of the {launch.size} ranks, with the same MASTER_ADDR / MASTER_PORT) and rerun the same command"
                )
            time.sleep(0.2)
    try:
        store = dist.TCPStore(
            addr,
            int(port),
            launch.size,
            is_master=master,
            timeout=timedelta(seconds=max(1.0, deadline - time.monotonic()) if not master else seconds),
            wait_for_workers=False,
            multi_tenant=master,
        )
    except Exception as err:  # no rank 0 to reach in time, or its port taken
        if master:
            raise RankFailed(
                f"rank 0: cannot host the ranks' rendezvous at {where} ({_one_line(err)[:200]}); set MASTER_PORT to a "
                "free port on every rank"
            ) from None
        raise RankFailed(
            f"rank {launch.rank}: could not reach rank 0 at {where} within {limit}; start rank 0 (every one of the "
            f"{launch.size} ranks, with the same MASTER_ADDR / MASTER_PORT) and rerun the same command"
        ) from None
    key = f"vase/attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/joined"
    try:
        store.set(f"{key}/{launch.rank}", "1")
        joined = store.add(key, 1)
        noted = time.monotonic()
        while joined < launch.size and time.monotonic() < deadline:
            time.sleep(0.05)
            joined = store.add(key, 0)
            if time.monotonic() - noted >= JOIN_NOTE_EVERY_S and joined < launch.size:
                noted = time.monotonic()
                missing = _missing_ranks(store, key, launch.size)
                logger.warning(
                    "rank %d: waiting for rank(s) %s to start (%d of %d joined; giving up %.0f s from now, %s)",
                    launch.rank,
                    ", ".join(map(str, missing)) or "?",
                    joined,
                    launch.size,
                    max(0.0, deadline - time.monotonic()),
                    JOIN_ENV,
                )
    except Exception as err:  # rank 0 went away (it gave up waiting, or died)
        raise RankFailed(
            f"rank {launch.rank}: lost rank 0's rendezvous at {where} ({_one_line(err)[:200]}); start every one of the "
            f"{launch.size} ranks together and rerun the same command"
        ) from None
    if joined < launch.size:
        missing = _missing_ranks(store, key, launch.size)
        which = f" (missing: rank {', '.join(map(str, missing))})" if missing else ""
        raise RankFailed(
            f"rank {launch.rank}: only {joined} of {launch.size} ranks joined within {limit}{which}; start every rank "
            f"(torchrun --nproc-per-node {launch.size}, or srun with {launch.size} tasks; a rank that starts slowly: "
            f"raise {JOIN_ENV}), then rerun the same command"
        )
    return store


# --------------------------------------------------------------------------------------------------------------------
# before Hydra starts (run.py)


def _quote(value: str) -> str:
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def hydra_overrides(argv: list[str], compose: Callable[[str, list[str]], Any]) -> list[str]:
    """``argv`` with Hydra's output directories pinned to rank 0's, for every rank of a multi-process launch.

    Rank 0 composes the command line (``compose(config_name, overrides)``, the sweep's values left out as Hydra
    does for its sweep directory) and resolves ``hydra.run.dir`` / ``hydra.sweep.dir`` (their ``${now:}`` included);
    rank 0 uses them as they are, rank ``r`` their subdirectory ``rank<r>/`` (its own Hydra files and log, next to
    rank 0's). A submitit launcher under torchrun is refused (one line). One process: ``argv`` unchanged.
    """
    world = current_world()
    if world.size == 1:
        return argv

    def resolve() -> dict[str, str]:
        from hydra._internal.utils import get_args_parser
        from hydra.core.override_parser.overrides_parser import OverridesParser

        args, _ = get_args_parser().parse_known_args(argv)
        parser = OverridesParser.create()
        fixed = [o for o in args.overrides if not parser.parse_override(o).is_sweep_override()]
        cfg = compose(args.config_name or "config", fixed)
        target = str(cfg.hydra.launcher.get("_target_", ""))
        if target != BASIC_LAUNCHER:
            raise ValueError(
                f"{world.source} started {world.size} ranks but the sweep's launcher is {target.rsplit('.', 1)[-1]}: "
                "under torchrun the ranks walk the sweep themselves; drop hydra/launcher= (the basic launcher)"
            )
        return {"run": str(cfg.hydra.run.dir), "sweep": str(cfg.hydra.sweep.dir)}

    dirs = world.leader("starting Hydra", resolve)
    if not world.is_leader:  # rank-local Hydra files: its own config, overrides, multirun.yaml and log, no races
        dirs = {k: str(Path(v) / f"rank{world.rank}") for k, v in dirs.items()}
    kept = [a for a in argv if not re.match(r"^[+~]*hydra\.(run|sweep)\.dir=", a)]
    return [*kept, f"hydra.run.dir={_quote(dirs['run'])}", f"hydra.sweep.dir={_quote(dirs['sweep'])}"]


def gpus_on_machine() -> int:
    """NVIDIA GPUs of this machine (``/proc/driver/nvidia/gpus``), without importing torch; 0 when unknown."""
    try:
        return len(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        return 0


def local_launcher_note(cfg: Any) -> str | None:
    """The one line a CPU-only local launcher owes a machine with GPUs (``None`` when there is nothing to say)."""
    launcher = cfg.hydra.launcher if "hydra" in cfg else None
    if launcher is None or "LocalLauncher" not in str(launcher.get("_target_", "")):
        return None
    gpus = gpus_on_machine()
    if not gpus or launcher.get("gpus_per_node"):
        return None
    return (
        f"note: hydra/launcher=local runs every job on the CPU (its jobs see no GPU); to run this sweep on the {gpus} "
        f"GPUs of this machine: torchrun --nproc-per-node {gpus} run.py -m ..."
    )
