"""The task interface: problems, grades and the :class:`Task` base dataclass.

A task is mostly data (where its problems come from, the prompt template, generation settings) plus a grader. Each
``conf/task/<name>.yaml`` names a :class:`Task` subclass as ``_target_`` and sets its fields; the runner builds it
with ``hydra.utils.instantiate`` and only uses the methods below, never the concrete type.

Loading order is deterministic (the dataset's own order). ``limit`` is applied first, then sharding: ``limit``
defines the problem set (e.g. the first 500 GSM8K test problems), and shard ``i`` of ``n`` takes every ``n``-th
problem of that set starting at ``i`` (round-robin, so shards get a similar mix of easy and hard problems). The union
of all shards is therefore exactly the unsharded set, whatever ``num_shards`` is.

Loading from the Hugging Face hub uses pinned revisions. Offline (``HF_DATASETS_OFFLINE=1`` / ``HF_HUB_OFFLINE=1``)
or when the hub is unreachable, :meth:`Task.load` raises one ``ValueError`` that names the dataset and says how to
point ``task.data_dir`` at a local copy in the ``../shared/data`` schema.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

logger = logging.getLogger(__name__)

LOCAL_DATA_HINT = "point task.data_dir at a local copy, e.g. task.data_dir=../shared/data"


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
    """

    extracted: str | None
    correct: bool
    truncated: bool
    detail: str = ""


def read_jsonl(path: str | Path) -> list[dict]:
    """Rows of a JSON-lines file (blank lines skipped)."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{path}:{lineno}: invalid JSON ({exc})") from None
    return rows


@dataclass
class Task:
    """Base of every task: loading, sharding, prompting and grading.

    Attributes:
        name: the task's name (as in ``conf/task/<name>.yaml``).
        data_dir: directory of local JSONL files in the ``../shared/data`` schema; ``None`` loads from the hub.
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
    """

    name: str = ""
    data_dir: str | None = None
    limit: int | None = None
    shard: int = 0
    num_shards: int = 1
    n_samples: int = 1
    max_length: int = 32768
    reference_output_tokens: dict[str, int] = field(default_factory=dict)
    thinking: bool = True
    window: int | None = None

    #: file name of the task in ``data_dir``
    local_file: ClassVar[str | None] = None

    def __post_init__(self) -> None:
        if not self.name:
            self.name = type(self).__name__.lower()
        if self.limit is not None and self.limit < 0:
            raise ValueError(f"task.limit: must be >= 0, got {self.limit}")
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

    # ---------------------------------------------------------------------------------------------------- loading

    def hub_sources(self) -> list[dict]:
        """The hub datasets this task loads by default: ``{"dataset", "config", "split", "revision"}`` each."""
        return []

    def describe(self) -> dict:
        """Where the problems come from, for the run manifest: the local file and its sha256 when ``data_dir`` is
        set, else the pinned hub datasets."""
        out: dict[str, Any] = {"name": self.name, "task_class": f"{type(self).__module__}.{type(self).__qualname__}"}
        if self.data_dir is not None:
            out["data_dir"] = str(Path(self.data_dir).resolve())
            if self.local_file and (Path(self.data_dir) / self.local_file).is_file():
                path = Path(self.data_dir) / self.local_file
                out["file"] = self.local_file
                out["sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
        else:
            out["hub"] = self.hub_sources()
        return out

    def load(self) -> list[Problem]:
        """The problems of this shard, in a deterministic order (``limit`` first, then round-robin sharding)."""
        problems = self.load_all()
        seen: set[str] = set()
        for p in problems:
            if p.id in seen:
                raise ValueError(f"task {self.name}: duplicate problem id {p.id!r}")
            seen.add(p.id)
        if self.limit is not None:
            problems = problems[: self.limit]
        return problems[self.shard :: self.num_shards]

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
        return [self.problem_from_row(row, i) for i, row in enumerate(read_jsonl(self.local_path(data_dir)))]

    def load_hub(self) -> list[Problem]:
        """Problems from the Hugging Face hub (pinned revision)."""
        raise ValueError(f"task {self.name}: no hub dataset; {LOCAL_DATA_HINT}")

    def problem_from_row(self, row: dict, index: int) -> Problem:
        """One problem from one dataset row (``index`` is its position in the file or split)."""
        raise NotImplementedError

    def hub_rows(
        self, dataset: str, config: str | None, split: str, revision: str, map_fn: Callable[[dict, int], Problem]
    ) -> list[Problem]:
        """Load ``dataset`` through :func:`datasets.load_dataset` and map its rows; one clear error if unreachable."""
        rows = load_hub_dataset(self.name, dataset, config, split, revision)
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

    def reference_tokens(self, model: str) -> int:
        """Mean full-cache output tokens of ``model`` on this task (the ``default`` entry if the model is absent)."""
        if model in self.reference_output_tokens:
            return self.reference_output_tokens[model]
        if "default" in self.reference_output_tokens:
            return self.reference_output_tokens["default"]
        raise ValueError(f"task.reference_output_tokens: no entry for {model!r} and no 'default'")


def hf_offline() -> bool:
    """Whether ``HF_DATASETS_OFFLINE`` or ``HF_HUB_OFFLINE`` is set to a true value."""
    return any(
        os.environ.get(k, "").strip().upper() in ("1", "ON", "YES", "TRUE")
        for k in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")
    )


def hub_cached(dataset: str) -> bool:
    """Whether anything of ``dataset`` is in the hub or datasets cache (a cheap check; no import of ``datasets``)."""
    home = Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface"))
    hub = Path(os.environ.get("HF_HUB_CACHE", os.environ.get("HUGGINGFACE_HUB_CACHE", home / "hub")))
    ds = Path(os.environ.get("HF_DATASETS_CACHE", home / "datasets"))
    return (hub / f"datasets--{dataset.replace('/', '--')}").exists() or (ds / dataset.replace("/", "___")).exists()


def _unreachable(task: str, what: str, reason: str) -> ValueError:
    return ValueError(f"task {task}: cannot load dataset {what} (offline or unreachable: {reason}); {LOCAL_DATA_HINT}")


def load_hub_dataset(task: str, dataset: str, config: str | None, split: str, revision: str) -> Iterable[dict]:
    """``datasets.load_dataset`` with one clear ``ValueError`` when the dataset cannot be reached.

    With the offline flags set and nothing of the dataset in the caches, it fails at once, without importing
    ``datasets`` (which alone takes about a second).
    """
    what = dataset + (f"/{config}" if config else "")
    if hf_offline() and not hub_cached(dataset):
        raise _unreachable(task, what, "offline mode is on and it is not in the cache")
    try:
        import datasets

        return datasets.load_dataset(dataset, config, split=split, revision=revision)
    except Exception as exc:  # ConnectionError offline, FileNotFoundError / DatasetNotFoundError, gated access...
        raise _unreachable(task, what, f"{type(exc).__name__}: {str(exc)[:200]}") from None


def hub_file(task: str, dataset: str, filename: str, revision: str) -> Path:
    """Download (or find in the cache) one file of a hub dataset repository; one clear error if unreachable."""
    if hf_offline() and not hub_cached(dataset):
        raise _unreachable(task, f"{dataset} file {filename}", "offline mode is on and it is not in the cache")
    try:
        from huggingface_hub import hf_hub_download

        return Path(hf_hub_download(dataset, filename, repo_type="dataset", revision=revision))
    except Exception as exc:
        raise _unreachable(task, f"{dataset} file {filename}", f"{type(exc).__name__}: {str(exc)[:200]}") from None
