"""The compiled decode step: ``generation.compile=auto|off|on``.

The decode forward (:meth:`vase.engine.decode.Decoder._decode_forward`) reads only tensors of fixed shape and storage
(the static cache's views over a key-length bucket, :func:`~vase.engine.cache.key_buckets`, the row masks rebuilt in
place by :meth:`~vase.engine.cache.VaseCache.prepare_step`, the token / position buffers) and run-constant host state;
its shapes that change are the number of rows it covers, which a compiled decoder rounds up to a power of two
(:func:`~vase.engine.cache.row_bucket`; the padding rows are free slots whose writes are masked out and whose logits are
dropped), and the key length of its K/V views (the smallest of at most 8 key buckets that holds the longest row, chosen
on the host). So ``torch.compile(fullgraph=True, dynamic=False)`` traces it once per (row bucket, key bucket) it meets
and never again. FlashAttention-2 runs inside the graph through the ``vase::flash_decode`` custom operator (it reads
each row's held slots of the whole storage: one key bucket, the capacity, without a selection). The token sampling is
part of the compiled forward (its counter-based hash fuses into a few kernels); the prefill and the eviction stay eager
(they run between forwards).

On CUDA the compile mode is ``"reduce-overhead"`` (CUDA-graph capture by torch's cudagraph trees): the cache's
buffers are marked as static addresses (:func:`mark_static`) so the captured graph reads and writes them in place;
the token and position inputs are views of preallocated buffers (cudagraph trees copy them into the graph's own
input buffers: a few bytes per step). Not run on a GPU yet (``docs/architecture.md``).

Selection policies (Quest, SeerAttention-R) are compiled too: their per-row state is made at each row's prefill,
eagerly (:meth:`~vase.engine.policy.SelectionPolicy.init_state`), and lives in the state store (static addresses);
inside the forward one ``select`` call per layer covers every row of the step over the span of the views, reading the
rows' lengths on the device only (:meth:`~vase.engine.layer.VaseLayer.selection_mask`).

``auto`` (:func:`compile_choice`) decides per decoder, in one log line: off on the CPU
(inductor's compile time there, :data:`MIN_STEPS`; ``on`` compiles, and needs a C++ compiler), off on CUDA when a
row's output cap is too short to amortise the compile, on otherwise.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable
from typing import Any

import torch

logger = logging.getLogger(__name__)

COMPILE_SETTINGS = ("auto", "on", "off")
#: ``auto`` on CUDA compiles when a row may decode at least this many tokens (its output cap); not measured on a GPU
#: yet (``docs/architecture.md``). On the CPU ``auto`` never compiles: inductor took 743 s for the four row buckets of
#: a 2-layer tiny model on the shared 2-core machine, which no CPU decode here pays back.
MIN_STEPS = 256


def compile_choice(
    setting: Any, device: torch.device, policy, expected_steps: int | None, attn_backend: str = "auto"
) -> tuple[bool, str]:
    """``(compile?, why)`` for ``generation.compile=setting``; a one-line ``ValueError`` for a bad or impossible one.

    Args:
        setting: ``"auto"``, ``"on"``, ``"off"`` (YAML's ``true`` / ``false`` are taken as on / off).
        device: the model's device.
        policy: the cache policy.
        expected_steps: tokens a row may decode (its output cap), or ``None`` if unknown.
        attn_backend: ``generation.attn_backend`` (unused by the rule: every backend compiles, FlashAttention-2
            through the ``vase::flash_decode`` operator, :func:`vase.engine.attention.flash_decode`).
    """
    if setting is True:
        setting = "on"
    elif setting is False or setting is None:
        setting = "off"
    if setting not in COMPILE_SETTINGS:
        raise ValueError(f"generation.compile: must be one of {', '.join(COMPILE_SETTINGS)}, got {setting!r}")
    if setting == "off":
        return False, "off: set explicitly"
    if device.type == "cpu" and not cxx_compiler():
        why = "no C++ compiler on PATH (inductor needs one on the CPU)"
        if setting == "on":
            raise ValueError(f"generation.compile=on: {why}; install g++ or use generation.compile=auto or off")
        return False, f"auto: off, {why}"
    if setting == "on":
        return True, "on: set explicitly"
    if device.type != "cuda":
        return False, f"auto: off on {device.type} (inductor's compile costs minutes per row bucket there)"
    if expected_steps is not None and expected_steps < MIN_STEPS:
        return False, f"auto: off, {expected_steps} tokens per row cannot amortise the compile (< {MIN_STEPS})"
    return True, f"auto: on (CUDA, {expected_steps} tokens per row >= {MIN_STEPS})"


def cxx_compiler() -> str | None:
    """The C++ compiler inductor would use on the CPU (``$CXX``, ``g++``, ``clang++``, ``c++``), or ``None``."""
    import os

    for name in (os.environ.get("CXX"), "g++", "clang++", "c++"):
        if name and shutil.which(name):
            return name
    return None


def compile_mode(device: torch.device) -> str | None:
    """The ``torch.compile`` mode: ``"reduce-overhead"`` (CUDA graphs) on CUDA, the default elsewhere."""
    return "reduce-overhead" if device.type == "cuda" else None


def compile_forward(
    fn: Callable, device: torch.device, buckets: int, backend: str | Callable | None = None
) -> Callable:
    """``torch.compile(fn, fullgraph=True, dynamic=False)`` with room for one graph per row bucket.

    ``backend``: ``None`` = inductor (with :func:`compile_mode`); a callable ``backend(gm, example_inputs)`` (tests
    count the graphs with one).
    """
    limit = buckets + 1
    if torch._dynamo.config.recompile_limit < limit:
        logger.info("torch._dynamo recompile_limit raised to %d (one graph per row bucket)", limit)
        torch._dynamo.config.recompile_limit = limit
    if backend is None:
        return torch.compile(fn, fullgraph=True, dynamic=False, mode=compile_mode(device))
    return torch.compile(fn, fullgraph=True, dynamic=False, backend=backend)


def mark_static(cache) -> None:
    """Mark every buffer the compiled step reads or writes as a static address (CUDA-graph capture reads them in
    place; call after the first prefill, when the layers' storage exists)."""
    tensors = [cache.lengths_t, cache.pos_t, cache.row_index, cache.held_mask, cache._bias_buf, cache.seqlens_t]
    tensors += [cache.write_slot, cache.live_t, cache.ring_slot, cache.ring_mask, cache._ring_bias_buf]
    tensors.append(cache.ring_seqlens)
    if cache.attended is not None:
        tensors.append(cache.attended)
    tensors += cache.storage.tensors()  # the stacked storage and every layer's views of it
    if cache.policy.kind == "selection":  # the state select() updates in the forward (made at the first prefill)
        tensors += list(cache.storage.state.store.values())
    for layer in cache.attention_layers:
        tensors += [t for t in (layer.keys, layer.values, layer.positions, layer.queries) if t is not None]
    tensors += [t for layer in cache.layers for t in _linear_views(layer)]
    for t in tensors:
        torch._dynamo.mark_static_address(t)


def static_inputs(cache) -> dict[str, int]:
    """``{name: data_ptr}`` of every buffer the decode forward reads or writes (tests: the addresses never change)."""
    out = {
        "lengths_t": cache.lengths_t.data_ptr(),
        "pos_t": cache.pos_t.data_ptr(),
        "held_mask": cache.held_mask.data_ptr(),
        "held_bias": cache.held_bias.data_ptr(),
        "seqlens_t": cache.seqlens_t.data_ptr(),
        "write_slot": cache.write_slot.data_ptr(),
        "live_t": cache.live_t.data_ptr(),
        "ring_slot": cache.ring_slot.data_ptr(),
        "ring_mask": cache.ring_mask.data_ptr(),
    }
    if cache.policy.kind == "selection":
        for key, t in cache.storage.state.store.items():
            out[f"state.{key}"] = t.data_ptr()
    for layer in cache.attention_layers:
        for name in ("keys", "values", "positions", "queries"):
            t = getattr(layer, name, None)
            if isinstance(t, torch.Tensor):
                out[f"layer{layer.layer_idx}.{name}"] = t.data_ptr()
    for layer in cache.layers:
        for name, t in zip(("conv", "recurrent"), _linear_views(layer)):
            out[f"linear{layer.layer_idx}.{name}"] = t.data_ptr()
    return out


def _linear_views(layer) -> list[torch.Tensor]:
    """A hybrid model's linear-attention layer's views of its states (``[]`` for a KV layer)."""
    return [t for t in (getattr(layer, "conv", None), getattr(layer, "recurrent", None)) if t is not None]
