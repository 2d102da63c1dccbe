"""The task interface: problems, grades and the :class:`Task` base dataclass.

A task is mostly data (where its problems come from, the prompt template, generation settings) plus a grader. Each
``conf/task/<name>.yaml`` names a :class:`Task` subclass as ``_target_`` and sets its fields; the runner builds it
with ``hydra.utils.instantiate`` and only uses the methods below, never the concrete type.

Loading order is deterministic (the dataset's own order). ``problem_ids`` is applied first (only those problems, in
the dataset's order; every id must exist), then ``limit``, then sharding: ``problem_ids`` and ``limit`` define the
problem set (e.g. the first 500 GSM8K test problems, or a committed list chosen by a selection run), and shard ``i``
of ``n`` takes every ``n``-th problem of that set starting at ``i`` (round-robin, so shards get a similar mix of easy
and hard problems). The union of all shards is therefore exactly the unsharded set, whatever ``num_shards`` is.

Loading from the Hugging Face hub uses pinned revisions: each task's ``pins`` (commit shas, see
``docs/reproducibility.md``), overridden by ``task.revision`` (a sha, or for a task that loads several datasets a
mapping part -> sha, e.g. ``task.revision.feb=<sha>``). After :meth:`Task.load`, :meth:`Task.resolved_sources` says
exactly what was loaded: the commit each hub dataset resolved to (read from the download, not the requested string),
or the sha256 of each local file. Offline (``HF_DATASETS_OFFLINE=1`` / ``HF_HUB_OFFLINE=1``), when the hub is
unreachable (probed once per process, :func:`vase.hub.ensure_hub_mode`), gated or the revision is missing,
:meth:`Task.load` raises one ``ValueError`` that names the dataset and says what to do (accept the terms and set
``HF_TOKEN``; or point ``task.data_dir`` at a local copy in the ``../shared/data`` schema). Reading the files and the
hub datasets themselves: :mod:`tasks.data`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from tasks.data import LOCAL_DATA_HINT, load_hub_dataset, numbered_jsonl, warn_unpinned
from vase.hub import revision_text, sha256_file

T = TypeVar("T")

logger = logging.getLogger(__name__)


@dataclass
class Problem:
    """One problem of a task.

    Attributes:
        id: stable identifier, unique within the task (the dataset's own id where it has one).
        prompt: the user message (paper template applied, before the chat template).
        answer: the gold answer: a string for math and for multiple choice (the letter); for code, what the grader
            needs (tests; ``None`` when the tests are not available locally).
        meta: extra fields, e.g. ``{"year": 2025}`` for AIME, subject and level for MATH-500.
    """

    id: str
    prompt: str
    answer: Any
    meta: dict = field(default_factory=dict)


@dataclass
class Grade:
    """The grade of one output.

    Attributes:
        extracted: the answer as extracted from the output (``None`` if none was found).
        correct: whether it is right.
        truncated: the output ended inside the thinking (no ``</think>``), so nothing was extracted.
        detail: why it is not correct (``"no_box"``, ``"no_choice"``, ``"no_code"``, ``"truncated"``,
            ``"wrong_answer"``, ``"no_tests"``, a sandbox status such as ``"timeout"``...), empty when correct.
        rules: for a task with several grader rules (:attr:`Task.grader_rules`: ``strict`` and ``last_boxed`` for
            boxed answers), the grade under each, by name; the fields above are the ``strict`` rule's. Empty for a
            task with one rule.
    """

    extracted: str | None
    correct: bool
    truncated: bool
    detail: str = ""
    rules: dict[str, Grade] = field(default_factory=dict)

    def under(self, rule: str) -> Grade:
        """The grade under grader ``rule`` (this grade itself when the task has only one rule)."""
        return self.rules.get(rule, self)


@dataclass
class Task:
    """Base of every task: loading, sharding, prompting and grading.

    Attributes:
        name: the task's name (as in ``conf/task/<name>.yaml``).
        data_dir: directory of local JSONL files in the ``../shared/data`` schema; ``None`` loads from the hub.
        problem_ids: keep only these problems (applied before ``limit`` and sharding; the dataset's order is kept; the
            runner never applies a task preset's default ``limit`` to them: :func:`vase.run.planning.problem_limit`);
            every id must exist in the task (ids as in ``samples.jsonl``, e.g. ``"HumanEval/12"``). ``None`` keeps
            them all.
        limit: keep only the first ``limit`` problems (applied before sharding).
        shard: index of this shard, in ``[0, num_shards)``.
        num_shards: number of shards; shard ``i`` takes problems ``i, i + n, i + 2n, ...`` of the limited set.
        n_samples: samples per problem (read by the runner).
        max_length: prompt + output tokens (read by the runner).
        reference_output_tokens: model name -> mean full-cache output tokens, plus a ``default`` entry; the runner
            sets the budget as reference / compression ratio.
        thinking: whether the model thinks (Qwen3 ``enable_thinking``); also the default of :meth:`grade`.
        window: recent-window override for the runner (``window: ${oc.select:task.window,64}``); ``None`` keeps the
            global default (the paper's 64). The short offline stand-ins set a smaller one.
        revision: hub revision; ``None`` takes the pins (:attr:`pins`). A commit sha (or branch/tag) for a task that
            loads one dataset; for one that loads several, a mapping part -> revision (missing parts keep their pin).
            Not used with ``data_dir``.
    """

    name: str = ""
    data_dir: str | None = None
    problem_ids: list[str] | None = None
    limit: int | None = None
    shard: int = 0
    num_shards: int = 1
    n_samples: int = 1
    max_length: int = 32768
    reference_output_tokens: dict[str, int] = field(default_factory=dict)
    thinking: bool = True
    window: int | None = None
    revision: Any = None

    #: the grader rules this task applies to every output (the first is the default); see :attr:`Grade.rules`
    grader_rules: ClassVar[tuple[str, ...]] = ("strict",)
    #: file name of the task in ``data_dir``
    local_file: ClassVar[str | None] = None
    #: the fields every row of the local file must have (checked with the file and line named, before any decoding)
    row_fields: ClassVar[tuple[str, ...]] = ()
    #: the hub datasets' pinned revisions, by part: ``{"": sha}`` for a task that loads one dataset,
    #: ``{"feb": sha, "nov": sha}`` for one that loads several; empty for a task that loads nothing from the hub
    pins: ClassVar[dict[str, str]] = {}

    def __post_init__(self) -> None:
        if not self.name:
            self.name = type(self).__name__.lower()
        if self.limit is not None and self.limit < 0:
            raise ValueError(f"task.limit: must be >= 0, got {self.limit}")
        self.problem_ids = self._checked_ids(self.problem_ids)
        if self.num_shards < 1:
            raise ValueError(f"task.num_shards: must be >= 1, got {self.num_shards}")
        if not 0 <= self.shard < self.num_shards:
            raise ValueError(f"task.shard: must be in [0, {self.num_shards}), got {self.shard}")
        if self.n_samples < 1:
            raise ValueError(f"task.n_samples: must be >= 1, got {self.n_samples}")
        if self.max_length < 1:
            raise ValueError(f"task.max_length: must be >= 1, got {self.max_length}")
        ref = self.reference_output_tokens
        if not isinstance(ref, Mapping):
            raise ValueError(f"task.reference_output_tokens: must be a mapping model -> tokens, got {ref!r}")
        self.reference_output_tokens = {str(k): int(v) for k, v in ref.items()}
        for model, tokens in self.reference_output_tokens.items():
            if tokens <= 0:
                raise ValueError(f"task.reference_output_tokens.{model}: must be > 0, got {tokens}")
        if self.window is not None and self.window < 1:
            raise ValueError(f"task.window: must be >= 1 or null, got {self.window}")
        if self.data_dir is not None:
            self.data_dir = str(self.data_dir)
            if not Path(self.data_dir).is_dir():
                raise ValueError(
                    f"task.data_dir: no such directory: {self.data_dir} (absolute: {Path(self.data_dir).resolve()})"
                )
        self.revision = self._checked_revision(self.revision)
        self._resolved: list[dict] = []
        self._loaded = False

    @staticmethod
    def _checked_ids(ids: Any) -> list[str] | None:
        """``task.problem_ids`` validated: ``None`` or a non-empty list of distinct ids (numbers taken as text)."""
        if ids is None:
            return None
        if isinstance(ids, (str, bytes, Mapping)) or not isinstance(ids, Iterable):
            raise ValueError(f"task.problem_ids: must be a list of problem ids or null, got {ids!r}")
        out = [str(i) for i in ids]
        if not out:
            raise ValueError("task.problem_ids: the list is empty; leave it null to keep every problem")
        dup = sorted({i for i in out if out.count(i) > 1})
        if dup:
            raise ValueError(f"task.problem_ids: listed more than once: {', '.join(dup)}")
        return out

    def _checked_revision(self, rev: Any) -> str | dict[str, str] | None:
        """``task.revision`` validated and completed with the pins."""
        if not self.pins:
            if rev is not None:
                raise ValueError(f"task.revision: task {self.name} loads nothing from the hub; leave it null")
            return None
        if set(self.pins) == {""}:
            return self.pins[""] if rev is None else revision_text(rev, "task.revision")
        parts = ", ".join(self.pins)
        if rev is None:
            return dict(self.pins)
        if not isinstance(rev, Mapping):
            first = next(iter(self.pins))
            raise ValueError(
                f"task.revision: task {self.name} loads {len(self.pins)} hub datasets; set one revision per part, "
                f"e.g. task.revision.{first}=<sha> (parts: {parts}), got {rev!r}"
            )
        out = dict(self.pins)
        for key, value in rev.items():
            if str(key) not in self.pins:
                raise ValueError(f"task.revision.{key}: unknown part of task {self.name}; parts: {parts}")
            out[str(key)] = revision_text(value, f"task.revision.{key}")
        return out

    def revision_of(self, part: str = "") -> str:
        """The revision to load for ``part`` (``""`` for a task that loads one dataset)."""
        if isinstance(self.revision, Mapping):
            return self.revision[part]
        if self.revision is None:
            raise ValueError(f"task.revision: task {self.name} loads nothing from the hub")
        return self.revision

    # ---------------------------------------------------------------------------------------------------- loading

    def hub_sources(self) -> list[dict]:
        """The hub datasets this task loads by default: ``{"dataset", "config", "split", "revision"}`` each."""
        return []

    def describe(self) -> dict:
        """Where the problems come from, for the run manifest: the local file and its sha256 when ``data_dir`` is
        set, else the pinned hub datasets; after :meth:`load` also ``resolved`` (:meth:`resolved_sources`)."""
        out: dict[str, Any] = {"name": self.name, "task_class": f"{type(self).__module__}.{type(self).__qualname__}"}
        if self.data_dir is not None:
            out["data_dir"] = str(Path(self.data_dir).resolve())
            if self.local_file and (Path(self.data_dir) / self.local_file).is_file():
                path = Path(self.data_dir) / self.local_file
                out["file"] = self.local_file
                out["sha256"] = sha256_file(path)
        else:
            out["hub"] = self.hub_sources()
        if self._loaded:
            out["resolved"] = self.resolved_sources()
        return out

    def resolved_sources(self) -> list[dict]:
        """What :meth:`load` actually read, for the manifest and the resume check.

        One dict per source: a hub dataset ``{"dataset", "config", "split", "revision", "sha"}`` (``revision`` as
        requested, ``sha`` the commit it resolved to, read from the download; ``None`` if it could not be read), a
        local file ``{"file", "sha256"}`` (its name in ``data_dir``, so a moved copy still matches), or a generator's
        parameters and the sha256 of the problems it produced. Independent of ``limit`` and sharding.
        """
        if not self._loaded:
            raise RuntimeError(f"task {self.name}: resolved_sources() is known after load()")
        return [dict(src) for src in self._resolved]

    def load(self) -> list[Problem]:
        """The problems of this shard, in a deterministic order (``problem_ids``, ``limit``, round-robin sharding)."""
        self._resolved, self._loaded = [], False
        problems = list(self.select(self.load_all(), key=lambda p: p.id))
        self._loaded = True
        return problems

    def select(self, items: Iterable[T], key: Callable[[T], str]) -> Iterator[T]:
        """This shard's items, lazily: of the items named by ``problem_ids`` (all when ``None``), the first ``limit``
        (nothing after them is read unless ``problem_ids`` must still be checked), every ``num_shards``-th from
        ``shard``. Duplicate ids (``key``) within the set are an error, and so is an id of ``problem_ids`` that no
        item has (one line naming it, raised once every item has been read)."""
        wanted = None if self.problem_ids is None else set(self.problem_ids)
        seen: set[str] = set()
        example = None
        k = 0
        for item in items:
            ident = key(item)
            example = ident if example is None else example
            if wanted is not None and ident not in wanted:
                continue
            if self.limit is not None and k >= self.limit:
                if wanted is None:
                    break
                seen.add(ident)  # past the limit: read on only to check that every listed id exists
                continue
            if ident in seen:
                raise ValueError(f"task {self.name}: duplicate problem id {ident!r}")
            seen.add(ident)
            if k % self.num_shards == self.shard:
                yield item
            k += 1
        if wanted is not None and not wanted <= seen:
            missing = [i for i in self.problem_ids or [] if i not in seen]
            more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            shown = ", ".join(repr(i) for i in missing[:5]) + more
            hint = f" (its ids look like {example!r})" if example is not None else ""
            raise ValueError(f"task.problem_ids: no problem {shown} in task {self.name}{hint}; fix or remove it")

    def record_source(self, source: Mapping[str, Any]) -> None:
        """Note a source read by :meth:`load` (see :meth:`resolved_sources`); repeated sources are kept once."""
        entry = dict(source)
        if entry not in self._resolved:
            self._resolved.append(entry)

    def record_file(self, path: Path, name: str | None = None) -> None:
        """Note a local file read by :meth:`load`, with the sha256 of its content."""
        self.record_source({"file": name or path.name, "sha256": sha256_file(path)})

    def load_all(self) -> list[Problem]:
        """Every problem of the task in the dataset's order, from ``data_dir`` if set, else from the hub."""
        if self.data_dir is not None:
            return self.load_local(Path(self.data_dir))
        return self.load_hub()

    def local_path(self, data_dir: Path, file_name: str | None = None) -> Path:
        """Path of the task's file in ``data_dir``; a one-line ``ValueError`` if it is missing."""
        name = file_name or self.local_file
        path = data_dir / str(name)
        if name is None or not path.is_file():
            raise ValueError(f"task.data_dir: {data_dir} has no {name} for task {self.name}")
        return path

    def load_local(self, data_dir: Path) -> list[Problem]:
        """Problems from the local JSONL file in ``data_dir``."""
        path = self.local_path(data_dir)
        self.record_file(path)
        problems = [self.checked_problem(path, lineno, row, i) for i, (lineno, row) in enumerate(numbered_jsonl(path))]
        if not problems:
            raise ValueError(f"task.data_dir: {path} holds no problems (the file is empty); {LOCAL_DATA_HINT}")
        return problems

    def checked_problem(self, path: Path, lineno: int, row: dict, index: int) -> Problem:
        """:meth:`problem_from_row` of one row of ``path``, any problem with the row a one-line ``ValueError`` naming
        the file, the line and what the task needs (:attr:`row_fields`)."""
        need = f"task {self.name} needs {', '.join(self.row_fields)} on every line"
        if missing := [f for f in self.row_fields if f not in row]:
            fix = "fix that line, or point task.data_dir at a complete copy"
            raise ValueError(f"{path}:{lineno}: missing field {', '.join(missing)} ({need}); {fix}")
        try:
            return self.problem_from_row(row, index)
        except (KeyError, TypeError, AttributeError, ValueError) as exc:
            what = f"missing field {exc}" if isinstance(exc, KeyError) else " ".join(str(exc).split())
            raise ValueError(f"{path}:{lineno}: cannot read this row ({what}; {need}); fix that line") from None

    def load_hub(self) -> list[Problem]:
        """Problems from the Hugging Face hub (pinned revision)."""
        raise ValueError(f"task {self.name}: no hub dataset; {LOCAL_DATA_HINT}")

    def problem_from_row(self, row: dict, index: int) -> Problem:
        """One problem from one dataset row (``index`` is its position in the file or split)."""
        raise NotImplementedError

    def hub_rows(
        self,
        dataset: str,
        config: str | None,
        split: str,
        revision: str,
        map_fn: Callable[[dict, int], T],
        part: str = "",
    ) -> list[T]:
        """Load ``dataset`` at ``revision`` (:func:`load_hub_dataset`), record the commit it resolved to, map its rows.

        ``part`` names the revision's key for a task that loads several datasets (for the hint to pin it).
        """
        rows, sha = load_hub_dataset(self.name, dataset, config, split, revision)
        warn_unpinned(self.name, dataset, revision, "task.revision" + (f".{part}" if part else ""), sha)
        self.record_source({"dataset": dataset, "config": config, "split": split, "revision": revision, "sha": sha})
        return [map_fn(row, i) for i, row in enumerate(rows)]

    # ---------------------------------------------------------------------------------------------------- prompting

    def messages(self, problem: Problem) -> list[dict]:
        """The chat messages of a problem: one user message holding its prompt."""
        return [{"role": "user", "content": problem.prompt}]

    def render(self, problem: Problem, tokenizer: Any, enable_thinking: bool | None = None) -> str:
        """The prompt text with the tokenizer's chat template applied and the generation prompt added.

        ``enable_thinking`` (default: the task's ``thinking``) is passed only when the template uses it (Qwen3). A
        tokenizer without a chat template gets the bare prompt (with a warning).
        """
        thinking = self.thinking if enable_thinking is None else enable_thinking
        template = getattr(tokenizer, "chat_template", None)
        if not template:
            logger.warning("task %s: tokenizer has no chat template; using the bare prompt", self.name)
            return problem.prompt
        kwargs = {"enable_thinking": thinking} if "enable_thinking" in str(template) else {}
        return tokenizer.apply_chat_template(
            self.messages(problem), tokenize=False, add_generation_prompt=True, **kwargs
        )

    # ---------------------------------------------------------------------------------------------------- grading

    def grade(self, problem: Problem, output: str, thinking: bool | None = None) -> Grade:
        """Grade one output (``thinking`` defaults to the task's setting)."""
        raise NotImplementedError

    def grade_many(self, items: list[tuple[Problem, str]], thinking: bool | None = None) -> list[Grade]:
        """Grade many outputs, in order."""
        return [self.grade(p, out, thinking) for p, out in items]

    def check_environment(self) -> None:
        """Refuse, with a one-line ``ValueError``, a machine this task cannot run on safely (before any decoding)."""

    def reference_tokens(self, model: str) -> int:
        """Mean full-cache output tokens of ``model`` on this task (the ``default`` entry if the model is absent)."""
        if model in self.reference_output_tokens:
            return self.reference_output_tokens[model]
        if "default" in self.reference_output_tokens:
            return self.reference_output_tokens["default"]
        raise ValueError(f"task.reference_output_tokens: no entry for {model!r} and no 'default'")


__all__ = ["Grade", "Problem", "Task"]
