"""Reading a task's data: local JSON-lines files and hub datasets at pinned revisions, each failure one line.

* :func:`numbered_jsonl` / :func:`iter_jsonl` / :func:`read_jsonl` — a local JSON-lines file (``.gz`` read
  compressed), row by row; text that is not UTF-8, a line that is not JSON or not an object is one ``ValueError``
  naming the file, the line and the fix.
* :func:`load_hub_dataset` / :func:`hub_file` — a hub dataset (or one file of its repository) at a revision, with the
  commit it resolved to; offline (``HF_DATASETS_OFFLINE=1`` / ``HF_HUB_OFFLINE=1``) or with the hub unreachable and
  nothing cached, it fails at once, in one line that points at ``task.data_dir``; :func:`warn_unpinned` warns once
  about a revision that is a branch or tag rather than a commit.

:class:`tasks.base.Task` uses these; a task file uses them for its own sources.
"""

from __future__ import annotations

import gzip
import json
import logging
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

from vase.hub import ensure_hub_mode, hub_error, is_commit_sha, single_log_lines

logger = logging.getLogger(__name__)

LOCAL_DATA_HINT = "point task.data_dir at a local copy (a directory of JSONL files in the ../shared/data schema)"


def numbered_jsonl(path: str | Path) -> Iterator[tuple[int, dict]]:
    """``(line number, row)`` of a JSON-lines file, one at a time (blank lines skipped; ``.gz`` read compressed).

    Every problem is a one-line ``ValueError`` naming the file, the line and the fix: text that is not UTF-8, a line
    that is not JSON, a JSON value that is not an object.
    """
    fix = "fix or remove that line, or point task.data_dir at a good copy"
    with (gzip.open if str(path).endswith(".gz") else open)(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise ValueError(
                    f"{path}:{lineno}: not UTF-8 text (byte {raw[exc.start]:#04x} at column {exc.start + 1}); save the "
                    "file as UTF-8 (e.g. iconv -f latin1 -t utf-8), or point task.data_dir at a good copy"
                ) from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: invalid JSON ({exc}); {fix}") from None
            if not isinstance(row, dict):
                raise ValueError(
                    f"{path}:{lineno}: a JSON {type(row).__name__}, not an object (every line must be one JSON object "
                    f"with the problem's fields); {fix}"
                )
            yield lineno, row


def iter_jsonl(path: str | Path) -> Iterator[dict]:
    """Rows of a JSON-lines file, one at a time (:func:`numbered_jsonl`): memory holds one row, not the file."""
    return (row for _, row in numbered_jsonl(path))


def read_jsonl(path: str | Path) -> list[dict]:
    """Rows of a JSON-lines file (blank lines skipped)."""
    return list(iter_jsonl(path))


_warned_unpinned: set[tuple[str, str]] = set()


def warn_unpinned(task: str, dataset: str, revision: str, setting: str, sha: str | None) -> None:
    """Warn once per dataset and revision when ``revision`` is a branch or tag rather than a commit sha."""
    if is_commit_sha(revision) or (dataset, revision) in _warned_unpinned:
        return
    _warned_unpinned.add((dataset, revision))
    logger.warning(
        "task %s: %s is not pinned (revision %r resolved to %s, recorded in the run's resolved.json); pin it with "
        "%s=%s (docs/reproducibility.md)",
        task,
        dataset,
        revision,
        sha,
        setting,
        sha or "<sha>",
    )


def hub_cached(dataset: str) -> bool:
    """Whether anything of ``dataset`` is in the hub or datasets cache (a cheap check; no import of ``datasets``)."""
    home = Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface"))
    hub = Path(os.environ.get("HF_HUB_CACHE", os.environ.get("HUGGINGFACE_HUB_CACHE", home / "hub")))
    ds = Path(os.environ.get("HF_DATASETS_CACHE", home / "datasets"))
    return (hub / f"datasets--{dataset.replace('/', '--')}").exists() or (ds / dataset.replace("/", "___")).exists()


def _offline_error(subject: str, reason: str) -> ValueError:
    return ValueError(f"{subject} (offline or unreachable: {reason}, and it is not in the cache); {LOCAL_DATA_HINT}")


def load_hub_dataset(
    task: str, dataset: str, config: str | None, split: str, revision: str
) -> tuple[Iterable[dict], str | None]:
    """``(rows, commit)`` of a hub dataset at ``revision``, with one clear ``ValueError`` on failure.

    Goes through ``datasets.load_dataset_builder`` + ``download_and_prepare`` + ``as_dataset`` (what
    ``datasets.load_dataset`` does) so that the commit the builder resolved (``builder.hash``: the snapshot of the
    dataset card, or offline the cached copy's commit) is known; a copy whose commit differs from a pinned sha is
    refused. Offline or with the hub unreachable and nothing of the dataset cached, it fails at once, without
    importing ``datasets``.
    """
    what = dataset + (f"/{config}" if config else "")
    subject = f"task {task}: cannot load dataset {what}"
    offline = ensure_hub_mode()
    if offline and not hub_cached(dataset):
        raise _offline_error(subject, offline)
    try:
        import datasets

        single_log_lines()
        builder = datasets.load_dataset_builder(dataset, config, revision=revision)
        builder.download_and_prepare()
        rows = builder.as_dataset(split=split)
    except Exception as exc:  # ConnectionError offline, DatasetNotFoundError, gated access, missing revision...
        raise hub_error(exc, subject, dataset, "dataset", revision, "task.revision", LOCAL_DATA_HINT) from None
    sha = getattr(builder, "hash", None)
    sha = sha if is_commit_sha(sha) else None
    if is_commit_sha(revision) and sha is not None and sha != revision:
        raise ValueError(
            f"task {task}: dataset {what} loaded commit {sha}, not the pinned {revision} (offline, `datasets` uses the "
            f"latest cached copy); run once with the hub reachable to cache the pinned one, or set task.revision"
        )
    return rows, sha


def hub_file(task: str, dataset: str, filename: str, revision: str) -> Path:
    """Download (or find in the cache) one file of a hub dataset repository; one clear error on failure.

    The file's commit is :func:`vase.hub.snapshot_sha` of the returned path.
    """
    subject = f"task {task}: cannot load dataset {dataset} file {filename}"
    offline = ensure_hub_mode()
    if offline and not hub_cached(dataset):
        raise _offline_error(subject, offline)
    try:
        from huggingface_hub import hf_hub_download

        return Path(hf_hub_download(dataset, filename, repo_type="dataset", revision=revision))
    except Exception as exc:
        raise hub_error(exc, subject, dataset, "dataset", revision, "task.revision", LOCAL_DATA_HINT) from None
