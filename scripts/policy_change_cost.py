"""What issue 38's policy changes cost per eviction event: each policy's keep() before and after, side by side in one
process on the same random event (docs/policies.md quotes it).

    OMP_NUM_THREADS=1 PYTHONPATH=. python scripts/policy_change_cost.py [--layers 8] [--budget 512] [--repeats 5]

The event: 2 sequences x ``layers`` layers folded (as the engine calls keep()), Qwen3-4B's attention geometry (8 KV
heads, 32 query heads, head dim 128), ``budget`` tokens plus a 128-step period of candidates. Prints the median
seconds of each variant; the pairs run interleaved so a drift of the machine hits both alike.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository, for a run from anywhere

from baselines.h2o import H2O  # noqa: E402
from baselines.keydiff import KeyDiff  # noqa: E402
from baselines.triattention import TriAttention  # noqa: E402
from tests.authors_rules import rule_inputs  # noqa: E402
from tests.policy_configs import calibrate  # noqa: E402
from vase.engine.evict import prefill_column_sums  # noqa: E402


def _time(policy, inputs_fn, repeats: int) -> float:
    out = []
    for _ in range(repeats):
        inputs = inputs_fn()
        t0 = time.perf_counter()
        policy.keep(inputs)
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--budget", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    h, hq, d, window = 8, 32, 128, 64
    layer_ids = list(range(a.layers))
    pairs = {
        "triattention": (
            TriAttention(budget=a.budget, window=window, selection="per_layer_head", protect_recent=None),
            TriAttention(budget=a.budget, window=window),
        ),
        "keydiff": (
            KeyDiff(budget=a.budget, window=window, protect_recent=None),
            KeyDiff(budget=a.budget, window=window),
        ),
        # H2O's rule is unchanged; its state is now padded to the storage capacity (here a prompt of 2 x budget)
        "h2o": (H2O(budget=a.budget, window=window), H2O(budget=a.budget, window=window)),
    }
    capacity = {"h2o": 2 * a.budget + 1}
    print(f"layers={a.layers} budget={a.budget} H={h} Hq={hq} D={d}; median of {a.repeats}, seconds per event")
    for name, (before, after) in pairs.items():
        for p in (before, after):
            calibrate(p, layers=a.layers, q_heads=hq, head_dim=d)
        times = {"before": [], "after": []}
        for _ in range(a.repeats):  # interleaved
            for label, p in (("before", before), ("after", after)):
                cap = capacity.get(name) if label == "after" else None
                times[label].append(
                    _time(p, lambda p=p, cap=cap: _with(rule_inputs(p, h, hq, d, 2, layer_ids), cap), 1)
                )
        b, t = statistics.median(times["before"]), statistics.median(times["after"])
        print(f"{name:13s} before {b:.4f} s  after {t:.4f} s  ratio {t / b:.2f}")
    for p in (1024, 4096):  # H2O's prefill seed: once per prompt and full layer
        q, k = torch.randn(1, hq, p, d), torch.randn(1, h, p, d)
        t0 = time.perf_counter()
        prefill_column_sums(q, k, d**-0.5)
        print(f"h2o prefill seed, one layer, prompt {p}: {time.perf_counter() - t0:.4f} s")
    return 0


def _with(inputs, capacity):
    inputs.capacity = capacity
    return inputs


if __name__ == "__main__":
    from vase.run.oneline import script_main

    torch.manual_seed(0)
    script_main(main)
