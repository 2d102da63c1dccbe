"""Trusted launcher that isolates one untrusted program; started by :mod:`tasks.sandbox`, never imported.

Usage (done by ``tasks.sandbox.run_program``)::

    python -I -S tasks/_sandbox_launcher.py PLAN.json

It is a fresh single-threaded interpreter (so ``fork`` is safe, unlike a ``preexec_fn`` in the multi-threaded
harness). It reads the plan, then, in ``full`` mode (the harness runs as root):

1. enters new mount, network, PID, IPC and UTS namespaces (no network: the new namespace has only a down loopback);
2. covers the world-writable directories (``/tmp``, ``/var/tmp``, ``/dev/shm``, ...) and the harness user's home with
   fresh size-limited tmpfs mounts, so nothing the program writes survives it or is visible outside, then re-binds the
   Python installation read-only where a cover hid it;
3. copies the program's files into a fresh working directory inside the private ``/tmp``;
4. forks the namespace's init (PID 1, root): it mounts a private ``/proc`` (the harness's processes and their
   environments are invisible), then forks the program (PID 2), which sets the resource limits, drops to an
   unprivileged uid/gid and ``exec``s. The init reaps every orphan and reports the program's wait status through a
   pipe; the launcher (root, outside) waits for the init and exits the way the program did. When the init exits the
   kernel kills and reaps every process left in the namespace, so fork bombs and detached grandchildren cannot
   outlive the run, and the program can signal neither the launcher, the init (other uid; PID 1 of its namespace)
   nor the harness (invisible, other uid).

In ``basic`` mode (not root) it only sets the resource limits, tries a private network namespace through an
unprivileged user namespace, and ``exec``s the program.

Usage: ``_sandbox_launcher.py PLAN.json [SETUP_FD]``. A failure of the setup exits with status 125 and writes a line
starting with ``VASE_SANDBOX_SETUP_ERROR`` on ``SETUP_FD`` (a pipe from the harness, close-on-exec here, so the
program never holds it and cannot fake a setup error; on stderr when no fd is given).
"""

import ctypes
import json
import os
import resource
import signal
import sys

SETUP_ERROR_STATUS = 125
SETUP_ERROR_TAG = "VASE_SANDBOX_SETUP_ERROR"

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REMOUNT = 32
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18
PR_SET_PDEATHSIG = 1

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
_libc.unshare.argtypes = [ctypes.c_int]
_libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]


class SetupError(Exception):
    """The sandbox could not be set up."""


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise SetupError(f"{what}: {os.strerror(err)} (errno {err})")


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    _check(_libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)), f"mount {target}")


_setup_fd = 2  # where _fail reports: the harness's setup pipe (main() sets it), else stderr


def _fail(msg: str) -> None:
    os.write(_setup_fd, f"{SETUP_ERROR_TAG}: {msg}\n".encode(errors="replace"))
    os._exit(SETUP_ERROR_STATUS)


def _set_rlimits(limits: dict) -> None:
    for name, (soft, hard) in limits.items():
        resource.setrlimit(getattr(resource, name), (soft, hard))


def _read_files(files_dir: str) -> dict[str, bytes]:
    out = {}
    for root, _dirs, names in os.walk(files_dir):
        for name in names:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, files_dir)] = f.read()
    return out


def _write_files(workdir: str, files: dict[str, bytes], uid: int, gid: int) -> None:
    os.makedirs(workdir, mode=0o700, exist_ok=True)
    os.chown(workdir, uid, gid)
    for rel, data in files.items():
        path = os.path.join(workdir, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)
        os.chown(path, uid, gid)


def _isolate_filesystem(plan: dict) -> None:
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    keep = [(path, os.open(path, os.O_PATH | os.O_DIRECTORY)) for path in plan["expose"]]
    for path, mode, size_mb in plan["cover"]:
        _mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV, f"size={size_mb}m,mode={mode}")
    for path, fd in keep:
        os.makedirs(path, mode=0o755, exist_ok=True)
        _mount(f"/proc/self/fd/{fd}", path, None, MS_BIND | MS_REC)
        try:  # read-only is defence in depth (the uid has no write permission there anyway)
            _mount(None, path, None, MS_REMOUNT | MS_BIND | MS_RDONLY)
        except SetupError:
            pass
        os.close(fd)


def _forward(status: int) -> None:
    """Exit the way a child with wait status ``status`` exited (same exit code, or killed by the same signal)."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        if sig not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
        os._exit(128 + sig)
    os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 1)


def _kill_child(pid: int) -> None:
    """SIGKILL ``pid`` from a signal handler; a child already reaped is not an error.

    The harness stops a run with SIGTERM to this launcher and then SIGKILLs the sandbox uid. On a loaded machine the
    program and the namespace's init can both be dead, and the init reaped by :func:`_supervise`'s ``waitpid``,
    before the launcher runs its SIGTERM handler (``wait4`` reports a zombie child before a pending signal): the kill
    then finds no process, and the error must not turn a finished run into a setup failure.
    """
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _waitpid(pid: int) -> tuple[int, int]:
    while True:
        try:
            return os.waitpid(pid, 0)
        except InterruptedError:
            continue


def _supervise(ns_init: int, status_r: int, plan_deadline_s: float) -> None:
    """The root half in the harness's namespaces: wait for the namespace's init and exit as the program did."""
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    # backstop if the harness is gone: never outlive the wall-clock limit by more than a few seconds
    signal.signal(signal.SIGALRM, lambda signum, frame: _kill_child(ns_init))
    signal.alarm(int(plan_deadline_s))
    _, init_status = _waitpid(ns_init)
    data = os.read(status_r, 64)
    _forward(int(data) if data else init_status)


def _ns_init(plan: dict, status_w: int) -> None:
    """PID 1 of the new PID namespace (root): start the program as PID 2, reap every orphan, report its status.

    The program is not PID 1 itself, so it keeps normal signal semantics (PID 1 ignores signals it has no handler
    for, including the CPU-limit SIGXCPU). When this process exits the kernel kills and reaps the whole namespace.
    """
    _check(_libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl")
    _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    program = os.fork()
    if program == 0:
        try:
            os.close(status_w)
            _set_rlimits(plan["rlimits"])
            os.setgroups([])
            os.setresgid(plan["gid"], plan["gid"], plan["gid"])
            os.setresuid(plan["uid"], plan["uid"], plan["uid"])
            os.chdir(plan["workdir"])
            os.execve(plan["argv"][0], plan["argv"], plan["env"])
        except (OSError, SetupError) as exc:
            _fail(f"{type(exc).__name__}: {exc}")
    for fd in (0, 1, 2):  # only the program holds the harness's pipes
        os.close(fd)
    while True:
        try:
            pid, status = os.waitpid(-1, 0)
        except InterruptedError:
            continue
        except ChildProcessError:
            os._exit(1)
        if pid == program:
            os.write(status_w, str(status).encode())
            os._exit(0)


def run_full(plan: dict) -> None:
    """Namespaces, private filesystem, unprivileged uid; see the module docstring."""
    uid, gid = plan["uid"], plan["gid"]
    files = _read_files(plan["files_dir"])
    _check(_libc.unshare(CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS), "unshare")
    _isolate_filesystem(plan)
    _write_files(plan["workdir"], files, uid, gid)
    status_r, status_w = os.pipe()
    # SIGTERM from the harness (timeout, output cap) kills the namespace's init from outside (which always works),
    # and we stay to reap it, so no zombie is left for a host init that may not reap orphans.
    child: dict = {"pid": None, "term": False}

    def on_term(signum: int, frame: object) -> None:
        if child["pid"] is None:
            child["term"] = True
        else:
            _kill_child(child["pid"])

    signal.signal(signal.SIGTERM, on_term)
    pid = os.fork()
    if pid > 0:
        child["pid"] = pid
        if child["term"]:
            _kill_child(pid)
        os.close(status_w)
        _supervise(pid, status_r, plan["deadline_s"])
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        os.close(status_r)
        _ns_init(plan, status_w)
    except (OSError, SetupError) as exc:
        _fail(f"{type(exc).__name__}: {exc}")


def run_basic(plan: dict) -> None:
    """Resource limits only, plus a private network namespace where unprivileged user namespaces are allowed."""
    try:
        if plan.get("isolate_network", True):
            _libc.unshare(CLONE_NEWUSER | CLONE_NEWNET)  # best effort: silently skipped where userns are disabled
        _set_rlimits(plan["rlimits"])
        os.chdir(plan["workdir"])
        os.execve(plan["argv"][0], plan["argv"], plan["env"])
    except (OSError, SetupError) as exc:
        _fail(f"{type(exc).__name__}: {exc}")


def main() -> None:
    """Read the plan named on the command line and run it."""
    global _setup_fd
    if len(sys.argv) > 2:
        _setup_fd = int(sys.argv[2])
        os.set_inheritable(_setup_fd, False)  # closed by the program's exec: only the setup can report on it
    try:
        # die with the harness (in basic mode this survives the exec and covers the program itself)
        _check(_libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl")
        with open(sys.argv[1]) as f:
            plan = json.load(f)
        if plan["mode"] == "full":
            run_full(plan)
        else:
            run_basic(plan)
    except (OSError, SetupError, KeyError, ValueError) as exc:
        _fail(f"{type(exc).__name__}: {exc}")


if __name__ == "__main__":
    main()
