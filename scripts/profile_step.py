#!/usr/bin/env python
"""Eager against compiled decode steps of a real model at a fixed number of live rows, and where the time goes.

Every step covers exactly ``--rows`` rows (EOS ignored, equal prompts), so the compiled step pays no bucket padding;
``--live 9 --rows 16`` decodes 9 prompts in 16 slots, which a compiled step pads to its bucket of 16;
``torch.profiler`` groups the operators' self time of a window of steady steps into matrix products, attention, the
compiled graph's kernels and the rest (vase/bench/step_profile.py). The embedded default's model and policy::

    OMP_NUM_THREADS=1 python scripts/profile_step.py --rows 16 --compile off,on --out results/bench/step_profile.json

The compiled mode compiles its one row bucket first (minutes on a CPU; inductor's cache makes a rerun fast).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen2.5_coder_0.5b", help="a conf/model preset (default: the embedded one)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--policy", default="vase_attnv", help="a conf/policy name")
    ap.add_argument("--budget", type=int, default=64)
    ap.add_argument("--window", type=int, default=16)
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--live", type=int, default=None, help="prompts decoded (default --rows; fewer: bucket padding)")
    ap.add_argument("--prompt-len", type=int, default=150)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--compile", default="off,on", help="comma list of generation.compile settings, run in order")
    ap.add_argument("--profile-steps", default="30:60", help="first:last decode steps profiled ('' for none)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)
    modes = [m.strip() for m in args.compile.split(",") if m.strip()]
    bad = [m for m in modes if m not in ("off", "on")]
    if bad or not modes:
        raise ValueError(f"--compile: a comma list of off and on, got {args.compile!r}")
    window = None
    if args.profile_steps:
        try:
            first, last = (int(x) for x in args.profile_steps.split(":"))
        except ValueError:
            raise ValueError(f"--profile-steps: first:last, got {args.profile_steps!r}") from None
        if not 1 <= first < last < args.new_tokens:
            raise ValueError(f"--profile-steps: need 1 <= first < last < --new-tokens, got {args.profile_steps!r}")
        window = (first, last)
    torch.set_num_threads(args.threads)

    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    from vase.bench.step_profile import profile_decode
    from vase.engine import SamplingConfig

    def conf(overrides: list[str]):
        with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
            return compose(config_name="config", overrides=overrides)

    cfg = conf([f"model={args.model}", f"model.dtype={args.dtype}", f"policy={args.policy}",
                f"budget={args.budget}", f"window={args.window}"])  # fmt: skip
    spec = instantiate(cfg.model)
    model, _ = spec.load()
    sampling = SamplingConfig(temperature=spec.temperature, top_p=spec.top_p, top_k=spec.top_k)
    results = []
    for mode in modes:
        r = profile_decode(
            model,
            instantiate(cfg.policy),
            rows=args.rows,
            prompt_len=args.prompt_len,
            new_tokens=args.new_tokens,
            compile=mode,
            sampling=sampling,
            window=window,
            live=args.live,
        )
        results.append(r)
        shares = ", ".join(f"{g} {100 * s:.1f} %" for g, s in (r.shares or {}).items())
        print(f"compile={mode}: {r.rows} rows, median step {r.median_ms:.1f} ms, {r.tokens_per_second:.2f} tok/s"
              + (f"; self time: {shares}" if shares else ""))  # fmt: skip
    if len(results) > 1:
        base = results[0]
        for r in results[1:]:
            print(f"compile={r.compile} / compile={base.compile}: {base.median_ms / r.median_ms:.2f}x")
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        cpu = torch.backends.cpu.get_cpu_capability()
        payload = {
            "args": vars(args),
            "cpu_capability": cpu,
            "torch": torch.__version__,
            "runs": [
                {
                    "compile": r.compile,
                    "rows": r.rows,
                    "steps": r.steps,
                    "median_step_ms": r.median_ms,
                    "tokens_per_second": r.tokens_per_second,
                    "shares": r.shares,
                    "top_ops": r.top_ops,
                    "step_ms": r.step_ms,
                }  # fmt: skip
                for r in results
            ],
        }
        out.write_text(json.dumps(payload, indent=1))
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    from vase.run.oneline import script_main

    script_main(main)
