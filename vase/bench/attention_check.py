"""Check that the fast attention path decodes like the reference path: logits and kept sets, teacher-forced.

Pairs compared (chosen automatically, or ``--pair``):

* ``flash_attn:sdpa`` — on CUDA with ``flash_attn`` importable: the engine's FlashAttention-2 path
  (``attn_backend="flash_attn"``: ``flash_attn_func`` at the prefill, ``flash_attn_with_kvcache`` on the static storage
  when decoding) against its SDPA path;
* ``sdpa-flash:sdpa-math`` — on CUDA without ``flash_attn``, and the CPU fallback: the engine's SDPA path under
  ``torch.nn.attention.sdpa_kernel(SDPBackend.FLASH_ATTENTION)`` against ``SDPBackend.MATH``;
* ``sdpa:eager`` — the SDPA path against the engine's explicit-softmax reference (any device).

Rows of different lengths: row ``r`` decodes the last ``prompt_len - r * stagger`` tokens of the prompt, so every
step exercises per-row key masks (SDPA) / ``cache_seqlens`` (FlashAttention-2) and rows evict at different steps.

Two checks:

1. Kernel, on identical inputs: side A decodes and every attention call (prefill and decode, every layer) is recomputed
   by side B's kernel on the very same query, keys and values (the static storage's views); the largest
   ``max |out_A - out_B| / max |out_B|`` must stay within ``--kernel-tol`` (bf16/fp16: 3e-2, about 4 bf16 ulps).
2. End to end, teacher-forced: A and B in the model dtype and a float32 reference (same rounded weights, SDPA math)
   decode the same tokens (the reference's greedy choices) in lockstep, with a deterministic policy (``snapkv``).
   Logits: A's largest error against the reference must be at most twice B's (FlashAttention's own test rule), and
   A's top-1 agreement with the reference at least B's minus 0.05. Kept sets, per (eviction, layer, row, KV head):
   layer 0 must be identical (its keys and queries do not depend on attention, so both sides score bitwise-equal
   inputs and must evict at the same steps and keep the same tokens); deeper layers' keys carry the attention's
   rounding, which swaps tokens whose scores tie within bf16 precision, so there A must agree with the reference as
   often as B does (minus 0.05); the identical fraction and the mean Jaccard of A against B are reported.

Entry point: ``scripts/gpu_check.py``. Usage::

    python scripts/gpu_check.py                      # CUDA: flash_attn vs sdpa (or SDPA flash vs math)
    python scripts/gpu_check.py --device cpu         # the CPU fallback (SDPA flash vs math kernels), runs anywhere
    python scripts/gpu_check.py --dry-run            # tiny model, CPU, a few steps: checks the script itself

Exit status 0 when every criterion holds; a JSON summary is printed (and written with ``--out``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from vase.bench.jobs import make_policy
from vase.bench.shapes import PRESETS, build_model, random_prompt

if TYPE_CHECKING:
    from vase.engine.policy import Policy

logger = logging.getLogger(__name__)


def pick_pair(device: torch.device) -> str:
    """The pair compared by default on ``device`` (see the module docstring)."""
    from vase.engine.attention import flash_attn_available

    if device.type == "cuda" and flash_attn_available():
        return "flash_attn:sdpa"
    return "sdpa-flash:sdpa-math"


def side_settings(name: str) -> tuple[str, Callable[[], contextlib.AbstractContextManager]]:
    """``(engine attn_backend, context manager factory)`` of one side of a pair."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if name == "sdpa-flash":
        return "sdpa", lambda: sdpa_kernel(SDPBackend.FLASH_ATTENTION)
    if name == "sdpa-math":
        return "sdpa", lambda: sdpa_kernel(SDPBackend.MATH)
    if name in ("flash_attn", "sdpa", "eager"):
        return name, contextlib.nullcontext
    raise ValueError(f"--pair: unknown side {name!r}")


class Side:
    """One backend's cache and decode state, driven step by step like :class:`vase.engine.decode.Decoder`.

    Row ``r`` decodes its own prompt: the last ``prompt_len - r * stagger`` tokens of ``prompt`` (rows of different
    lengths, so per-row masks / ``cache_seqlens`` and out-of-step evictions are exercised); every row is prefilled
    into its own slot, then all rows decode together, teacher-forced.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        policy: Policy,
        name: str,
        prompt: torch.Tensor,
        rows: int,
        steps: int,
        seed: int,
        stagger: int = 0,
    ) -> None:
        from vase.engine import VaseCache, cache_capacity, model_geometry, sample_seeds

        self.model, self.name = model, name
        self.backend, self.ctx = side_settings(name)
        device = next(model.parameters()).device
        p = prompt.numel()
        self.prompts = [prompt[r * stagger :].to(device) for r in range(rows)]
        if min(x.numel() for x in self.prompts) < 1:
            raise ValueError(f"--stagger: {stagger} x {rows} rows leaves an empty prompt of {p} tokens")
        geometry = model_geometry(model, rows, cache_capacity(policy, p, steps), prompt_len=p)
        self.cache = VaseCache(geometry, policy, scaling=geometry.head_dim**-0.5, attn_backend=self.backend)
        self.seeds = sample_seeds(seed, rows)
        self.kept: list[tuple[int, torch.Tensor]] = []  # (layer, kept positions sorted (rows, H, n_keep))
        self.cache.on_evict = lambda layer, rids, idx, kept_p: self.kept.append(
            (layer.layer_idx, kept_p.sort(dim=-1).values.cpu())
        )
        self.device, self.rows = device, rows

    def prefill(self) -> torch.Tensor:
        """Each row's prompt into its slot; ``(rows, V)`` float32 logits of each prompt's last token."""
        from vase.engine import vase_attention

        out = []
        with vase_attention(self.model), self.ctx():
            for r, ids in enumerate(self.prompts):
                self.cache.begin_prefill([r], [self.seeds[r]], [r])
                logits = self.model(
                    input_ids=ids.view(1, -1),
                    position_ids=torch.arange(ids.numel(), device=self.device).view(1, -1),
                    cache=self.cache,
                    use_cache=True,
                    logits_to_keep=1,
                    vase_cache=self.cache,
                ).logits[:, -1]
                self.cache.end_prefill(ids.numel())
                out.append(logits)
        return torch.cat(out).float()

    def step(self, tokens: torch.Tensor, step: int) -> torch.Tensor:
        """Feed ``tokens (rows,)`` at each row's own next position; ``(rows, V)`` float32 logits."""
        from vase.engine import vase_attention

        cache = self.cache
        cache.prepare_step(self.rows)
        with vase_attention(self.model), self.ctx():
            logits = self.model(
                input_ids=tokens.view(-1, 1).to(self.device),
                position_ids=cache.pos_t[: self.rows].view(-1, 1),
                cache=cache,
                use_cache=True,
                vase_cache=cache,
            ).logits[:, -1]
        cache.advance()
        cache.evict_due()
        return logits.float()


def _kept_agreement(ka_list, kb_list) -> tuple[float, bool, float]:
    """(fraction of identical kept sets, layer 0 all identical, mean Jaccard) over every (eviction, row, KV head)."""
    identical = total = 0
    layer0_ok = True
    jaccard = []
    for (layer, ka), (_, kb) in zip(ka_list, kb_list):
        same = (ka == kb).all(dim=-1)  # (rows, H): sorted kept positions equal
        identical += int(same.sum())
        total += same.numel()
        if layer == 0 and not bool(same.all()):
            layer0_ok = False
        for r in range(ka.shape[0]):
            for h in range(ka.shape[1]):
                sa, sb = set(ka[r, h].tolist()), set(kb[r, h].tolist())
                jaccard.append(len(sa & sb) / len(sa | sb))
    return (identical / total if total else 1.0), layer0_ok, (sum(jaccard) / len(jaccard) if jaccard else 1.0)


class KernelShadow:
    """Wraps the registered ``"vase"`` attention: every call also runs side B's kernel on the very same inputs.

    Side A's output is returned (the decode proceeds on A), so the comparison is per call, on identical query, keys
    and values: no accumulation of rounding through layers and steps. ``max_rel`` is the largest
    ``max |out_A - out_B| / max |out_B|`` over every layer, prefill and decode step.
    """

    def __init__(self, b_name: str) -> None:
        self.b_backend, self.b_ctx = side_settings(b_name)
        self.max_rel = 0.0
        self.calls = 0

    def __enter__(self) -> KernelShadow:
        from transformers import AttentionInterface

        import vase.engine.attention as va

        self.va = va
        self.orig = va.vase_attention_forward

        def shadow(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
            out, w = self.orig(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
            cache = kwargs.get("vase_cache")
            if cache is not None:
                sc = scaling if scaling is not None else query.shape[-1] ** -0.5
                prefill = cache.prefilling is not None
                mask = None
                if not prefill:  # each row over its own held tokens (the live views hold up to the longest row)
                    held = cache.length_mask(query.shape[0], key.shape[2])
                    mask = None if held is None else held[:, None, None, :]
                with self.b_ctx():
                    if self.b_backend == "eager":
                        ref = va.eager_attention(query, key, value, sc, causal=prefill, mask=mask)
                    else:
                        ref = va._sdpa(query, key, value, sc, prefill, mask)
                ref = ref.transpose(1, 2).float()
                rel = ((out.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item()
                self.max_rel = max(self.max_rel, rel)
                self.calls += 1
            return out, w

        AttentionInterface.register(va.ATTN_NAME, shadow)
        return self

    def __exit__(self, *exc: object) -> bool:
        from transformers import AttentionInterface

        AttentionInterface.register(self.va.ATTN_NAME, self.orig)
        return False


@torch.inference_mode()
def check(args: argparse.Namespace) -> dict:
    from vase.models import resolve_dtype

    device = torch.device(args.device)
    dtype = resolve_dtype(args.dtype)
    pair = args.pair or pick_pair(device)
    a_name, b_name = pair.split(":")
    overrides = dict(initializer_range=args.init_std)
    model = build_model(args.model, dtype, device, args.seed, args.prompt_len + args.steps + 1, **overrides)
    ref_model = build_model(args.model, torch.float32, device, args.seed, args.prompt_len + args.steps + 1, **overrides)
    ref_model.load_state_dict({k: v.float() for k, v in model.state_dict().items()})  # the same (rounded) weights
    policy = make_policy(args.policy, args.budget, args.window)
    prompt = random_prompt(args.prompt_len, model.config.vocab_size, seed=args.seed)
    # 1. kernel check: side A decodes; every attention call is recomputed by side B's kernel on the same inputs
    shadow_side = Side(model, policy, a_name, prompt, args.batch, args.steps, args.seed, args.stagger)
    with KernelShadow(b_name) as shadow:
        tokens = shadow_side.prefill().argmax(-1)
        for step in range(1, args.steps):
            tokens = shadow_side.step(tokens, step).argmax(-1)
    # 2. end to end, teacher-forced: A and B (bf16) and a float32 reference decode the same tokens in lockstep
    ref_side = "sdpa-math" if b_name.startswith("sdpa") or b_name == "flash_attn" else b_name
    sides = {
        "A": Side(model, policy, a_name, prompt, args.batch, args.steps, args.seed, args.stagger),
        "B": Side(model, policy, b_name, prompt, args.batch, args.steps, args.seed, args.stagger),
        "R": Side(ref_model, policy, ref_side, prompt, args.batch, args.steps, args.seed, args.stagger),
    }
    err = {"A": 0.0, "B": 0.0, "AB": 0.0}
    top1 = {"AB": 0, "AR": 0, "BR": 0}
    count = 0

    def compare(logits: dict) -> None:
        nonlocal count
        scale = logits["R"].abs().max().clamp_min(1e-6)
        err["A"] = max(err["A"], ((logits["A"] - logits["R"]).abs().max() / scale).item())
        err["B"] = max(err["B"], ((logits["B"] - logits["R"]).abs().max() / scale).item())
        err["AB"] = max(err["AB"], ((logits["A"] - logits["B"]).abs().max() / scale).item())
        am = {k: v.argmax(-1) for k, v in logits.items()}
        top1["AB"] += int((am["A"] == am["B"]).sum())
        top1["AR"] += int((am["A"] == am["R"]).sum())
        top1["BR"] += int((am["B"] == am["R"]).sum())
        count += am["A"].numel()

    logits = {k: s.prefill() for k, s in sides.items()}
    compare(logits)
    tokens = logits["R"].argmax(-1)  # teacher forcing: every side is fed the float32 reference's greedy tokens
    for step in range(1, args.steps):
        logits = {k: s.step(tokens, step) for k, s in sides.items()}
        compare(logits)
        tokens = logits["R"].argmax(-1)
    n_ev = {k: len(s.kept) for k, s in sides.items()}
    assert len(set(n_ev.values())) == 1, f"every side evicts at the same steps (host-side trigger): {n_ev}"
    ab = _kept_agreement(sides["A"].kept, sides["B"].kept)
    ar = _kept_agreement(sides["A"].kept, sides["R"].kept)
    br = _kept_agreement(sides["B"].kept, sides["R"].kept)
    result = dict(
        pair=pair,
        reference=f"{ref_side} float32",
        device=str(device),
        device_name=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        dtype=args.dtype,
        model=args.model,
        init_std=args.init_std,
        policy=args.policy,
        budget=args.budget,
        window=args.window,
        batch=args.batch,
        prompt_len=args.prompt_len,
        row_prompt_lens=[x.numel() for x in sides["A"].prompts],
        steps=args.steps,
        evictions=n_ev["A"],
        kernel_max_rel_diff_A_vs_B=shadow.max_rel,
        kernel_calls=shadow.calls,
        kernel_tol=args.kernel_tol,
        max_rel_logit_err_A_vs_ref=err["A"],
        max_rel_logit_err_B_vs_ref=err["B"],
        max_rel_logit_diff_A_vs_B=err["AB"],
        top1_agreement_A_B=top1["AB"] / count,
        top1_agreement_A_ref=top1["AR"] / count,
        top1_agreement_B_ref=top1["BR"] / count,
        kept_identical_A_B=ab[0],
        kept_layer0_identical_A_B=ab[1],
        kept_jaccard_A_B=ab[2],
        kept_identical_A_ref=ar[0],
        kept_identical_B_ref=br[0],
    )
    checks = {
        "kernel_A_vs_B_same_inputs": shadow.calls > 0 and shadow.max_rel <= args.kernel_tol,
        # the fast path is as close to float32 as the reference path is (FlashAttention's own test criterion)
        "logits_A_within_2x_B_error": err["A"] <= 2 * err["B"] + args.logit_tol,
        "top1_A_as_close_to_ref_as_B": result["top1_agreement_A_ref"] >= result["top1_agreement_B_ref"] - 0.05,
        "evicted": n_ev["A"] > 0,
        "kept_layer0_identical": ab[1],
        "kept_A_as_close_to_ref_as_B": ar[0] >= br[0] - 0.05,
    }
    result["checks"] = checks
    result["ok"] = all(checks.values())
    return result


def main(argv: list[str] | None = None) -> int:
    """``scripts/gpu_check.py``: run :func:`check`, print (and ``--out``) the JSON summary; 0 when every check holds."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--model", default="qwen3-0.6b-shape", choices=list(PRESETS))
    ap.add_argument("--pair", default=None, help="A:B, e.g. flash_attn:sdpa, sdpa-flash:sdpa-math, sdpa:eager")
    ap.add_argument("--policy", default="snapkv")
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--window", type=int, default=32)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=300)
    ap.add_argument(
        "--stagger",
        type=int,
        default=37,
        help="row r's prompt is prompt-len - r * stagger tokens (rows of different lengths)",
    )
    ap.add_argument("--steps", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--init-std",
        type=float,
        default=0.02,
        help="weight init std of the random model (HF default 0.02)",
    )
    ap.add_argument("--logit-tol", type=float, default=1e-3, help="absolute slack (relative units) on the 2x rule")
    ap.add_argument(
        "--kernel-tol",
        type=float,
        default=None,
        help="max relative attention-output difference on identical inputs (bf16/fp16 3e-2, fp32 1e-4)",
    )
    ap.add_argument("--dry-run", action="store_true", help="tiny model on CPU, a few steps (checks the script)")
    ap.add_argument("--out", default=None, help="write the JSON summary here")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    if args.dry_run:
        args.device, args.model, args.budget, args.window = "cpu", "cpu-small", 64, 16
        args.batch, args.prompt_len, args.steps, args.stagger = 3, 80, 64, 23
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cpu":
        torch.set_num_threads(1)
    if args.kernel_tol is None:
        args.kernel_tol = 1e-4 if args.dtype in ("float32", "fp32") else 3e-2
    result = check(args)
    text = json.dumps(result, indent=2)
    logger.info("%s", text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0 if result["ok"] else 1
