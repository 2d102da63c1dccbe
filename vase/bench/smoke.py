"""The first run on a new GPU machine: ``scripts/gpu_smoke.sh`` (at most 8 minutes on one 80+ GB GPU), one table.

Sections, each under its own time cap (a section that reaches it stops and says so; the shell script also stops
the whole run at 470 s and the partial table is still printed):

1. ``env`` — device, torch, CUDA, cuDNN; whether ``flash_attn.flash_attn_interface`` imports; what
   ``attn_backend=auto`` resolves to in bf16; which SDPA kernel torch's default dispatch picks for a staggered
   decode call (per-row mask) in the two layouts (``enable_gqa`` with a mask; the query heads of a KV group packed
   into the query-length axis) and for a causal prefill (:func:`vase.bench.attention_check.default_kernels`).
2. ``kernel`` — :mod:`vase.bench.attention_check` (``scripts/gpu_check.py``) on a Qwen3-0.6B-shaped model in bf16:
   the default SDPA dispatch against the math kernel (and FlashAttention-2 against it when it imports), rows of
   different lengths, prefill and decode, teacher-forced against float32; which kernel the decode used.
3. ``decode`` — a short real decode on a Qwen3-4B-shaped random model (bf16): ``vase_dkv`` with sampling, more
   samples than rows from prompts of different lengths and different output caps, so rows hold different lengths,
   evict at different steps and are refilled as samples end (the runner's path through
   :class:`vase.engine.Decoder`); every sample must end at its cap with finite logits.
4. ``compile`` — the decode's workload (one sample per row, one output cap: one row bucket) eager and compiled
   (``generation.compile=on``: inductor with CUDA graphs on CUDA; dynamo alone in the dry run), side by side: tok/s,
   the median step against the memory floor (weights + allocated KV bytes over a measured device copy's bandwidth),
   the slowest first step at a new number of live rows (a graph compile or a plan build shows there), the first
   against the tenth step at each new step shape (rows, key length; :func:`first_vs_tenth`), and whether the samples
   agree with eager. ``env`` also checks the installed transformers against ``pyproject.toml``'s range
   in one line (with the offline install when it is outside).
5. ``rows`` — tok/s against rows at equal KV memory, ``full`` against ``vase_dkv`` (ratio 4), staggered prompts:
   :func:`vase.bench.gpu_rows.equal_memory` at an 8K context, levels 5 to 40 GiB.
6. peak memory — per section (CUDA ``max_memory_allocated``; on the CPU the process's peak RSS).

``--dry-run`` runs every section on the CPU with tiny shapes in float32: every code path the GPU run takes except the
kernels themselves (the time caps are off unless ``--cap-scale`` sets them).

    scripts/gpu_smoke.sh                 # on the GPU machine
    scripts/gpu_smoke.sh --dry-run       # the CPU, tiny shapes: checks the script
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import torch

from vase.bench import REPO
from vase.bench.gpu_rows import equal_memory, staggered_requests
from vase.bench.measure import TimeCap, deadline_hook, proc_status_bytes
from vase.bench.shapes import build_model

logger = logging.getLogger(__name__)

#: seconds per section on the GPU (their sum, with start-up, stays under the shell script's 470 s)
CAPS = {"env": 30.0, "kernel": 110.0, "decode": 70.0, "compile": 100.0, "rows": 150.0}

GPU = dict(
    device="cuda",
    dtype="bfloat16",
    kernel=dict(model="qwen3-0.6b-shape", policy="snapkv", budget=256, window=32, batch=4, prompt_len=300, stagger=37,
                steps=96, init_std=0.02),
    decode=dict(model="qwen3-4b-shape", policy="vase_dkv", budget=1024, window=64, rows=16, samples=32,
                prompt_lens=[2048, 1792, 1536, 1280], max_new_tokens=[192, 256, 320, 384]),
    rows=dict(policy="vase_dkv", context=8192, budget=2048, window=64, kv_memory_gib="5,10,20,40", prompts=4,
              stagger=0.5, steps=64, warmup=64),
)  # fmt: skip
DRY = dict(
    device="cpu",
    dtype="float32",
    kernel=dict(model="tiny", policy="snapkv", budget=16, window=8, batch=3, prompt_len=40, stagger=7, steps=32,
                init_std=0.3),
    decode=dict(model="tiny", policy="vase_dkv", budget=32, window=8, rows=4, samples=8, prompt_lens=[40, 34, 28, 22],
                max_new_tokens=[24, 32, 40, 48]),
    rows=dict(policy="vase_dkv", context=256, budget=64, window=16, kv_memory_gib="0.0005,0.001", prompts=4,
              stagger=0.5, steps=16, warmup=16),
)  # fmt: skip


class Section:
    """A section's timing, peak memory and table lines (``(what, rows, tok/s, result)``)."""

    def __init__(self, name: str, device: torch.device, cap: float | None) -> None:
        self.name, self.device = name, device
        self.deadline = None if cap is None else time.perf_counter() + cap
        self.lines: list[tuple[str, object, object, str]] = []
        self.ok = True
        self.t0 = time.perf_counter()
        self.seconds = 0.0
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)

    def add(self, what: str, result: str, rows: object = "", tok_s: object = "", ok: bool = True) -> None:
        self.lines.append((what, rows, tok_s, result))
        self.ok &= ok

    def peak_gib(self) -> float | None:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) / 2**30
        rss = proc_status_bytes("VmHWM")
        return rss / 2**30 if rss else None


def section_env(sec: Section, dtype: torch.dtype) -> dict:
    """Device, versions, flash-attn import, ``auto`` backend, default SDPA kernels for the decode layouts."""
    from vase.bench.attention_check import _auto_backend
    from vase.bench.sdpa_kernels import default_kernels

    dev = sec.device
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    info = dict(
        device=name,
        torch=torch.__version__,
        cuda=torch.version.cuda,
        cudnn=torch.backends.cudnn.version() if dev.type == "cuda" else None,
    )
    try:
        import flash_attn.flash_attn_interface  # noqa: F401

        info["flash_attn"] = "imports"
    except Exception as err:  # noqa: BLE001 - any failure to import is the answer
        info["flash_attn"] = f"{type(err).__name__}: {err}"[:120]
    info["auto_backend_bf16"] = _auto_backend(dev, torch.bfloat16)
    sec.add("device", f"{name}, torch {info['torch']}, CUDA {info['cuda']}, cuDNN {info['cudnn']}")
    ok, line = transformers_check()
    info["transformers"] = line
    sec.add("transformers", line, ok=ok)
    sec.add("flash_attn", info["flash_attn"])
    sec.add("attn_backend=auto (bf16)", info["auto_backend_bf16"])
    kernels = default_kernels(dev, dtype)
    info["default_sdpa_kernels"] = kernels
    for phase in ("decode_gqa_mask", "decode_packed", "prefill"):
        sec.add(f"default SDPA kernel, {phase}", ", ".join(kernels.get(phase, {})) or "none")
    return info


def section_kernel(sec: Section, cfg: dict, device: str, dtype: str) -> dict:
    """``scripts/gpu_check.py``'s checks on the configured model (every pair that applies)."""
    from vase.bench.attention_check import check

    args = argparse.Namespace(device=device, dtype=dtype, pair=None, seed=0, logit_tol=1e-3, **cfg)
    args.kernel_tol = 1e-4 if dtype == "float32" else 3e-2
    args.deadline = sec.deadline
    result = check(args)
    for r in result["pairs"]:
        failed = [k for k, v in r["checks"].items() if not v]
        kernels = r["kernels_A"].get("decode", r["kernels_A"])
        text = "PASS" if r["ok"] else f"FAIL: {', '.join(failed)}"
        text += f" (max rel {r['kernel_max_rel_diff_A_vs_B']:.1e}; decode kernels {json.dumps(kernels)})"
        sec.add(f"{r['pair']}, {cfg['model']}, {cfg['batch']} rows", text, rows=cfg["batch"], ok=r["ok"])
    return result


def _smoke_decoder(model, policy, rows: int, lens: list[int], caps: list[int], on_step, **kw):
    """The smoke decodes' :class:`~vase.engine.Decoder`: ``rows`` rows sized for the longest prompt + cap, the model
    card's sampling, EOS ignored (every sample runs to its cap); ``kw`` (compile settings) passed on."""
    from vase.engine import Decoder, SamplingConfig, cache_capacity

    return Decoder(
        model,
        policy,
        rows=rows,
        capacity=max(cache_capacity(policy, p, c) for p, c in zip(lens, caps)),
        sampling=SamplingConfig(temperature=0.6, top_p=0.95, top_k=20),
        max_new_tokens=max(caps),
        ignore_eos=True,
        on_step=on_step,
        **kw,
    )


def section_decode(sec: Section, model, cfg: dict) -> dict:
    """A short real decode (see the module docstring); PASS when every sample ends at its cap, finite."""
    from vase.bench.jobs import make_policy

    policy = make_policy(cfg["policy"], cfg["budget"], cfg["window"])
    lens, caps = cfg["prompt_lens"], cfg["max_new_tokens"]
    reqs = staggered_requests(lens, cfg["samples"], model.config.vocab_size, seed=3, max_new_tokens=caps)
    marks = {"evict_steps": 0, "staggered": 0, "max_rows": 0}

    def on_step(info) -> None:
        marks["max_rows"] = max(marks["max_rows"], info.active_rows)
        if info.evicted_rows:
            marks["evict_steps"] += 1
            marks["staggered"] += len(info.evicted_rows) < info.active_rows

    dec = _smoke_decoder(model, policy, cfg["rows"], lens, caps, deadline_hook(sec.deadline, on_step))
    t0 = time.perf_counter()
    done = list(dec.run(reqs))
    if dec.device.type == "cuda":
        torch.cuda.synchronize(dec.device)
    wall = time.perf_counter() - t0
    want = {(r.key, s): caps[r.key % len(caps)] for r in reqs for s in r.samples}
    got = {(f.key, f.sample): (len(f.tokens), f.finish_reason) for f in done}
    bad = [k for k, n in want.items() if got.get(k) != (n, "length")]
    st = dec.stats
    out = dict(
        samples=len(done),
        tokens=st.tokens,
        decode_seconds=st.decode_seconds,
        prefill_seconds=st.prefill_seconds,
        wall_seconds=wall,
        tok_s=st.tokens / st.decode_seconds if st.decode_seconds else None,
        evictions=dec.cache.evictions(),
        eviction_steps=marks["evict_steps"],
        staggered_eviction_steps=marks["staggered"],
        max_rows=marks["max_rows"],
        wrong_samples=bad[:5],
    )
    checks = dict(
        every_sample_at_its_cap=not bad,
        evicted=out["evictions"] > 0,
        rows_evict_at_different_steps=marks["staggered"] > 0,
        rows_refilled=len(done) > cfg["rows"],
    )
    out["checks"] = checks
    ok = all(checks.values())
    failed = [k for k, v in checks.items() if not v]
    text = ("PASS" if ok else f"FAIL: {', '.join(failed)}") + (
        f" ({len(done)} samples, prompts {min(lens)}-{max(lens)}, {marks['staggered']}/{marks['evict_steps']}"
        " evicting steps with only some rows)"
    )
    sec.add(f"{cfg['policy']} B={cfg['budget']}, sampled", text, rows=cfg["rows"], tok_s=out["tok_s"], ok=ok)
    return out


def transformers_check() -> tuple[bool, str]:
    """Whether the installed transformers is in the range ``pyproject.toml`` asks for, in one line (with the offline
    fix when it is not: a GPU image may ship another release)."""
    from importlib.metadata import version

    from vase.bench.carry import transformers_range

    want = transformers_range()
    have = version("transformers")
    if want.contains(have, prereleases=True):
        return True, f"transformers {have} (needs {want})"
    return False, (
        f"FAIL: transformers {have} is outside {want}; without a registry: `python scripts/gpu_carry.py "
        "--torch <this torch> --hub <this huggingface-hub>` on a connected machine, copy .carry/ here, rerun "
        "scripts/gpu_smoke.sh (docs/gpus.md)"
    )


def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """Bytes per second of a device-to-device copy of ``nbytes`` (read + write counted): the memory floor's divisor."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda *_: None)
    sync(device)
    t0 = time.perf_counter()
    for _ in range(5):
        dst.copy_(src)
    sync(device)
    return 2 * 5 * src.nbytes / (time.perf_counter() - t0)


def section_compile(sec: Section, model, cfg: dict, dry_run: bool) -> dict:
    """The decode section's workload eager and compiled (``generation.compile``; CUDA graphs on CUDA), side by side:
    tok/s, mean step time against the memory floor (weights + allocated KV bytes / measured copy bandwidth), and
    whether the samples agree. The dry run compiles with dynamo's ``eager`` backend (every code path of the compiled
    step but inductor's code and the capture)."""
    from vase.bench.jobs import make_policy

    policy = make_policy(cfg["policy"], cfg["budget"], cfg["window"])
    # one sample per row, one output cap: every step in one row bucket (one graph to compile and capture)
    lens, caps, samples = cfg["prompt_lens"], [max(cfg["max_new_tokens"])], cfg["rows"]
    out: dict = {}
    tokens: dict = {}
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    bw = copy_bandwidth(sec.device, 2**22 if dry_run else 2**30)
    for mode in ("off", "on"):
        reqs = staggered_requests(lens, samples, model.config.vocab_size, seed=3, max_new_tokens=caps)
        walls: list[tuple[tuple[int, int], float]] = []  # ((rows the step covered, key slots), wall clock) per step
        held: dict = {}  # the decoder, for the hook to read the step's shape

        def on_step(info, w=walls, h=held) -> None:
            c = h["dec"].cache
            w.append(((c.step_rows, c.step_length), info.wall_seconds))

        backend = "eager" if dry_run and mode == "on" else None
        hook = deadline_hook(sec.deadline, on_step)
        dec = _smoke_decoder(model, policy, cfg["rows"], lens, caps, hook, compile=mode, compile_backend=backend)
        held["dec"] = dec
        done = list(dec.run(reqs))
        if dec.device.type == "cuda":
            torch.cuda.synchronize(dec.device)
        st = dec.stats
        steps = [(r, 1e3 * (b - a)) for (_, a), (r, b) in zip(walls, walls[1:])]
        step_ms = sorted(ms for _, ms in steps)[len(steps) // 2] if steps else float("nan")  # median: warm steps
        first = {}  # the first step at each number of live rows (a new graph, or a new plan, is built there)
        for (r, _), ms in steps:
            first.setdefault(r, ms)
        first_tenth = first_vs_tenth(steps)
        floor_ms = 1e3 * (weights + dec.geometry.kv_bytes) / bw
        tokens[mode] = {(f.key, f.sample): f.tokens for f in done}
        out[mode] = dict(
            tok_s=st.tokens / st.decode_seconds if st.decode_seconds else None,
            step_ms=step_ms,
            first_step_ms_max=max(first.values(), default=None),
            first_vs_tenth=first_tenth,
            floor_ms=floor_ms,
            compile=dec.compile_report(),
        )
        what = "eager" if mode == "off" else ("compiled (dynamo only)" if dry_run else "compiled + CUDA graphs")
        line = f"median step {step_ms:.2f} ms = {step_ms / floor_ms:.1f}x the floor {floor_ms:.2f} ms"
        line += f"; slowest first step at a new row count {out[mode]['first_step_ms_max'] or 0:.0f} ms"
        if first_tenth:
            worst = max(first_tenth, key=lambda x: x["ratio"])
            line += (
                f"; first/tenth step at a new (rows, key length) up to {worst['ratio']:.1f}x "
                f"(rows {worst['rows']}, {worst['key_slots']} slots; {len(first_tenth)} shapes)"
            )
        sec.add(what, line, rows=cfg["rows"], tok_s=out[mode]["tok_s"])
        if mode == "on":
            for b in out[mode]["compile"]["buckets"]:
                what_c, result, ok = capture_line(b, out[mode]["compile"]["cuda_graphs"])
                sec.add(what_c, result, rows=b["rows"], ok=ok)
    same = sum(tokens["on"].get(k) == v for k, v in tokens["off"].items())
    out["samples_equal"] = f"{same}/{len(tokens['off'])}"
    # float32 (the dry run): identical; bf16 on a GPU, inductor's fused kernels may round differently (reported)
    sec.add("samples equal to eager", out["samples_equal"], ok=same == len(tokens["off"]) or not dry_run)
    return out


def capture_line(bucket: dict, cuda_graphs: bool) -> tuple[str, str, bool]:
    """The smoke table's line for one row bucket of the compiled step (:class:`vase.engine.capture.BucketCapture`):
    ``(what, result, ok)``; a skipped capture (CUDA graphs expected) is a failure, with torch's reason."""
    counts = (
        f"compiled in {bucket['compile_seconds']:.1f} s; CUDA graphs recorded {bucket['recorded']}, replayed "
        f"{bucket['replayed']} of {bucket['forwards']} forwards, skipped {bucket['skipped']}"
    )
    if bucket["skipped"]:
        counts += f" ({bucket['reason']})"
    if not cuda_graphs:
        return "capture (no CUDA graphs here)", counts, True
    return "capture", counts, not bucket["skipped"] and bucket["replayed"] > 0


def first_vs_tenth(steps: list[tuple[tuple[int, int], float]]) -> list[dict]:
    """The first step against the tenth at each new step shape ``(rows, key slots)`` (a plan or graph built on the
    shape's first step shows as a ratio well above 1); shapes that ran fewer than ten steps are left out.

    ``steps``: ``((rows, key slots), milliseconds)`` per decode step, in order: the wall clock between consecutive
    ``on_step`` calls, so the run's very first decode step (its start lies in the prefill phase; with a compiled
    step, the first bucket's compile) is not among them.
    """
    seen: dict[tuple[int, int], list[float]] = {}
    for shape, ms in steps:
        seen.setdefault(shape, []).append(ms)
    return [
        dict(rows=r, key_slots=k, first_ms=ms[0], tenth_ms=ms[9], ratio=ms[0] / ms[9] if ms[9] > 0 else float("inf"))
        for (r, k), ms in seen.items()
        if len(ms) >= 10
    ]


def section_rows(sec: Section, model, cfg: dict) -> list[dict]:
    """Tok/s against rows at equal KV memory: :func:`vase.bench.gpu_rows.equal_memory`."""
    args = argparse.Namespace(**cfg)
    table = equal_memory(model, args, deadline=sec.deadline, progress=logger.debug)
    for r in table:
        what = f"{r['policy']} @ {r['kv_memory_gib']:g} GiB KV"
        if r.get("tok_s"):
            lens = "/".join(map(str, r["prompt_lens"]))
            note = f"x{r['vs_full']:.2f} full" if r.get("vs_full") else f"prompts {lens}"
            peak = f", peak {r['peak_gib']:.1f} GiB" if r.get("peak_gib") else ""
            sec.add(what, f"ok{peak}, {note}", rows=r["rows"], tok_s=r["tok_s"])
        else:
            reason = r.get("skipped") or r.get("error")
            # an OOM fails the smoke only where the KV level is at most half the device (the rest must fit)
            fits = sec.device.type == "cuda" and r["kv_memory_gib"] * 2**30 <= 0.5 * total_memory(sec.device)
            sec.add(what, str(reason), rows=r.get("rows", ""), ok=not (r.get("error") and fits))
    if not any(r.get("tok_s") for r in table):
        sec.add("(no point ran)", "FAIL", ok=False)
    return table


def total_memory(device: torch.device) -> int:
    """Bytes of memory of a CUDA device."""
    return torch.cuda.get_device_properties(device).total_memory


def format_table(sections: list[Section]) -> str:
    """One table: section, what, rows, tok/s, peak GiB, result."""
    head = ("section", "what", "rows", "tok/s", "peak GiB", "result")
    lines = []
    for sec in sections:
        peak = sec.peak_gib()
        for i, (what, rows, tok_s, result) in enumerate(sec.lines):
            tok = f"{tok_s:.0f}" if isinstance(tok_s, float) else str(tok_s)
            pk = f"{peak:.1f}" if (peak is not None and i == len(sec.lines) - 1) else ""
            lines.append((sec.name if i == 0 else "", what, str(rows), tok, pk, result))
    widths = [max(len(h), *(len(x[i]) for x in lines)) if lines else len(h) for i, h in enumerate(head)]
    widths[-1] = len(head[-1])
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    out = [fmt.format(*head), fmt.format(*("-" * w for w in widths))]
    out += [fmt.format(*x).rstrip() for x in lines]
    return "\n".join(out)


def run(args: argparse.Namespace) -> tuple[list[Section], dict]:
    """Every section of ``args.sections`` in order; returns the sections (for the table) and the JSON record."""
    conf = DRY if args.dry_run else GPU
    device = torch.device(conf["device"])
    dtype_name = conf["dtype"]
    dtype = getattr(torch, dtype_name)
    scale = args.cap_scale if args.cap_scale is not None else (None if args.dry_run else 1.0)
    sections: list[Section] = []
    record: dict = {"dry_run": args.dry_run, "config": conf, "caps": CAPS if scale else None}
    model = None
    try:
        for name in args.sections:
            sec = Section(name, device, None if scale is None else CAPS[name] * scale)
            sections.append(sec)
            try:
                if name == "env":
                    record[name] = section_env(sec, dtype)
                elif name == "kernel":
                    record[name] = section_kernel(sec, conf["kernel"], conf["device"], dtype_name)
                else:
                    if model is None:
                        model_name = conf["decode"]["model"]
                        model = build_model(model_name, dtype, device, seed=0, max_tokens=conf["rows"]["context"] + 512)
                    if name == "compile":
                        record[name] = section_compile(sec, model, conf["decode"], args.dry_run)
                    else:
                        fn = section_decode if name == "decode" else section_rows
                        record[name] = fn(sec, model, conf[name])
            except TimeCap as err:
                sec.add("(time cap)", f"stopped: {err}", ok=False)
            except torch.OutOfMemoryError as err:
                sec.add("(out of memory)", str(err).splitlines()[0][:100], ok=False)
            except Exception as err:  # noqa: BLE001 - a failing section is reported, the next one still runs
                logger.exception("section %s failed", name)
                sec.add("(error)", f"{type(err).__name__}: {err}"[:160], ok=False)
            sec.seconds = time.perf_counter() - sec.t0
            record.setdefault("seconds", {})[name] = round(sec.seconds, 1)
            record.setdefault("peak_gib", {})[name] = sec.peak_gib()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    except KeyboardInterrupt:  # the shell script's hard cap (SIGINT): still print what ran
        if sections:
            sections[-1].add("(interrupted)", "stopped by the run's time limit", ok=False)
        record["interrupted"] = True
    record["ok"] = bool(sections) and all(s.ok for s in sections)
    return sections, record


def main(argv: list[str] | None = None) -> int:
    """``scripts/gpu_smoke.py`` (run by ``scripts/gpu_smoke.sh``)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes: every code path but the kernels")
    ap.add_argument(
        "--sections", default="env,kernel,decode,compile,rows", help="comma list of env, kernel, decode, compile, rows"
    )
    ap.add_argument("--cap-scale", type=float, default=None, help="multiply the section time caps (dry run: off)")
    ap.add_argument("--out", default=None, help="default results/bench/gpu_smoke_<time>[_dryrun]")
    args = ap.parse_args(argv)
    args.sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = [s for s in args.sections if s not in CAPS]
    if unknown:
        ap.error(f"--sections: unknown {unknown}; choose from {', '.join(CAPS)}")
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_smoke: no CUDA device visible (torch.cuda.is_available() is False); use --dry-run on a CPU")
        return 2
    if args.dry_run:
        torch.set_num_threads(1)
    t0 = time.perf_counter()
    sections, record = run(args)
    record["total_seconds"] = round(time.perf_counter() - t0, 1)
    table = format_table(sections)
    stamp = time.strftime("%Y%m%d_%H%M%S")
    out = Path(args.out or REPO / "results" / "bench" / f"gpu_smoke_{stamp}{'_dryrun' if args.dry_run else ''}")
    out.mkdir(parents=True, exist_ok=True)
    (out / "result.json").write_text(json.dumps(record, indent=2, default=str) + "\n")
    (out / "table.txt").write_text(table + "\n")
    print(table)
    verdict = "PASS" if record["ok"] else "FAIL"
    print(f"\n{verdict} in {record['total_seconds']:.0f} s; details: {out}/result.json")
    return 0 if record["ok"] else 1
