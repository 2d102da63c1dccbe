"""The results-tree validator: what the lines of a run directory's samples files must be *together*.

Each line is checked on its own by :func:`vase.schema.check_sample` (a type and a range for every field, finite
numbers, nesting at most :data:`vase.schema.MAX_DEPTH` deep, parsed by :func:`vase.schema.loads`). This module checks
what only the whole set shows, against the protocol of the run (:class:`Planned`: its ``n_samples`` from
``protocol.json``, and where the reader knows the task, its problems):

* one line per ``(problem, sample)``: a second line for the same pair with *other* content is refused in one line
  naming both lines (which one is right cannot be known). The *same* line twice is tolerated and counted once: a
  shard merge or a data-parallel fold killed between appending a part's lines and deleting the part leaves exactly
  that (:func:`vase.run.results.fold_parts`), and both copies say the same;
* ``sample`` below the run's ``n_samples`` (the samples planned are ``0 .. n_samples - 1``);
* ``problem_id`` one of the task's problems, where the reader knows them (``run.py`` does: it loaded the task);
* one layout: lines written by an older release, without fields the metrics read (:data:`vase.schema.METRIC_FIELDS`)
  are an :class:`OldLayout` naming the run and a fix that applies (rerun it into a new directory); a single line
  without them among complete ones is damage (:class:`vase.schema.BadSample`);
* a field a newer release added that only some lines carry (``kv_retained_bytes_mean`` on the lines a resumed run
  added to an older run's) is never averaged over the lines that have it: :func:`partial_fields` names it, and the
  metrics and the report show it as missing (``None``) with the count of lines that lack it.

Every error is a one-line ``ValueError`` (:class:`vase.schema.BadSample`) naming the file and the line, raised before
anything is counted or written.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from vase.schema import METRIC_FIELDS, SAMPLE_FIELDS, SCHEMA, BadSample

logger = logging.getLogger(__name__)

#: fields a newer release may have added, read by the metrics or the report where a line has them: never averaged
#: over a subset of a run's lines (:func:`partial_fields`)
OPTIONAL_FIELDS = tuple(
    k
    for k in SCHEMA
    if k not in SAMPLE_FIELDS + METRIC_FIELDS
    and k not in ("seed", "grader", "error", "output", "meta", "rank", "budget", "problem_id", "policy_output_checked")
)


class OldLayout(BadSample):
    """A run directory whose lines were written by an older release of vase (fields the metrics read are absent from
    them): one line naming the run and what to do with it."""


@dataclass(frozen=True)
class Planned:
    """The samples a run plans: ``(problem, sample)`` for ``sample < n_samples`` and ``problem`` one of the task's.

    Attributes:
        n_samples: the run's ``n_samples`` (``protocol.json``); ``None``: not checked.
        problems: problems known to be the task's (those this invocation loaded); ``None``: not checked.
        all_problems: every problem of the task, asked only when a line names one outside ``problems`` (a run that
            loaded the first ``limit`` problems reads the rest only then); ``None``: ``problems`` are all of them.
        task: the task's name, for the messages.
    """

    n_samples: int | None = None
    problems: Collection[str] | None = None
    all_problems: Callable[[], Collection[str]] | None = None
    task: str = "the task"


def planned_of(run_dir: Path, planned: Planned | None, read_json: Callable[[Path], dict]) -> Planned:
    """``planned``, or what the run directory's ``protocol.json`` says (its ``n_samples``; nothing without one)."""
    if planned is not None:
        return planned
    path = Path(run_dir) / "protocol.json"
    if not path.is_file():
        return Planned()
    n = read_json(path).get("n_samples")
    return Planned(n_samples=n if isinstance(n, int) and not isinstance(n, bool) and n >= 1 else None)


def check_rows(located: Iterable[tuple[Path, int, Mapping]], planned: Planned, for_metrics: bool = False) -> list[dict]:
    """The samples of a run from its ``(file, line number, row)`` (every row already a sample by
    :func:`vase.schema.check_sample`), each ``(problem, sample)`` once, in the order first written; raises
    :class:`BadSample` (one line naming the file and the line) for a line against the protocol (module docstring), and
    with ``for_metrics`` :class:`OldLayout` for lines of an older release."""
    located = list(located)
    if for_metrics:
        _check_layout(located)
    first: dict[tuple, tuple[Path, int, Mapping]] = {}
    rows: list[dict] = []
    outside: list[tuple[Path, int, Mapping]] = []
    known = None if planned.problems is None else set(planned.problems)
    for path, lineno, row in located:
        key = (row["problem_id"], row["sample"])
        if key in first:
            p0, n0, r0 = first[key]
            if r0 != row:
                raise BadSample(
                    f"{path}: line {lineno}: sample {row['sample']} of problem {row['problem_id']!r} again, with other "
                    f"content than {p0}: line {n0} (vase writes each sample once, so one of them was edited); delete "
                    "the wrong line, then rerun (nothing was counted or written)"
                )
            continue  # the same line again (a fold killed before it deleted the part): counted once
        if planned.n_samples is not None and row["sample"] >= planned.n_samples:
            raise BadSample(
                f"{path}: line {lineno}: sample {row['sample']} of problem {row['problem_id']!r} is beyond the run's "
                f"n_samples={planned.n_samples} (protocol.json: samples 0 to {planned.n_samples - 1}); delete that "
                "line, then rerun (nothing was counted or written)"
            )
        if known is not None and row["problem_id"] not in known:
            outside.append((path, lineno, row))
        first[key] = (path, lineno, row)
        rows.append(dict(row))
    if outside:
        everything = _every_problem(planned, known, outside)
        for path, lineno, row in outside if everything is not None else ():
            if row["problem_id"] not in everything:
                raise BadSample(
                    f"{path}: line {lineno}: problem {row['problem_id']!r} is not a problem of {planned.task} (its "
                    f"{len(everything)} problems); delete that line, or resume with the task it was written for "
                    "(nothing was counted or written)"
                )
    return rows


def _every_problem(planned: Planned, known: set[str], outside: list) -> set[str] | None:
    """Every problem of the task (``None``, with a warning, when the rest of the task cannot be read here: the lines
    outside this invocation's problems are then taken as written by a larger ``limit``)."""
    if planned.all_problems is None:
        return known
    try:
        return set(planned.all_problems())
    except Exception as err:  # the rest of a hub dataset offline, a file gone: the check cannot be made, not an error
        logger.warning(
            "%s: %d lines name problems outside this invocation's; %s could not be read whole to check them (%s)",
            outside[0][0],
            len(outside),
            planned.task,
            " ".join(str(err).split()),
        )
        return None


def _check_layout(located: list[tuple[Path, int, Mapping]]) -> None:
    """Lines without fields the metrics read: two or more lines (or every line) lacking the same fields are an older
    release's (:class:`OldLayout`); a single such line among complete ones is damage (:class:`BadSample`)."""
    lacking = [(p, n, tuple(k for k in METRIC_FIELDS if k not in r)) for p, n, r in located]
    lacking = [x for x in lacking if x[2]]
    if not lacking:
        return
    path, lineno, missing = lacking[0]
    same = [x for x in lacking if x[2] == missing]
    if len(same) >= 2 or len(located) == 1:
        run_dir = path.parent.parent if path.parent.name == "ranks" else path.parent
        raise OldLayout(
            f"{run_dir}: written by an older release of vase ({len(same)} of {len(located)} lines, from {path}: line "
            f"{lineno}, lack {', '.join(missing)}, which the metrics read); its samples cannot be counted with this "
            f"release's: rerun it into a new directory (python run.py --config-path {run_dir.resolve()} "
            f"--config-name config run_dir={run_dir}-rerun), or move it out of the results tree"
        )
    raise BadSample(
        f"{path}: line {lineno} is not a sample the metrics read (an object without {', '.join(missing)}; every line "
        f"vase writes is an object with {', '.join(SAMPLE_FIELDS + METRIC_FIELDS)}); fix or delete that line, or "
        "restore the file from a copy, then rerun (nothing was counted or written)"
    )


def partial_fields(rows: Iterable[Mapping[str, Any]]) -> dict[str, int]:
    """Fields of :data:`OPTIONAL_FIELDS` (and ``correct_<rule>`` / ``extracted_<rule>``) that some of ``rows`` carry
    and others lack (lines of an older release among a newer one's), each with the number of rows that lack it. A
    figure read from such a field would be averaged over a subset: it is reported missing instead."""
    rows = list(rows)
    seen: dict[str, int] = {}
    for r in rows:
        for k in r:
            if k in OPTIONAL_FIELDS or k.startswith(("correct_", "extracted_")):
                seen[k] = seen.get(k, 0) + 1
    return {k: len(rows) - n for k, n in sorted(seen.items()) if n < len(rows)}


def missing_note(partial: Mapping[str, int], total: int) -> dict[str, str]:
    """``metrics.json``'s ``fields_missing``: per partial field, why its figures are ``None``."""
    return {
        k: f"absent from {n} of {total} samples (lines written by an older release): not averaged over the rest; "
        "rerun the run into a new directory for it"
        for k, n in partial.items()
    }


def planned_for(task: Any, problems: Iterable[Any], n_samples: int) -> Planned:
    """The samples ``run.py`` plans for ``task``: ``n_samples`` per problem, the problems it loaded (``problems``) and,
    only if a line names another one, every problem of the task (the same task without ``limit``, ``problem_ids``
    and sharding: an earlier invocation with a larger ``limit`` wrote those lines legitimately)."""
    ids = frozenset(p.id for p in problems)
    subset = task.limit is not None or task.problem_ids is not None or task.num_shards > 1

    def every() -> frozenset[str]:
        whole = replace(task, limit=None, problem_ids=None, shard=0, num_shards=1)
        return ids | frozenset(p.id for p in whole.load())

    return Planned(n_samples, ids, every if subset else None, f"task {task.name}")
