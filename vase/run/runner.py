"""The runner behind ``python run.py``: one (model, task, policy, budget) run, resumable, logged to disk and W&B.

Everything is built from the composed Hydra config with ``hydra.utils.instantiate`` (model spec, task, policy,
logger), so the runner never branches on types. Order of work, cheapest first, and nothing is written before every
input has been checked:

1. check every setting (:func:`vase.run.checks.check_settings`), then build the task, the model spec and the policy
   (one-line ``ValueError`` on bad input, before any data or weights load);
2. resolve the budget (``budget=`` or the task's reference full-cache output length for the model / ``ratio``,
   rounded to a multiple of ``window``), the run directory and its protocol;
3. load the problems and the tokenizer (no weights), render and measure every prompt; refuse a changed protocol;
4. only then write ``protocol.json`` / ``config.yaml``, load the weights, size the cache (capacity per row from the
   longest prompt still to decode; rows in flight from ``generation.max_rows`` / ``generation.kv_memory``) and decode
   every missing sample with continuous batching, writing each sample to ``samples.jsonl`` (flushed) as it ends;
5. write ``metrics.json`` from ``samples.jsonl`` + ``throughput.jsonl`` (the source of truth) and mirror to W&B.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from vase.engine import Decoder, Request, model_geometry
from vase.engine.cache import cache_capacity
from vase.engine.memory import auto_dtype, plan_rows
from vase.engine.sampling import SamplingConfig, sample_seeds
from vase.run.checks import check_settings, parse_bytes
from vase.run.records import ThroughputLog, compute_metrics, sample_row, write_manifest
from vase.run.results import (
    SAMPLES,
    THROUGHPUT,
    append_jsonl,
    check_protocol,
    check_resolved,
    read_jsonl_tolerant,
    stable_hash,
    write_json,
)

logger = logging.getLogger(__name__)

# Settings that do not change results: excluded from the protocol comparison on resume.
NON_PROTOCOL_TASK_KEYS = ("problem_ids", "limit", "shard", "num_shards", "data_dir", "max_workers")
NON_PROTOCOL_GENERATION_KEYS = ("sync_every", "attn_backend", "batching", "max_rows", "kv_memory")


def build(node: Any, what: str) -> Any:
    """``hydra.utils.instantiate`` that surfaces a constructor's ``ValueError`` as itself (one line, no wrapper)."""
    from hydra.errors import InstantiationException

    try:
        return instantiate(node)
    except InstantiationException as err:
        cause = err.__cause__
        if isinstance(cause, ValueError):
            raise ValueError(str(cause)) from None
        raise ValueError(f"{what}: cannot build it ({err})") from None


def resolve_budget(reference_tokens: int, ratio: float, window: int) -> int:
    """``reference / ratio`` rounded to the nearest multiple of ``window`` (at least ``2 * window``)."""
    return max(2, round(reference_tokens / ratio / window)) * window


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


def prepare(cfg: DictConfig) -> Prepared:
    """Validate, resolve the budget and build task / model spec / policy (no data or weights loaded)."""
    check_settings(cfg)  # every setting, before anything is built, written or loaded (vase/run/checks.py)
    task_cfg = OmegaConf.to_container(cfg.task, resolve=True)
    if cfg.limit is not None:
        task_cfg["limit"] = cfg.limit
    if cfg.n_samples is not None:
        task_cfg["n_samples"] = cfg.n_samples
    task = build(task_cfg, "task")
    model_spec = build(cfg.model, "model")
    explicit_budget = cfg.budget is not None
    if not explicit_budget:
        budget = resolve_budget(task.reference_tokens(model_spec.key), cfg.ratio, cfg.window)
        OmegaConf.update(cfg, "budget", budget, force_add=True)
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
        "model": {k: v for k, v in asdict(model_spec).items() if k != "device"},
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
    if cfg.run_dir:
        run_dir = Path(cfg.run_dir)
    else:
        budget_tag = "" if budget_free else f"-b{cfg.budget}"
        tag = f"{policy.name}{budget_tag}-{stable_hash(policy_desc, 6)}-s{cfg.seed}"
        if task.num_shards > 1:
            tag += f"-shard{task.shard}of{task.num_shards}"
        run_dir = Path(cfg.results_dir) / task.name / model_spec.key / tag
    return Prepared(
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
    )


def eos_ids(model, tokenizer) -> list[int]:
    """EOS tokens: the generation config's (int or list) and the tokenizer's."""
    ids = set()
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if isinstance(gen_eos, int):
        ids.add(gen_eos)
    elif gen_eos:
        ids.update(int(t) for t in gen_eos)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return sorted(ids)


@dataclass
class Work:
    """A problem with samples still to decode: its rendered prompt's ids and its seeds."""

    problem: Any
    ids: list[int]
    missing: list[int]
    seeds: list[int]


def run(cfg: DictConfig, progress: bool = True) -> dict:
    """Run (or resume) one configuration; return its metrics. See the module docstring."""
    prep = prepare(cfg)
    run_dir = prep.run_dir
    problems = prep.task.load()  # a missing data file fails here, before anything is written
    data = {"data": prep.task.resolved_sources()}
    check_resolved(run_dir, data, write=False)  # refuse a resume on changed data (read-only)
    done_rows = read_jsonl_tolerant(run_dir / SAMPLES)
    done = {(r["problem_id"], r["sample"]) for r in done_rows}
    pending = [(p, [i for i in range(prep.n_samples) if (p.id, i) not in done]) for p in problems]
    pending = [(p, missing) for p, missing in pending if missing]
    work = _measure(prep, pending) if pending else []
    logger.info(
        "run dir %s: %d problems, %d samples done, %d problems to decode", run_dir, len(problems), len(done), len(work)
    )
    run_dir.mkdir(parents=True, exist_ok=True)
    check_protocol(run_dir, _with_dtype(prep, work))
    check_resolved(run_dir, data)
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    read_jsonl_tolerant(run_dir / SAMPLES, repair=True)  # a torn last line (killed mid-write) is cut off
    read_jsonl_tolerant(run_dir / THROUGHPUT, repair=True)

    run_logger = build(cfg.logger, "logger")
    run_id = stable_hash({"dir": str(run_dir.resolve()), "protocol": prep.protocol}, 16)
    run_logger.start(run_dir=run_dir, config=OmegaConf.to_container(cfg, resolve=True), run_id=run_id)
    try:
        if work:
            _decode(prep, work, done_rows, run_dir, run_logger, progress)
        info = {
            "budget_source": "explicit" if prep.explicit_budget else "ratio",
            "policy": prep.policy.name,
            "policy_kind": prep.policy.kind,
            "task": prep.task.name,
            "model": prep.model_spec.key,
            "budget": cfg.budget if prep.policy.kind != "none" else None,
            "window": cfg.window if prep.policy.kind != "none" else None,
            "ratio": cfg.ratio,
            "run_dir": str(run_dir),
        }
        metrics = compute_metrics(run_dir, [p.id for p in problems], prep.n_samples, info, cfg.pass_k)
        write_json(run_dir / "metrics.json", metrics)
        run_logger.finish(metrics=metrics, run_dir=run_dir)
    except BaseException:
        run_logger.abort()
        raise
    return metrics


def _measure(prep: Prepared, pending) -> list[Work]:
    """Render and tokenize the prompts still to decode (tokenizer only); refuse a max_length no prompt fits."""
    tokenizer = prep.model_spec.load_tokenizer()
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


def _resolved_spec(prep: Prepared, work: list[Work]):
    """The model spec with ``dtype=auto`` resolved, and why."""
    spec = prep.model_spec
    if spec.dtype != "auto":
        return spec, "model.dtype"
    dtype, reason = auto_dtype(spec.resolved_device(), _rows_guess(prep, work))
    return replace(spec, dtype=dtype), reason


def _with_dtype(prep: Prepared, work: list[Work]) -> dict:
    """The protocol with the dtype the weights will really have (``auto`` resolved on this machine)."""
    if not work:  # nothing to decode: the weights never load, so the dtype is the one the run already used
        stored = prep.run_dir / "protocol.json"
        if prep.model_spec.dtype == "auto" and stored.exists():
            dtype = json.loads(stored.read_text()).get("model", {}).get("dtype", "auto")
            return {**prep.protocol, "model": {**prep.protocol["model"], "dtype": dtype}}
        return prep.protocol
    spec, _ = _resolved_spec(prep, work)
    return {**prep.protocol, "model": {**prep.protocol["model"], "dtype": spec.dtype}}


def _decode(prep: Prepared, work: list[Work], done_rows, run_dir: Path, run_logger, progress: bool) -> None:
    from tqdm import tqdm

    cfg, policy = prep.cfg, prep.policy
    spec, dtype_reason = _resolved_spec(prep, work)
    check_resolved(run_dir, {"model": spec.resolve()})  # refuse a resume on changed weights
    t_load = time.perf_counter()
    model, tokenizer = spec.load()
    logger.info("model %s loaded in %.1f s (%s, %s)", spec.name, time.perf_counter() - t_load, spec.dtype, dtype_reason)
    stop = eos_ids(model, tokenizer)
    limits = {w.problem.id: prep.max_length - len(w.ids) for w in work}
    fits = [w for w in work if limits[w.problem.id] >= 1]
    if prep.batching == "per_problem":
        plans = [([w], len(w.missing)) for w in fits]
    else:
        plans = [(fits, None)] if fits else []
    too_long = [w for w in work if limits[w.problem.id] < 1]
    recorder = None
    if cfg.get("record_kept", False):
        from vase.run.kept_sets import KeptSetRecorder

        recorder = KeptSetRecorder()
    by_id = {w.problem.id: w for w in work}
    left = {w.problem.id: len(w.missing) for w in work}
    correct = [bool(r["correct"]) for r in done_rows]
    total = sum(len(w.missing) for w in work)
    bar = tqdm(total=total, desc=f"{prep.task.name}/{policy.name}", unit="sample", disable=not progress)
    manifest_written = False
    for group, rows in plans + ([(too_long, 1)] if too_long else []):
        capacity = max(cache_capacity(policy, len(w.ids), max(1, limits[w.problem.id])) for w in group)
        geometry = model_geometry(model, 1, capacity, prompt_len=max(len(w.ids) for w in group))
        plan = plan_rows(
            geometry,
            policy,
            max_rows=rows if rows is not None else prep.max_rows,
            kv_memory=None if rows is not None else prep.kv_memory,
            samples=sum(len(w.missing) for w in group),
        )
        dec = Decoder(
            model,
            policy,
            rows=plan.rows,
            capacity=capacity,
            sampling=prep.sampling,
            max_length=prep.max_length,
            eos_token_ids=stop,
            stop_when=_loop_stop(tokenizer) if cfg.generation.get("stop_on_loop", False) else None,
            attn_backend=cfg.generation.attn_backend,
            sync_every=cfg.generation.sync_every,
            on_cache=None if recorder is None else recorder.attach,
        )
        if not manifest_written:
            write_manifest(prep, run_dir, model, tokenizer, spec, dtype_reason, dec, plan, stop)
            manifest_written = True
        meter = ThroughputLog(run_dir, dec)
        if rows is None or len(plans) <= 1:
            logger.info(
                "decoding %d samples: %d rows in flight (%s), %d slots per row, %.1f MiB of KV storage",
                sum(len(w.missing) for w in group),
                plan.rows,
                plan.reason,
                capacity,
                dec.geometry.kv_bytes / 2**20,
            )
        requests = [Request(w.ids, [w.seeds[i] for i in w.missing], key=w.problem.id, samples=w.missing) for w in group]
        dec.on_step = lambda info, m=meter: m.step(bar, info)
        try:
            for fin in dec.run(requests):
                w = by_id[fin.key]
                row = _grade(prep, w, fin, tokenizer, dec)
                append_jsonl(run_dir / SAMPLES, [row])  # durable before the next sample
                correct.append(row["correct"])
                left[fin.key] -= 1
                if recorder is not None and left[fin.key] == 0:
                    from vase.run.kept_sets import kept_sets_path

                    recorder.dump(kept_sets_path(run_dir, fin.key), recorder.take(fin.key))
                bar.update(1)
                meter.sample(bar, correct, run_logger)
        finally:
            meter.flush()
    bar.close()


def _loop_stop(tokenizer):
    """``stop_when`` for ``generation.stop_on_loop``: the paper's loop detector on the decoded tail of a sample."""
    from vase.run.metrics import LOOP_WINDOW, has_loop

    tail_tokens = LOOP_WINDOW // 2  # >= 500 characters for any tokenizer of >= 2 characters per token

    def stop(tokens: list[int]) -> bool:
        return has_loop(tokenizer.decode(tokens[-tail_tokens:], skip_special_tokens=True))

    return stop


def _grade(prep: Prepared, w: Work, fin, tokenizer, dec: Decoder) -> dict:
    """Decode, grade and describe one finished sample."""
    text = tokenizer.decode(fin.tokens, skip_special_tokens=True)
    grade = None
    if fin.finish_reason not in ("prompt_too_long", "nonfinite"):
        grade = prep.task.grade_many([(w.problem, text)], thinking=prep.thinking)[0]
    evicts = prep.policy.kind == "eviction"
    return sample_row(
        w.problem,
        fin,
        text,
        grade,
        thinking=prep.thinking,
        budget=prep.cfg.budget if prep.policy.kind != "none" else None,
        window=prep.cfg.window,
        evicts=evicts,
        bytes_per_token=dec.geometry.bytes_per_token,
        max_length=prep.max_length,
    )
