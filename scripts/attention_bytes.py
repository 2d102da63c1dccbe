"""Bytes read per decode step: the K/V bytes the decode attention is given against the bytes the rows hold, for
``full`` and ``vase_dkv`` (budget 32, window 8), eager and compiled, over the staggered 300-step continuous-batching
decode of ``vase.bench.attention_bytes`` (tiny Qwen3, 5 rows; docs/architecture.md, "Bytes read per step").

    OMP_NUM_THREADS=1 python scripts/attention_bytes.py            # eager and compiled (dynamo's graphs, ~2 min)
    OMP_NUM_THREADS=1 python scripts/attention_bytes.py --eager    # eager only (~20 s)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository, for a run from anywhere

from vase.bench.attention_bytes import BytesReport, staggered_decode  # noqa: E402
from vase.bench.jobs import make_policy  # noqa: E402
from vase.engine.cache import row_buckets  # noqa: E402
from vase.models import tiny_model  # noqa: E402

POLICIES = ("full", "vase_dkv")
ROWS = 5


def row(r: BytesReport) -> str:
    """One markdown row of the table."""
    steady = [s for s in r.steps if s.live == r.rows]
    before = sum(s.rows * r.capacity * r.token_bytes for s in steady) / sum(s.held for s in steady)
    graphs = f"{r.graphs} (<= {len(row_buckets(r.rows)) * len(r.key_buckets)})" if r.compiled else "-"
    return (
        f"| `{r.policy}` | {'compiled' if r.compiled else 'eager'} | {r.capacity} | "
        f"{', '.join(map(str, r.key_buckets))} | {len(r.steps)} ({len(steady)}) | {graphs} | {r.ratio():.3f} | "
        f"{r.ratio(steady=True):.3f} | {r.ratio_to_longest(steady=True):.3f} | {before:.3f} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--eager", action="store_true", help="eager steps only (no dynamo trace)")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = tiny_model("qwen3", num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2)
    print(
        "| policy | step | capacity | key buckets | steps (every row live) | graphs | given / held | "
        "given / held, every row live | given / (live rows x longest), every row live | "
        "whole capacity / held (before), every row live |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in POLICIES:
        for compiled in (False,) if args.eager else (False, True):
            report = staggered_decode(model, make_policy(name, 32, 8), name, compiled=compiled, rows=ROWS)
            print(row(report), flush=True)


if __name__ == "__main__":
    from vase.run.oneline import script_main

    script_main(main)
