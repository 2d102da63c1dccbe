"""Planning a run: every check, the run directory, the samples still to decode, in one pass that writes nothing.

Steps 1-3 of the order of work (:mod:`vase.run.runner` runs them, then takes the lock, then writes):

1. check every setting (:func:`vase.run.checks.check_settings`), the fields of the task, model, policy and logger
   nodes, then build them (one-line ``ValueError`` on bad input, before any data or weights load);
2. resolve the budget (``budget=`` or the task's reference full-cache output length for the model / ``ratio``,
   rounded to a multiple of ``window``), the run directory (absent, empty or a vase run:
   :func:`vase.run.rundir.check_run_dir`) and its protocol;
3. load the problems (none is an error) and, with samples missing, the model's config and the tokenizer (no
   weights): device, context window, every prompt rendered and measured, the cache against the memory; refuse a
   changed protocol, data or weights.

:func:`plan` does all of it and writes nothing: ``run.py`` runs it for every cell of a command line before Hydra
starts, the runner again before it takes the lock, and every rank of a data-parallel run on its own device (the
ranks other than 0 after rank 0 has opened the directory; they only read it).
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from vase.engine.memory import auto_dtype
from vase.engine.sampling import SamplingConfig, sample_seeds
from vase.engine.scores import score_dtype
from vase.run.checks import MAX_BUDGET, check_protocol_n_protect, check_settings, parse_bytes
from vase.run.preflight import (
    check_cache,
    check_fields,
    check_model,
    load_problems,
    load_tokenizer,
    no_problems,
    tensor_of,
)
from vase.run.protocol import check_authors_data, check_authors_source, comparable, data_copy, protocol_knobs, run_tag
from vase.run.protocol import settings as protocol_settings
from vase.run.results import PROTOCOL, check_protocol, check_resolved, read_json, read_samples, stable_hash
from vase.run.rundir import check_run_dir
from vase.run.validate import planned_for

logger = logging.getLogger(__name__)

# Settings that do not change results: excluded from the protocol comparison on resume.
NON_PROTOCOL_TASK_KEYS = ("problem_ids", "limit", "shard", "num_shards", "data_dir", "max_workers")
NON_PROTOCOL_GENERATION_KEYS = (
    "sync_every",
    "attn_backend",
    "batching",
    "max_rows",
    "kv_memory",
    "grade_workers",
    "compile",
)


def build(node: Any, what: str) -> Any:
    """``hydra.utils.instantiate`` after :func:`vase.run.preflight.check_fields` (unknown keys and wrong types, one
    line each), surfacing a constructor's ``ValueError`` as itself (one line, no wrapper)."""
    from hydra.errors import InstantiationException

    check_fields(node, what)
    try:
        return instantiate(node)
    except InstantiationException as err:
        cause = err.__cause__
        if isinstance(cause, ValueError):
            msg = " ".join(str(cause).split())
            fix = "" if "; " in msg else f"; fix it (the settings of each {what}: conf/{what}/*.yaml)"
            raise ValueError(msg + fix) from None
        raise ValueError(f"{what}: cannot build it ({' '.join(str(cause or err).split())})") from None


def resolve_budget(reference_tokens: int, ratio: float, window: int) -> int:
    """``reference / ratio`` rounded to the nearest multiple of ``window`` (at least ``2 * window``).

    Raises:
        ValueError: one line naming ``ratio`` when the budget would exceed what a cache can hold
            (:data:`vase.run.checks.MAX_BUDGET` tokens; ``ratio=1e-300`` would make a 300-digit budget).
    """
    tokens = reference_tokens / ratio
    if not tokens <= MAX_BUDGET:  # inf and nan too
        raise ValueError(
            f"ratio: {ratio!r} gives budget = {reference_tokens} / {ratio!r} tokens, more than a cache can hold (at "
            f"most {MAX_BUDGET} tokens); use ratio >= {reference_tokens / MAX_BUDGET:.3g} (e.g. ratio=4), or set "
            "budget= directly"
        )
    return max(2, round(tokens / window)) * window


_logged_fallbacks: set[tuple[str, str, int]] = set()


def reference_length(task: Any, model_spec: Any) -> tuple[int, str]:
    """``(reference full-cache output tokens, where it came from)`` for ``ratio=``: ``model.reference_tokens`` when
    set, else the task's ``reference_output_tokens`` entry for the model's key, else the task's ``default`` entry.

    The fallback to ``default`` (a model the task's table does not list, e.g. a local directory under a new
    ``model.key``) is said in one log line naming the length, why, and how to set it (once per task, key and length).
    """
    key = model_spec.key
    if model_spec.reference_tokens is not None:
        return int(model_spec.reference_tokens), "model.reference_tokens"
    table = task.reference_output_tokens
    if key in table:
        return table[key], f"task.reference_output_tokens.{key}"
    tokens = task.reference_tokens(key)  # the default entry (a one-line error without one)
    if (task.name, key, tokens) not in _logged_fallbacks:
        _logged_fallbacks.add((task.name, key, tokens))
        listed = ", ".join(k for k in table if k != "default") or "none"
        logger.warning(
            "budget: ratio= uses the default reference output length of task %s, %d tokens, because model.key %r has "
            "no entry in task.reference_output_tokens (listed: %s); set model.reference_tokens=<mean full-cache output "
            "tokens of this model> or budget= to choose it",
            task.name,
            tokens,
            key,
            listed,
        )
    return tokens, "task.reference_output_tokens.default"


def problem_limit(task_cfg: dict, limit: int | None) -> int | None:
    """The ``limit`` the task is built with: the top-level ``limit=`` when given, else the task's own ``task.limit``
    (a preset's default, e.g. HumanEval's 16) -- except with an explicit ``task.problem_ids``, which a task's limit
    never cuts: every listed problem is decoded (one log line says that the task's limit was set aside). A
    top-level ``limit=N`` with ``problem_ids`` keeps the first N listed problems (in the dataset's order)."""
    ids, own = task_cfg.get("problem_ids"), task_cfg.get("limit")
    if limit is not None:
        return limit
    if ids is not None and own is not None:
        if isinstance(ids, (list, tuple)) and len(ids) > own:  # otherwise the limit cuts nothing: no line
            logger.info(
                "task.problem_ids lists %d problems: task.limit=%d (the task's default) is not applied to them; "
                "limit=<n> keeps the first n of the listed problems",
                len(ids),
                own,
            )
        return None
    return own


def problem_seed(seed: int, problem_id: str) -> int:
    """A problem's seed: stable across runs, shards and resumes (independent of the problem's position)."""
    return int(hashlib.sha256(f"{seed}:{problem_id}".encode()).hexdigest()[:12], 16)


@dataclass
class Prepared:
    """Everything built from the config before any data or weights load."""

    cfg: DictConfig
    task: Any
    model_spec: Any
    policy: Any
    sampling: SamplingConfig
    n_samples: int
    max_length: int
    thinking: bool
    run_dir: Path
    protocol: dict
    explicit_budget: bool
    batching: str
    max_rows: int | str
    kv_memory: int | None
    grader: str = "strict"
    score_dtype: Any = None
    reference: dict | None = None  # ratio=: {"tokens", "source", "ratio"}; None for an explicit budget=
    data_copy: dict | None = None  # which copy of the data the run reads (vase.run.protocol.data_copy), after loading


def prepare(cfg: DictConfig) -> Prepared:
    """Validate, resolve the budget and build task / model spec / policy (no data or weights loaded)."""
    check_settings(cfg)  # every setting, before anything is built, written or loaded (vase/run/checks.py)
    task_cfg = OmegaConf.to_container(cfg.task, resolve=True)
    task_cfg["limit"] = problem_limit(task_cfg, cfg.limit)
    if cfg.n_samples is not None:
        task_cfg["n_samples"] = cfg.n_samples
    task = build(task_cfg, "task")
    model_spec = build(cfg.model, "model")
    explicit_budget = cfg.budget is not None
    reference = None
    if not explicit_budget:
        tokens, source = reference_length(task, model_spec)
        reference = {"tokens": tokens, "source": source, "ratio": cfg.ratio}
        budget = resolve_budget(tokens, cfg.ratio, cfg.window)
        OmegaConf.update(cfg, "budget", budget, force_add=True)
        check_protocol_n_protect(cfg)  # the protocol's value slots against the budget now known
    policy = build(cfg.policy, "policy")
    gen = cfg.generation
    sampling = SamplingConfig(temperature=gen.temperature, top_p=gen.top_p, top_k=gen.top_k, greedy=gen.greedy)
    max_length = int(gen.max_length) if gen.max_length is not None else int(task.max_length)
    batching = gen.get("batching", "continuous")  # choices, max_rows and kv_memory checked by check_settings
    max_rows = gen.get("max_rows", "auto")
    kv_memory = None if gen.get("kv_memory") is None else parse_bytes(gen.kv_memory, "generation.kv_memory")
    task.check_environment()  # e.g. a code task refuses an unsafe sandbox now, not after decoding
    thinking = bool(model_spec.thinking and task.thinking)
    policy_desc = policy.describe()
    # The full cache ignores budget and window: one run serves every ratio of a sweep (never decoded twice).
    budget_free = policy.kind == "none"
    if budget_free:
        policy_desc = {k: v for k, v in policy_desc.items() if k not in ("budget", "window")}
    protocol = {
        # reference_tokens only sets the budget (recorded below), like ratio: not a protocol key of its own
        "model": {k: v for k, v in asdict(model_spec).items() if k not in ("device", "reference_tokens")},
        "task": {k: v for k, v in task_cfg.items() if k not in NON_PROTOCOL_TASK_KEYS},
        "policy": policy_desc,
        "generation": {
            **asdict(sampling),
            "max_length": max_length,
            "thinking": thinking,
            "stop_on_loop": bool(gen.get("stop_on_loop", False)),
        },
        "seed": cfg.seed,
        "n_samples": task.n_samples,
        "budget": None if budget_free else cfg.budget,
        "window": None if budget_free else cfg.window,
    }
    own = protocol_settings(cfg.get("protocol"))
    # the protocol's grader where the task has that rule (boxed answers), else the task's one rule (code)
    grader = own["grader"] if own["grader"] in task.grader_rules else task.grader_rules[0]
    if cfg.run_dir:
        run_dir = Path(cfg.run_dir)
    else:
        budget_tag = "" if budget_free else f"-b{cfg.budget}"
        tag = f"{policy.name}{budget_tag}-{stable_hash(policy_desc, 6)}-s{cfg.seed}{run_tag(cfg.get('protocol'))}"
        if task.num_shards > 1:
            tag += f"-shard{task.shard}of{task.num_shards}"
        run_dir = Path(cfg.results_dir) / task.name / model_spec.key / tag
    prep = Prepared(
        cfg,
        task,
        model_spec,
        policy,
        sampling,
        task.n_samples,
        max_length,
        thinking,
        run_dir,
        protocol,
        explicit_budget,
        batching,
        max_rows,
        kv_memory,
        grader,
        score_dtype(own["score_dtype"]),
        reference,
    )
    protocol["protocol"] = protocol_knobs(prep, grader)  # every knob of docs/protocol.md, as this run uses it
    return prep


@dataclass
class Work:
    """A problem with samples still to decode: its rendered prompt's ids and its seeds."""

    problem: Any
    ids: list[int]
    missing: list[int]
    seeds: list[int]


@dataclass
class RunPlan:
    """What a run will do, found without writing anything (:func:`plan`)."""

    prep: Prepared
    problems: list
    data: dict
    done_rows: list[dict]
    work: list[Work]


def plan(cfg: DictConfig, *, machine: bool = True, cache: bool = False, device: str | None = None) -> RunPlan:
    """Every check of a run, in one pass that writes nothing (steps 1-3 of the module docstring).

    Args:
        machine: the run will happen on this machine: check the device and the memory here too (``run.py`` passes
            ``False`` before submitting to SLURM, where the job checks them on its node).
        cache: keep the loaded problems and tokenizer for the run that follows in this process (``run.py``).
        device: this rank's device in a data-parallel run (:meth:`vase.run.distributed.World.pick_device`; not part
            of the protocol); ``None``: ``model.device`` as set.

    Raises:
        ValueError: one line naming the setting or file and the fix.
    """
    prep = prepare(cfg)
    if device is not None:
        prep.model_spec = replace(prep.model_spec, device=device)
    run_dir = prep.run_dir
    build(cfg.logger, "logger")  # its settings, checked now (it starts after the lock)
    check_run_dir(run_dir, "run_dir" if cfg.run_dir else "results_dir")
    check_authors_source(prep.task, cfg.get("protocol"))  # protocol=paper without task.data_dir: before the hub
    key = stable_hash([type(prep.task).__qualname__, asdict(prep.task)], 16)
    prep.task, problems = load_problems(prep.task, key, cache)
    if not problems:
        raise ValueError(no_problems(prep.task, cfg))
    check_authors_data(prep.task, cfg.get("protocol"))  # protocol=paper with task.data_dir: the authors' files
    prep.data_copy = data_copy(prep.task)
    data = {"data": prep.task.resolved_sources(), "data_copy": prep.data_copy}
    check_resolved(run_dir, data, write=False)  # refuse a resume on changed data (read-only)
    # samples.jsonl and the rank part files of a data-parallel run, against the samples this run plans
    done_rows = read_samples(run_dir, for_metrics=True, planned=planned_for(prep.task, problems, prep.n_samples))
    check_resumed_output_checks(cfg, prep.policy, run_dir, done_rows)
    done = {(r["problem_id"], r["sample"]) for r in done_rows}
    pending = [(p, [i for i in range(prep.n_samples) if (p.id, i) not in done]) for p in problems]
    pending = [(p, missing) for p, missing in pending if missing]
    work: list[Work] = []
    if pending:
        setting = "task.max_length" if cfg.generation.max_length is None else "generation.max_length"
        config = check_model(prep.model_spec, prep.max_length, setting, machine, cache)
        prep.policy.check_model(config)  # fields that depend on the model (Quest's dense_layers), before any weight
        tokenizer = load_tokenizer(prep.model_spec, cache)
        work = measure(prep, pending, tokenizer)
        check_calibration_text(prep.policy, tokenizer)
        spec, _ = resolved_spec(prep, work)
        check_cache(prep, spec, [(w.ids, w.missing) for w in work], config, setting, machine)
        _check_scale(prep, spec, work, config, machine)
        from vase.engine.compiled import compile_choice  # torch: only once the run has work

        # generation.compile=on that cannot run (a selection policy, no C++ compiler on the CPU): one line, now
        g = cfg.generation
        compile_choice(g.get("compile", "off"), spec.resolved_device(), prep.policy, prep.max_length)
        check_resolved(run_dir, {"model": prep.model_spec.resolve()}, write=False)  # refuse changed weights
    check_protocol(run_dir, comparable(run_dir, with_dtype(prep, work)), write=False)
    return RunPlan(prep, problems, data, done_rows, work)


def _check_scale(prep: Prepared, spec: Any, work: list[Work], config: Any, machine: bool) -> None:
    """The plan's size in one line when large; a paper-scale plan on a CPU asks for explicit limit= and n_samples=
    (:func:`vase.run.scale.check_scale`)."""
    import torch

    from vase.engine.geometry import config_geometry
    from vase.models import resolve_dtype
    from vase.run.scale import check_scale

    try:
        geometry = config_geometry(config, 1, prep.max_length, resolve_dtype(spec.dtype), torch.device("cpu"))
        row_kv: int | None = int(geometry.kv_bytes_per_row)
    except Exception:  # a config the estimate cannot read: the size in tokens alone
        row_kv = None
    cfg = prep.cfg
    explicit = (cfg.limit is not None and cfg.n_samples is not None) or cfg.task.get("problem_ids") is not None
    check_scale(
        prep.task.name,
        spec.resolved_device().type,
        [(len(w.ids), len(w.missing)) for w in work],
        prep.max_length,
        row_kv,
        explicit,
        machine,
    )


def check_calibration_text(policy: Any, tokenizer: Any) -> None:
    """A policy's calibration text (TriAttention's) gives the calibration pass at least 2 tokens of this model's
    tokenizer (its file was read and checked when the policy was built); one line naming the setting otherwise."""
    path = policy.calibration_input()
    if path is None:
        return
    n = len(tokenizer(Path(path).read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"])
    if n < 2:
        raise ValueError(
            f"policy.calibration_text: {str(path)!r} is {n} token(s) long for this model's tokenizer, the calibration "
            "pass needs at least 2; give a longer plain-text file"
        )


def preflight(cfg: DictConfig, *, multirun: bool = False) -> RunPlan:
    """The one decision whether a run may start, before Hydra writes anything: the composed config (with Hydra's own
    node, as ``run.py`` composes it) in, the plan out, or a one-line ``ValueError`` (``run.py`` prints it and exits 2).

    Hydra's output directory must be writable and ``parallel.tensor`` must divide the ranks started here; then
    :func:`plan` (every check of the run, on this machine unless the launcher is SLURM's, whose nodes check device,
    memory and ranks), and for a single run that no other process holds the run directory. The runner then executes
    the plan (:func:`vase.run.runner.run` plans again under the same rules before it takes the lock).
    docs/architecture.md, "Which file decides what", lists what each check decides.
    """
    from vase.run.rundir import check_writable, probe_lock

    hydra = cfg.hydra
    where = hydra.sweep.dir if multirun else hydra.run.dir
    fix = "point results_dir (or hydra.run.dir / hydra.sweep.dir) at a directory you can write"
    check_writable(Path(str(where)), "results_dir (Hydra's output directory)", fix)
    machine = "Slurm" not in str(hydra.launcher.get("_target_", ""))
    if machine:  # parallel.tensor against the ranks started here (a SLURM job's ranks: checked on its nodes)
        from copy import copy

        from vase.run.distributed import current_world

        copy(current_world()).with_tensor(tensor_of(cfg))
    p = plan(cfg, machine=machine, cache=True)
    if not multirun:
        probe_lock(p.prep.run_dir)
    return p


def check_resumed_output_checks(cfg: DictConfig, policy, run_dir: Path, done_rows: list[dict]) -> None:
    """``generation.check_policy_output=true`` on a run that already holds samples decoded without the check: refused
    in one line (resuming would check only the samples still to decode, and a finished run none at all)."""
    if policy.kind != "eviction" or not bool(cfg.generation.get("check_policy_output", False)):
        return
    unchecked = [r for r in done_rows if not r.get("policy_output_checked")]
    if unchecked:
        raise ValueError(
            f"generation.check_policy_output=true: {len(unchecked)} of the {len(done_rows)} samples in {run_dir} were "
            "decoded without the check, and a resumed run cannot check them; set run_dir= to a new directory to "
            "check every answer, or drop the setting to resume this run as it is"
        )


def still_to_do(p: RunPlan, done_rows: list[dict]) -> list[Work]:
    """The plan's work, measured again if ``done_rows`` (read under the lock) differ from the plan's."""
    done = {(r["problem_id"], r["sample"]) for r in done_rows}
    if done == {(r["problem_id"], r["sample"]) for r in p.done_rows}:
        return p.work
    pending = [(q, [i for i in range(p.prep.n_samples) if (q.id, i) not in done]) for q in p.problems]
    pending = [(q, missing) for q, missing in pending if missing]
    return measure(p.prep, pending) if pending else []


def measure(prep: Prepared, pending, tokenizer=None) -> list[Work]:
    """Render and tokenize the prompts still to decode (tokenizer only); refuse a max_length no prompt fits."""
    tokenizer = tokenizer if tokenizer is not None else prep.model_spec.load_tokenizer()
    work = []
    for problem, missing in pending:
        prompt = prep.task.render(problem, tokenizer, enable_thinking=prep.thinking)
        ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        seeds = sample_seeds(problem_seed(prep.cfg.seed, problem.id), prep.n_samples)
        work.append(Work(problem, ids, missing, seeds))
    shortest = min(len(w.ids) for w in work)
    if shortest >= prep.max_length:
        raise ValueError(
            f"generation.max_length: {prep.max_length} leaves no room for output (the shortest prompt has "
            f"{shortest} tokens); raise generation.max_length"
        )
    fitting = [len(w.ids) for w in work if len(w.ids) < prep.max_length]
    if fitting:  # the longest prompt first: a fix hint from it (keep_prompt's budget) serves every prompt
        prep.policy.check_prompt(max(fitting))  # e.g. keep_prompt: the prompt and the window must fit the budget
    for w in work:
        if len(w.ids) >= prep.max_length:
            logger.warning(
                "problem %s: its prompt has %d tokens >= generation.max_length=%d; its samples are recorded as "
                "prompt_too_long (not decoded)",
                w.problem.id,
                len(w.ids),
                prep.max_length,
            )
    return work


def _rows_guess(prep: Prepared, work: list[Work]) -> int:
    """Rows that will decode together, before the weights load (decides ``model.dtype=auto`` on CPU)."""
    samples = sum(len(w.missing) for w in work) or 1
    if prep.batching == "per_problem":
        return max((len(w.missing) for w in work), default=1)
    from vase.engine.memory import AUTO_CPU_ROWS

    rows = prep.max_rows if isinstance(prep.max_rows, int) else AUTO_CPU_ROWS
    return min(rows, samples)


def resolved_spec(prep: Prepared, work: list[Work]):
    """The model spec with ``dtype=auto`` resolved, and why (a resumed run keeps the dtype it started with)."""
    spec = prep.model_spec
    if spec.dtype != "auto":
        return spec, "model.dtype"
    stored = prep.run_dir / PROTOCOL
    if stored.exists():
        dtype = read_json(stored).get("model", {}).get("dtype", "auto")
        if dtype != "auto":
            return replace(spec, dtype=dtype), f"auto: {dtype}, the dtype the run started with ({PROTOCOL})"
    dtype, reason = auto_dtype(spec.resolved_device(), _rows_guess(prep, work))
    return replace(spec, dtype=dtype), reason


def with_dtype(prep: Prepared, work: list[Work]) -> dict:
    """The protocol with the dtype the weights will really have (``auto`` resolved on this machine)."""
    if not work:  # nothing to decode: the weights never load, so the dtype is the one the run already used
        stored = prep.run_dir / PROTOCOL
        if prep.model_spec.dtype == "auto" and stored.exists():
            dtype = read_json(stored).get("model", {}).get("dtype", "auto")
            return {**prep.protocol, "model": {**prep.protocol["model"], "dtype": dtype}}
        return prep.protocol
    spec, _ = resolved_spec(prep, work)
    return {**prep.protocol, "model": {**prep.protocol["model"], "dtype": spec.dtype}}
