"""Bytes read per decode step: the K/V bytes the decode attention is given against the bytes the rows hold.

What the attention is given is measured, not computed from the engine's own bookkeeping: :class:`KVBytes` (a
``TorchDispatchMode``) sees every attention kernel a decode forward runs and adds up

* an SDPA kernel's (any of :data:`~vase.engine.attention.SDPA_KERNELS`) ``key`` and ``value`` arguments: every element
  of the views it is handed (a fused kernel may skip masked blocks on some devices, cuDNN and the memory-efficient
  kernel do not: this is what it may read);
* ``vase::flash_decode`` (FlashAttention-2): ``cache_seqlens[r]`` slots of row ``r``'s K and V (its contract; the
  CPU reference reads only those, ``tests/test_attention_bytes.py`` poisons the rest with NaN).

A compiled step is measured inside its graph: :class:`CountingBackend` is a ``torch.compile`` backend that returns
dynamo's traced graph run under the mode (a dispatch mode cannot be active around a compiled call), so what is
measured is the graph inductor would be given, step by step. The bytes held are the live rows' tokens after the
step's append (``VaseCache.lengths`` + 1) times the K and V bytes of one token, on every full-attention layer.

:func:`staggered_decode` is the scenario of the compiled-step tests (``tests/test_compiled.py``): 8 prompts of 9-40
tokens x 2 samples on 5 rows of a tiny Qwen3, EOS ending rows early and new problems taking their slots (continuous
batching, rows of different lengths), sampled at temperature 1; ``scripts/attention_bytes.py`` prints the table.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from vase.engine.attention import SDPA_KERNELS, decompose_composite

#: the operator of the FlashAttention-2 decode (vase.engine.attention.flash_decode)
FLASH_DECODE = "vase::flash_decode"


class KVBytes(TorchDispatchMode):
    """Adds up the K/V bytes every decode attention kernel is given (see the module docstring) in :attr:`given`."""

    def __init__(self) -> None:
        super().__init__()
        self.given = 0
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = decompose_composite(self, func, args, kwargs)
        if out is not NotImplemented:
            return out
        if func.overloadpacket.__name__ in SDPA_KERNELS:
            key, value = args[1], args[2]
            self.given += key.numel() * key.element_size() + value.numel() * value.element_size()
            self.calls += 1
        elif func.name() == FLASH_DECODE:
            k_cache, seqlens = args[1], args[3]  # (b, S, H, D), (b,)
            per_slot = k_cache.shape[2] * k_cache.shape[3] * k_cache.element_size()
            self.given += 2 * int(seqlens.sum()) * per_slot
            self.calls += 1
        return func(*args, **kwargs)


class CountingBackend:
    """A ``torch.compile`` backend: records each graph dynamo traces and runs it (its ``forward``, no code generator)
    under ``mode`` when one is set."""

    def __init__(self) -> None:
        self.graphs: list[torch.fx.GraphModule] = []
        self.mode: KVBytes | None = None

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        self.graphs.append(gm)

        def run(*args):
            if self.mode is None:
                return gm.forward(*args)
            with self.mode:
                return gm.forward(*args)

        return run


@dataclass
class StepBytes:
    """One decode step: live rows, the rows and key slots the attention spanned, bytes given and held."""

    live: int
    rows: int
    key_slots: int
    longest: int
    given: int
    held: int


@dataclass
class BytesReport:
    """The steps of one decode (:func:`staggered_decode`)."""

    policy: str
    compiled: bool
    capacity: int
    rows: int
    key_buckets: tuple[int, ...]
    graphs: int
    steps: list[StepBytes] = field(default_factory=list)
    tokens: dict = field(default_factory=dict)
    token_bytes: int = 0  # K + V bytes of one token, summed over the full-attention layers

    def ratio(self, steady: bool = False) -> float:
        """Bytes given / bytes held over the decode's steps (``steady``: only those with every row live)."""
        steps = [s for s in self.steps if s.live == self.rows] if steady else self.steps
        return sum(s.given for s in steps) / sum(s.held for s in steps)

    def ratio_to_longest(self, steady: bool = False) -> float:
        """Bytes given / (live rows x the longest row's tokens): what the key bucket and the row bucket add over a
        dense kernel that pads every row to the longest (no design over padded SDPA reads less than 1.0 of it)."""
        steps = [s for s in self.steps if s.live == self.rows] if steady else self.steps
        return sum(s.given for s in steps) / sum(s.live * s.longest * self.token_bytes for s in steps)


def staggered_decode(
    model, policy, name: str, *, compiled: bool, rows: int = 5, max_new: int = 160, attn_backend: str = "sdpa"
) -> BytesReport:
    """The staggered continuous-batching decode (module docstring), measured step by step."""
    from vase.engine import Decoder, Request, SamplingConfig, sample_seeds
    from vase.engine.cache import cache_capacity

    g = torch.Generator().manual_seed(5)
    lengths = (11, 27, 19, 40, 9, 33, 14, 22)
    prompts = [torch.randint(0, model.config.vocab_size, (n,), generator=g) for n in lengths]
    reqs = [Request(p, sample_seeds(100 + i, 2), key=i) for i, p in enumerate(prompts)]
    cap = max(cache_capacity(policy, len(r.prompt_ids), max_new) for r in reqs)
    backend = CountingBackend() if compiled else None
    if compiled:
        torch._dynamo.reset()
    dec = Decoder(
        model,
        policy,
        rows=rows,
        capacity=cap,
        sampling=SamplingConfig(temperature=1.0, top_p=0.95, top_k=50),
        max_new_tokens=max_new,
        eos_token_ids=range(0, 2),
        attn_backend=attn_backend,
        compile="on" if compiled else "off",
        compile_backend=backend,
    )
    token_bytes = dec.geometry.bytes_per_token
    report = BytesReport(name, compiled, cap, rows, dec.key_buckets(), 0, token_bytes=token_bytes)
    forward = dec._forward  # measured around each decode forward (the decoder's own callable, wrapped here only)

    def measured(input_ids, position_ids):
        cache = dec.cache
        live = cache.n_live
        held_tokens = sum(cache.lengths[:live]) + live  # after this step's append
        mode = KVBytes()
        if backend is not None:
            backend.mode = mode
            out = forward(input_ids, position_ids)
            backend.mode = None
        else:
            with mode:
                out = forward(input_ids, position_ids)
        longest = cache.max_length_after_append
        report.steps.append(
            StepBytes(live, cache.step_rows, cache.step_length, longest, mode.given, held_tokens * token_bytes)
        )
        return out

    dec._forward = measured
    report.tokens = {(f.key, f.sample): f.tokens for f in dec.run(reqs)}
    report.graphs = len(backend.graphs) if backend is not None else 0
    return report
