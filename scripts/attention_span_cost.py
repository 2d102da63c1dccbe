"""What reading the whole capacity costs the decode attention: ``decode_attention`` over views of 1,024 / 2,048 /
4,096 slots at Qwen3-4B's head shapes (16 rows, 8 KV heads, 4 query heads per group, head_dim 128), float32, one
thread, each row masked to half the span (docs/architecture.md, "Static decode shapes and the compiled step").

    OMP_NUM_THREADS=1 python scripts/attention_span_cost.py
"""

from __future__ import annotations

import argparse
import time

import torch

from vase.engine.attention import additive_mask, decode_attention


def span_ms(store_k: torch.Tensor, store_v: torch.Tensor, q: torch.Tensor, length: int, repeats: int = 20) -> float:
    """Mean milliseconds of one decode attention over the first ``length`` slots of the storage."""
    n, d = store_k.shape[0], store_k.shape[-1]
    k, v = store_k[:, :, :length], store_v[:, :, :length]
    held = torch.arange(length)[None] < torch.full((n, 1), length // 2 + 1)
    bias = additive_mask(held[:, None, :], torch.float32)
    decode_attention(q, k, v, d**-0.5, bias)
    t0 = time.perf_counter()
    for _ in range(repeats):
        decode_attention(q, k, v, d**-0.5, bias)
    return (time.perf_counter() - t0) / repeats * 1e3


def main() -> None:
    argparse.ArgumentParser(description=__doc__.split("\n")[0]).parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    n, h, g, d, cap = 16, 8, 4, 128, 4096
    store_k, store_v = torch.randn(n, h, cap, d), torch.randn(n, h, cap, d)
    q = torch.randn(n, h * g, 1, d)
    for length in (1024, 2048, 4096):
        print(f"{length} slots: {span_ms(store_k, store_v, q, length):.1f} ms")


if __name__ == "__main__":
    from vase.run.oneline import script_main

    script_main(main)
