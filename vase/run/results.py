"""Run directories on disk — the source of truth (W&B only mirrors them).

A run directory holds:

* ``config.yaml`` — the resolved Hydra config;
* ``protocol.json`` — the settings that define the experiment (model, task protocol, policy, sampling, seed,
  samples, budget); a rerun with a different protocol in the same directory is refused;
* ``manifest.json`` — git SHA, library versions, device, model and dataset revisions, prompt template, sampling,
  seed, grading, and one entry per rank of a data-parallel run;
* ``resolved.json`` — what was actually loaded: the commit every hub dataset and model resolved to, the sha256 of
  every local data file (:func:`check_resolved`); a resumed run whose data or weights changed is refused;
* ``samples.jsonl`` — one line per graded sample, appended and made durable (fsync) as each is graded
  (:func:`write_sample`, the one writer of sample lines);
* ``throughput.jsonl`` — one line per stretch of decoding (wall times, tokens, rows in flight, memory);
* ``metrics.json`` — written at the end (and rewritten by a resumed run); see :mod:`vase.run.records`;
* ``ranks/`` — only while a data-parallel run (``torchrun``, :mod:`vase.run.distributed`) is under way or was killed:
  ``rank<r>.samples.jsonl`` / ``rank<r>.throughput.jsonl``, the lines rank ``r`` appends (fsynced) as it goes.
  Readers take the union (:func:`read_samples`, :func:`read_throughput`); at the end rank 0 folds them into the two
  files above (:func:`fold_parts`: append, fsync, then delete), so the finished directory is a single-process one;
* ``.vase.lock`` — the writer's lock (:func:`vase.run.rundir.lock_run_dir`): one process writes a run directory at a
  time.

A run directory is owned (:mod:`vase.run.rundir`): a run writes only into a directory that is absent, empty or already
one of these, and never shortens or rewrites ``samples.jsonl`` (it appends; a torn last line left by a kill is the only
thing ever cut off).

Test hook, the one place every kill point is defined: ``VASE_TEST_KILL_AT=[rank<r>:]<event>:<n>[:<signal>]`` makes
this process (of rank ``r`` only, when given) send itself SIGKILL (or ``SIG<signal>``: ``INT`` is Ctrl-C) at its
``n``-th ``event`` (counted per process), so a kill test stops a run at a known point, never after a poll
(:func:`kill_point`). Events: ``submitted`` — a finished sample was handed to grading (in the background: its grade is
being computed, its line not written; inline: before it is graded); ``written`` — a sample's line is durable in
``samples.jsonl`` or the rank's part file (:func:`write_sample`).

Long module: the run directory's files, their one writer each and their readers (through the results validator,
:mod:`vase.run.validate`), are one on-disk format.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import signal
import subprocess
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path
from typing import Any

from vase.run.validate import Planned, check_rows, planned_of
from vase.schema import SAMPLE_FIELDS, BadSample, Unparseable, check_sample, first_nonfinite, loads, number_problem

__all__ = ["SAMPLE_FIELDS", "BadSample"]

logger = logging.getLogger(__name__)

SAMPLES = "samples.jsonl"
THROUGHPUT = "throughput.jsonl"
RESOLVED = "resolved.json"
PROTOCOL = "protocol.json"
LOCK = ".vase.lock"
RANKS = "ranks"  # the per-rank part files of a data-parallel run
#: the test hook of the module docstring (:func:`kill_point`)
KILL_ENV = "VASE_TEST_KILL_AT"
KILL_EVENTS = ("submitted", "written")


def stable_hash(obj: Any, n: int = 8) -> str:
    """Short hex digest of a JSON-serialisable object (key order independent)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:n]


def read_jsonl_tolerant(path: Path, repair: bool = False) -> list[dict]:
    """Rows of a JSONL file written by a run that may have been killed mid-line.

    A torn (unparseable) last line is ignored; with ``repair`` the file is truncated to its last complete line so
    appends continue cleanly. A bad line elsewhere is an error (the file is corrupt, not torn), and so is a line, the
    last one too, that is JSON vase never writes (:func:`vase.schema.loads`: nested too deep, a number of thousands of
    digits): a one-line ``ValueError`` naming the file and the line.
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
                rows.append((i + 1, loads(line)))
            except Unparseable as err:  # never a torn write: refused wherever it is, like a field out of range
                raise BadSample(
                    f"{path}: line {i + 1} is not a line vase writes ({err}); fix or delete that line (every other "
                    "line is kept), then rerun (nothing was counted or written)"
                ) from None
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


# --------------------------------------------------------------------------------------------------------------------
# samples: one writer, readers that take the union of samples.jsonl and the rank part files


def part_path(run_dir: Path, rank: int, name: str) -> Path:
    """``run_dir/ranks/rank<r>.<name>``: where rank ``r`` appends its lines of ``name`` (samples or throughput)."""
    return Path(run_dir) / RANKS / f"rank{rank}.{name}"


def part_files(run_dir: Path, name: str) -> list[Path]:
    """The part files of ``name`` in ``run_dir/ranks/``, in rank order."""
    parts = Path(run_dir) / RANKS
    if not parts.is_dir():
        return []
    found = {}
    for p in parts.glob(f"rank*.{name}"):
        rank = p.name[len("rank") : -len(name) - 1]
        if rank.isdigit():
            found[int(rank)] = p
    return [found[r] for r in sorted(found)]


def sample_file(run_dir: Path, rank: int | None = None) -> Path:
    """The file this process appends its samples to: ``samples.jsonl``, or rank ``r``'s part file."""
    return Path(run_dir) / SAMPLES if rank is None else part_path(run_dir, rank, SAMPLES)


def _sample_rows(path: Path, repair: bool = False, for_metrics: bool = False) -> list[dict]:
    """The lines of one samples file (:func:`read_jsonl_tolerant`), each checked against the schema of
    :mod:`vase.schema` (a line that is not a sample, a field of the wrong type or out of its range, a NaN or an
    infinity: a one-line :class:`BadSample` naming the file, the line and the field). Every line is checked before the
    file is repaired, so a bad file is never touched."""
    located = _located_rows(path)
    if for_metrics:
        check_rows(located, Planned(), for_metrics=True)
    if repair:
        _numbered_rows(path, repair=True)
    return [row for _, _, row in located]


def _located_rows(path: Path) -> list[tuple[Path, int, dict]]:
    """``(path, line number, row)`` of every line of one samples file, each a sample by :func:`check_sample`."""
    located = []
    for lineno, row in _numbered_rows(path, repair=False):
        check_sample(row, path, lineno)
        located.append((path, lineno, row))
    return located


def _sample_key(row: Mapping) -> tuple:
    return (row["problem_id"], row["sample"])


def _throughput_key(row: Mapping) -> tuple:
    return (row.get("rank"), row.get("time"))


def read_samples(
    run_dir: Path, repair: bool = False, for_metrics: bool = False, planned: Planned | None = None
) -> list[dict]:
    """Every sample of a run directory: ``samples.jsonl``, then the rank part files of a data-parallel run under way
    or killed, through the results validator (:mod:`vase.run.validate`): every line a sample by the schema (a type
    and a range for every field), each ``(problem_id, sample)`` once (the same line twice counts once; two different
    lines for one sample, a sample beyond the run's ``n_samples`` or a problem outside ``planned``'s are refused), one
    line naming the file and the line otherwise. ``planned``: the samples the run plans (default: ``n_samples`` from
    the directory's ``protocol.json``). ``repair`` cuts a torn last line off every file (a process killed mid-write),
    so appends continue cleanly, once every file's lines passed; ``for_metrics``: every line must also carry the
    fields the metrics read (:data:`vase.schema.METRIC_FIELDS`; lines of an older release that lack them:
    :class:`vase.run.validate.OldLayout`)."""
    if Path(run_dir).is_file():  # a samples file given for its directory would read as no samples at all
        raise ValueError(f"read_samples: {run_dir} is a file; give the run directory that holds it")
    paths = [Path(run_dir) / SAMPLES, *part_files(run_dir, SAMPLES)]
    located = [x for path in paths for x in _located_rows(path)]
    rows = check_rows(located, planned_of(run_dir, planned, read_json), for_metrics)
    if repair:  # every file checked before any is repaired
        for path in paths:
            _numbered_rows(path, repair=True)
    return rows


def read_throughput_file(path: Path, repair: bool = False) -> list[dict]:
    """The lines of one ``throughput.jsonl`` (or a rank's part), each an object whose figures are finite and in range
    (:func:`vase.schema.number_problem`: counts, seconds, bytes); a line that is not is a one-line ``ValueError``
    naming the file and the line, raised before the file is repaired."""
    rows = []
    for lineno, row in _numbered_rows(path):
        why = number_problem(row) if isinstance(row, dict) else f"a JSON {type(row).__name__}, not an object"
        if why:
            raise ValueError(
                f"{path}: line {lineno}: {why}; fix or delete that line (every other line is kept), then rerun "
                "(nothing was counted or written)"
            )
        rows.append(row)
    if repair:
        _numbered_rows(path, repair=True)
    return rows


def read_throughput(run_dir: Path, repair: bool = False) -> list[dict]:
    """Every ``throughput.jsonl`` line of a run directory, then the rank part files' lines not folded in yet (each
    checked by :func:`read_throughput_file`)."""
    rows = read_throughput_file(Path(run_dir) / THROUGHPUT, repair=repair)
    seen = {_throughput_key(r) for r in rows}
    for part in part_files(run_dir, THROUGHPUT):
        rows += [r for r in read_throughput_file(part, repair=repair) if _throughput_key(r) not in seen]
    return rows


def fold_parts(run_dir: Path) -> int:
    """Fold the rank part files into ``samples.jsonl`` / ``throughput.jsonl``; return the sample lines added.

    Crash-safe order: for each part, the lines not yet in the main file are appended and fsynced, and only then is
    the part deleted. Killed in between, the next fold finds those lines already there and adds nothing twice
    (samples are keyed by (problem_id, sample), throughput lines by (rank, time)). Sample lines are appended in
    (problem_id, sample) order of each part. The main files are only appended to.
    """
    added = 0
    readers: tuple[tuple[str, Callable[..., list[dict]], Callable], ...] = (
        (SAMPLES, _sample_rows, _sample_key),
        (THROUGHPUT, read_throughput_file, _throughput_key),
    )
    for name, read, key in readers:
        parts = part_files(run_dir, name)
        if not parts:
            continue
        main = Path(run_dir) / name
        seen = {key(r) for r in read(main, repair=True)}
        for part in parts:
            new = []
            for r in read(part, repair=True):
                if key(r) not in seen:
                    seen.add(key(r))
                    new.append(r)
            if name == SAMPLES:
                new.sort(key=lambda r: (str(r["problem_id"]), r["sample"]))
                added += len(new)
            if new:
                append_jsonl(main, new)  # durable before the part goes
            part.unlink()
    ranks = Path(run_dir) / RANKS
    if ranks.is_dir() and not any(ranks.iterdir()):
        ranks.rmdir()
    return added


def write_sample(path: Path, row: Mapping) -> None:
    """Append one graded sample's line to ``path`` (``samples.jsonl``, or a rank's part file: :func:`sample_file`),
    durably (:func:`append_jsonl`): the one writer of sample lines, inline or background grading, one process or
    several. Then the ``written`` kill point of the test hook (:func:`kill_point`)."""
    append_jsonl(path, [row])
    kill_point("written")


_events: Counter = Counter()


def kill_point(event: str) -> None:
    """Count this process's ``event`` and, when ``VASE_TEST_KILL_AT`` names it (and this rank) at this count, send this
    process the hook's signal (SIGKILL unless given); see the module docstring. Unset, this only counts."""
    _events[event] += 1
    spec = os.environ.get(KILL_ENV, "").strip()
    if not spec:
        return
    parts = spec.split(":")
    if parts[0].startswith("rank"):
        rank = os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))
        if parts[0] != f"rank{rank}":
            return
        parts = parts[1:]
    name = parts[2] if len(parts) == 3 else "KILL"
    if (
        len(parts) not in (2, 3)
        or parts[0] not in KILL_EVENTS
        or not parts[1].isdigit()
        or not hasattr(signal, f"SIG{name}")
    ):
        raise ValueError(
            f"{KILL_ENV}={spec!r}: write [rank<r>:]<event>:<n>[:<signal>] with event one of {', '.join(KILL_EVENTS)}, "
            "e.g. written:2 or rank1:submitted:3:INT"
        )
    if parts[0] == event and int(parts[1]) == _events[event]:
        logger.warning("%s=%s: sending this process SIG%s", KILL_ENV, spec, name)
        logging.shutdown()
        os.kill(os.getpid(), getattr(signal, f"SIG{name}"))


def append_jsonl(path: Path, rows: Iterable[Mapping]) -> None:
    """Append rows and make them durable (flush + fsync) before returning. A failed write (a full disk, a lost
    permission) raises an ``OSError`` that names ``path`` (the OS reports a failed write or fsync without a file)."""
    with _naming(path), open(path, "a", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, default=str) + "\n")
        f.flush()
        os.fsync(f.fileno())


@contextmanager
def _naming(path: Path) -> Iterator[None]:
    """Re-raise an ``OSError`` without a file name (``write``, ``fsync`` and ``flush`` report none) as one that names
    ``path``, so the one-line error says which file could not be written."""
    try:
        yield
    except OSError as err:
        if err.filename is not None:
            raise
        raise OSError(err.errno, err.strerror or str(err), str(path)) from err


def write_json(path: Path, obj: Any) -> None:
    """Write JSON atomically (temp file + rename); a file that already holds exactly this JSON is left untouched.

    A non-finite number (NaN, infinity) is never written: a one-line ``ValueError`` naming the file and the key,
    before the file is touched."""
    bad = first_nonfinite(obj)
    if bad is not None:
        raise ValueError(
            f"{path}: not written, {bad} is not a finite number (NaN or infinity is an error, never data); this is a "
            "bug of the code that computed it: rerun with raise_errors=true and report it"
        )
    text = json.dumps(obj, indent=2, sort_keys=True, default=str, allow_nan=False) + "\n"
    if path.is_file() and path.read_bytes() == text.encode():
        return
    tmp = path.with_suffix(path.suffix + ".tmp")
    with _naming(tmp):
        tmp.write_text(text)
    tmp.replace(path)


def read_json(path: Path) -> dict:
    """A JSON object this harness wrote, or a one-line ``ValueError`` naming the file when it is damaged (truncated,
    not UTF-8, edited into something else)."""
    try:
        obj = loads(path.read_bytes().decode("utf-8"))
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


def _probe(name: str) -> bool | None:
    """``torch.cpu.<name>()`` (a private capability probe), or ``None`` where this torch lacks it."""
    import torch

    fn = getattr(torch.cpu, name, None)
    return bool(fn()) if callable(fn) else None


def cpu_model() -> str | None:
    """The CPU's model name (``/proc/cpuinfo``'s first ``model name``, else ``platform.processor()``), or ``None``."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def device_info() -> dict[str, Any]:
    """The machine: platform, CPU count, and the CUDA device when there is one."""
    import torch

    info: dict[str, Any] = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cpu": cpu_model(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),  # the ATen kernels torch picked: AVX2, AVX512...
        "cpu_bf16": _probe("_is_avx512_bf16_supported"),  # native bf16 (AVX-512 BF16): model.dtype=auto may pick it
        "cpu_amx": _probe("_is_amx_tile_supported"),
    }
    if torch.cuda.is_available():
        info["cuda_device"] = torch.cuda.get_device_name()
        info["cuda"] = torch.version.cuda
    return info


def reset_peak_memory(device) -> None:
    """Start a run's (a sweep cell's) CUDA peak-memory statistics afresh; on the CPU the peak RSS is the process's and
    cannot be reset (a sweep's later cells report the largest so far)."""
    import torch

    if getattr(device, "type", str(device)) == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_bytes(device) -> int:
    """CUDA max allocated on a CUDA device since the run began (:func:`reset_peak_memory`), else the process's peak
    resident set size."""
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
