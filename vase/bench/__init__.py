"""Benchmarks of the engine: decode throughput and memory per policy, kvpress comparison, fast-attention checks.

Modules (the entry points are ``scripts/bench_throughput.py``, ``scripts/bench_kvpress.py``,
``scripts/gpu_check.py``, ``scripts/profile_decode.py``, ``scripts/kvpress_step_profile.py``):

* :mod:`~vase.bench.shapes`: the random-weight model presets and the static KV size computed from a config;
* :mod:`~vase.bench.measure`: trimmed means, peak memory (CUDA max allocated / peak RSS), machine information;
* :mod:`~vase.bench.jobs`: one benchmark config (policy, prompt, planned lengths) and its timed runs;
* :mod:`~vase.bench.report`: ratios, full-length estimates, the targets, CSV, table and plot of a sweep;
* :mod:`~vase.bench.throughput`: the sweep (``scripts/bench_throughput.py``'s options and protocols);
* :mod:`~vase.bench.kvpress`: our ``snapkv`` against kvpress's ``DecodingPress(SnapKVPress)``;
* :mod:`~vase.bench.attention_check`: the fast attention path against the reference path (``scripts/gpu_check.py``);
* :mod:`~vase.bench.worker`: ``python -m vase.bench.worker``, one config in a fresh process.

``shapes`` and ``measure`` import only the standard library and torch (their model-building functions import the
rest when called): the kvpress side imports them inside kvpress's own virtual environment, which has neither this
project's dependencies nor its transformers version.
"""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
"""The repository root (``conf/policy/*.yaml`` are read from it; the worker processes start there)."""
