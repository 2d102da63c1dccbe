"""Who may write a run directory: ownership (:func:`check_run_dir`) and the writer's lock (:func:`lock_run_dir`).

* A run writes only into a directory that is absent, empty or already a run directory of this harness: every entry
  (and every file under ``ranks/``) matches :data:`RUN_DIR_CONTENT`. ``run_dir=conf`` or ``results_dir=/dev/null`` are
  refused in one line before anything is written.
* One process writes a run directory at a time: it holds ``run_dir/.vase.lock`` (an exclusive ``fcntl.flock``, the
  holder's pid, host and start time written in it) from before its first write until its metrics are written. A
  data-parallel job (``torchrun``, :mod:`vase.run.distributed`) takes it once, on rank 0, for the whole job; the other
  ranks never take it (rank 0 opens the directory before they read it, and they write only their own part files
  under ``ranks/``). :func:`probe_lock` checks it without creating anything (the checks before a run starts).
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import time
from fnmatch import fnmatch
from pathlib import Path

from vase.run.results import LOCK, PROTOCOL, RANKS, RESOLVED, SAMPLES, THROUGHPUT

logger = logging.getLogger(__name__)

#: everything a run directory of this harness may hold, one list: a name, a pattern (``*.tmp``: :func:`write_json`'s
#: temporary files left by a kill mid-write), ``<dir>/`` for a directory whose content is its owner's (W&B's offline
#: runs, the kept sets of ``record_kept=true``), or ``<dir>/<pattern>`` for the files of a directory (the part files
#: of a data-parallel run under way or killed). A directory holding anything else is not a run (:func:`check_run_dir`).
RUN_DIR_CONTENT = (
    PROTOCOL,
    RESOLVED,
    SAMPLES,
    THROUGHPUT,
    LOCK,
    "config.yaml",
    "manifest.json",
    "metrics.json",
    "*.tmp",
    "wandb/",
    "kept_sets/",
    f"{RANKS}/rank*.{SAMPLES}",
    f"{RANKS}/rank*.{THROUGHPUT}",
)


def foreign_entries(run_dir: Path) -> list[str]:
    """The entries of ``run_dir`` (and of its ``ranks/``) that :data:`RUN_DIR_CONTENT` does not allow."""
    foreign = []
    for entry in sorted(os.listdir(run_dir)):
        if (run_dir / entry).is_dir():
            inside = [p.split("/", 1)[1] for p in RUN_DIR_CONTENT if p.startswith(entry + "/")]
            if "" in inside:  # <dir>/: its owner's
                continue
            if inside:
                foreign += [
                    f"{entry}/{e}"
                    for e in sorted(os.listdir(run_dir / entry))
                    if (run_dir / entry / e).is_dir() or not any(fnmatch(e, p) for p in inside)
                ]
                continue
            foreign.append(entry + "/")
        elif not any(fnmatch(entry, p) for p in RUN_DIR_CONTENT if "/" not in p):
            foreign.append(entry)
    return foreign


def check_run_dir(run_dir: Path, setting: str = "run_dir") -> None:
    """Refuse a target a run may not write into, before anything is written (one line naming ``setting``).

    A run writes into ``run_dir`` only when it is absent (its nearest existing ancestor a writable directory), empty,
    or a run directory of this harness: everything in it allowed by :data:`RUN_DIR_CONTENT`, and ``protocol.json``
    there unless the directory holds nothing but the lock (a run killed before it wrote anything).
    """
    run_dir = Path(run_dir)
    if setting.startswith("results_dir"):
        fix = "point results_dir at a directory you can write, e.g. results_dir=results"
    else:
        fix = f"point {setting} at a new or empty directory, or at a vase run directory to resume it"
    check_writable(run_dir, setting, fix)
    if not run_dir.exists():
        return
    foreign = foreign_entries(run_dir)
    if foreign:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise ValueError(f"{setting}: {run_dir} is not a vase run directory (it holds {shown}); {fix}")
    entries = sorted(os.listdir(run_dir))
    if entries and PROTOCOL not in entries and set(entries) - {LOCK}:
        raise ValueError(
            f"{setting}: {run_dir} holds {', '.join(entries)} but no {PROTOCOL}, so it is not a vase run directory "
            f"(or a damaged one); {fix}"
        )


def check_writable(path: Path, setting: str, fix: str) -> None:
    """``path`` is a writable directory, or can be created: its nearest existing ancestor is a writable directory.
    One line naming ``setting`` otherwise (nothing is created)."""
    path = Path(path)
    _check_links(path, setting, fix)
    if path.exists():
        if not path.is_dir():
            raise ValueError(f"{setting}: {path} is not a directory; {fix}")
        if not os.access(path, os.W_OK | os.X_OK):
            raise ValueError(f"{setting}: {path} is not writable; make it writable, or {fix}")
        return
    ancestor = path.absolute().parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise ValueError(f"{setting}: {path} cannot be created ({ancestor} is not a directory); {fix}")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise ValueError(f"{setting}: {path} cannot be created ({ancestor} is not writable); {fix}, on a writable disk")


def _check_links(path: Path, setting: str, fix: str) -> None:
    """``path`` and each of its ancestors either exists or is absent: a symbolic link that points nowhere (a dangling
    link, or a loop) is one line naming it, where ``mkdir`` would fail after Hydra wrote its directory."""
    for p in [path, *path.absolute().parents]:
        if p.exists() or not os.path.islink(p):
            continue
        try:
            p.resolve(strict=True)
            why = "a symbolic link that cannot be followed"
        except RuntimeError:  # Python < 3.13: a loop
            why = "a symbolic link loop"
        except OSError as err:
            loop = err.errno == errno.ELOOP
            why = "a symbolic link loop" if loop else f"a dangling symbolic link (to {os.readlink(p)})"
        where = "" if p == path else f" (on the way to {path})"
        raise ValueError(f"{setting}: {p} is {why}{where}; remove or repair the link, or {fix}")


class RunDirBusy(ValueError):
    """Another process holds the run directory's lock (:func:`lock_run_dir`); the message names it."""


class RunDirLock:
    """An exclusive lock on a run directory, held while this object is open (see :func:`lock_run_dir`)."""

    def __init__(self, run_dir: Path, fd: int | None):
        self.run_dir, self._fd = Path(run_dir), fd

    @property
    def held(self) -> bool:
        """Whether the lock is held (``False`` after :meth:`release`, or on a file system without locks)."""
        return self._fd is not None

    def release(self) -> None:
        """Release the lock (closing its file descriptor); idempotent."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> RunDirLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


_warned_no_locks: set[str] = set()


def _busy(run_dir: Path, fd: int) -> RunDirBusy:
    """The refusal naming the lock's holder (read from the lock file)."""
    holder = os.pread(fd, 4096, 0).decode("utf-8", "replace").strip()
    try:
        info = json.loads(holder)
        who = f"pid {info.get('pid')} on {info.get('host')}, since {info.get('since')}"
    except (json.JSONDecodeError, AttributeError):
        who = "another process"
    return RunDirBusy(
        f"run_dir {run_dir} is being written by another run ({who}); wait for it to finish (then rerun this command "
        "to resume or extend it), or set run_dir= / results_dir= for a separate run"
    )


def probe_lock(run_dir: Path) -> None:
    """Raise :class:`RunDirBusy` when another process holds ``run_dir``'s lock; creates nothing (a check before
    anything is written; the run itself takes the lock with :func:`lock_run_dir`)."""
    path = Path(run_dir) / LOCK
    if not path.is_file():
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise _busy(Path(run_dir), fd) from None
    finally:
        os.close(fd)


def lock_run_dir(run_dir: Path) -> RunDirLock:
    """Take the exclusive writer's lock of ``run_dir`` (created if absent), or raise :class:`RunDirBusy` in one line.

    ``fcntl.flock`` on ``run_dir/.vase.lock``, non-blocking: the kernel releases it when its holder exits in any way,
    ``kill -9`` included, so a crashed run never leaves a stale lock. The holder's pid, host and start time are written
    into the file for the refusal's message. Hold it for as long as the process may write the directory (``with
    lock_run_dir(d): ...`` or :meth:`RunDirLock.release`); a data-parallel job takes it once, on rank 0, for all its
    ranks. Any process that opens the file separately conflicts with it, including the same process (two runs of one
    directory in a test). On a file system without ``flock`` (some Lustre mounts) the run goes on unlocked, with a
    warning.
    """
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        if err.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            os.close(fd)
            if str(run_dir) not in _warned_no_locks:
                _warned_no_locks.add(str(run_dir))
                logger.warning(
                    "run dir %s: this file system has no file locks (%s); a second run writing this directory at the "
                    "same time would not be detected",
                    run_dir,
                    err.strerror,
                )
            return RunDirLock(run_dir, None)
        busy = _busy(run_dir, fd)
        os.close(fd)
        raise busy from None
    info = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%d %H:%M:%S")}
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
    return RunDirLock(run_dir, fd)
