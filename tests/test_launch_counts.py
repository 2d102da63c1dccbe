"""Kernel launches of a decode step at Qwen3-4B's attention shapes (issue 26: the decode is launch-bound on a GPU).

The real :meth:`vase.engine.Decoder.run` under the dispatch recorder of ``tests/test_gpu_path.py``
(:class:`~tests.test_gpu_path.SyncDetector`: every aten op, composite ops decomposed as they run), on a random Qwen3
with Qwen3-4B's attention geometry — 36 layers, 32 query heads, 8 KV heads, head_dim 128 — and a tiny hidden size,
MLP and vocabulary (they change no op count); 16 rows whose prompts put them in pairs that evict together at
different steps; ``vase_dkv``, budget 64, window 16; Qwen3's sampling (temperature 0.6, top-p 0.95, top-k 20).

A kernel-launching op is every recorded op but views and bare allocations (:func:`launches`); on a GPU each is
(at least) one kernel launch with its host overhead (5-8 us), so these counts bound an eager step's host cost.
Measured here, kernel-launching ops per decode step of 16 rows (a step's count includes its sampling):

=================  =========================================  ========================================
                   before (per-layer storage and eviction)    after (stacked storage, one event)
=================  =========================================  ========================================
plain step         2,127                                      2,127
evicting step      5,656 (+3,529 for one group of 2 rows)     2,272 (+145)
sampling           77                                         77
=================  =========================================  ========================================

Sampling is not yet at the issue's target (<= 30): 13 ops of top-k / top-p / race and 64 of the counter-based hash
(:mod:`vase.engine.rng`: five ``mix32`` rounds of 10 int64 ops). Any draw under ~17 ops needs another hash, which
changes every sampled token of every run (a protocol change, to be made deliberately); the threshold below is the
measured count until then.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

import vase.engine.decode as decode
from tests.policy_configs import load_small
from tests.test_gpu_path import SyncDetector
from vase.engine import Decoder, Request, SamplingConfig
from vase.engine.cache import cache_capacity
from vase.models import tiny_model

LAYERS, Q_HEADS, KV_HEADS, HEAD_DIM = 36, 32, 8, 128  # Qwen3-4B
ROWS, BUDGET, WINDOW = 16, 64, 16
#: thresholds (issue 26, "Launch counts")
PLAIN_MAX, EVICT_EXTRA_MAX = 2_200, 600
#: the issue's target is 30; today's token hash costs 64 of these 77 (see the module docstring)
SAMPLING_MAX = 77
#: ops that launch no kernel: bare allocations (views are recognised by their schema, :func:`launches`)
NO_KERNEL = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "lift_fresh", "detach"}


def _is_view(name: str) -> bool:
    packet = getattr(torch.ops.aten, name, None)
    if packet is None:
        return False
    return any(getattr(packet, o).is_view for o in packet.overloads())


def launches(ops: Counter) -> int:
    """Kernel-launching ops of a recorded phase: every op but views and bare allocations."""
    return sum(c for name, c in ops.items() if name not in NO_KERNEL and not _is_view(name))


@pytest.fixture(scope="module")
def counts():
    model = tiny_model(
        "qwen3",
        num_hidden_layers=LAYERS,
        num_attention_heads=Q_HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        hidden_size=64,
        intermediate_size=64,
        vocab_size=256,
    )
    policy = load_small("vase_dkv", BUDGET, WINDOW, model)
    g = torch.Generator().manual_seed(0)
    # prompt lengths 66..73, two samples each: rows (2i, 2i+1) evict together, a pair every step for 8 steps of 16
    reqs = [Request(torch.randint(6, 256, (66 + i,), generator=g), [2 * i, 2 * i + 1], key=i) for i in range(8)]
    max_new = 24
    cap = max(cache_capacity(policy, len(r.prompt_ids), max_new) for r in reqs)
    dec = Decoder(
        model,
        policy,
        rows=ROWS,
        capacity=cap,
        sampling=SamplingConfig(temperature=0.6, top_p=0.95, top_k=20),
        max_new_tokens=max_new,
        eos_token_ids=[],
        sync_every=8,
    )
    mp = pytest.MonkeyPatch()
    detector = SyncDetector(mp)
    steps: dict[int, dict] = {}
    step_fn, sample_fn = Decoder._decode_step, decode.sample_tokens

    def tagged(self, n, pending):
        detector.phase = ("step", self.step + 1)
        try:
            held, tok, evicted = step_fn(self, n, pending)
        finally:
            detector.phase = "between"
        steps[self.step] = {"rows": n, "evicted": list(evicted)}
        return held, tok, evicted

    def sampled(*args, **kwargs):
        phase = detector.phase
        detector.phase = ("sample", phase)
        try:
            return sample_fn(*args, **kwargs)
        finally:
            detector.phase = phase

    mp.setattr(Decoder, "_decode_step", tagged)
    mp.setattr(decode, "sample_tokens", sampled)
    try:
        with detector:
            done = list(dec.run(reqs))
    finally:
        mp.undo()
    assert len(done) == ROWS and detector.step_syncs() == {}
    out = {"plain": [], "evicting": [], "sampling": []}
    for k, info in steps.items():
        if info["rows"] != ROWS:
            continue
        n = launches(detector.ops[("step", k)])
        sampling = launches(detector.ops[("sample", ("step", k))])
        groups = len(info["evicted"]) // 2  # rows evict in pairs
        out["sampling"].append(sampling)
        if groups:
            out["evicting"].append((n + sampling, groups))
        else:
            out["plain"].append(n + sampling)
    return out


def test_a_plain_decode_step(counts):
    assert counts["plain"], counts
    assert max(counts["plain"]) <= PLAIN_MAX, counts["plain"]


def test_an_evicting_step_adds_one_event_not_one_per_layer(counts):
    plain = min(counts["plain"])
    assert counts["evicting"] and all(g == 1 for _, g in counts["evicting"]), counts["evicting"]
    extra = [n - plain for n, _ in counts["evicting"]]
    assert max(extra) <= EVICT_EXTRA_MAX, extra


def test_sampling(counts):
    assert max(counts["sampling"]) <= SAMPLING_MAX, counts["sampling"]
