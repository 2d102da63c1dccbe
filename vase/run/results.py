"""Run directories on disk — the source of truth (W&B only mirrors them).

A run directory holds:

* ``config.yaml`` — the resolved Hydra config;
* ``protocol.json`` — the settings that define the experiment (model, task protocol, policy, sampling, seed,
  samples, budget); a rerun with a different protocol in the same directory is refused;
* ``manifest.json`` — git SHA, library versions, device, model and dataset revisions, prompt template, sampling,
  seed;
* ``resolved.json`` — what was actually loaded: the commit every hub dataset and model resolved to, the sha256 of
  every local data file (:func:`check_resolved`); a resumed run whose data or weights changed is refused;
* ``samples.jsonl`` — one line per finished sample, appended and flushed (fsync) as each sample finishes;
* ``throughput.jsonl`` — one line per stretch of decoding (wall times, tokens, rows in flight, memory);
* ``metrics.json`` — written at the end (and rewritten by a resumed run); see :mod:`vase.run.records`;
* ``.vase.lock`` — the writer's lock (:func:`lock_run_dir`): one run writes a run directory at a time.

A run directory is owned: a run writes only into a directory that is absent, empty or already one of these
(:func:`check_run_dir`), and never shortens or rewrites ``samples.jsonl`` (it appends; a torn last line left by a kill
is the only thing ever cut off).
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import os
import platform
import signal
import socket
import subprocess
import time
from collections.abc import Iterable, Mapping
from fnmatch import fnmatch
from importlib import metadata
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

SAMPLES = "samples.jsonl"
THROUGHPUT = "throughput.jsonl"
RESOLVED = "resolved.json"
PROTOCOL = "protocol.json"
LOCK = ".vase.lock"
#: every entry a run directory of this harness may hold (W&B's offline runs in ``wandb/``, the kept sets of
#: ``record_kept=true`` in ``kept_sets/``): a directory holding anything else is not a run (:func:`check_run_dir`)
RUN_DIR_ENTRIES = frozenset(
    {
        PROTOCOL,
        RESOLVED,
        SAMPLES,
        THROUGHPUT,
        LOCK,
        "config.yaml",
        "manifest.json",
        "metrics.json",
        "wandb",
        "kept_sets",
    }
)
#: and names of these forms (per-process sample or throughput files of a data-parallel run, :func:`write_json`'s
#: temporary files left by a kill mid-write)
RUN_DIR_PATTERNS = ("samples*.jsonl", "throughput*.jsonl", "*.tmp")
#: the fields every line of ``samples.jsonl`` has (:func:`read_samples`)
SAMPLE_FIELDS = ("problem_id", "sample", "correct")
#: test hook: ``k`` (or ``k:INT``) SIGKILLs (SIGINTs) this process right after its k-th sample is durable
#: (:func:`write_sample`)
KILL_AFTER_SAMPLES_ENV = "VASE_TEST_KILL_AFTER_SAMPLES"


def stable_hash(obj: Any, n: int = 8) -> str:
    """Short hex digest of a JSON-serialisable object (key order independent)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:n]


def read_jsonl_tolerant(path: Path, repair: bool = False) -> list[dict]:
    """Rows of a JSONL file written by a run that may have been killed mid-line.

    A torn (unparseable) last line is ignored; with ``repair`` the file is truncated to its last complete line so
    appends continue cleanly. A bad line elsewhere is an error (the file is corrupt, not torn).
    """
    return [row for _, row in _numbered_rows(path, repair)]


def _numbered_rows(path: Path, repair: bool = False) -> list[tuple[int, Any]]:
    """``(line number, row)`` of :func:`read_jsonl_tolerant`."""
    if not path.exists():
        return []
    data = path.read_bytes()
    rows, good_end, pos = [], 0, 0
    lines = data.split(b"\n")
    for i, line in enumerate(lines):
        end = pos + len(line) + (1 if i < len(lines) - 1 else 0)
        if line.strip():
            try:
                rows.append((i + 1, json.loads(line)))
            except (json.JSONDecodeError, UnicodeDecodeError):
                if i < len(lines) - 1 and any(x.strip() for x in lines[i + 1 :]):
                    raise ValueError(
                        f"{path}: corrupt line {i + 1} (not the last line, so not a torn write); fix or delete that "
                        "line (every other line is kept)"
                    ) from None
                logger.warning("%s: ignoring a torn last line (%d bytes)", path, len(line))
                break
        if i < len(lines) - 1:
            good_end = end
        elif line.strip():
            good_end = end  # a complete last line without its newline
        pos = end
    if repair and good_end < len(data):
        with open(path, "r+b") as f:
            f.truncate(good_end)
        if good_end and not data[:good_end].endswith(b"\n"):
            with open(path, "ab") as f:
                f.write(b"\n")
    return rows


def read_samples(path: Path, repair: bool = False) -> list[dict]:
    """The samples of a ``samples.jsonl`` (:func:`read_jsonl_tolerant`), each checked to be one.

    A line that is valid JSON but not a sample (not an object with :data:`SAMPLE_FIELDS`) is a one-line
    ``ValueError`` naming the file and the line: the file was edited, or is not a vase samples file.
    """
    rows = _numbered_rows(path, repair)
    for lineno, row in rows:
        ok = isinstance(row, dict) and all(k in row for k in SAMPLE_FIELDS)
        if ok and not (isinstance(row["problem_id"], str) and isinstance(row["sample"], int)):
            ok = False
        if not ok:
            what = (
                f"an object without {', '.join(k for k in SAMPLE_FIELDS if k not in row)}"
                if isinstance(row, dict)
                else f"a JSON {type(row).__name__}"
            )
            raise ValueError(
                f"{path}: line {lineno} is not a sample ({what}; every line vase writes is an object with "
                f"{', '.join(SAMPLE_FIELDS)}); delete that line or restore the file from a copy, then rerun"
            )
    return [row for _, row in rows]


_samples_written = 0


def write_sample(run_dir: Path, row: Mapping) -> None:
    """Append one finished sample to ``run_dir/samples.jsonl``, durably (:func:`append_jsonl`).

    Test hook: with ``VASE_TEST_KILL_AFTER_SAMPLES=k`` in the environment the process SIGKILLs itself right after its
    k-th sample is durable (``k:INT`` sends SIGINT instead, as Ctrl-C does), so a kill test stops a run at a known
    point, never after a poll.
    """
    global _samples_written
    append_jsonl(run_dir / SAMPLES, [row])
    _samples_written += 1
    hook = os.environ.get(KILL_AFTER_SAMPLES_ENV, "").strip()
    if hook:
        count, _, name = hook.partition(":")
        if count.isdigit() and _samples_written == int(count):
            os.kill(os.getpid(), getattr(signal, f"SIG{name or 'KILL'}"))


def append_jsonl(path: Path, rows: Iterable[Mapping]) -> None:
    """Append rows and make them durable (flush + fsync) before returning."""
    with open(path, "a", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, default=str) + "\n")
        f.flush()
        os.fsync(f.fileno())


def write_json(path: Path, obj: Any) -> None:
    """Write JSON atomically (temp file + rename); a file that already holds exactly this JSON is left untouched."""
    text = json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n"
    if path.is_file() and path.read_bytes() == text.encode():
        return
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def read_json(path: Path) -> dict:
    """A JSON object this harness wrote, or a one-line ``ValueError`` naming the file when it is damaged (truncated,
    not UTF-8, edited into something else)."""
    try:
        obj = json.loads(path.read_bytes().decode("utf-8"))
        if not isinstance(obj, dict):
            raise ValueError(f"a JSON {type(obj).__name__}, not an object")
        return obj
    except (json.JSONDecodeError, UnicodeDecodeError, ValueError) as err:
        reason = " ".join(str(err).split())
        raise ValueError(
            f"{path}: damaged ({reason}; vase writes it atomically, so something else truncated or edited it); "
            f"restore it from a copy, or move {path.parent} aside and start the run afresh"
        ) from None


def diff_protocol(old: Mapping, new: Mapping, prefix: str = "") -> list[str]:
    """Human-readable differences between two nested protocol dicts (``key: old -> new``)."""
    out = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key, "<unset>"), new.get(key, "<unset>")
        name = f"{prefix}{key}"
        if isinstance(a, Mapping) and isinstance(b, Mapping):
            out += diff_protocol(a, b, name + ".")
        elif a != b:
            out.append(f"{name}: {a!r} -> {b!r}")
    return out


def check_protocol(run_dir: Path, protocol: Mapping, write: bool = True) -> None:
    """Refuse to continue a run whose stored protocol differs; store it for a new run (unless ``write=False``: the
    check before anything is written)."""
    path = run_dir / PROTOCOL
    if path.exists():
        old = read_json(path)
        diffs = diff_protocol(old, json.loads(json.dumps(protocol, default=str)))
        if diffs:
            raise ValueError(
                f"run_dir {run_dir} holds a run with a different protocol ({'; '.join(diffs)}); "
                "resume with the original settings, or set run_dir= / results_dir= for a new run"
            )
    elif write:
        write_json(path, protocol)


def git_sha() -> str | None:
    """The project's git commit (``+dirty`` when the tree has changes), or None outside a checkout."""
    root = Path(__file__).resolve().parents[1]
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=5)
        if sha.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=root, capture_output=True, text=True, timeout=5)
        return sha.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None


def library_versions() -> dict[str, str | None]:
    """Versions of the libraries that can change results."""
    out = {}
    for name in ("torch", "transformers", "flash-attn", "math-verify", "datasets", "hydra-core", "vase"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def device_info() -> dict[str, Any]:
    """The machine: platform, CPU count, and the CUDA device when there is one."""
    import torch

    info: dict[str, Any] = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
    }
    if torch.cuda.is_available():
        info["cuda_device"] = torch.cuda.get_device_name()
        info["cuda"] = torch.version.cuda
    return info


def peak_memory_bytes(device) -> int:
    """CUDA max allocated on a CUDA device, else the process's peak resident set size."""
    import torch

    if getattr(device, "type", str(device)) == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


def _source_key(src: Mapping) -> str:
    """A stable name for one resolved source: ``dataset:<id>[:<config>][:<split>]``, ``file:<name>``, ..."""
    for key in ("dataset", "file", "dir", "generator"):
        if key in src:
            extra = [str(src[k]) for k in ("config", "split", "release") if src.get(k) is not None]
            return ":".join([key, str(src[key]), *extra])
    return stable_hash(src, 12)


def _keyed(value: Any) -> Any:
    """Lists of sources as mappings keyed by :func:`_source_key` (so a difference names its source)."""
    if isinstance(value, list) and value and all(isinstance(v, Mapping) for v in value):
        return {_source_key(v): _keyed(dict(v)) for v in value}
    if isinstance(value, Mapping):
        return {str(k): _keyed(v) for k, v in value.items()}
    return value


def _compare(old: Any, new: Any, name: str, diffs: list[str]) -> Any:
    """Append ``name: old -> new`` for each difference; return the merged value to store.

    A ``files`` mapping (hashes of files read on demand, which depend on ``limit``) is compared on the files both
    sides have and stored as their union; anything else must be equal.
    """
    if not (isinstance(old, Mapping) and isinstance(new, Mapping)):
        if old != new:
            diffs.append(f"{name}: {old!r} -> {new!r}")
        return new
    merged = {}
    for key in sorted(set(old) | set(new)):
        sub = f"{name}.{key}"
        a, b = old.get(key, "<unset>"), new.get(key, "<unset>")
        if key == "files" and isinstance(a, Mapping) and isinstance(b, Mapping):
            diffs += [f"{sub}.{f}: {a[f]!r} -> {b[f]!r}" for f in sorted(set(a) & set(b)) if a[f] != b[f]]
            merged[key] = {**a, **b}
        else:
            merged[key] = _compare(a, b, sub, diffs)
    return merged


def check_resolved(run_dir: Path, resolved: Mapping[str, Any], write: bool = True) -> dict:
    """Refuse to continue a run whose data or weights changed; record what this run loaded.

    ``resolved`` holds some top-level entries, e.g. ``{"data": task.resolved_sources()}`` right after the problems
    load and ``{"model": model_spec.resolve()}`` before the weights load. Each entry is compared with the one stored
    in ``run_dir/resolved.json`` by an earlier run of the directory (an entry not stored yet is just stored): a
    changed commit or content hash is a one-line ``ValueError`` naming every difference, like a changed protocol.
    Lists of sources are stored keyed by source (``dataset:<id>:<split>``, ``file:<name>``); in a ``files`` mapping
    only the files both runs read are compared, and the union is kept.

    With ``write=False`` nothing is written (the check before a new run's directory exists).

    Returns the content of ``resolved.json`` after the update.
    """
    path = run_dir / RESOLVED
    stored = read_json(path) if path.exists() else {}
    new = _keyed(json.loads(json.dumps(dict(resolved), default=str)))
    diffs: list[str] = []
    updated = dict(stored)
    for key, value in new.items():
        updated[key] = value if key not in stored else _compare(stored[key], value, key, diffs)
    if diffs:
        raise ValueError(
            f"run_dir {run_dir} holds a run made from other data or weights ({'; '.join(diffs)}); resume with the "
            "original revisions and files, or set run_dir= / results_dir= for a new run"
        )
    if write and (updated != stored or not path.exists()):
        write_json(path, updated)
    return updated


# --------------------------------------------------------------------------------------------------------------------
# ownership and the writer's lock


def check_run_dir(run_dir: Path, setting: str = "run_dir") -> None:
    """Refuse a target a run may not write into, before anything is written (one line naming ``setting``).

    A run writes into ``run_dir`` only when it is absent (its nearest existing ancestor a writable directory), empty,
    or a run directory of this harness: every entry one of :data:`RUN_DIR_ENTRIES` or of the forms
    :data:`RUN_DIR_PATTERNS`, and ``protocol.json`` there unless the directory holds nothing but the lock (a run
    killed before it wrote anything). ``run_dir=conf`` or ``results_dir=/dev/null`` are refused, never written into.
    """
    run_dir = Path(run_dir)
    if setting.startswith("results_dir"):
        fix = "point results_dir at a directory you can write, e.g. results_dir=results"
    else:
        fix = f"point {setting} at a new or empty directory, or at a vase run directory to resume it"
    check_writable(run_dir, setting, fix)
    if not run_dir.exists():
        return
    entries = sorted(os.listdir(run_dir))
    foreign = [e for e in entries if e not in RUN_DIR_ENTRIES and not any(fnmatch(e, p) for p in RUN_DIR_PATTERNS)]
    if foreign:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise ValueError(f"{setting}: {run_dir} is not a vase run directory (it holds {shown}); {fix}")
    if entries and PROTOCOL not in entries and set(entries) - {LOCK}:
        raise ValueError(
            f"{setting}: {run_dir} holds {', '.join(entries)} but no {PROTOCOL}, so it is not a vase run directory "
            f"(or a damaged one); {fix}"
        )


def check_writable(path: Path, setting: str, fix: str) -> None:
    """``path`` is a writable directory, or can be created: its nearest existing ancestor is a writable directory.
    One line naming ``setting`` otherwise (nothing is created)."""
    path = Path(path)
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
