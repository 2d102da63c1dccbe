"""Every setting check in one place: :func:`check_settings` runs before anything is built, written or loaded.

``python run.py`` calls it on the composed config before Hydra starts (so a bad value writes no file, not even
Hydra's own output directory), and :func:`vase.run.runner.prepare` calls it first thing (library use, tests).
A bad value raises one ``ValueError("<setting>: <what is wrong>, got <value>; <fix>")``; nothing is ever silently
replaced by a default (``generation.max_length=0`` is an error, not "the task's length").

Only the standard library and OmegaConf are imported here, so the command line's checks stay fast (no torch; an
explicit ``generation.attn_backend=flash_attn`` imports flash-attn, and so torch, to check that it works).
The choices below mirror the engine's (``vase.engine.attention.BACKENDS``, ``vase.engine.scores.SCORE_DTYPES``), the
model loader's (``vase.models.DTYPES``) and the graders' (``tasks.grading.GRADER_RULES``); ``tests/test_checks.py``
and ``tests/test_protocol.py`` keep them equal.

Settings that a checkout may not have yet (``generation.max_rows``, ``generation.kv_memory``, ``generation.batching``)
are checked when present and ignored when absent.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from decimal import Decimal, InvalidOperation
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

#: ``generation.attn_backend`` (= ``vase.engine.attention.BACKENDS``).
ATTN_BACKENDS = ("auto", "sdpa", "eager", "flash_attn")
#: ``model.dtype``: ``auto`` (the checkpoint's own dtype) or a name of ``vase.models.DTYPES``.
MODEL_DTYPES = ("auto", "bfloat16", "bf16", "float16", "fp16", "float32", "fp32")
#: ``model.reasoning_format`` (= ``vase.models.REASONING_FORMATS``).
REASONING_FORMATS = ("think_tags", "harmony")
#: ``generation.compile`` (= ``vase.engine.compiled.COMPILE_SETTINGS``; YAML's unquoted on / off read as true / false).
COMPILE_SETTINGS = ("auto", "on", "off")
#: ``generation.batching``.
BATCHING = ("continuous", "per_problem")
#: ``protocol.grader`` (= ``tasks.grading.GRADER_RULES``).
GRADERS = ("strict", "last_boxed")
#: ``protocol.score_dtype`` (= the names of ``vase.engine.scores.SCORE_DTYPES``).
SCORE_DTYPES = ("float32", "bfloat16")
#: ``protocol.equivalence`` and ``protocol.code_extraction`` (= ``tasks.grading.EQUIVALENCES``, ``CODE_EXTRACTIONS``).
EQUIVALENCES = ("math_verify", "authors")
CODE_EXTRACTIONS = ("harness", "authors")

#: the largest budget (tokens per layer, KV head and sequence): more than any model's context window, so more than a
#: cache can hold (``ratio=1e-300`` would otherwise make a 300-digit budget and a run directory name to match).
MAX_BUDGET = 2**24

#: the keys of the ``generation`` group (conf/generation/default.yaml): any other is a typo, ``+`` or not
GENERATION_KEYS = (
    "temperature",
    "top_p",
    "top_k",
    "greedy",
    "max_length",
    "attn_backend",
    "compile",
    "sync_every",
    "batching",
    "max_rows",
    "kv_memory",
    "stop_on_loop",
    "grade_workers",
    "check_policy_output",
)
#: the top-level settings of conf/config.yaml and its groups (``hydra``: Hydra's own node, when composed with it)
TOP_LEVEL_KEYS = (
    "ratio",
    "budget",
    "window",
    "seed",
    "n_samples",
    "limit",
    "pass_k",
    "results_dir",
    "run_dir",
    "progress",
    "record_kept",
    "raise_errors",
    "model",
    "task",
    "policy",
    "generation",
    "protocol",
    "pilot_row",
    "logger",
    "sweep",
    "parallel",
    "hydra",
)

_ABSENT = object()
# Decimal (SI) and binary (IEC) byte units; a bare K/M/G/T is refused as ambiguous.
_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: Any, setting: str = "size") -> int:
    """A byte count from ``8GB`` (10^9), ``512MiB`` (2^20), ``1.5GiB``, ``"4096"`` or an integer (>= 1).

    Units are case-insensitive: ``B``, ``KB`` / ``MB`` / ``GB`` / ``TB`` (powers of 1000) and ``KiB`` / ``MiB`` /
    ``GiB`` / ``TiB`` (powers of 1024). A bare ``8G`` is refused (write ``8GB`` or ``8GiB``). Fractional byte counts
    are rounded down. Raises a one-line ``ValueError`` naming ``setting``.
    """
    fix = f"write a size such as {setting}=8GB, 512MiB, 1.5GiB or a byte count"
    if isinstance(value, bool):
        raise ValueError(f"{setting}: must be a size, got {value!r}; {fix}")
    if isinstance(value, int):
        n = value
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{setting}: must be a size, got {value!r}; {fix}")
        n = int(value)
    elif isinstance(value, str):
        match = _SIZE.match(value)
        if not match:
            raise ValueError(f"{setting}: not a size: {value!r}; {fix}")
        number, unit = match.groups()
        if unit.lower() not in _UNITS:
            ambiguous = unit.lower() in ("k", "m", "g", "t")
            why = f"ambiguous unit {unit!r}" if ambiguous else f"unknown unit {unit!r}"
            hint = f"{number}{unit.upper()}B (powers of 1000) or {number}{unit.upper()}iB (powers of 1024)"
            raise ValueError(f"{setting}: {why} in {value!r}; {'write ' + hint if ambiguous else fix}")
        try:
            n = int(Decimal(number) * _UNITS[unit.lower()])
        except InvalidOperation:
            raise ValueError(f"{setting}: not a size: {value!r}; {fix}") from None
    else:
        raise ValueError(f"{setting}: must be a size, got {value!r}; {fix}")
    if n < 1:
        raise ValueError(f"{setting}: must be at least 1 byte, got {value!r}; {fix}")
    return n


# --------------------------------------------------------------------------------------------------------------------
# small checkers: each raises ValueError("<setting>: <what is wrong>, got <value>; <fix>")


def _get(cfg: DictConfig, path: str) -> Any:
    """The resolved value at ``path``, or ``_ABSENT``; an unresolvable interpolation names the setting."""
    try:
        value = OmegaConf.select(cfg, path, default=_ABSENT, throw_on_resolution_failure=True)
    except OmegaConfBaseException as err:
        reason = " ".join(str(err).split("\n")[0].split())
        raise ValueError(f"{path}: cannot resolve its value ({reason}); set it explicitly, e.g. {path}=...") from None
    if isinstance(value, (DictConfig, ListConfig)):
        return OmegaConf.to_container(value, resolve=True)
    return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _fail(setting: str, problem: str, value: Any, fix: str) -> None:
    raise ValueError(f"{setting}: {problem}, got {value!r}; {fix}")


def _integer(
    cfg: DictConfig, path: str, minimum: int | None, *, nullable: bool = False, null_means: str = "", fix: str = ""
) -> Any:
    value = _get(cfg, path)
    if value is _ABSENT or (nullable and value is None):
        return value
    if not _is_int(value) or (minimum is not None and value < minimum):
        bound = "an integer" if minimum is None else f"an integer >= {minimum}"
        alt = f" or null ({null_means})" if nullable else ""
        _fail(path, f"must be {bound}{alt}", value, fix or f"e.g. {path}={max(minimum or 0, 1)}")
    return value


def _number(cfg: DictConfig, path: str, *, low: float, low_open: bool, high: float | None = None, fix: str) -> Any:
    value = _get(cfg, path)
    if value is _ABSENT:
        return value
    ok = _is_number(value) and (value > low if low_open else value >= low) and (high is None or value <= high)
    if not ok:
        if high is not None:
            rng = f"in {'(' if low_open else '['}{low:g}, {high:g}]"
        else:
            rng = f"{'>' if low_open else '>='} {low:g}"
        finite = "a finite number " if isinstance(value, float) and not math.isfinite(value) else ""
        _fail(path, f"must be {finite}{rng}", value, fix)
    return value


def _boolean(cfg: DictConfig, path: str) -> Any:
    value = _get(cfg, path)
    if value is not _ABSENT and not isinstance(value, bool):
        _fail(path, "must be true or false", value, f"write {path}=true or {path}=false")
    return value


def _choice(cfg: DictConfig, path: str, choices: tuple[str, ...], *, nullable: bool = False) -> Any:
    value = _get(cfg, path)
    if value is _ABSENT or (nullable and value is None):
        return value
    if value not in choices:
        import difflib

        close = difflib.get_close_matches(str(value), choices, n=1)
        hint = f"did you mean {path}={close[0]}? " if close else ""
        _fail(path, "unknown choice", value, f"{hint}choose one of {', '.join(choices)}")
    return value


def _path(cfg: DictConfig, path: str, *, nullable: bool, example: str) -> Any:
    value = _get(cfg, path)
    if value is _ABSENT or (nullable and value is None):
        return value
    if not isinstance(value, str) or not value.strip():
        alt = " or null" if nullable else ""
        _fail(path, f"must be a directory path{alt}", value, f"e.g. {path}={example}")
    return value


# --------------------------------------------------------------------------------------------------------------------
# the settings


def _check_top_level(cfg: DictConfig) -> None:
    _number(cfg, "ratio", low=0, low_open=True, fix="budget = reference output length / ratio: e.g. ratio=4")
    window = _integer(cfg, "window", 1, fix="the recent window in tokens: e.g. window=64")
    budget = _get(cfg, "budget")
    if budget not in (None, _ABSENT):
        w = window if _is_int(window) else 64
        if not _is_int(budget) or budget <= w:
            _fail("budget", f"must be an integer > window={w} or null (from ratio)", budget, f"e.g. budget={4 * w}")
        if budget > MAX_BUDGET:
            most = f"must be <= {MAX_BUDGET} tokens (the most a cache can hold)"
            _fail("budget", most, budget, f"e.g. budget={4 * w}")
    _integer(cfg, "seed", None, fix="e.g. seed=0")
    _integer(cfg, "n_samples", 1, nullable=True, null_means="the task's protocol", fix="e.g. n_samples=4")
    _integer(cfg, "limit", 0, nullable=True, null_means="the task's default", fix="e.g. limit=10")
    pass_k = _get(cfg, "pass_k")
    if pass_k is not _ABSENT:
        if not isinstance(pass_k, list):
            _fail("pass_k", "must be a list of integers >= 1", pass_k, "e.g. pass_k=[1,4,16]")
        for k in pass_k:
            if not (_is_int(k) and k >= 1):
                _fail("pass_k", "entries must be integers >= 1", k, "e.g. pass_k=[1,4,16]")
    _path(cfg, "results_dir", nullable=False, example="results")
    _path(cfg, "run_dir", nullable=True, example="results/my_run")
    for flag in ("progress", "record_kept", "raise_errors"):
        _boolean(cfg, flag)
    _known_keys(cfg.get("parallel"), "parallel.", ("tensor",), "keys of parallel")
    _integer(cfg, "parallel.tensor", 1, fix="ranks per model: e.g. parallel.tensor=2 (torchrun --nproc-per-node 2)")


def _known_keys(node: Any, prefix: str, known: tuple[str, ...], where: str) -> None:
    """Every key of ``node`` is one of ``known``: a key added with ``+`` (``+generation.compil=on``) is refused like a
    typo without it, with a did-you-mean."""
    if not isinstance(node, (DictConfig, Mapping)):
        return
    for key in node:
        if key in known:
            continue
        import difflib

        close = difflib.get_close_matches(str(key), known, n=1)
        hint = f" (did you mean {prefix}{close[0]}?)" if close else ""
        raise ValueError(
            f"{prefix}{key}: unknown setting{hint}; {where}: {', '.join(k for k in known if k != 'hydra')}"
        )


def _check_generation(cfg: DictConfig) -> None:
    g = "generation"
    _known_keys(cfg.get(g), f"{g}.", GENERATION_KEYS, "keys of generation")
    _number(cfg, f"{g}.temperature", low=0, low_open=False, fix=f"0 = greedy; e.g. {g}.temperature=0.6")
    _number(cfg, f"{g}.top_p", low=0, low_open=True, high=1, fix=f"1 = off; e.g. {g}.top_p=0.95")
    _integer(cfg, f"{g}.top_k", 0, fix=f"0 = off; e.g. {g}.top_k=20")
    _boolean(cfg, f"{g}.greedy")
    _boolean(cfg, f"{g}.stop_on_loop")
    _boolean(cfg, f"{g}.check_policy_output")
    _integer(
        cfg,
        f"{g}.max_length",
        1,
        nullable=True,
        null_means="task.max_length",
        fix=f"e.g. {g}.max_length=4096 (prompt + output tokens)",
    )
    backend = _choice(cfg, f"{g}.attn_backend", ATTN_BACKENDS)
    if backend == "flash_attn":
        _check_flash_attn(cfg)
    _integer(
        cfg,
        f"{g}.sync_every",
        1,
        nullable=True,
        null_means="1 on CPU, 16 on CUDA",
        fix=f"e.g. {g}.sync_every=16 (copy tokens to the host every 16 steps)",
    )
    max_rows = _get(cfg, f"{g}.max_rows")
    if max_rows is not _ABSENT and max_rows != "auto" and not (_is_int(max_rows) and max_rows >= 1):
        _fail(f"{g}.max_rows", "must be auto or an integer >= 1", max_rows, f"e.g. {g}.max_rows=auto or 16")
    kv_memory = _get(cfg, f"{g}.kv_memory")
    if kv_memory not in (None, _ABSENT):
        parse_bytes(kv_memory, f"{g}.kv_memory")
    _choice(cfg, f"{g}.batching", BATCHING)
    if not isinstance(_get(cfg, f"{g}.compile"), bool):
        _choice(cfg, f"{g}.compile", COMPILE_SETTINGS)
    workers = _get(cfg, f"{g}.grade_workers")
    if workers is not _ABSENT and workers != "auto" and not (_is_int(workers) and workers >= 0):
        _fail(
            f"{g}.grade_workers",
            "must be auto or an integer >= 0",
            workers,
            f"{g}.grade_workers=0 grades in the decode loop, N in N worker processes, auto on the cores left over",
        )


def _check_flash_attn(cfg: DictConfig) -> None:
    """An explicit ``generation.attn_backend=flash_attn`` must be able to run: CUDA, fp16/bf16, a working import."""
    setting, fix = "generation.attn_backend", "use generation.attn_backend=auto (SDPA)"
    if _get(cfg, "model.device") == "cpu":
        _fail(setting, "flash_attn needs a CUDA device", "flash_attn", f"{fix} on CPU")
    dtype = _get(cfg, "model.dtype")
    if dtype in ("float32", "fp32"):
        _fail(setting, f"flash_attn needs fp16 or bf16, model.dtype is {dtype}", "flash_attn", f"{fix} or bf16")
    from vase.engine.attention import flash_attn_import_error  # imports torch: only when flash_attn is asked for

    error = flash_attn_import_error()
    if error is not None:
        _fail(
            setting,
            f"flash_attn.flash_attn_interface does not import ({error})",
            "flash_attn",
            f"install a flash-attn built for this torch (pip install '.[gpu]'), or {fix}",
        )


def _check_model(cfg: DictConfig) -> None:
    _choice(cfg, "model.dtype", MODEL_DTYPES)
    _choice(cfg, "model.reasoning_format", REASONING_FORMATS)
    device = _get(cfg, "model.device")
    if device is not _ABSENT and not (
        device in ("auto", "cpu", "cuda") or (isinstance(device, str) and re.fullmatch(r"cuda:\d+", device))
    ):
        _fail("model.device", "must be auto, cpu, cuda or cuda:<index>", device, "e.g. model.device=auto")


def _check_task(cfg: DictConfig) -> None:
    _integer(cfg, "task.limit", 0, nullable=True, null_means="every problem", fix="e.g. task.limit=10")
    _integer(cfg, "task.n_samples", 1, fix="e.g. task.n_samples=4")
    _integer(cfg, "task.max_length", 1, fix="prompt + output tokens: e.g. task.max_length=4096")
    num_shards = _integer(cfg, "task.num_shards", 1, fix="e.g. task.num_shards=4")
    shard = _integer(cfg, "task.shard", 0, fix="e.g. task.shard=0")
    if _is_int(num_shards) and _is_int(shard) and shard >= num_shards:
        _fail("task.shard", f"must be in [0, task.num_shards={num_shards})", shard, "e.g. task.shard=0")
    _path(cfg, "task.data_dir", nullable=True, example="../shared/data")


def _check_protocol(cfg: DictConfig) -> None:
    """The ``protocol`` node (conf/protocol/): its choices, and the value slots it hands the policy."""
    p = "protocol"
    name = _get(cfg, f"{p}.name")
    if name is not _ABSENT and not (isinstance(name, str) and name.strip()):
        _fail(f"{p}.name", "must be a non-empty name", name, "e.g. protocol=paper, or protocol.name=mine")
    _choice(cfg, f"{p}.grader", GRADERS)
    _choice(cfg, f"{p}.score_dtype", SCORE_DTYPES)
    _boolean(cfg, f"{p}.shuffle_choices")
    _choice(cfg, f"{p}.equivalence", EQUIVALENCES)
    _choice(cfg, f"{p}.code_extraction", CODE_EXTRACTIONS)
    _boolean(cfg, f"{p}.require_authors_data")
    by_task = _get(cfg, f"{p}.n_protect_by_task")
    if by_task not in (_ABSENT, None):
        if not isinstance(by_task, dict):
            _fail(f"{p}.n_protect_by_task", "must be a mapping task -> slots", by_task, "e.g. {math500: 256}")
        for task, n in by_task.items():
            if not (_is_int(n) and n >= 0):
                _fail(
                    f"{p}.n_protect_by_task.{task}",
                    "must be an integer >= 0",
                    n,
                    f"e.g. {p}.n_protect_by_task.{task}=256",
                )
    n = _get(cfg, f"{p}.n_protect")
    if n not in (_ABSENT, None) and not ((_is_int(n) and n >= 0) or (_is_number(n) and 0 < n < 1)):
        _fail(
            f"{p}.n_protect",
            "must be an integer >= 0, a fraction of budget in (0, 1) or null",
            n,
            f"e.g. {p}.n_protect=256",
        )
    check_protocol_n_protect(cfg)


def check_protocol_n_protect(cfg: DictConfig) -> None:
    """When the policy takes its value slots from the protocol (``policy.n_protect: ${...protocol.n_protect...}``), they
    must fit its budget: a one-line error naming ``protocol.n_protect`` rather than the policy's field the user never
    set. Skipped while the budget is not known yet (``budget=null``: the runner calls it again once it is)."""
    raw = OmegaConf.select(cfg, "policy", default=None)
    if not isinstance(raw, DictConfig) or "n_protect" not in raw:
        return
    text = OmegaConf.to_container(raw, resolve=False).get("n_protect")
    if not (isinstance(text, str) and "protocol.n_protect" in text):
        return
    n, budget, window = _get(cfg, "policy.n_protect"), _get(cfg, "budget"), _get(cfg, "window")
    if not (_is_int(n) and _is_int(budget) and _is_int(window)):
        return
    if n > budget - window:
        task = _get(cfg, "task.name")
        _fail(
            "protocol.n_protect",
            f"{n} protected value slots (protocol {_get(cfg, 'protocol.name')!r}, task {task}) do not fit "
            f"budget - window = {budget} - {window}",
            n,
            f"raise budget (budget={-(-(n + window) // window) * window}: room for them, a multiple of the window) "
            "or set policy.n_protect=<slots>",
        )


def _check_launcher(cfg: DictConfig) -> None:
    """``hydra/launcher=local`` is CPU-only: hydra-submitit's local executor gives every concurrent job the same
    ``CUDA_VISIBLE_DEVICES=0..n-1``, so a GPU count there would put every job on GPU 0 (present only when the config
    was composed with Hydra's own node, as ``run.py`` does)."""
    target = _get(cfg, "hydra.launcher._target_")
    if not isinstance(target, str) or not target.endswith("LocalLauncher"):
        return
    gpus = _get(cfg, "hydra.launcher.gpus_per_node")
    if _is_int(gpus) and gpus > 0:
        _fail(
            "hydra.launcher.gpus_per_node",
            "hydra/launcher=local is CPU-only (every concurrent job would get the same GPUs, all on GPU 0)",
            gpus,
            "keep it 0, and run on this machine's GPUs with torchrun --nproc-per-node <GPUs> run.py -m ...",
        )


#: the largest integer any setting may hold: what a C ``int64`` (torch, numpy, the OS) holds
MAX_INT = 2**63 - 1


def _check_int_range(cfg: DictConfig) -> None:
    """No integer setting (of any group: the policy's, the task's, the model's...) beyond a signed 64-bit integer:
    such a value is a typo (a seed of 5000 digits), and past this point it overflows far from the setting's name."""

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                if prefix == "" and k == "hydra":
                    continue
                walk(v, f"{prefix}{k}.")
        elif isinstance(node, list):
            for i, v in enumerate(node):
                walk(v, f"{prefix[:-1]}[{i}].")
        elif _is_int(node) and abs(node) > MAX_INT:
            name = prefix[:-1]
            _fail_big(name, node)

    walk(OmegaConf.to_container(cfg, resolve=False), "")


def _fail_big(setting: str, value: int) -> None:
    digits = len(str(abs(value))) if value.bit_length() < 14000 else None
    size = f"an integer of {digits} digits" if digits else "an integer of over 4000 digits"
    raise ValueError(
        f"{setting}: {size} is out of range (at most 2**63 - 1 = {MAX_INT}); give a value that fits the setting"
        + (f", e.g. {setting}=0" if setting.endswith("seed") else "")
    )


def check_settings(cfg: DictConfig | Mapping) -> None:
    """Check every top-level, ``generation``, ``model``, common ``task`` and ``protocol`` setting of a composed config.

    Runs before anything is built, written or loaded. Group-specific fields (a policy's ``n_protect``, a task's
    ``timeout_s``) are checked by their dataclasses when built, still before any data or weights load.

    Raises:
        ValueError: one line, ``"<setting>: <what is wrong>, got <value>; <fix>"``.
    """
    if not isinstance(cfg, DictConfig):
        cfg = OmegaConf.create(dict(cfg))
    _check_int_range(cfg)
    _known_keys(cfg, "", TOP_LEVEL_KEYS, "top-level settings and groups")
    _check_top_level(cfg)
    _check_generation(cfg)
    _check_model(cfg)
    _check_task(cfg)
    _check_protocol(cfg)
    _check_launcher(cfg)
