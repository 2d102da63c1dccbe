"""Benchmarks of the engine: throughput and memory per policy, peer engines, whole runs side by side, GPU checks.

Modules (the entry points are the thin scripts of ``scripts/``: ``bench_throughput.py``, ``bench_rows.py``,
``bench_kvpress.py``, ``bench_vllm.py``, ``bench_variants.py``, ``gpu_check.py``, ``gpu_bench_rows.py``,
``gpu_smoke.sh``/``gpu_smoke.py``, ``profile_decode.py``, ``kvpress_step_profile.py``, ``attention_bytes.py``):

* :mod:`~vase.bench.shapes`: the random-weight model presets, random and staggered prompts, the static KV size;
* :mod:`~vase.bench.measure`: trimmed means, peak memory (CUDA max allocated / peak RSS), machine information, time
  caps for decode loops;
* :mod:`~vase.bench.jobs`: one benchmark config (policy, prompts, planned lengths) and its timed runs;
* :mod:`~vase.bench.report`: ratios, full-length estimates, the targets, CSV, table and plot of a sweep;
* :mod:`~vase.bench.throughput`: the sweep (``scripts/bench_throughput.py``'s options and protocols);
* :mod:`~vase.bench.rows`: continuous batching on the real offline model (rows, equal memory, flat memory);
* :mod:`~vase.bench.kvpress`: our ``snapkv`` against kvpress's ``DecodingPress(SnapKVPress)``;
* :mod:`~vase.bench.vllm`: vLLM's CPU build against ``run.py`` on the embedded default's samples;
* :mod:`~vase.bench.variants`: ``run.py`` at several revisions / thread counts / settings, side by side;
* :mod:`~vase.bench.runs`: whole processes as runs (threads, wall time, peak RSS) and ``run.py`` run directories;
* :mod:`~vase.bench.sdpa_kernels`: which SDPA kernel each call ran (torch only);
* :mod:`~vase.bench.attention_check`: the engine's attention kernels against the math kernel (``gpu_check.py``; with
  ``attention_bytes``, the modules of this package that reach into the engine's attention);
* :mod:`~vase.bench.attention_bytes`: the K/V bytes each decode step's attention is given against the bytes the rows
  hold (``attention_bytes.py``);
* :mod:`~vase.bench.gpu_rows`: tok/s against rows at equal KV memory, staggered prompts (``gpu_bench_rows.py``);
* :mod:`~vase.bench.smoke`: the first run on a new GPU machine (``gpu_smoke.sh``);
* :mod:`~vase.bench.worker`: ``python -m vase.bench.worker KIND SPEC``, one config in a fresh process; its
  :data:`~vase.bench.worker.WORKERS` table is the one place that names the worker functions (no module imports
  another benchmark to run it).

``shapes``, ``measure``, ``runs`` and ``worker`` import only the standard library and torch at import time (their
model-building functions import the rest when called): the kvpress and vLLM sides import them inside their own virtual
environments, which have neither this project's dependencies nor its transformers version.
"""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
"""The repository root (``conf/policy/*.yaml`` are read from it; the worker processes start there)."""
