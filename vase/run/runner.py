"""The runner behind ``python run.py``: one (model, task, policy, budget) run, resumable, logged to disk and W&B.

Everything is built from the composed Hydra config with ``hydra.utils.instantiate`` (model spec, task, policy,
logger), so the runner never branches on types. Order of work, cheapest first:

1. check every setting (:func:`vase.run.checks.check_settings`), then build the task, the model spec and the policy
   (one-line ``ValueError`` on bad input, before any data or weights load);
2. resolve the budget (``budget=`` or the task's reference full-cache output length for the model / ``ratio``,
   rounded to a multiple of ``window``), the run directory and its protocol (a changed protocol is refused);
3. load the problems, then the model; skip finished samples; decode each problem's missing samples as one batch;
   grade; append to ``samples.jsonl`` (flushed) as each problem finishes;
4. write ``metrics.json`` from ``samples.jsonl`` + ``batches.jsonl`` (the source of truth) and mirror to W&B.
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from vase.engine.decode import SamplingConfig, generate, sample_seeds
from vase.run.checks import check_settings
from vase.run.metrics import classify_output, mean_pass_at_1, mean_pass_at_k
from vase.run.results import (
    BATCHES,
    SAMPLES,
    append_jsonl,
    check_protocol,
    device_info,
    git_sha,
    library_versions,
    peak_memory_bytes,
    read_jsonl_tolerant,
    stable_hash,
    write_json,
)

logger = logging.getLogger(__name__)

# Settings that do not change results: excluded from the protocol comparison on resume.
NON_PROTOCOL_TASK_KEYS = ("limit", "shard", "num_shards", "data_dir", "max_workers")
NON_PROTOCOL_GENERATION_KEYS = ("sync_every", "attn_backend")


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


def held_at_end(total: int, prompt_len: int, budget: int, window: int, evicts: bool) -> int:
    """Tokens the cache holds after ``total`` tokens (prompt + output) under the eviction schedule."""
    if not evicts or total <= budget:
        return total
    held = prompt_len
    for _ in range(total - prompt_len - 1):  # the last token is sampled, never appended
        held += 1
        if held > budget and held % window == 0:
            held = budget
    return held + 1


@dataclass
class Prepared:
    """Everything built from the config before the model loads."""

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
    max_length = int(gen.max_length or task.max_length)
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
        "generation": {**asdict(sampling), "max_length": max_length, "thinking": thinking},
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


def run(cfg: DictConfig, progress: bool = True) -> dict:
    """Run (or resume) one configuration; return its metrics. See the module docstring."""
    prep = prepare(cfg)
    run_dir = prep.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    check_protocol(run_dir, prep.protocol)
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    samples_path, batches_path = run_dir / SAMPLES, run_dir / BATCHES
    done_rows = read_jsonl_tolerant(samples_path, repair=True)
    read_jsonl_tolerant(batches_path, repair=True)
    done = {(r["problem_id"], r["sample"]) for r in done_rows}

    problems = prep.task.load()
    todo = [(p, [i for i in range(prep.n_samples) if (p.id, i) not in done]) for p in problems]
    todo = [(p, missing) for p, missing in todo if missing]
    logger.info(
        "run dir %s: %d problems, %d samples done, %d problems to decode", run_dir, len(problems), len(done), len(todo)
    )

    run_logger = build(cfg.logger, "logger")
    run_id = stable_hash({"dir": str(run_dir.resolve()), "protocol": prep.protocol}, 16)
    run_logger.start(run_dir=run_dir, config=OmegaConf.to_container(cfg, resolve=True), run_id=run_id)
    try:
        if todo:
            _decode(prep, todo, done_rows, run_dir, run_logger, progress)
        info = {
            "budget_source": "explicit" if prep.explicit_budget else "ratio",
            "policy": prep.policy.name,
            "task": prep.task.name,
            "model": prep.model_spec.key,
            "budget": cfg.budget,
            "window": cfg.window,
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


def _decode(prep: Prepared, todo, done_rows, run_dir: Path, run_logger, progress: bool) -> None:
    from tqdm import tqdm

    cfg = prep.cfg
    t_load = time.perf_counter()
    model, tokenizer = prep.model_spec.load()
    logger.info("model %s loaded in %.1f s", prep.model_spec.name, time.perf_counter() - t_load)
    device = next(model.parameters()).device
    stop = eos_ids(model, tokenizer)
    write_json(
        run_dir / "manifest.json",
        {
            "git_sha": git_sha(),
            "libraries": library_versions(),
            "device": device_info(),
            "model": {
                "name": prep.model_spec.name,
                "revision": prep.model_spec.revision,
                "dtype": str(next(model.parameters()).dtype),
                "attn_backend": cfg.generation.attn_backend,
            },
            "dataset": prep.task.describe() if hasattr(prep.task, "describe") else {"name": prep.task.name},
            "prompt_template": getattr(tokenizer, "chat_template", None),
            "thinking": prep.thinking,
            "sampling": asdict(prep.sampling),
            "max_length": prep.max_length,
            "seed": cfg.seed,
            "eos_token_ids": stop,
            "budget": cfg.budget,
            "window": cfg.window,
            "policy": prep.policy.describe(),
        },
    )
    recorder = None
    if cfg.get("record_kept", False):
        from vase.run.kept_sets import KeptSetRecorder

        recorder = KeptSetRecorder()
    correct_so_far = [bool(r["correct"]) for r in done_rows]
    tokens_total, seconds_total = 0, 0.0
    bar = tqdm(todo, desc=f"{prep.task.name}/{prep.policy.name}", unit="problem", disable=not progress)
    for problem, missing in bar:
        prompt = prep.task.render(problem, tokenizer, enable_thinking=prep.thinking)
        ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        seeds = sample_seeds(problem_seed(cfg.seed, problem.id), prep.n_samples)
        out = generate(
            model,
            ids,
            prep.policy,
            n_samples=len(missing),
            sampling=prep.sampling,
            max_length=prep.max_length,
            eos_token_ids=stop,
            seeds=[seeds[i] for i in missing],
            attn_backend=cfg.generation.attn_backend,
            sync_every=cfg.generation.sync_every,
            on_cache=None
            if recorder is None
            else (lambda cache, pid=problem.id, rows=missing: recorder.attach(cache, problem_id=pid, samples=rows)),
        )
        if recorder is not None:
            from vase.run.kept_sets import kept_sets_path

            recorder.dump(kept_sets_path(run_dir, problem.id))
            recorder.clear()
        texts = [tokenizer.decode(t, skip_special_tokens=True) for t in out.tokens]
        grades = prep.task.grade_many([(problem, t) for t in texts], thinking=prep.thinking)
        st = out.stats
        p_len = out.prompt_len
        rows = []
        for j, i in enumerate(missing):
            n_tok = len(out.tokens[j])
            finished = out.finish_reasons[j] != "length"
            total = p_len + n_tok
            held = held_at_end(total, p_len, cfg.budget, cfg.window, prep.policy.kind == "eviction")
            rows.append(
                {
                    "problem_id": problem.id,
                    "sample": i,
                    "seed": seeds[i],
                    "output": texts[j],
                    "extracted": grades[j].extracted,
                    "correct": bool(grades[j].correct),
                    "truncated": bool(grades[j].truncated),
                    "grade_detail": grades[j].detail,
                    "loop_class": classify_output(texts[j], finished, prep.thinking),
                    "finish_reason": out.finish_reasons[j],
                    "prompt_tokens": p_len,
                    "output_tokens": n_tok,
                    "budget": cfg.budget,
                    "held_tokens_end": held,
                    "compression_ratio": total / held,
                    "prefill_seconds": st["prefill_seconds"],
                    "batch_decode_seconds": st["decode_seconds"],
                    "meta": problem.meta,
                }
            )
        itemsize = next(model.parameters()).element_size()
        mc = model.config
        head_dim = getattr(mc, "head_dim", None) or mc.hidden_size // mc.num_attention_heads
        full_bytes = (
            2
            * mc.num_hidden_layers
            * mc.num_key_value_heads
            * head_dim
            * itemsize
            * len(missing)
            * (p_len + max(len(t) for t in out.tokens))
        )
        batch = {
            "problem_id": problem.id,
            "samples": missing,
            "prompt_tokens": p_len,
            "output_tokens": st["decode_tokens"],
            "prefill_seconds": st["prefill_seconds"],
            "decode_seconds": st["decode_seconds"],
            "evictions": st["evictions"],
            "eviction_seconds": st["eviction_seconds"],
            "kv_cache_bytes": st["kv_cache_bytes"],
            "kv_cache_bytes_full": full_bytes,
            "aux_bytes": st["aux_bytes"],
            "attended_tokens": st["attended_tokens"],
            "held_tokens": st["held_tokens"],
            "peak_memory_bytes": peak_memory_bytes(device),
            "attn_backend": st["attn_backend"],
        }
        append_jsonl(run_dir / BATCHES, [batch])
        append_jsonl(run_dir / SAMPLES, rows)  # samples last: a sample on disk implies its batch stats are too
        correct_so_far += [r["correct"] for r in rows]
        tokens_total += st["decode_tokens"]
        seconds_total += st["decode_seconds"]
        tps = tokens_total / seconds_total if seconds_total else 0.0
        acc = sum(correct_so_far) / len(correct_so_far)
        bar.set_postfix(tok_s=f"{tps:.1f}", acc=f"{acc:.3f}")
        run_logger.log_progress(
            {
                "progress/samples_done": len(correct_so_far),
                "progress/accuracy": acc,
                "progress/decode_tokens_per_second": tps,
            }
        )


def compute_metrics(run_dir: Path, problem_ids: list[str], n_samples: int, info: dict, pass_k) -> dict:
    """The run's metrics, from ``samples.jsonl`` and ``batches.jsonl`` (restricted to ``problem_ids``).

    ``info`` (policy, task, model, budget, ...) is copied into the metrics so they are self-describing.
    """
    ids = set(problem_ids)
    rows = [r for r in read_jsonl_tolerant(run_dir / SAMPLES) if r["problem_id"] in ids]
    batches = [b for b in read_jsonl_tolerant(run_dir / BATCHES) if b["problem_id"] in ids]
    by_problem: dict[str, list[dict]] = defaultdict(list)
    seen = set()
    for r in rows:  # a sample is counted once even if a crash wrote it twice
        key = (r["problem_id"], r["sample"])
        if key not in seen:
            seen.add(key)
            by_problem[r["problem_id"]].append(r)
    rows = [r for rs in by_problem.values() for r in rs]
    n = len(rows)
    metrics: dict[str, Any] = {
        "problems": len(by_problem),
        "problems_expected": len(ids),
        "samples": n,
        "complete": len(by_problem) == len(ids) and all(len(v) == n_samples for v in by_problem.values()),
        **info,
    }
    if not n:
        return metrics
    per_problem = [[r["correct"] for r in rs] for rs in by_problem.values()]
    metrics["accuracy"] = mean_pass_at_1(per_problem)
    if len(per_problem) > 1:
        accs = [sum(p) / len(p) for p in per_problem]
        mean = sum(accs) / len(accs)
        metrics["accuracy_stderr"] = math.sqrt(sum((a - mean) ** 2 for a in accs) / (len(accs) - 1) / len(accs))
    min_n = min(len(p) for p in per_problem)
    for k in pass_k:
        if k <= min_n:
            metrics[f"pass@{k}"] = mean_pass_at_k(per_problem, k)
    classes = [r["loop_class"] for r in rows]
    metrics.update(
        {
            "answered_rate": sum(r["extracted"] is not None for r in rows) / n,
            "loop_rate": classes.count("loop") / n,
            "garbage_rate": classes.count("garbage") / n,
            "truncation_rate": classes.count("truncated") / n,
            "mean_output_tokens": sum(r["output_tokens"] for r in rows) / n,
            "compression_ratio": sum(r["compression_ratio"] for r in rows) / n,
        }
    )
    groups = {pid: rs[0].get("meta", {}).get("year") for pid, rs in by_problem.items()}
    if len({g for g in groups.values() if g is not None}) > 1:
        for year in sorted({g for g in groups.values() if g is not None}):
            sub = [[r["correct"] for r in rs] for pid, rs in by_problem.items() if groups[pid] == year]
            metrics[f"accuracy/{year}"] = mean_pass_at_1(sub)
    if batches:
        dec_s = sum(b["decode_seconds"] for b in batches)
        metrics.update(
            {
                "kv_cache_bytes": max(b["kv_cache_bytes"] for b in batches),
                "kv_cache_bytes_full": max(b["kv_cache_bytes_full"] for b in batches),
                "peak_memory_bytes": max(b["peak_memory_bytes"] for b in batches),
                "prefill_seconds": sum(b["prefill_seconds"] for b in batches) / len(batches),
                "decode_tokens_per_second": sum(b["output_tokens"] for b in batches) / dec_s if dec_s else None,
                "evictions": sum(b["evictions"] for b in batches),
                "eviction_seconds": sum(b["eviction_seconds"] for b in batches),
            }
        )
        att = [b["attended_tokens"] for b in batches if b.get("attended_tokens") is not None]
        metrics["attended_tokens"] = sum(att) / len(att) if att else None
        metrics["held_tokens"] = sum(b["held_tokens"] for b in batches) / len(batches)
    return metrics
