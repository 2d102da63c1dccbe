"""The compact, committed form of a pilot's results: a slim results tree packed in one ``.tar.xz``.

A pilot's results tree (``results/pilot``: a few MB, mostly the generated text) is slimmed into
``docs/data/<name>.tar.xz`` (tens of KB) that holds, for every vase run directory under it (same relative paths):

- ``config.yaml``, ``protocol.json``, ``metrics.json``, ``manifest.json``, ``resolved.json``: copied byte for byte
  (the policy and its hyper-parameters, budget, window, seed, the protocol, the machine and dtype; small files that
  compress to almost nothing across runs);
- ``throughput.jsonl``: every line (decode rate, wall time, memory);
- ``samples.jsonl``: every sample (rank part files folded in, each ``(problem_id, sample)`` once, schema-checked on
  the way in), every field except :data:`DROPPED_FIELDS` (the generated text and the grader's free-text detail), an
  extracted answer longer than :data:`MAX_ANSWER` characters (a code task's program) cut to that length (the readers
  only ask whether there is one);
- ``slim.json`` at the top: the format, where it came from, the counts, the wall time of the command that produced
  the runs (``wall_seconds``, when given) and what was dropped.

So :func:`vase.analysis.load.load_tree` reads the unpacked tree as it reads the original one, with no reader of its
own: :func:`open_slim` unpacks it into a temporary directory. Every number a generator computes from the tree is the
same on both (``tests/test_tables.py`` checks the pilot blocks digit for digit). The archive is deterministic: the
same tree gives the same bytes (sorted members, no times, owners or modes of this machine), so a re-slim of unchanged
results leaves git with nothing to commit. Why an archive and not a plain slim tree: ~2,500 sample lines of ~30
fields are ~1.6 MB as JSON and ~100 KB packed; why not a new table format: the readers (and the results validator)
then need no second path.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import shutil
import tarfile
import tempfile
from collections.abc import Iterator
from pathlib import Path

from vase.analysis.load import find_run_dirs, not_a_run
from vase.run.results import SAMPLES, THROUGHPUT, read_samples, read_throughput

logger = logging.getLogger(__name__)

FORMAT = 1
SUFFIX = ".tar.xz"
INFO = "slim.json"
#: the run files copied as they are
RUN_FILES = ("config.yaml", "protocol.json", "metrics.json", "manifest.json", "resolved.json")
#: the sample fields left out (free text no generator reads)
DROPPED_FIELDS = ("output", "grade_detail")
#: an extracted answer (``extracted``, ``extracted_<rule>``) longer than this is cut to it
MAX_ANSWER = 200


def slim_sample(row: dict) -> dict:
    """A sample line without :data:`DROPPED_FIELDS`, its long extracted answers cut to :data:`MAX_ANSWER` characters
    (the field order kept)."""
    out = {}
    for key, value in row.items():
        if key in DROPPED_FIELDS:
            continue
        if key.startswith("extracted") and isinstance(value, str) and len(value) > MAX_ANSWER:
            value = value[:MAX_ANSWER]
        out[key] = value
    return out


def _jsonl(rows: list[dict]) -> bytes:
    return "".join(json.dumps(r, ensure_ascii=False, allow_nan=False) + "\n" for r in rows).encode("utf-8")


def slim_files(src: str | Path, *, wall_seconds: float | None = None, machine: str | None = None) -> dict[str, bytes]:
    """The files of the slim tree of the results tree ``src``: relative path -> content. ``machine``: the CPU or GPU
    the runs ran on, in words, for manifests that predate their ``device.cpu`` field (``slim.json``'s ``machine``).

    Raises:
        ValueError: ``src`` is not a directory or holds no vase run (one line naming it).
        vase.schema.BadSample: a damaged sample line (one line naming the file and the line).
    """
    src = Path(src)
    if not src.is_dir():
        raise ValueError(f"slim: no such results directory: {src}; run the pilot first (make pilot)")
    if wall_seconds is not None and not (wall_seconds >= 0 and wall_seconds != float("inf")):
        raise ValueError(f"slim: --wall-seconds must be a finite number >= 0, not {wall_seconds}")
    files: dict[str, bytes] = {}
    runs = samples = 0
    for run_dir in find_run_dirs(src):
        if (why := not_a_run(run_dir)) is not None:
            logger.warning("slim: skipping %s: %s", run_dir, why)
            continue
        rel = run_dir.relative_to(src).as_posix()
        prefix = "" if rel == "." else rel + "/"
        for name in RUN_FILES:
            if (run_dir / name).is_file():
                files[prefix + name] = (run_dir / name).read_bytes()
        rows = [slim_sample(r) for r in read_samples(run_dir)]
        if rows:
            files[prefix + SAMPLES] = _jsonl(rows)
        lines = read_throughput(run_dir)
        if lines:
            files[prefix + THROUGHPUT] = _jsonl(lines)
        runs += 1
        samples += len(rows)
    if not runs:
        raise ValueError(f"slim: no vase runs (metrics.json or samples.jsonl) under {src}")
    info = {
        "format": FORMAT,
        "source": src.as_posix(),
        "runs": runs,
        "samples": samples,
        "wall_seconds": wall_seconds,
        **({"machine": machine} if machine else {}),
        "dropped_fields": list(DROPPED_FIELDS),
        "max_answer_chars": MAX_ANSWER,
    }
    files[INFO] = (json.dumps(info, indent=1) + "\n").encode()
    return files


def pack(files: dict[str, bytes], archive: str | Path) -> Path:
    """Write ``files`` (relative path -> content) as a deterministic ``.tar.xz`` at ``archive`` (atomically: a
    half-written archive never replaces a good one)."""
    archive = Path(archive)
    if not archive.name.endswith(SUFFIX):
        raise ValueError(f"slim: the archive's name must end in {SUFFIX}: {archive}")
    archive.parent.mkdir(parents=True, exist_ok=True)
    tmp = archive.with_name(archive.name + ".tmp")
    with tarfile.open(tmp, "w:xz", preset=9, format=tarfile.PAX_FORMAT) as tar:
        for name in sorted(files):
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.mode, info.uid, info.gid = len(files[name]), 0, 0o644, 0, 0
            info.uname = info.gname = ""
            tar.addfile(info, io.BytesIO(files[name]))
    os.replace(tmp, archive)
    return archive


def slim_tree(
    src: str | Path, archive: str | Path, *, wall_seconds: float | None = None, machine: str | None = None
) -> dict:
    """Slim the results tree ``src`` into ``archive`` (see the module docstring); return its ``slim.json``."""
    files = slim_files(src, wall_seconds=wall_seconds, machine=machine)
    pack(files, archive)
    return json.loads(files[INFO])


@contextlib.contextmanager
def open_slim(archive: str | Path) -> Iterator[Path]:
    """Unpack ``archive`` into a temporary directory, yield its root (a results tree :func:`load_tree` reads),
    remove it afterwards."""
    archive = Path(archive)
    if not archive.is_file():
        raise ValueError(f"slim: no such archive: {archive}")
    tmp = Path(tempfile.mkdtemp(prefix="vase-slim-"))
    try:
        with tarfile.open(archive, "r:xz") as tar:
            tar.extractall(tmp, filter="data")  # no absolute paths, links out of the tree or devices
        if not (tmp / INFO).is_file():
            raise ValueError(
                f"slim: {archive} is not a slim results archive (no {INFO}); make it with scripts/slim_results.py"
            )
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def slim_info(root: str | Path) -> dict:
    """The ``slim.json`` of an unpacked slim tree."""
    return json.loads((Path(root) / INFO).read_text())
