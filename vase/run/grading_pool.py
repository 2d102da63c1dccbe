"""Grading finished samples: in the decode loop, or in worker processes while decoding goes on.

``generation.grade_workers`` picks the mode:

* ``0``: inline. Each finished sample is graded in the decode loop (the decoder waits for its grade), then its line is
  appended to ``samples.jsonl`` (fsynced).
* ``N >= 1``: a pool of ``N`` worker processes (``spawn``: no CUDA or OpenMP state is inherited; processes, not
  threads, because math-verify's timeouts use ``SIGALRM`` in a main thread and the code sandbox already forks
  children of its own). The decode loop hands each finished sample to the pool and goes on; after every decode step
  it collects the grades that are ready and appends their lines (the main process is the file's one writer: one
  fsynced line per graded sample). At the end of the run it waits for the rest.
* ``auto`` (default): one worker per core left over by the decode, :func:`auto_workers` (this rank's cores minus the
  decode's threads: one for a CUDA device, torch's intra-op threads on the CPU), at most :data:`MAX_AUTO_WORKERS`;
  with no core left (a CPU decode that uses every core) it grades inline, because an OpenMP decode slows down
  sharply when another process takes one of its cores.

Both modes call the task's own grading (``task.grade_many([(problem, output)], thinking)``), so a sample's line is
the same whichever mode graded it; only the order of the lines can differ. ``kill -9`` loses at most the samples in
flight in the decoder or handed to the pool and not yet written; a worker dies with its parent
(``PR_SET_PDEATHSIG``). Lines are written by :func:`vase.run.results.write_sample` (the one writer of sample lines);
the test hook's kill points (``VASE_TEST_KILL_AT``, :func:`vase.run.results.kill_point`) are ``submitted`` (here: a
sample handed to grading) and ``written`` (its line durable).
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor
from pathlib import Path
from typing import Any

from tasks.sandbox import available_cores
from vase.run.results import kill_point, write_sample

logger = logging.getLogger(__name__)

#: ``auto`` never starts more workers than this per process (each holds the task's grader: math-verify, sympy).
MAX_AUTO_WORKERS = 16


def auto_workers(device_type: str, decode_threads: int, local_ranks: int = 1) -> tuple[int, str]:
    """``(workers, why)`` for ``generation.grade_workers=auto``: the cores this rank leaves to grading.

    Args:
        device_type: ``cuda`` (the decode takes one core: the thread that drives the GPU) or ``cpu``.
        decode_threads: torch's intra-op threads (the decode's cores on the CPU).
        local_ranks: ranks on this machine. When this process may run on every core of the machine (no CPU
            binding), those cores are shared among them; a process bound to a subset (SLURM's ``--cpus-per-task``)
            owns its subset.
    """
    cores = available_cores()
    mine = cores
    if local_ranks > 1 and cores >= (os.cpu_count() or cores):
        mine = max(1, cores // local_ranks)
    decode = 1 if device_type == "cuda" else max(1, decode_threads)
    left = max(0, mine - decode)
    workers = min(left, MAX_AUTO_WORKERS)
    why = f"auto: {mine} cores for this process - {decode} for the decode on {device_type} = {left} left"
    if workers == 0:
        why += " (no core left: graded inline)"
    return workers, why


def grade_workers(setting: Any, device_type: str, decode_threads: int, local_ranks: int = 1) -> tuple[int, str]:
    """``(workers, why)`` for ``generation.grade_workers``: 0 (inline), ``N``, or ``auto`` (:func:`auto_workers`)."""
    if setting == "auto":
        return auto_workers(device_type, decode_threads, local_ranks)
    return int(setting), f"generation.grade_workers={setting}"


# --------------------------------------------------------------------------------------------------------------------
# the worker side (module level: the pool pickles these by name)

_TASK: Any = None
_THINKING = False


def _die_with_parent(parent: int) -> None:
    """Ask Linux to SIGKILL this worker when its parent dies (a killed run leaves no orphan grading)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the pool's own shutdown still ends the workers
        pass
    if os.getppid() != parent:  # the parent died before the request took effect
        os._exit(1)


def _init_worker(task: Any, thinking: bool, parent: int) -> None:
    global _TASK, _THINKING
    _die_with_parent(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    _TASK, _THINKING = task, thinking


def _grade_in_worker(problem: Any, output: str) -> Any:
    return _TASK.grade_many([(problem, output)], thinking=_THINKING)[0]


# --------------------------------------------------------------------------------------------------------------------
# the decode side


class Grader:
    """Grades finished samples and appends their lines to ``path``, inline (``workers=0``) or in a process pool.

    Args:
        task: the run's task (its ``grade_many`` grades; it is pickled once into each worker).
        thinking: the run's thinking flag (passed to the grader).
        path: the samples file this process appends to (``samples.jsonl`` or its rank's part file:
            :func:`vase.run.results.sample_file`).
        workers: 0 for inline grading, else the pool's size.
        choice: why that many (for the manifest).
        on_row: called with each line once it is durable (progress bar, running accuracy).
        record: ``False``: grade and write nothing, only count (a tensor-parallel rank whose group's first rank
            writes the samples).
    """

    def __init__(
        self,
        task: Any,
        thinking: bool,
        path: Path,
        workers: int,
        choice: str = "",
        on_row: Callable[[dict], None] | None = None,
        record: bool = True,
    ):
        self.task, self.thinking, self.path, self.workers = task, thinking, Path(path), workers
        self.choice, self.on_row, self.record = choice, on_row, record
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.submitted = 0
        self.written = 0
        self._pending: list[tuple[Future, Callable[[Any], dict]]] = []
        self._pool: ProcessPoolExecutor | None = None
        if workers > 0:
            import multiprocessing

            self._pool = ProcessPoolExecutor(
                max_workers=workers,
                mp_context=multiprocessing.get_context("spawn"),
                initializer=_init_worker,
                initargs=(task, thinking, os.getpid()),
            )

    @property
    def mode(self) -> str:
        return "background" if self._pool is not None else "inline"

    def describe(self) -> dict:
        """For the manifest: ``mode``, ``workers`` and why."""
        return {"mode": self.mode, "workers": self.workers, "workers_choice": self.choice}

    @property
    def in_flight(self) -> int:
        """Samples handed to the pool whose lines are not written yet."""
        return len(self._pending)

    def submit(self, problem: Any, output: str, make_row: Callable[[Any], dict], grade: bool = True) -> None:
        """Grade ``output`` (``grade=False``: a sample that was not decoded to the end, written ungraded) and write
        ``make_row(grade)`` once graded: now when inline, after a later :meth:`poll` / :meth:`close` otherwise."""
        self.submitted += 1
        if not self.record:
            return
        if not grade:
            self._write(make_row(None))
        elif self._pool is None:
            kill_point("submitted")
            self._write(make_row(self.task.grade_many([(problem, output)], thinking=self.thinking)[0]))
        else:
            # the problem travels with each sample (a LiveCodeBench problem's tests can be large: a worker holds
            # one problem at a time, not every problem of the run)
            self._pending.append((self._pool.submit(_grade_in_worker, problem, output), make_row))
            kill_point("submitted")
        self.poll()

    def poll(self) -> None:
        """Write the lines of the grades that are ready (in the order the samples were handed in)."""
        if not self._pending:
            return
        ready = [item for item in self._pending if item[0].done()]
        if not ready:
            return
        self._pending = [item for item in self._pending if not item[0].done()]
        for fut, make_row in ready:
            self._write(make_row(self._result(fut)))

    def close(self, drain: bool = True) -> None:
        """Wait for every grade and write its line, then stop the workers.

        ``drain=False`` (the run is being interrupted): grades not started are dropped, the ones running finish
        and are written when they succeed; errors are logged, not raised.
        """
        try:
            if not drain:
                for fut, _ in self._pending:
                    fut.cancel()
            while self._pending:
                fut, make_row = self._pending.pop(0)
                if fut.cancelled():
                    continue
                try:
                    row = make_row(self._result(fut))
                except Exception:
                    if drain:
                        raise
                    logger.exception("a sample's grade was lost while the run stopped")
                    continue
                self._write(row)
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True, cancel_futures=True)
                self._pool = None

    def _result(self, fut: Future) -> Any:
        from concurrent.futures.process import BrokenProcessPool

        try:
            return fut.result()
        except BrokenProcessPool as err:
            raise RuntimeError(
                f"a grading worker died ({err}); rerun the same command to resume, or grade inline with "
                "generation.grade_workers=0"
            ) from None

    def _write(self, row: dict) -> None:
        write_sample(self.path, row)  # durable before it counts (then the test hook's "written" kill point)
        self.written += 1
        if self.on_row is not None:
            self.on_row(row)
