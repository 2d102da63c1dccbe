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
buffers are marked as static addresses (:func:`mark_static`) so the captured graph reads and writes them in place
(the layers index their storage inside the graph, so no two mutated inputs alias: ``tests/test_capture.py``);
the token and position inputs are views of preallocated buffers (cudagraph trees copy them into the graph's own
input buffers: a few bytes per step). What capture did per bucket is watched and reported
(:mod:`vase.engine.capture`). A compiled decoder owns dynamo's cache while it decodes (:func:`own_dynamo_cache`);
the drain compiles no tiny bucket (:func:`drain_bucket`). Not run on a GPU yet (``docs/architecture.md``, "CUDA
graphs").

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
import os
import shutil
import weakref
from collections.abc import Callable
from typing import Any

import torch

logger = logging.getLogger(__name__)

COMPILE_SETTINGS = ("auto", "on", "off")
#: ``auto`` on CUDA compiles when a row may decode at least this many tokens (its output cap); not measured on a GPU
#: yet (``docs/architecture.md``). On the CPU ``auto`` never compiles: inductor took 743 s for the four row buckets of
#: a 2-layer tiny model on the shared 2-core machine, which no CPU decode here pays back.
MIN_STEPS = 256


def compile_setting(setting: Any) -> str:
    """``generation.compile`` as one of :data:`COMPILE_SETTINGS` (YAML's ``true`` / ``false`` / ``null``: on / off /
    off); a one-line ``ValueError`` for anything else."""
    if setting is True:
        return "on"
    if setting is False or setting is None:
        return "off"
    if setting not in COMPILE_SETTINGS:
        raise ValueError(f"generation.compile: must be one of {', '.join(COMPILE_SETTINGS)}, got {setting!r}")
    return setting


def compile_choice(setting: Any, device: torch.device, policy, expected_steps: int | None) -> tuple[bool, str]:
    """``(compile?, why)`` for ``generation.compile=setting``; a one-line ``ValueError`` for a bad or impossible one.

    Args:
        setting: ``"auto"``, ``"on"``, ``"off"`` (YAML's ``true`` / ``false`` are taken as on / off).
        device: the model's device.
        policy: the cache policy.
        expected_steps: tokens a row may decode (its output cap), or ``None`` if unknown.

    Every attention backend compiles (FlashAttention-2 through the ``vase::flash_decode`` operator,
    :func:`vase.engine.attention.flash_decode`), so the backend does not enter the rule.
    """
    setting = compile_setting(setting)
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

    ``backend``: ``None`` = inductor (with :func:`compile_mode`; its on-disk cache under the model cache,
    :func:`inductor_cache_dir`); a callable ``backend(gm, example_inputs)`` (tests count the graphs with one).
    The budget is per decoder: :func:`own_dynamo_cache` empties dynamo's cache when another decoder starts.
    """
    limit = buckets + 1
    if torch._dynamo.config.recompile_limit < limit:
        logger.info("torch._dynamo recompile_limit raised to %d (one graph per row bucket)", limit)
        torch._dynamo.config.recompile_limit = limit
    if backend is None:
        inductor_cache_dir()
        return torch.compile(fn, fullgraph=True, dynamic=False, mode=compile_mode(device))
    return torch.compile(fn, fullgraph=True, dynamic=False, backend=backend)


#: the compiled decoder whose graphs dynamo's cache holds (:func:`own_dynamo_cache`)
_owner: weakref.ref | None = None


def own_dynamo_cache(decoder) -> bool:
    """Make ``decoder`` the one compiled decoder dynamo's cache serves: reset dynamo (``torch._dynamo.reset()``, on
    CUDA with its cudagraph trees) when another decoder compiled last. Returns whether it reset.

    Why a reset per decoder and not a larger recompile budget: dynamo caches per *code object*, and every
    :class:`~vase.engine.decode.Decoder` compiles the same method, so its graphs pile up on one cache entry list; each
    decoder guards on its own cache's tensors (static addresses), so no graph of one decoder ever serves another. A
    budget grown with every decoder would keep every dead decoder's graphs, guards (evaluated in order at every
    step) and CUDA-graph memory pools alive for the whole process, and still end at dynamo's global
    ``accumulated_recompile_limit``. One process builds decoders one after another (``batching=per_problem``, an
    in-process sweep), so dropping the previous decoder's graphs costs nothing; the on-disk inductor cache
    (:func:`inductor_cache_dir`) makes a decoder of an already seen geometry load its kernels instead of generating
    them. A decoder used again after another one (interleaved) compiles again, never hits the limit.
    """
    global _owner
    if _owner is not None and _owner() is decoder:
        return False
    reset = _owner is not None
    if reset:
        logger.info("torch._dynamo.reset(): a new compiled decoder (the previous one's graphs are dropped)")
        torch._dynamo.reset()
    _owner = weakref.ref(decoder)
    return reset


def inductor_cache_dir() -> str:
    """Inductor's on-disk cache (generated kernels, FX graphs, AOTAutograd), persistent across runs: the user's
    ``$TORCHINDUCTOR_CACHE_DIR`` if set, else ``<model cache>/inductor`` (``$VASE_CACHE`` or ``~/.cache/vase``, where
    the converted models live; torch's default is a per-user folder under ``/tmp``). Set in the environment, which
    inductor reads at every lookup, before the first compile."""
    from vase.models import cache_dir

    return os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir() / "inductor"))


#: in the drain (nothing left to admit) a smaller row bucket is compiled only if it is at most this fraction of the
#: smallest compiled bucket that holds the live rows (:func:`drain_bucket`)
DRAIN_SHRINK = 4


def drain_bucket(want: int, live: int, compiled: set[int], remaining: int) -> int:
    """The row bucket a decode step covers in the drain (no request pending: the live rows only decrease).

    Args:
        want: the bucket of the live rows (:func:`~vase.engine.cache.row_bucket`).
        live: live rows.
        compiled: the buckets compiled so far.
        remaining: the most tokens a live row may still decode (its output cap minus its tokens: an upper bound).

    ``want`` if it is compiled; else a new compile only when it pays: ``want`` is at most ``1 / DRAIN_SHRINK`` of the
    smallest compiled bucket that holds the live rows and a row may still decode :data:`MIN_STEPS` tokens (``auto``'s
    rule for compiling at all); otherwise that compiled bucket, its extra rows padding. Why: a drain compile serves only
    the last rows' remaining tokens, and walking down every power of two compiles log2(rows) graphs in the tail of
    every run; a padded step reads and computes no more than the steps before it in that bucket did (the padding rows
    are free slots), so the drain is never slower per step than the decode before it, and the padding stays under
    ``DRAIN_SHRINK`` x the live rows.
    """
    holding = [b for b in compiled if b >= live]
    if want in compiled or not holding:
        return want
    smallest = min(holding)
    if want * DRAIN_SHRINK <= smallest and remaining >= MIN_STEPS:
        return want
    return smallest


def mark_static(cache) -> None:
    """Mark every buffer the compiled step reads or writes as a static address (CUDA-graph capture reads them in
    place; call after the first prefill, when the layers' storage exists). On any device: on the CPU nothing is
    captured, but inductor is handed the same ``static_input_idxs`` (``tests/test_capture.py``)."""
    tensors = [cache.lengths_t, cache.pos_t, cache.row_index, cache.held_mask, cache.held_bias, cache.seqlens_t]
    tensors += [cache.write_slot, cache.live_t, cache.ring_slot, cache.ring_mask, cache.ring_bias]
    tensors.append(cache.ring_seqlens)
    if cache.attended is not None:
        tensors.append(cache.attended)
    # the stacked storage: the layers index it inside the graph (vase.engine.layer.storage_view), so their views are
    # never graph inputs
    tensors += cache.storage.tensors()
    if cache.policy.kind == "selection":  # the state select() updates in the forward (made at the first prefill)
        tensors += list(cache.storage.state.store.values())
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
