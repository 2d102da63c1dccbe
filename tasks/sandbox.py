"""Run untrusted (model-generated) programs in isolated child processes.

Long module: the isolation levels, their probe, the uid reservation and the launcher protocol are one security
boundary; split, its invariants would be spread over files a reviewer must read together.

Nothing generated ever runs in the harness process. :func:`run_program` starts one child per program through the
trusted launcher ``tasks/_sandbox_launcher.py`` (a fresh interpreter, so no ``preexec_fn`` runs in the
multi-threaded harness) and enforces:

* wall clock: past ``timeout_s`` the harness kills the run (full mode: the launcher kills the program's PID
  namespace, then the sandbox uid is swept; basic mode: the whole process group gets SIGKILL). CPU time
  (``RLIMIT_CPU``), address space (``RLIMIT_AS``), processes + threads (``RLIMIT_NPROC``), file size
  (``RLIMIT_FSIZE``), open files (``RLIMIT_NOFILE``), no core dumps, and an output cap: stdout and stderr are read
  incrementally and the program is killed as soon as either passes ``max_output_bytes`` (printing 1 GB never gets
  buffered);
* a clean environment (only ``PATH``, ``HOME``, ``TMPDIR``, ``LANG``/``LC_ALL`` and single-thread BLAS settings: no
  harness variable, hence no secret, reaches the program) and a fresh temporary working directory, also ``HOME``;
* the run dies with the harness (``PR_SET_PDEATHSIG``) and never outlives ``timeout_s + 5`` s (launcher alarm).

The program runs as ``__main__`` of the harness's interpreter in isolated mode, without :mod:`site` start-up but with
the site-packages directories importable (see :func:`_bootstrap`).

Isolation levels (:func:`isolation_mode`, probed once):

* ``full`` (the harness runs as root and namespaces work): private network, mount, PID, IPC and UTS namespaces;
  ``/tmp``, ``/var/tmp``, ``/dev/shm``, ``/run/lock`` and the harness user's home are covered by fresh tmpfs mounts
  (writes go nowhere; the Python installation is re-bound read-only where a cover hid it); a private ``/proc``; the
  program runs as a dedicated unprivileged uid, one per concurrent run (from :data:`SANDBOX_UID_BASE`, reserved with
  a lock file so several harness processes on one machine never share one), so ``RLIMIT_NPROC`` - ignored for
  root - bounds each run separately. The program cannot see or signal the harness, and everything it forked dies
  with it.
* ``basic`` (a non-root user, e.g. on a cluster): the limits above, a new session killed as a group, and a private
  network namespace only if unprivileged user namespaces are allowed. Files outside the working directory are
  protected only by the user's own permissions, and ``RLIMIT_NPROC`` counts all the user's processes (it is set to
  their current count + ``max_procs``). A warning is logged once.
* root without working namespaces (e.g. an unprivileged container): refused with :class:`SandboxRefused` (a
  ``ValueError``: one line with the fix), since basic mode would keep root's file access and ``RLIMIT_NPROC`` does
  not apply to root. Opt in explicitly with ``VASE_SANDBOX_ALLOW_ROOT_FALLBACK=1`` (:data:`ALLOW_ROOT_FALLBACK_ENV`)
  to run in basic mode anyway (a warning says what is lost).

Not covered even in ``full`` mode: reads of world-readable files (the program can read the code base and system
files, never write them), and CPU/memory contention with the harness beyond the limits.

:func:`run_many` runs programs in parallel on a thread pool (each worker drives one child), bounded by the cores.

(About 600 lines, one module on purpose: the isolation probe, the uid pool and the run loop share private state and
are reviewed together as the security boundary; the privileged part lives in ``_sandbox_launcher.py``.)
"""

from __future__ import annotations

import dataclasses
import fcntl
import functools
import json
import logging
import math
import os
import pwd
import selectors
import shutil
import signal
import site
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)

LAUNCHER = Path(__file__).with_name("_sandbox_launcher.py")
SETUP_ERROR_STATUS = 125
SETUP_ERROR_TAG = "VASE_SANDBOX_SETUP_ERROR"
#: First uid used for sandboxed programs in ``full`` mode; run ``i`` of those in flight at once gets ``BASE + i``.
SANDBOX_UID_BASE = 64000
MAX_SANDBOX_UIDS = 1024
#: Working directory of the program inside the private ``/tmp`` in ``full`` mode.
FULL_MODE_WORKDIR = "/tmp/vase_sandbox"
COVERED_TMP_DIRS = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")
STATUSES = ("ok", "failed", "timeout", "output_limit", "error")
#: Set to 1 to run generated code as root in ``basic`` mode when full isolation is unavailable (refused otherwise).
ALLOW_ROOT_FALLBACK_ENV = "VASE_SANDBOX_ALLOW_ROOT_FALLBACK"


class SandboxRefused(ValueError):
    """The sandbox will not run generated code here (root without isolation); the message says how to fix it."""


@dataclass(frozen=True)
class SandboxLimits:
    """Resource limits of one sandboxed run.

    Attributes:
        timeout_s: wall-clock limit; the whole process group is killed when it passes.
        cpu_s: CPU-time limit (``RLIMIT_CPU``, rounded up to whole seconds); ``None`` means ``timeout_s``.
        memory_mb: address-space limit (``RLIMIT_AS``) of each process.
        max_procs: processes plus threads the sandbox uid may hold (``RLIMIT_NPROC``).
        max_output_bytes: cap on stdout and on stderr; the program is killed when either passes it.
        max_file_mb: largest file the program may write (``RLIMIT_FSIZE``).
        max_open_files: ``RLIMIT_NOFILE``.
        tmp_mb: size of each private tmpfs (``/tmp``, which holds the working directory, ``/dev/shm``, ...) in full
            mode.
    """

    timeout_s: float = 10.0
    cpu_s: float | None = None
    memory_mb: int = 2048
    max_procs: int = 64
    max_output_bytes: int = 16 * 1024 * 1024
    max_file_mb: int = 64
    max_open_files: int = 256
    tmp_mb: int = 128

    def __post_init__(self) -> None:
        for name in ("timeout_s", "cpu_s"):
            value = getattr(self, name)
            if value is None and name == "cpu_s":
                continue
            if not _is_real(value) or not math.isfinite(value) or value <= 0:
                alt = " or None" if name == "cpu_s" else ""
                raise ValueError(f"sandbox.{name}: must be a finite number of seconds > 0{alt}, got {value!r}")
        for name in _INTEGRAL_LIMITS:
            value = getattr(self, name)
            if not _is_real(value) or not math.isfinite(value) or value != int(value) or value < 1:
                raise ValueError(f"sandbox.{name}: must be a whole number >= 1 (an OS limit), got {value!r}")
            object.__setattr__(self, name, int(value))


_INTEGRAL_LIMITS = ("memory_mb", "max_procs", "max_output_bytes", "max_file_mb", "max_open_files", "tmp_mb")


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class SandboxSetupError(ValueError):
    """The sandbox could not run a program at all (its own setup failed): never a grade of the program."""


@dataclass
class SandboxResult:
    """Outcome of one sandboxed run.

    Attributes:
        status: ``ok`` (exit status 0), ``failed`` (non-zero exit or killed by a signal, e.g. ``MemoryError`` under
            the address-space limit), ``timeout`` (wall clock or CPU time), ``output_limit`` (too much output) or
            ``error`` (the sandbox itself could not start the program: reported by the launcher on a pipe the
            program never holds, or raised in the harness, so a program cannot fake it; see
            :func:`raise_for_setup`).
        stdout: decoded stdout (UTF-8, undecodable bytes replaced), at most ``max_output_bytes``.
        stderr: decoded stderr, at most ``max_output_bytes``.
        returncode: exit status; negative for a signal (as :mod:`subprocess`); ``None`` if never started.
        wall_s: wall-clock seconds from start to the end of the cleanup.
        reason: short human-readable cause of a non-``ok`` status.
        uid: the unprivileged uid the program ran as (full mode), for debugging.
    """

    status: str
    stdout: str = ""
    stderr: str = ""
    returncode: int | None = None
    wall_s: float = 0.0
    reason: str = ""
    uid: int | None = None

    @property
    def ok(self) -> bool:
        """Whether the program exited normally with status 0."""
        return self.status == "ok"


@dataclass
class Program:
    """One program for :func:`run_many`: its source, stdin and extra files (``{relative path: text}``)."""

    code: str
    stdin: str | bytes = ""
    files: Mapping[str, str | bytes] = field(default_factory=dict)
    args: Sequence[str] = ()


# --------------------------------------------------------------------------------------------------------------------
# isolation mode and uid pool


_mode_lock = threading.Lock()
_mode: str | None = None
_refusal: str | None = None  # why isolation_mode() refuses (root without namespaces, no opt-in), once probed
_uid_lock = threading.Lock()
_uids_in_use: dict[int, int] = {}  # uid -> fd holding its lock file


def _covered_dirs() -> list[tuple[str, str, int]]:
    """``(path, tmpfs mode, size factor)`` of the directories covered by a private tmpfs in full mode."""
    homes = {os.path.expanduser("~"), pwd.getpwuid(os.getuid()).pw_dir}
    out: list[tuple[str, str, int]] = [(d, "1777", 1) for d in COVERED_TMP_DIRS if os.path.isdir(d)]
    out += [(h, "0755", 0) for h in sorted(homes) if h not in ("/", "") and os.path.isdir(h)]
    return out


def _exposed_dirs(covered: Sequence[str]) -> list[str]:
    """Directories of the Python installation hidden by a cover, re-bound read-only inside the sandbox."""
    roots = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    roots.add(str(Path(os.path.realpath(sys.executable)).parent.parent))
    out = []
    for root in sorted(os.path.realpath(r) for r in roots):
        if any(root == c or root.startswith(c.rstrip("/") + "/") for c in covered) and root not in out:
            if not any(root.startswith(o + "/") for o in out):
                out.append(root)
    return out


def _remove_stale_dirs() -> None:
    """Remove the temporary directories of harness processes that died without cleaning up (killed mid-run)."""
    for path in Path(tempfile.gettempdir()).glob("vase-sbx-*-*"):
        owner = path.name.split("-")[2]
        if owner.isdigit() and not Path(f"/proc/{owner}").exists():
            shutil.rmtree(path, ignore_errors=True)


def root_fallback_allowed() -> bool:
    """Whether the user opted in to ``basic`` isolation while running as root (:data:`ALLOW_ROOT_FALLBACK_ENV`)."""
    return os.environ.get(ALLOW_ROOT_FALLBACK_ENV, "").strip().lower() in ("1", "true", "yes")


def isolation_mode() -> str:
    """The isolation level available here, ``"full"`` or ``"basic"`` (probed once by running a tiny program).

    Raises:
        SandboxRefused: running as root where full isolation does not work, unless
            ``VASE_SANDBOX_ALLOW_ROOT_FALLBACK=1`` (root keeps its file access in basic mode and ``RLIMIT_NPROC`` does
            not apply to it).
    """
    global _mode, _refusal
    with _mode_lock:
        if _refusal is not None:
            raise SandboxRefused(_refusal)
        if _mode is None:
            _remove_stale_dirs()
            mode = "basic"
            if os.geteuid() == 0:
                probe = _run("import socket, os\nprint(os.getuid())", mode="full", limits=SandboxLimits(timeout_s=10))
                if probe.ok and probe.stdout.strip() != "0":
                    mode = "full"
                else:
                    why = " ".join(f"{probe.status} {probe.reason} {probe.stderr}".split())[-200:]
                    if not root_fallback_allowed():
                        _refusal = (
                            f"sandbox: refusing to run generated code as root without isolation (namespaces "
                            f"unavailable: {why}); run as a non-root user, or allow namespaces (e.g. a container "
                            f"with CAP_SYS_ADMIN), or opt in to the weaker basic mode with "
                            f"{ALLOW_ROOT_FALLBACK_ENV}=1"
                        )
                        raise SandboxRefused(_refusal)
                    logger.warning(
                        "sandbox: full isolation unavailable (%s); running generated code as ROOT in basic mode "
                        "because %s=1: it keeps root's file access and no process-count limit applies",
                        why,
                        ALLOW_ROOT_FALLBACK_ENV,
                    )
            if mode == "basic":
                logger.warning(
                    "sandbox: basic isolation only (resource limits, clean environment, fresh working directory; "
                    "no private filesystem, network isolation only where unprivileged user namespaces work, and the "
                    "process-count limit is shared with this user's processes)"
                )
            _mode = mode
        return _mode


def _acquire_uid() -> int:
    """A sandbox uid no other run uses, in this process (a set) or in another harness process on the machine (an
    ``flock`` on ``<tmp>/vase-sandbox-locks/uid-<uid>.lock``, released by the kernel if the holder dies)."""
    lock_dir = Path(tempfile.gettempdir()) / "vase-sandbox-locks"
    lock_dir.mkdir(mode=0o700, exist_ok=True)
    with _uid_lock:
        for uid in range(SANDBOX_UID_BASE, SANDBOX_UID_BASE + MAX_SANDBOX_UIDS):
            if uid in _uids_in_use:
                continue
            fd = os.open(lock_dir / f"uid-{uid}.lock", os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                continue
            _uids_in_use[uid] = fd
            return uid
    raise RuntimeError(f"sandbox: all {MAX_SANDBOX_UIDS} sandbox uids from {SANDBOX_UID_BASE} are in use")


def _release_uid(uid: int) -> None:
    with _uid_lock:
        fd = _uids_in_use.pop(uid, None)
    if fd is not None:
        os.close(fd)  # drops the flock


def _pids_of_uid(uid: int, include_zombies: bool = False) -> list[int]:
    """Host pids whose real uid is ``uid`` (zombies, which cannot be killed, are skipped unless asked for)."""
    pids = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
            if int(fields["Uid"].split()[0]) == uid and (
                include_zombies or not fields["State"].strip().startswith("Z")
            ):
                pids.append(int(entry.name))
        except (OSError, ValueError, KeyError):
            continue
    return pids


def _kill_uid(uid: int, rounds: int = 50) -> None:
    """Backstop: SIGKILL every process of ``uid`` until none is left (normally there is none)."""
    for _ in range(rounds):
        pids = _pids_of_uid(uid)
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.01)
    logger.warning("sandbox: processes of uid %d survived %d kill rounds", uid, rounds)


def _user_task_count() -> int:
    """Processes plus threads of this uid (what ``RLIMIT_NPROC`` counts for a non-root user)."""
    uid, total = os.getuid(), 0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
            if int(fields["Uid"].split()[0]) == uid:
                total += int(fields["Threads"])
        except (OSError, ValueError, KeyError):
            continue
    return total


# --------------------------------------------------------------------------------------------------------------------
# one run


def _rlimits(limits: SandboxLimits, mode: str) -> dict[str, list[int]]:
    cpu = int(-(-(limits.cpu_s if limits.cpu_s is not None else limits.timeout_s) // 1))
    nproc = limits.max_procs if mode == "full" else _user_task_count() + limits.max_procs
    mem = limits.memory_mb * 1024 * 1024
    fsize = limits.max_file_mb * 1024 * 1024
    return {
        "RLIMIT_CPU": [cpu, cpu + 1],
        "RLIMIT_AS": [mem, mem],
        "RLIMIT_NPROC": [nproc, nproc],
        "RLIMIT_FSIZE": [fsize, fsize],
        "RLIMIT_NOFILE": [limits.max_open_files, limits.max_open_files],
        "RLIMIT_CORE": [0, 0],
    }


@functools.lru_cache(maxsize=1)
def _bootstrap() -> str:
    """The ``python -I -S -c`` code that runs ``main.py`` as ``__main__``.

    Skipping :mod:`site` halves the interpreter start-up (no ``.pth`` processing), which dominates short test runs;
    the bootstrap restores what generated code relies on: the site-packages directories (after the standard library,
    so numpy & co. stay importable) and the ``exit``/``quit`` builtins. ``runpy`` sets ``__name__ == "__main__"``,
    ``__file__`` and ``sys.argv[0] = "main.py"``. The working directory is not on ``sys.path`` (as with ``-I``).
    """
    dirs = [d for d in site.getsitepackages() if os.path.isdir(d)]
    return (
        "import sys, builtins\n"
        f"sys.path.extend({dirs!r})\n"
        "builtins.exit = builtins.quit = sys.exit\n"
        "import runpy\n"
        "runpy.run_path('main.py', run_name='__main__')\n"
    )


def _clean_env(workdir: str) -> dict[str, str]:
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": workdir,
        "TMPDIR": workdir,
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "OPENBLAS_NUM_THREADS": "1",
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
    }


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _stop(proc: subprocess.Popen, uid: int | None) -> None:
    """Kill a run. In full mode the root launcher is asked to kill the namespace (it then reaps its child, so no
    zombie is left for an init that may not reap); SIGKILL of the whole group is the fallback."""
    if uid is not None:
        try:
            os.kill(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        _kill_uid(uid)
        try:
            proc.wait(timeout=2.0)
            return
        except subprocess.TimeoutExpired:
            logger.warning("sandbox: launcher %d ignored SIGTERM; killing its process group", proc.pid)
    _kill_group(proc.pid)


def _pump(proc: subprocess.Popen, limits: SandboxLimits, deadline: float) -> tuple[bytes, bytes, str | None]:
    """Read stdout/stderr until both close, the deadline passes or a cap is exceeded; returns why it stopped early."""
    sel = selectors.DefaultSelector()
    bufs = {proc.stdout: bytearray(), proc.stderr: bytearray()}
    for stream in bufs:
        os.set_blocking(stream.fileno(), False)
        sel.register(stream, selectors.EVENT_READ)
    stop = None
    try:
        while sel.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                stop = "timeout"
                break
            for key, _ in sel.select(timeout=min(left, 0.5)):
                try:
                    chunk = os.read(key.fd, 1 << 16)
                except BlockingIOError:
                    continue
                if not chunk:
                    sel.unregister(key.fileobj)
                    continue
                buf = bufs[key.fileobj]
                room = limits.max_output_bytes - len(buf)
                buf += chunk[: max(room, 0)]
                if len(chunk) > room:
                    stop = "output_limit"
            if stop:
                break
    finally:
        sel.close()
    return bytes(bufs[proc.stdout]), bytes(bufs[proc.stderr]), stop


def _write_tree(root: Path, files: Mapping[str, str | bytes]) -> None:
    for rel, content in files.items():
        path = (root / rel).resolve()
        if root.resolve() not in path.parents:
            raise ValueError(f"sandbox file {rel!r} escapes the working directory")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content.encode() if isinstance(content, str) else content)


def _run(
    code: str,
    stdin: str | bytes = "",
    *,
    limits: SandboxLimits,
    mode: str,
    files: Mapping[str, str | bytes] | None = None,
    args: Sequence[str] = (),
) -> SandboxResult:
    start = time.monotonic()
    uid = _acquire_uid() if mode == "full" else None
    base = Path(tempfile.mkdtemp(prefix=f"vase-sbx-{os.getpid()}-"))
    proc = None
    setup_r = None
    try:
        all_files = {"main.py": code, **dict(files or {})}
        files_dir = base / "files"
        files_dir.mkdir()
        _write_tree(files_dir, all_files)
        if mode == "full":
            workdir = FULL_MODE_WORKDIR
            covered = _covered_dirs()
            plan = {
                "mode": "full",
                "uid": uid,
                "gid": uid,
                "files_dir": str(files_dir),
                "cover": [(p, m, limits.tmp_mb if f else 1) for p, m, f in covered],
                "expose": _exposed_dirs([p for p, _, _ in covered]),
            }
        else:
            workdir = str(files_dir)
            plan = {"mode": "basic", "isolate_network": True}
        plan.update(
            workdir=workdir,
            argv=[os.path.realpath(sys.executable), "-I", "-S", "-c", _bootstrap(), *args],
            env=_clean_env(workdir),
            rlimits=_rlimits(limits, mode),
            deadline_s=limits.timeout_s + 5.0,
        )
        plan_path = base / "plan.json"
        plan_path.write_text(json.dumps(plan))
        # the launcher reports its own setup failures on this pipe, closed (close-on-exec) before the program runs
        setup_r, setup_w = os.pipe()
        with tempfile.TemporaryFile() as stdin_file:
            stdin_file.write(stdin.encode() if isinstance(stdin, str) else stdin)
            stdin_file.seek(0)
            try:
                proc = subprocess.Popen(
                    [os.path.realpath(sys.executable), "-I", "-S", str(LAUNCHER), str(plan_path), str(setup_w)],
                    stdin=stdin_file,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    cwd=str(base),
                    env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
                    start_new_session=True,
                    close_fds=True,
                    pass_fds=(setup_w,),
                )
            finally:
                os.close(setup_w)
        # interpreter start-up of the launcher is not charged to the program
        deadline = time.monotonic() + limits.timeout_s + 0.5
        out, err, stop = _pump(proc, limits, deadline)
        if stop is not None:
            _stop(proc, uid)
        try:
            returncode = proc.wait(timeout=max(deadline - time.monotonic(), 0.0) + 1.0)
        except subprocess.TimeoutExpired:
            stop = stop or "timeout"
            _stop(proc, uid)
            returncode = proc.wait()
        if uid is None:
            _kill_group(proc.pid)  # basic mode: leftovers of the program's own group
        else:
            _kill_uid(uid)  # full mode: the namespace is gone already; this is a backstop
        result = _result(returncode, out, err, stop, limits, time.monotonic() - start, _read_setup(setup_r))
        result.uid = uid
        return result
    except (OSError, ValueError, subprocess.SubprocessError) as exc:
        if proc is not None and proc.poll() is None:
            _stop(proc, uid)
            proc.wait()
        return SandboxResult("error", reason=f"{type(exc).__name__}: {exc}", wall_s=time.monotonic() - start)
    finally:
        if setup_r is not None:
            os.close(setup_r)
        if proc is not None:
            for stream in (proc.stdout, proc.stderr):
                if stream is not None:
                    stream.close()
        if uid is not None:
            _release_uid(uid)
        shutil.rmtree(base, ignore_errors=True)


def _read_setup(fd: int) -> str:
    """What the launcher wrote on its setup-error pipe (empty: the setup succeeded)."""
    os.set_blocking(fd, False)
    chunks = []
    while True:
        try:
            chunk = os.read(fd, 1 << 16)
        except BlockingIOError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks).decode(errors="replace").strip()


def _result(
    returncode: int,
    out: bytes,
    err: bytes,
    stop: str | None,
    limits: SandboxLimits,
    wall_s: float,
    setup: str = "",
) -> SandboxResult:
    stdout, stderr = out.decode(errors="replace"), err.decode(errors="replace")
    res = SandboxResult("ok", stdout, stderr, returncode, wall_s)
    if setup:  # the launcher's own report, on a pipe the program never holds (it cannot fake one)
        res.status, res.reason = "error", setup.splitlines()[0]
    elif stop == "output_limit":
        res.status, res.reason = "output_limit", f"output exceeded {limits.max_output_bytes} bytes"
    elif stop == "timeout":
        res.status, res.reason = "timeout", f"wall clock exceeded {limits.timeout_s:g} s"
    elif returncode == -signal.SIGXCPU:
        res.status, res.reason = "timeout", "CPU time limit"
    elif returncode < 0:
        res.status, res.reason = "failed", f"killed by {signal.Signals(-returncode).name}"
    elif returncode != 0:
        res.status = "failed"
        last = stderr.strip().splitlines()[-1:] or [""]
        res.reason = f"exit status {returncode}" + (f": {last[0][:200]}" if last[0] else "")
    return res


def run_program(
    code: str,
    stdin: str | bytes = "",
    timeout_s: float = 10.0,
    memory_mb: int = 2048,
    *,
    files: Mapping[str, str | bytes] | None = None,
    args: Sequence[str] = (),
    limits: SandboxLimits | None = None,
) -> SandboxResult:
    """Run the Python program ``code`` in a sandbox and return its outcome (never raises for program failures).

    Args:
        code: Python source, saved as ``main.py`` in a fresh working directory and run as ``__main__`` by the harness's
            interpreter in isolated mode, with its site-packages (numpy...) importable; see :func:`_bootstrap`.
        stdin: bytes fed to the program's standard input.
        timeout_s: wall-clock limit (overridden by ``limits`` when given).
        memory_mb: address-space limit (overridden by ``limits`` when given).
        files: extra files ``{relative path: content}`` written next to ``main.py``.
        args: command-line arguments after ``main.py``.
        limits: every limit at once; see :class:`SandboxLimits`.
    """
    limits = limits or SandboxLimits(timeout_s=timeout_s, memory_mb=memory_mb)
    return _run(code, stdin, limits=limits, mode=isolation_mode(), files=files, args=args)


def raise_for_setup(result: SandboxResult, limits: SandboxLimits | None = None) -> SandboxResult:
    """``result``, unless the sandbox itself failed (status ``error``): then :class:`SandboxSetupError`, so a failure to
    set up the sandbox is never graded as the program failing."""
    if result.status == "error":
        shown = f" under {limits}" if limits is not None else ""
        raise SandboxSetupError(
            f"sandbox: could not run a program at all ({result.reason}){shown}; this is not the program's fault, so "
            "nothing was graded: fix the sandbox's limits (task.timeout_s, task.memory_mb) or the machine, then rerun "
            "to resume"
        )
    return result


_limits_checked: set[SandboxLimits] = set()


def check_limits(limits: SandboxLimits, setting: str = "task.memory_mb") -> None:
    """Run a trivial program under ``limits`` (with a generous wall clock) and refuse, in one line naming ``setting``,
    limits under which even it fails: every program would then be graded wrong. Once per limits and process."""
    canary = dataclasses.replace(limits, timeout_s=max(limits.timeout_s, 600.0), cpu_s=None)  # never reached
    if canary in _limits_checked:
        return
    res = raise_for_setup(run_program("import sys\nprint('ok')", limits=canary), canary)
    if res.status == "ok" and res.stdout.strip() == "ok":
        _limits_checked.add(canary)
    else:
        why = " ".join(f"{res.status}: {res.reason or res.stderr[-200:]}".split())
        raise ValueError(
            f"{setting}: the sandbox cannot run even an empty program under these limits ({why}), so every program "
            f"would be graded wrong; raise it (e.g. {setting}=1024)"
        )


def available_cores() -> int:
    """Cores this process may run on (its CPU affinity, e.g. under Slurm or a container), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def default_workers(n_jobs: int) -> int:
    """Parallel sandbox workers: one per available core, never more than the jobs."""
    return max(1, min(available_cores(), n_jobs))


def run_many(
    programs: Sequence[Program | str],
    limits: SandboxLimits | None = None,
    max_workers: int | None = None,
) -> list[SandboxResult]:
    """Run programs in parallel (one child each, ``min(cores, n)`` workers by default); results keep input order."""
    limits = limits or SandboxLimits()
    items = [p if isinstance(p, Program) else Program(code=p) for p in programs]
    if not items:
        return []
    isolation_mode()  # probe once before the workers start
    workers = max_workers or default_workers(len(items))

    def one(p: Program) -> SandboxResult:
        return run_program(p.code, p.stdin, files=p.files, args=p.args, limits=limits)

    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="sandbox") as pool:
        return list(pool.map(one, items))
