"""The decode loop of one process: load the weights, size the cache, decode its share of the samples with continuous
batching and hand each finished sample to the grader (:class:`vase.run.grading_pool.Grader`), which writes its line
once it is graded.

Step 4 of the order of work (:mod:`vase.run.runner`), after the plan and under the run directory's lock (held by
this process, or by rank 0 of a data-parallel run). The capacity per row comes from the longest prompt still to
decode; the rows in flight from ``generation.max_rows`` / ``generation.kv_memory``. Throughput lines go to
``throughput.jsonl`` (a rank: its part file) every 30 s of decoding; the progress bar counts graded samples and shows
the decoded ones.
"""

from __future__ import annotations

import hashlib
import logging
import time
from pathlib import Path
from typing import Any

import torch

from vase.engine import Decoder, Request, model_geometry
from vase.engine.cache import cache_capacity
from vase.engine.capture import merge_reports
from vase.engine.memory import plan_rows
from vase.reasoning import output_text
from vase.run.grading_pool import Grader
from vase.run.planning import Prepared, Work, resolved_spec
from vase.run.records import NOT_DECODED, ThroughputLog, manifest, rank_entry, row_maker
from vase.run.results import THROUGHPUT, part_path, reset_peak_memory, write_json

logger = logging.getLogger(__name__)

#: a calibrated policy's record (e.g. TriAttention's Q centres) in the run directory
CALIBRATION = "calibration.pt"


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


def loop_stop(tokenizer):
    """``stop_when`` for ``generation.stop_on_loop``: the paper's loop detector on the decoded tail of a sample."""
    from vase.run.metrics import LOOP_WINDOW, has_loop

    tail_tokens = LOOP_WINDOW // 2  # >= 500 characters for any tokenizer of >= 2 characters per token

    def stop(tokens: list[int]) -> bool:
        return has_loop(tokenizer.decode(tokens[-tail_tokens:], skip_special_tokens=True))

    return stop


def calibrate_policy(policy, model, tokenizer, run_dir: Path, write: bool = True) -> dict | None:
    """Run the policy's calibration pass (TriAttention's Q centres) before decoding; ``None`` if it has none.

    The centres go to ``<run_dir>/calibration.pt`` (never overwritten: a resumed run reloads them, so its samples use
    the same centres); returns the manifest's record: the text, its sha256, the tokens used and the file.
    """
    text_path = policy.calibration_input()
    if text_path is None:
        return None
    text_path = Path(text_path)
    raw = text_path.read_bytes()
    out = run_dir / CALIBRATION
    device = next(model.parameters()).device
    if out.exists():
        record = torch.load(out, map_location="cpu", weights_only=True)
        policy.load_calibration(record, device=device)
        logger.info("policy %s: calibration reloaded from %s", policy.name, out)
    else:
        ids = torch.tensor(tokenizer(raw.decode("utf-8"), add_special_tokens=False)["input_ids"], dtype=torch.long)
        t0 = time.perf_counter()
        record = policy.calibrate(model, ids)
        logger.info("policy %s: calibrated in %.1f s", policy.name, time.perf_counter() - t0)
        if write:  # written whole, then renamed: another rank never reads a torn file
            tmp = out.with_name(out.name + ".tmp")
            torch.save(record, tmp)
            tmp.replace(out)
    return {
        "text": str(text_path),
        "text_sha256": hashlib.sha256(raw).hexdigest(),
        "tokens": int(record.get("tokens", 0)),
        "file": CALIBRATION,
        "file_sha256": hashlib.sha256(out.read_bytes()).hexdigest() if out.exists() else None,
    }


def decode(
    prep: Prepared,
    work: list[Work],
    done_rows: list[dict],
    grader: Grader,
    run_logger,
    progress: bool,
    rank: int | None = None,
    resolved: tuple[Any, str] | None = None,
    tensor_mesh: Any = None,
) -> dict:
    """Decode ``work`` and hand each finished sample to ``grader``; return this session's manifest.

    Args:
        done_rows: the samples already on disk (the running accuracy starts from them).
        rank: a rank of a data-parallel run (throughput to its part file; only rank 0 writes ``manifest.json`` now,
            with its own entry; the runner rewrites it with every rank's at the end); ``None``: the one process.
        resolved: the model spec with the run's dtype and why (every rank decodes in the protocol's dtype, decided
            from the whole run's work); default: from ``work``.
        tensor_mesh: the ranks this one shares the model with (``parallel.tensor``; :meth:`ModelSpec.load`).
    """
    from tqdm import tqdm

    cfg, policy, run_dir = prep.cfg, prep.policy, prep.run_dir
    spec, dtype_reason = resolved or resolved_spec(prep, work)
    t_load = time.perf_counter()
    reset_peak_memory(spec.resolved_device())  # this run's (this sweep cell's) peak, not an earlier cell's
    model, tokenizer = spec.load() if tensor_mesh is None else spec.load(tensor_mesh=tensor_mesh)
    logger.info("model %s loaded in %.1f s (%s, %s)", spec.name, time.perf_counter() - t_load, spec.dtype, dtype_reason)
    stop = eos_ids(model, tokenizer)
    calibration = calibrate_policy(policy, model, tokenizer, run_dir, write=rank in (None, 0))
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
    name = f"{prep.task.name}/{policy.name}" + ("" if rank is None else f" [rank {rank}]")
    bar = tqdm(total=total, desc=name, unit="sample", disable=not progress, position=rank or 0)
    meter: ThroughputLog | None = None

    def on_row(row: dict) -> None:  # a graded sample's line is durable: the bar counts it
        correct.append(row["correct"])
        bar.update(1)
        if meter is not None:
            meter.sample(bar, correct, run_logger)

    grader.on_row = on_row
    session: dict = {}
    captures: list[list[dict]] = []  # each decoder's compile and CUDA-graph capture per row bucket
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
            stop_when=loop_stop(tokenizer) if cfg.generation.get("stop_on_loop", False) else None,
            attn_backend=cfg.generation.attn_backend,
            sync_every=cfg.generation.sync_every,
            check_policy_output=bool(cfg.generation.get("check_policy_output", False)),
            compile=cfg.generation.get("compile", "off"),
            on_cache=None if recorder is None else recorder.attach,
            score_dtype=prep.score_dtype,
        )
        if not session:
            session = manifest(prep, model, tokenizer, spec, dtype_reason, dec, plan, stop)
            if calibration is not None:
                session["calibration"] = calibration
            session.update(grading=grader.describe(), ranks=[rank_entry(rank, dec, model, plan, total, grader.mode)])
            if rank in (None, 0):
                write_json(run_dir / "manifest.json", session)
        decoded = meter.decoded if meter is not None else 0
        meter = ThroughputLog(run_dir, dec, None if rank is None else part_path(run_dir, rank, THROUGHPUT), rank)
        meter.decoded = decoded
        if rows is None or len(plans) <= 1:
            logger.info(
                "decoding %d samples: %d rows in flight (%s), %d slots per row, %.1f MiB of KV storage; grading %s",
                sum(len(w.missing) for w in group),
                plan.rows,
                plan.reason,
                capacity,
                dec.geometry.kv_bytes / 2**20,
                grader.mode,
            )
        requests = [Request(w.ids, [w.seeds[i] for i in w.missing], key=w.problem.id, samples=w.missing) for w in group]
        dec.on_step = lambda info, m=meter: (m.step(bar, info), grader.poll())  # write the grades that came back
        try:
            for fin in dec.run(requests):
                w = by_id[fin.key]
                text = output_text(tokenizer, fin.tokens, spec.reasoning_format)  # <think>…</think>answer
                meter.decoded += 1
                make_row = row_maker(prep, w.problem, fin, text, dec.geometry.whole())  # the model's every head
                grader.submit(w.problem, text, make_row, grade=fin.finish_reason not in NOT_DECODED)  # line once graded
                left[fin.key] -= 1
                if recorder is not None and left[fin.key] == 0:
                    from vase.run.kept_sets import kept_sets_path

                    recorder.dump(kept_sets_path(run_dir, fin.key), recorder.take(fin.key))
        finally:
            meter.flush()
            captures.append(dec.capture.report())
    if session and any(captures):  # what capture did per bucket is known only now: the manifest says it
        session["compile"]["buckets"] = merge_reports(captures)
        if rank in (None, 0):
            write_json(run_dir / "manifest.json", session)
    grader.close()  # wait for the last grades
    if meter is not None:
        meter.show(bar)
    bar.close()
    return session
