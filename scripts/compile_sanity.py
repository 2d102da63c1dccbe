"""Eager against compiled decode on a tiny random Qwen3 (2 layers), side by side: tokens equal, graphs, seconds.

A sanity check of ``generation.compile``, not a benchmark: 6 prompts x 2 samples through 5 rows (buckets 1, 2, 4, 5),
EOS ending rows early, sampled at temperature 1, float32 on the CPU. The compiled run's seconds include compiling
every bucket it meets.

    OMP_NUM_THREADS=1 python scripts/compile_sanity.py vase_dkv inductor   # inductor (needs a C++ compiler)
    OMP_NUM_THREADS=1 python scripts/compile_sanity.py full count          # dynamo only, graphs counted
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.test_continuous import MODEL, load_policy, prompts  # noqa: E402
from vase.engine import Decoder, Request, SamplingConfig, sample_seeds  # noqa: E402
from vase.engine.cache import cache_capacity  # noqa: E402
from vase.models import tiny_model  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("policy", nargs="?", default="vase_dkv", help="a policy of conf/policy (default vase_dkv)")
    ap.add_argument("backend", nargs="?", default="count", choices=("count", "inductor"), help="default count")
    args = ap.parse_args()
    name, backend = args.policy, args.backend
    torch.manual_seed(0)
    model = tiny_model("qwen3", **MODEL)
    graphs = []

    def count(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def run(compile: str):
        policy = load_policy(name)
        reqs = [Request(p, sample_seeds(100 + i, 2), key=i) for i, p in enumerate(prompts((11, 27, 19, 40, 9, 33)))]
        cap = max(cache_capacity(policy, len(r.prompt_ids), 80) for r in reqs)
        dec = Decoder(
            model,
            policy,
            rows=5,
            capacity=cap,
            sampling=SamplingConfig(temperature=1.0),
            max_new_tokens=80,
            eos_token_ids=range(0, 6),
            compile=compile,
            compile_backend=None if backend == "inductor" else count,
        )
        t0 = time.perf_counter()
        out = {(f.key, f.sample): f.tokens for f in dec.run(reqs)}
        return out, dec.stats.decode_steps, time.perf_counter() - t0

    eager, steps, t_eager = run("off")
    compiled, _, t_compiled = run("on")
    print(
        f"{name} ({backend}): tokens equal {eager == compiled}, {steps} steps, graphs counted {len(graphs)}, "
        f"eager {t_eager:.1f} s, compiled {t_compiled:.1f} s (compiles included)"
    )


if __name__ == "__main__":
    from vase.run.oneline import script_main

    script_main(main)
