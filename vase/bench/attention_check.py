"""Check the engine's attention kernels on the real decode path: rows of different lengths, prefill and decode.

Pairs compared (side A against side B; ``--pair`` picks them, a comma list; default: every pair that applies):

* ``sdpa:sdpa-math`` — always, with or without flash-attn, on CUDA and CPU: the engine's SDPA path under torch's own
  default dispatch (no ``sdpa_kernel`` forcing: whatever torch 2.x picks for these shapes, masks and dtype) against
  the same path with SDPA's math kernel forced (``sdpa_kernel(SDPBackend.MATH)``);
* ``flash_attn:sdpa-math`` — when ``attn_backend=auto`` resolves to FlashAttention-2 (CUDA, fp16/bf16, a working
  ``flash_attn`` import): ``flash_attn_func`` at the prefill, ``flash_attn_with_kvcache`` on the static storage when
  decoding, against SDPA's math kernel;
* ``sdpa:eager`` (``--pair``) — the SDPA path against the engine's explicit-softmax reference (any device).

Rows of different lengths: row ``r`` decodes the last ``prompt_len - r * stagger`` tokens of the prompt (its own
request), so every decode step needs per-row key masks (SDPA) / ``cache_seqlens`` (FlashAttention-2) and rows evict
at different steps. Every side runs the engine's own :class:`vase.engine.Decoder` (greedy, EOS ignored).

Which kernel the default dispatch ran: every SDPA call of side A is recorded (a ``TorchFunctionMode`` around the
call, a ``TorchDispatchMode`` inside it) with the aten kernel it reached — ``flash``, ``efficient``
(memory-efficient), ``cudnn``, ``flash_cpu``, ``overrideable`` or ``math`` — counted per phase (``prefill`` /
``decode``) in ``kernels``. On CUDA the check ``no_math_fallback`` requires that no call of the default dispatch fell
back to the math kernel (the math kernel repeats K/V to every query head in float32: the memory blow-up of issue 19).

Two checks per pair:

1. Kernel, on identical inputs: while side A decodes, every attention call (prefill and decode, every layer) is run
   again with side B's kernel on the very same query, keys and values; the largest
   ``max |out_A - out_B| / max |out_B|`` must stay within ``--kernel-tol`` (bf16/fp16: 3e-2, about 4 bf16 ulps;
   float32: 1e-4).
2. End to end, teacher-forced: a float32 reference ``R`` (the same rounded weights, SDPA math) decodes greedily;
   A and B in the model dtype are fed R's tokens (their logits recorded, then forced to R's token through the
   decoder's ``on_logits`` hook), with a deterministic policy (``snapkv``). Logits: A's largest error against R must
   be at most twice B's (FlashAttention's own test rule), and A's top-1 agreement with R at least B's minus 0.05.
   Kept sets, per (layer, row, eviction): layer 0 must be identical (its keys and queries do not depend on
   attention); deeper layers' keys carry the attention's rounding, which swaps tokens whose scores tie within bf16
   precision, so there A must agree with R as often as B does (minus 0.05).

Entry point: ``scripts/gpu_check.py``. This module is the one place of ``vase/bench`` that reaches into the engine's
attention: the registered attention function (:data:`vase.engine.attention.ATTN_NAME`), and the cache's
``attn_backend`` to run side B's kernel inside side A's decode (:func:`_backend_of`).

    python scripts/gpu_check.py                      # CUDA: sdpa vs math (+ flash_attn vs math when it imports)
    python scripts/gpu_check.py --device cpu         # the same on the CPU (SDPA's CPU kernels), runs anywhere
    python scripts/gpu_check.py --dry-run            # small model, CPU, a few steps: checks the script itself

Exit status 0 when every criterion holds; a JSON summary is printed (and written with ``--out``).
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import logging
import math
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from vase.bench.jobs import make_policy
from vase.bench.measure import deadline_hook
from vase.bench.sdpa_kernels import SdpaKernels
from vase.bench.shapes import PRESETS, build_model, random_prompt

logger = logging.getLogger(__name__)

FORCED_LOGIT = -1.0e4  # every logit but the forced token's (finite in fp16/bf16, far below any real logit)


# ---- the engine's attention, as this check uses it (the one place) -------------------------------------------------
def _auto_backend(device: torch.device, dtype: torch.dtype) -> str:
    """What ``attn_backend=auto`` resolves to for ``(device, dtype)`` (passes ``dtype`` when the engine takes it)."""
    from vase.engine.attention import resolve_backend

    if "dtype" in inspect.signature(resolve_backend).parameters:
        return resolve_backend("auto", device, dtype=dtype)
    return resolve_backend("auto", device)


@contextlib.contextmanager
def _backend_of(cache, name: str) -> Iterator[None]:
    """Run the cache's attention calls with backend ``name`` meanwhile (side B's kernel inside side A's decode)."""
    previous = cache.attn_backend
    cache.attn_backend = name
    try:
        yield
    finally:
        cache.attn_backend = previous


def side_settings(name: str) -> tuple[str, Callable[[], contextlib.AbstractContextManager]]:
    """``(engine attn_backend, context manager factory)`` of one side of a pair."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if name == "sdpa-math":
        return "sdpa", lambda: sdpa_kernel(SDPBackend.MATH)
    if name in ("flash_attn", "sdpa", "eager"):
        return name, contextlib.nullcontext
    raise ValueError(f"--pair: unknown side {name!r}; sides: sdpa, sdpa-math, flash_attn, eager")


class KernelShadow:
    """Wraps the registered ``"vase"`` attention: every call also runs side B's kernel on the very same inputs.

    Side A's output is returned (the decode proceeds on A), so the comparison is per call, on identical query, keys
    and values: no accumulation of rounding through layers and steps. The second call must be free of side effects
    (the query ring is written again with the same query). ``max_rel[phase]`` is the largest
    ``max |out_A - out_B| / max |out_B|`` over every layer of that phase.
    """

    def __init__(self, b_name: str, kernels: SdpaKernels | None = None) -> None:
        self.b_backend, self.b_ctx = side_settings(b_name)
        self.kernels = kernels
        self.max_rel = {"prefill": 0.0, "decode": 0.0}
        self.calls = 0
        self.finite = True

    def __enter__(self) -> KernelShadow:
        from transformers import AttentionInterface
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        from vase.engine.attention import ATTN_NAME

        self.name = ATTN_NAME
        self.orig = ALL_ATTENTION_FUNCTIONS[ATTN_NAME]

        def shadow(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
            phase = "prefill" if query.shape[2] > 1 else "decode"  # (n, Hq, T, D) as transformers passes it
            if self.kernels is not None:
                self.kernels.phase = phase
            out, w = self.orig(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
            cache = kwargs.get("vase_cache")
            if cache is not None:
                paused = self.kernels.paused() if self.kernels is not None else contextlib.nullcontext()
                with paused, self.b_ctx(), _backend_of(cache, self.b_backend):
                    ref, _ = self.orig(
                        module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
                    )
                ref = ref.float()
                rel = ((out.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item()
                if math.isfinite(rel):
                    self.max_rel[phase] = max(self.max_rel[phase], rel)
                else:
                    self.finite = False
                self.calls += 1
            return out, w

        AttentionInterface.register(ATTN_NAME, shadow)
        return self

    def __exit__(self, *exc: object) -> bool:
        from transformers import AttentionInterface

        AttentionInterface.register(self.name, self.orig)
        return False


# ---- one side's decode ----------------------------------------------------------------------------------------------
@dataclass
class SideRun:
    """What one side's decode recorded: per-step logits ``(rows, V)`` float32 (step 0: the prefills), the tokens of
    each row, the kept positions per ``(layer, row, eviction index)``, the steps where only some rows evicted."""

    logits: list[torch.Tensor] = field(default_factory=list)
    tokens: list[list[int]] = field(default_factory=list)
    kept: dict[tuple[int, int, int], torch.Tensor] = field(default_factory=dict)
    staggered_eviction_steps: int = 0
    eviction_steps: int = 0
    finite: bool = True


def decode_side(
    model: torch.nn.Module,
    policy,
    side: str,
    prompts: list[torch.Tensor],
    steps: int,
    seed: int,
    forced: list[list[int]] | None = None,
    keep_logits: bool = True,
    deadline: float | None = None,
) -> SideRun:
    """Decode ``prompts`` (one row each) for ``steps`` tokens with the engine's :class:`~vase.engine.Decoder`.

    ``forced[r][s]``: the token row ``r`` is fed at step ``s`` (teacher forcing: the logits are recorded, then every
    logit but the forced token's is set to :data:`FORCED_LOGIT`, so the greedy pick is the forced token).
    ``deadline``: :class:`vase.bench.measure.TimeCap` is raised from a decode step after it.
    """
    from vase.engine import Decoder, Request, SamplingConfig, cache_capacity, sample_seeds

    backend, ctx = side_settings(side)
    rows = len(prompts)
    run = SideRun()
    prefill_logits: list[torch.Tensor] = []
    device = next(model.parameters()).device
    forced_t = None if forced is None else torch.tensor(forced, device=device)  # (rows, steps)
    evict_counts: Counter = Counter()

    def on_logits(step: int, logits: torch.Tensor) -> None:
        row = len(prefill_logits) if step == 0 else None
        run.finite &= bool(torch.isfinite(logits).all())
        if keep_logits or step == 0:
            (prefill_logits if step == 0 else run.logits).append(logits.float().clone())
        if forced_t is not None:
            want = forced_t[row : row + 1, 0] if step == 0 else forced_t[: logits.shape[0], step]
            logits.fill_(FORCED_LOGIT)
            logits.scatter_(1, want.view(-1, 1), 0.0)

    def on_step(info) -> None:
        if info.evicted_rows:
            run.eviction_steps += 1
            run.staggered_eviction_steps += len(info.evicted_rows) < info.active_rows

    def on_evict(layer, row_ids, keep, kept_positions) -> None:
        for j, rid in enumerate(row_ids):
            r = rid[0]
            i = evict_counts[(layer.layer_idx, r)]
            evict_counts[(layer.layer_idx, r)] += 1
            run.kept[(layer.layer_idx, r, i)] = kept_positions[j].sort(dim=-1).values.cpu()

    p = max(x.numel() for x in prompts)
    dec = Decoder(
        model,
        policy,
        rows=rows,
        capacity=cache_capacity(policy, p, steps),
        sampling=SamplingConfig(temperature=0),
        max_new_tokens=steps,
        ignore_eos=True,
        attn_backend=backend,
        on_logits=on_logits,
        on_step=deadline_hook(deadline, on_step),
        on_cache=lambda cache: setattr(cache, "on_evict", on_evict),
    )
    seeds = sample_seeds(seed, rows)
    with ctx():
        done = list(dec.run([Request(x, [s], key=r) for r, (x, s) in enumerate(zip(prompts, seeds))]))
    if keep_logits:
        run.logits.insert(0, torch.cat(prefill_logits))
    run.tokens = [f.tokens for f in sorted(done, key=lambda f: f.key)]
    return run


def _kept_agreement(a: dict, b: dict) -> tuple[float, bool, float, int]:
    """(fraction of identical kept sets, layer 0 all identical, mean Jaccard, events compared) over every common
    (layer, row, eviction) and KV head."""
    identical = total = 0
    layer0_ok = True
    jaccard = []
    for key in sorted(set(a) & set(b)):
        ka, kb = a[key], b[key]
        same = (ka == kb).all(dim=-1)  # (H,)
        identical += int(same.sum())
        total += same.numel()
        if key[0] == 0 and not bool(same.all()):
            layer0_ok = False
        for h in range(ka.shape[0]):
            sa, sb = set(ka[h].tolist()), set(kb[h].tolist())
            jaccard.append(len(sa & sb) / max(len(sa | sb), 1))
    n = len(set(a) & set(b))
    return (identical / total if total else 1.0), layer0_ok, (sum(jaccard) / len(jaccard) if jaccard else 1.0), n


def check_pair(args: argparse.Namespace, pair: str, model, ref: SideRun, prompts, policy) -> dict:
    """Both checks of one pair against the float32 reference run ``ref`` (see the module docstring)."""
    a_name, b_name = pair.split(":")
    device = next(model.parameters()).device
    kernels = SdpaKernels()
    deadline = getattr(args, "deadline", None)
    with KernelShadow(b_name, kernels) as shadow, kernels:
        a = decode_side(model, policy, a_name, prompts, args.steps, args.seed, forced=ref.tokens, deadline=deadline)
    b = decode_side(model, policy, b_name, prompts, args.steps, args.seed, forced=ref.tokens, deadline=deadline)
    err = {"A": 0.0, "B": 0.0, "AB": 0.0}
    top1 = Counter()
    count = 0
    for la, lb, lr in zip(a.logits, b.logits, ref.logits):
        scale = lr.abs().max().clamp_min(1e-6)
        err["A"] = max(err["A"], ((la - lr).abs().max() / scale).item())
        err["B"] = max(err["B"], ((lb - lr).abs().max() / scale).item())
        err["AB"] = max(err["AB"], ((la - lb).abs().max() / scale).item())
        am, bm, rm = la.argmax(-1), lb.argmax(-1), lr.argmax(-1)
        top1["AB"] += int((am == bm).sum())
        top1["AR"] += int((am == rm).sum())
        top1["BR"] += int((bm == rm).sum())
        count += am.numel()
    ab, ar, br = (_kept_agreement(x, y) for x, y in ((a.kept, b.kept), (a.kept, ref.kept), (b.kept, ref.kept)))
    finite = a.finite and b.finite and shadow.finite and all(math.isfinite(v) for v in err.values())
    result = dict(
        pair=pair,
        kernels_A=kernels.summary() if a_name.startswith("sdpa") else {"flash_attn": "flash_attn_with_kvcache"},
        evictions=len(a.kept),
        staggered_eviction_steps=a.staggered_eviction_steps,
        eviction_steps=a.eviction_steps,
        kernel_max_rel_diff_A_vs_B=max(shadow.max_rel.values()),
        kernel_max_rel_diff_by_phase=shadow.max_rel,
        kernel_calls=shadow.calls,
        kernel_tol=args.kernel_tol,
        max_rel_logit_err_A_vs_ref=err["A"],
        max_rel_logit_err_B_vs_ref=err["B"],
        max_rel_logit_diff_A_vs_B=err["AB"],
        top1_agreement_A_B=top1["AB"] / max(count, 1),
        top1_agreement_A_ref=top1["AR"] / max(count, 1),
        top1_agreement_B_ref=top1["BR"] / max(count, 1),
        kept_identical_A_B=ab[0],
        kept_layer0_identical_A_B=ab[1],
        kept_jaccard_A_B=ab[2],
        kept_identical_A_ref=ar[0],
        kept_identical_B_ref=br[0],
    )
    checks = {
        "finite": finite,
        "kernel_A_vs_B_same_inputs": shadow.calls > 0 and max(shadow.max_rel.values()) <= args.kernel_tol,
        # the fast path is as close to float32 as the reference path is (FlashAttention's own test criterion)
        "logits_A_within_2x_B_error": err["A"] <= 2 * err["B"] + args.logit_tol,
        "top1_A_as_close_to_ref_as_B": result["top1_agreement_A_ref"] >= result["top1_agreement_B_ref"] - 0.05,
        "evicted": len(a.kept) > 0 and len(a.kept) == len(b.kept) == len(ref.kept),
        "kept_layer0_identical": ab[1],
        "kept_A_as_close_to_ref_as_B": ar[0] >= br[0] - 0.05,
    }
    if args.stagger and len(prompts) > 1:
        checks["rows_evict_at_different_steps"] = a.staggered_eviction_steps > 0
    if device.type == "cuda" and a_name == "sdpa":
        math_calls = sum(c.get("math", 0) + c.get("unknown", 0) for c in kernels.counts.values())
        checks["no_math_fallback"] = math_calls == 0 and sum(sum(c.values()) for c in kernels.counts.values()) > 0
    result["checks"] = checks
    result["ok"] = all(checks.values())
    return result


def default_pairs(device: torch.device, dtype: torch.dtype) -> list[str]:
    """``sdpa:sdpa-math`` always; ``flash_attn:sdpa-math`` too when ``auto`` resolves to FlashAttention-2."""
    pairs = ["sdpa:sdpa-math"]
    try:
        if _auto_backend(device, dtype) == "flash_attn":
            pairs.append("flash_attn:sdpa-math")
    except ValueError:
        pass
    return pairs


@torch.inference_mode()
def check(args: argparse.Namespace) -> dict:
    """Every pair of ``args.pair`` (default: :func:`default_pairs`); ``ok`` when every check of every pair holds."""
    from vase.models import resolve_dtype

    device = torch.device(args.device)
    dtype = resolve_dtype(args.dtype)
    pairs = args.pair.split(",") if args.pair else default_pairs(device, dtype)
    for pair in pairs:
        for side in pair.split(":"):
            side_settings(side)
    overrides = dict(initializer_range=args.init_std)
    longest = args.prompt_len + args.steps + 1
    model = build_model(args.model, dtype, device, args.seed, longest, **overrides)
    ref_model = build_model(args.model, torch.float32, device, args.seed, longest, **overrides)
    ref_model.load_state_dict({k: v.float() for k, v in model.state_dict().items()})  # the same (rounded) weights
    policy = make_policy(args.policy, args.budget, args.window)
    prompt = random_prompt(args.prompt_len, model.config.vocab_size, seed=args.seed)
    prompts = [prompt[r * args.stagger :] for r in range(args.batch)]
    if min(x.numel() for x in prompts) < 1:
        raise ValueError(f"--stagger: {args.stagger} x {args.batch} rows leaves an empty prompt of {args.prompt_len}")
    deadline = getattr(args, "deadline", None)
    ref = decode_side(ref_model, policy, "sdpa-math", prompts, args.steps, args.seed, deadline=deadline)
    del ref_model
    results = [check_pair(args, pair, model, ref, prompts, policy) for pair in pairs]
    return dict(
        pairs=results,
        reference="sdpa-math float32",
        device=str(device),
        device_name=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        torch=torch.__version__,
        cuda=torch.version.cuda,
        cudnn=torch.backends.cudnn.version() if device.type == "cuda" else None,
        auto_backend=_auto_backend(device, dtype),
        dtype=args.dtype,
        model=args.model,
        init_std=args.init_std,
        policy=args.policy,
        budget=args.budget,
        window=args.window,
        batch=args.batch,
        prompt_len=args.prompt_len,
        row_prompt_lens=[x.numel() for x in prompts],
        steps=args.steps,
        ok=all(r["ok"] for r in results),
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """``scripts/gpu_check.py``'s options (``--dry-run``: a small model on the CPU, a few steps)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--model", default="qwen3-0.6b-shape", choices=list(PRESETS))
    ap.add_argument("--pair", default=None, help="A:B[,A:B], e.g. sdpa:sdpa-math,flash_attn:sdpa-math, sdpa:eager")
    ap.add_argument("--policy", default="snapkv")
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--window", type=int, default=32)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=300)
    ap.add_argument("--stagger", type=int, default=37, help="row r's prompt is prompt-len - r * stagger tokens")
    ap.add_argument("--steps", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--init-std", type=float, default=0.02, help="weight init std of the random model")
    ap.add_argument("--logit-tol", type=float, default=1e-3, help="absolute slack (relative units) on the 2x rule")
    ap.add_argument(
        "--kernel-tol",
        type=float,
        default=None,
        help="max relative attention-output difference on identical inputs (bf16/fp16 3e-2, fp32 1e-4)",
    )
    ap.add_argument("--dry-run", action="store_true", help="small model on CPU, a few steps (checks the script)")
    ap.add_argument("--out", default=None, help="write the JSON summary here")
    args = ap.parse_args(argv)
    if args.dry_run:
        args.device, args.model, args.budget, args.window = "cpu", "cpu-small", 64, 16
        args.batch, args.prompt_len, args.steps, args.stagger = 3, 80, 64, 23
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.kernel_tol is None:
        args.kernel_tol = 1e-4 if args.dtype in ("float32", "fp32") else 3e-2
    return args


def main(argv: list[str] | None = None) -> int:
    """``scripts/gpu_check.py``: run :func:`check`, print (and ``--out``) the JSON summary; 0 when every check holds."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    if args.device == "cpu":
        torch.set_num_threads(1)
    result = check(args)
    text = json.dumps(result, indent=2, default=str)
    logger.info("%s", text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    return 0 if result["ok"] else 1
