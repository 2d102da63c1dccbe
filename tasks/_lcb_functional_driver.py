"""Sandbox-side driver of LiveCodeBench functional (LeetCode-style) tests; shipped into the sandbox as ``main.py``.

It runs inside the sandbox (never in the harness): it reads ``tests.json`` (``fn_name``, ``inputs``, ``outputs``,
``timeout_s``) and ``solution.py`` (the solution after the standard-library prelude LiveCodeBench uses), executes
it, calls ``Solution().<fn_name>`` (or a module-level function) on each test's JSON arguments (one per line) with a
per-test timer, compares with ``==`` (a tuple counts as a list), stops at the first failure, and prints one line
``<MARKER>{"results": [...], "error": ...}`` on the original stdout. The solution's own prints go to /dev/null.
"""

import json
import os
import signal
import sys

MARKER = "__VASE_LCB_RESULT__"


class _Timeout(BaseException):
    pass


def _on_alarm(signum, frame):
    raise _Timeout()


def main():
    """Run the tests and report."""
    with open("tests.json") as f:
        spec = json.load(f)
    with open("solution.py") as f:
        code = f.read()
    report = os.fdopen(os.dup(1), "w")
    devnull = open(os.devnull, "w")
    os.dup2(devnull.fileno(), 1)
    sys.stdout = devnull
    timeout = float(spec["timeout_s"])
    signal.signal(signal.SIGALRM, _on_alarm)
    results, error = [], None

    def done():
        report.write(MARKER + json.dumps({"results": results, "error": error}) + "\n")
        report.flush()

    try:
        namespace = {"__name__": "solution"}
        signal.setitimer(signal.ITIMER_REAL, timeout)
        exec(compile(code, "solution.py", "exec"), namespace)
        signal.setitimer(signal.ITIMER_REAL, 0)
        if "class Solution" in code and "Solution" in namespace:
            target = getattr(namespace["Solution"](), spec["fn_name"])
        else:
            target = namespace[spec["fn_name"]]
    except _Timeout:
        error = "compile_timeout"
        return done()
    except BaseException as exc:  # noqa: BLE001 - any failure of untrusted code is a failed test
        signal.setitimer(signal.ITIMER_REAL, 0)
        error = f"compile_error: {type(exc).__name__}: {str(exc)[:200]}"
        return done()
    for raw_in, raw_out in zip(spec["inputs"], spec["outputs"]):
        try:
            args = [json.loads(line) for line in raw_in.split("\n")]
            expected = json.loads(raw_out)
        except ValueError as exc:
            error = f"bad_test: {exc}"
            results.append(False)
            break
        try:
            signal.setitimer(signal.ITIMER_REAL, timeout)
            got = target(*args)
            signal.setitimer(signal.ITIMER_REAL, 0)
        except _Timeout:
            error = "timeout"
            results.append(False)
            break
        except BaseException as exc:  # noqa: BLE001
            signal.setitimer(signal.ITIMER_REAL, 0)
            error = f"runtime_error: {type(exc).__name__}: {str(exc)[:200]}"
            results.append(False)
            break
        if isinstance(got, tuple):
            got = list(got)
        try:
            ok = bool(got == expected)
        except BaseException:  # noqa: BLE001 - e.g. numpy arrays have no truth value
            ok = False
        results.append(ok)
        if not ok:
            error = "wrong_answer"
            break
    return done()


if __name__ == "__main__":
    main()
