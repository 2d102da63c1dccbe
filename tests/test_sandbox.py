"""The sandbox for generated code: basics, limits, and hostile programs.

Each hostile program must end as a non-``ok`` status within its limit, the harness (this pytest process) must keep
running, and no file outside the sandbox may change. The protections that need root (private filesystem, other uid,
private ``/proc``) are checked only in ``full`` isolation mode; the others run in both modes.

No test depends on the machine's speed: a program that ends by itself runs under :data:`ENDS` (a wall clock it never
reaches, so its status is its own), and only programs that never end run under :data:`FAST` (they time out however
fast the machine is). Nothing is timed; a wait is a blocking read or a wait on a process, never a poll.
"""

from __future__ import annotations

import os
import select
import socket
import subprocess
import sys
import tempfile
import threading
import uuid
from pathlib import Path

import pytest

from tasks import sandbox
from tasks.sandbox import (
    ALLOW_ROOT_FALLBACK_ENV,
    Program,
    SandboxLimits,
    SandboxRefused,
    SandboxResult,
    isolation_mode,
    run_many,
    run_program,
)

#: for programs that never end by themselves: they time out after 2 s, whatever the machine
ROOT = Path(__file__).resolve().parents[1]
FAST = SandboxLimits(timeout_s=2.0, memory_mb=512, max_procs=32, max_output_bytes=1 << 20)
#: for programs that end by themselves: a wall clock never reached, so a loaded machine cannot turn them into timeouts
ENDS = SandboxLimits(timeout_s=600.0, memory_mb=512, max_procs=32, max_output_bytes=1 << 20)


def _full_isolation() -> bool:
    try:
        return isolation_mode() == "full"
    except SandboxRefused:
        return False


needs_full = pytest.mark.skipif(
    not _full_isolation(), reason="needs full isolation (root with namespaces) to protect the harness"
)


def _snapshot(path: Path) -> dict[str, tuple[int, int]]:
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(path.rglob("*"))}


@pytest.fixture
def outside(tmp_path: Path):  # noqa: ANN201 - yields a helper
    """A directory outside the sandbox with a sentinel file; asserts it is unchanged after the test."""
    (tmp_path / "sentinel.txt").write_text("keep me")
    before = _snapshot(tmp_path)
    yield tmp_path
    assert _snapshot(tmp_path) == before


def _no_processes_left(res: sandbox.SandboxResult) -> bool:
    return res.uid is None or not sandbox._pids_of_uid(res.uid, include_zombies=True)


# --------------------------------------------------------------------------------------------------------------------
# basics


def test_runs_program_with_stdin_files_and_args() -> None:
    code = "import sys\nprint(sys.stdin.read().upper(), open('data.txt').read(), sys.argv[1:])"
    res = run_program(code, "hello", files={"data.txt": "payload"}, args=["-x", "y"], limits=ENDS)
    assert res.status == "ok", res
    assert res.stdout.strip() == "HELLO payload ['-x', 'y']"
    assert res.returncode == 0 and res.wall_s > 0


def test_fresh_working_directory_clean_environment_and_site_packages() -> None:
    code = (
        "import os, json, numpy\n"
        "print(json.dumps({'cwd': os.getcwd(), 'home': os.environ['HOME'], 'files': sorted(os.listdir('.')),"
        " 'env': sorted(os.environ)}))"
    )
    first = run_program(code, limits=ENDS)
    second = run_program(code, limits=ENDS)
    assert first.status == "ok", first
    import json

    info = json.loads(first.stdout)
    assert info["files"] == ["main.py"]
    assert info["home"] == info["cwd"]
    assert set(info["env"]) <= {
        "PATH",
        "HOME",
        "TMPDIR",
        "LANG",
        "LC_ALL",
        "OPENBLAS_NUM_THREADS",
        "OMP_NUM_THREADS",
        "MKL_NUM_THREADS",
    }
    assert json.loads(second.stdout)["files"] == ["main.py"]  # nothing left over from the first run


def test_failure_statuses() -> None:
    assert run_program("raise SystemExit(3)", limits=ENDS).returncode == 3
    res = run_program("1/0", limits=ENDS)
    assert res.status == "failed" and "ZeroDivisionError" in res.reason
    res = run_program("import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)", limits=ENDS)
    assert res.status == "failed"


def test_cpu_time_limit() -> None:
    # the wall clock (600 s) is never reached first, however loaded the machine: the CPU limit ends the loop
    res = run_program("while True:\n    pass", limits=SandboxLimits(timeout_s=600, cpu_s=1))
    assert (res.status, res.reason) == ("timeout", "CPU time limit")


def test_limits_validation() -> None:
    with pytest.raises(ValueError, match=r"^sandbox.timeout_s: must be a finite number of seconds > 0, got 0$"):
        SandboxLimits(timeout_s=0)
    with pytest.raises(ValueError, match="sandbox.memory_mb"):
        SandboxLimits(memory_mb=-1)


def test_run_many_keeps_order_and_runs_in_parallel(monkeypatch: pytest.MonkeyPatch) -> None:
    progs = [Program(f"print({i})") for i in range(4)]
    results = run_many(progs, limits=ENDS, max_workers=4)
    assert [r.stdout.strip() for r in results] == ["0", "1", "2", "3"]
    assert run_many([]) == []
    # parallel: every worker waits at a barrier for the other three (run one at a time, the first would wait forever;
    # the barrier's timeout only ends a test that failed)
    barrier = threading.Barrier(4, timeout=600)

    def meet(code: str, *args: object, **kwargs: object) -> SandboxResult:
        barrier.wait()
        return SandboxResult("ok", stdout=code)

    monkeypatch.setattr(sandbox, "run_program", meet)
    assert [r.stdout for r in run_many(["a", "b", "c", "d"], max_workers=4)] == ["a", "b", "c", "d"]


def test_default_workers_bounded_by_cores() -> None:
    assert sandbox.default_workers(1) == 1
    assert sandbox.default_workers(10_000) == sandbox.available_cores() <= (os.cpu_count() or 1)


def test_basic_mode_enforces_limits() -> None:
    """The fallback for non-root harnesses, exercised here even as root."""
    ok = sandbox._run("print(6 * 7)", limits=ENDS, mode="basic")
    assert (ok.status, ok.stdout.strip()) == ("ok", "42")
    quick = SandboxLimits(timeout_s=1.0, memory_mb=512)
    assert sandbox._run("while True: pass", limits=quick, mode="basic").status == "timeout"
    assert sandbox._run("x = bytearray(2 * 1024**3)", limits=ENDS, mode="basic").status == "failed"
    assert sandbox._run("print('x' * 10**7)", limits=ENDS, mode="basic").status == "output_limit"


def _fake_machine(monkeypatch: pytest.MonkeyPatch, *, root: bool, namespaces: bool) -> list[str]:
    """Forget the probed mode; fake the user (root or not) and whether namespaces work. Returns the modes run."""
    monkeypatch.setattr(sandbox, "_mode", None)
    monkeypatch.setattr(sandbox, "_refusal", None)
    monkeypatch.setattr(sandbox.os, "geteuid", lambda: 0 if root else 1000)
    monkeypatch.delenv(ALLOW_ROOT_FALLBACK_ENV, raising=False)
    runs: list[str] = []

    def fake_run(code: str, stdin: str | bytes = "", *, limits: SandboxLimits, mode: str, **_: object) -> SandboxResult:
        runs.append(mode)
        if mode == "full" and not namespaces:
            return SandboxResult("error", reason="VASE_SANDBOX_SETUP_ERROR: unshare: Operation not permitted (errno 1)")
        return SandboxResult("ok", stdout="64000\n", returncode=0)

    monkeypatch.setattr(sandbox, "_run", fake_run)
    return runs


def test_root_without_isolation_is_refused_with_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    """B11: as root with no namespaces, basic mode would keep root's file access: refuse, never run the program."""
    runs = _fake_machine(monkeypatch, root=True, namespaces=False)
    with pytest.raises(SandboxRefused) as info:
        run_program("print('untrusted')")
    msg = str(info.value)
    assert isinstance(info.value, ValueError) and "\n" not in msg
    assert msg.startswith("sandbox: refusing to run generated code as root without isolation")
    assert "Operation not permitted" in msg and "non-root user" in msg and f"{ALLOW_ROOT_FALLBACK_ENV}=1" in msg
    with pytest.raises(SandboxRefused):  # refused again, without probing again
        run_many(["print(1)", "print(2)"])
    assert runs == ["full"]  # only the probe ran; the program never did


def test_root_fallback_runs_in_basic_mode_only_when_opted_in(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    runs = _fake_machine(monkeypatch, root=True, namespaces=False)
    monkeypatch.setenv(ALLOW_ROOT_FALLBACK_ENV, "1")
    with caplog.at_level("WARNING", logger="tasks.sandbox"):
        assert isolation_mode() == "basic"
        assert run_program("print(1)").ok
    assert runs == ["full", "basic"]
    assert any("as ROOT in basic mode" in r.getMessage() for r in caplog.records)


def test_isolation_mode_for_a_normal_user_and_for_root_with_namespaces(monkeypatch: pytest.MonkeyPatch) -> None:
    runs = _fake_machine(monkeypatch, root=False, namespaces=False)
    assert isolation_mode() == "basic" and runs == []  # no refusal and no probe for a non-root user
    runs = _fake_machine(monkeypatch, root=True, namespaces=True)
    assert isolation_mode() == "full" and runs == ["full"]
    monkeypatch.setenv(ALLOW_ROOT_FALLBACK_ENV, "0")
    assert not sandbox.root_fallback_allowed()


# --------------------------------------------------------------------------------------------------------------------
# hostile programs


def _assert_within(res: sandbox.SandboxResult, limits: SandboxLimits, status: str | tuple[str, ...]) -> None:
    """The run ended (the call returned) with one of ``status``; never a timing (``limits`` says which clock)."""
    statuses = (status,) if isinstance(status, str) else status
    assert res.status in statuses, res
    assert limits.timeout_s in (FAST.timeout_s, ENDS.timeout_s)


def test_hostile_infinite_loop(outside: Path) -> None:
    _assert_within(run_program("while True:\n    pass", limits=FAST), FAST, "timeout")


def test_hostile_sleep_forever_with_detached_child(outside: Path) -> None:
    code = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(1000)\ntime.sleep(1000)"
    res = run_program(code, limits=FAST)
    _assert_within(res, FAST, "timeout")
    assert _no_processes_left(res)


@needs_full
def test_hostile_fork_bomb(outside: Path) -> None:
    code = (
        "import os\n"
        "while True:\n"
        "    try:\n"
        "        if os.fork() == 0:\n"
        "            os.setsid()\n"
        "    except OSError:\n"
        "        pass\n"
    )
    res = run_program(code, limits=FAST)
    _assert_within(res, FAST, ("timeout", "failed"))
    assert _no_processes_left(res)
    assert run_program("print('still fine')", limits=ENDS).stdout.strip() == "still fine"


def test_hostile_memory_hog(outside: Path) -> None:
    code = "chunks = []\nwhile True:\n    chunks.append(bytearray(50 * 1024 * 1024))"
    res = run_program(code, limits=ENDS)
    _assert_within(res, ENDS, "failed")
    assert "MemoryError" in res.stderr or res.returncode < 0


def test_hostile_print_one_gigabyte(outside: Path) -> None:
    code = "import sys\nchunk = 'x' * (1 << 20)\nfor _ in range(1024):\n    sys.stdout.write(chunk)"
    res = run_program(code, limits=ENDS)
    # killed at the cap (1 MiB), not after writing the gigabyte
    assert res.status == "output_limit", (res.status, res.reason, res.returncode, res.stderr[-500:])
    assert len(res.stdout) <= ENDS.max_output_bytes


def test_hostile_stderr_flood(outside: Path) -> None:
    res = run_program("import sys\nwhile True:\n    sys.stderr.write('e' * 65536)", limits=ENDS)
    assert res.status == "output_limit"


@needs_full
def test_hostile_writes_outside_the_sandbox(outside: Path) -> None:
    tag = uuid.uuid4().hex
    home = Path.home()
    targets = [
        home / f"vase_pwned_{tag}",
        outside / f"pwned_{tag}",
        Path("/tmp") / f"vase_pwned_{tag}",
        Path("/dev/shm") / f"vase_pwned_{tag}",
        Path(__file__).resolve().parent / f"pwned_{tag}",
    ]
    code = (
        "import os\n"
        f"targets = {[str(t) for t in targets]!r}\n"
        "written = []\n"
        "for t in targets:\n"
        "    try:\n"
        "        with open(t, 'w') as f:\n"
        "            f.write('pwned')\n"
        "        written.append(t)\n"
        "    except OSError:\n"
        "        pass\n"
        "open(os.path.expanduser('~/inside.txt'), 'w').write('ok')  # the sandbox home is the working dir\n"
        "if len(written) < len(targets):\n"
        "    raise SystemExit('some writes were refused')\n"
    )
    res = run_program(code, limits=ENDS)
    _assert_within(res, ENDS, "failed")
    for t in targets:
        assert not t.exists(), t
    assert not any(tag in p.name for p in home.iterdir())


@needs_full
def test_hostile_network_socket(outside: Path) -> None:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    code = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1).sendall(b'leak')\n"
    res = run_program(code, limits=ENDS)
    res_dns = run_program("import socket\nsocket.create_connection(('pypi.org', 443), timeout=1)", limits=ENDS)
    server.setblocking(False)
    try:  # the kernel completes handshakes without accept(): a pending connection would be accepted here
        server.accept()
        connected = True
    except BlockingIOError:
        connected = False
    finally:
        server.close()
    _assert_within(res, ENDS, "failed")
    _assert_within(res_dns, ENDS, "failed")
    assert not connected


@needs_full
def test_hostile_kills_the_parent(outside: Path) -> None:
    me = os.getpid()
    code = f"import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\nos.kill({me}, signal.SIGKILL)\n"
    res = run_program(code, limits=ENDS)
    _assert_within(res, ENDS, "failed")
    assert os.getpid() == me  # still here
    assert run_program("print(1)", limits=ENDS).ok


@needs_full
def test_hostile_reads_harness_secrets(monkeypatch: pytest.MonkeyPatch, outside: Path) -> None:
    secret = f"s3cr3t-{uuid.uuid4().hex}"
    monkeypatch.setenv("VASE_TEST_SECRET_TOKEN", secret)
    code = (
        "import os, glob\n"
        "found = [v for v in os.environ.values() if 's3cr3t' in v]\n"
        "for path in glob.glob('/proc/*/environ') + glob.glob('/proc/*/cmdline'):\n"
        "    try:\n"
        "        data = open(path, 'rb').read()\n"
        "    except OSError:\n"
        "        continue\n"
        "    if b's3cr3t' in data:\n"
        "        found.append(data.decode(errors='replace'))\n"
        f"for pid in (os.getppid(), {os.getpid()}):\n"
        "    try:\n"
        "        found.append(open(f'/proc/{pid}/environ', 'rb').read().decode(errors='replace'))\n"
        "    except OSError:\n"
        "        pass\n"
        "print(found)\n"
        "if not any('s3cr3t' in f for f in found):\n"
        "    raise SystemExit('no secret found')\n"
    )
    res = run_program(code, limits=ENDS)
    _assert_within(res, ENDS, "failed")
    assert secret not in res.stdout and secret not in res.stderr


def _pids_with_arg(tag: str) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and tag.encode() in (entry / "cmdline").read_bytes():
                pids.append(int(entry.name))
        except OSError:
            continue
    return pids


def test_sandbox_dies_with_the_harness() -> None:
    """A harness killed mid-run (SIGKILL: no cleanup) must not leave its sandboxed program running.

    No poll: the harness says when its program is running (a hook on the read of the program's first output line),
    and the test then waits on each process of the program (``pidfd``) until it is gone."""
    tag = f"vase-orphan-{uuid.uuid4().hex}"
    script = (
        "import os, sys\n"
        "from tasks import sandbox\n"
        "sandbox.isolation_mode()  # its probe runs a program too: before the hook\n"
        "pump = sandbox._pump\n"
        "def told(proc, limits, deadline):\n"
        "    os.set_blocking(proc.stdout.fileno(), True)\n"
        "    proc.stdout.readline()  # the program's 'running' line\n"
        "    print('running', flush=True)\n"
        "    return pump(proc, limits, deadline)\n"
        "sandbox._pump = told\n"
        "code = 'import time\\nprint(\"running\", flush=True)\\ntime.sleep(600)'\n"
        f"sandbox.run_program(code, args=[{tag!r}], limits=sandbox.SandboxLimits(timeout_s=600))\n"
    )
    harness = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE)
    assert harness.stdout.readline().strip() == b"running"  # blocks until the program runs
    program = set(_pids_with_arg(tag)) - {harness.pid}
    assert program, "the sandboxed program is not running"
    pidfds = []
    for pid in program:
        try:
            pidfds.append(os.pidfd_open(pid))
        except ProcessLookupError:
            pass
    harness.kill()
    harness.wait()
    for fd in pidfds:  # readable once the process has exited; the timeout only ends a test that failed
        assert select.select([fd], [], [], 600)[0] == [fd]
        os.close(fd)
    assert set(_pids_with_arg(tag)) - {harness.pid} == set()
    leftovers = list(Path(tempfile.gettempdir()).glob(f"vase-sbx-{harness.pid}-*"))
    assert leftovers  # the killed harness could not clean up its temporary directory...
    sandbox._remove_stale_dirs()
    assert not any(p.exists() for p in leftovers)  # ...which the next harness removes


def test_the_launcher_s_kill_of_a_reaped_child_is_not_a_setup_error() -> None:
    """The race behind a once-in-a-suite ``error`` on a loaded machine: the harness stops a run (output cap, timeout)
    with SIGTERM to the launcher, then SIGKILLs the sandbox uid; the program and the namespace's init can both be
    dead, and the init reaped, before the launcher's SIGTERM handler runs. Its kill must then be a no-op, not a
    ``ProcessLookupError`` that the launcher reports on the setup pipe (status ``error`` instead of ``output_limit``).
    Reproduced deterministically: the handler's kill runs after the child is reaped."""
    import ast
    import inspect

    from tasks import _sandbox_launcher as launcher

    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    launcher._kill_child(pid)  # reaped: no such process, no error
    # every kill of a child in the launcher goes through _kill_child (the only other kill is of itself)
    tree = ast.parse(inspect.getsource(launcher))
    kills = [
        ast.unparse(n)
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and ast.unparse(n.func) == "os.kill" and "getpid" not in ast.unparse(n.args[0])
    ]
    assert kills == ["os.kill(pid, signal.SIGKILL)"], kills
