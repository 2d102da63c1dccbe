"""The static-budget KV cache: the only code in the project that touches transformers' cache internals.

One :class:`VaseCache` serves a whole decode (many problems, continuous batching). It preallocates, once, K and V
storage for every layer in one tensor per kind (:class:`~vase.engine.storage.CacheStorage`) of shape
``(rows, layers, num_key_value_heads, capacity, head_dim)`` (never repeated per query head), zero filled, with

* ``capacity = min(P + max_new_tokens, max(P, budget) + E)`` for eviction policies (``E`` the eviction period,
  ``window`` by default; ``max(P, budget + E)`` with ``compress_prefill``),
* ``capacity = P + max_new_tokens`` for the full cache and selection policies,

where ``P`` is the longest prompt the cache will hold (:func:`cache_capacity`). Beside it: the absolute position of
every held token ``(rows, layers, H, capacity)`` and, only for policies that declare ``needs_queries``, a ring buffer
of the last ``window`` post-RoPE queries of every row ``(rows, layers, Hq, window, head_dim)`` (a query of position
``p`` sits in slot ``p % window``). Layer ``l``'s :class:`~vase.engine.layer.VaseLayer` (transformers'
``CacheLayerMixin``) works on the views ``[:, l]`` (``(rows, H, capacity, D)``): the append and the attention are
per layer, an eviction is one event for all layers (:mod:`vase.engine.evict`).

Layer types (``geometry.layer_types``). The stacked storage above holds the full-attention layers only: they are
what the policy's budget, the eviction event and a selection apply to. A sliding-window layer (gpt-oss, OLMo-3, a
Qwen config with ``use_sliding_window``) holds a static ring of the model's window per row (``storage.ring_*``, the
token of position ``p`` in slot ``p % window``, its true position recorded), masked at each decode step to its valid
slots (:attr:`VaseCache.ring_mask`, the positions ``> current - window``), moved and cleared with its row and never
scored, evicted or selected in.

Rows. Row ``r`` is a slot of the storage; rows ``[0, n_live)`` are live and decode together (the decode loop keeps
them contiguous: a finished row's slot is given to the next pending sample, or the last live row moves into it). Each
row has its own held length, next absolute position, eviction key (its random stream, :mod:`vase.engine.rng`) and
policy state; its length is known on the host (so deciding to evict never synchronises with the device) and mirrored
in a device tensor (for attention masks and FlashAttention's ``cache_seqlens``). A prompt is prefilled once (batch 1)
into the rows of its samples.

No host synchronisation while decoding: the row indices a step needs (the rows that evict together, a prompt's rows)
are built once per step from the host's lists (:meth:`VaseCache.index`: a slice for a contiguous run, else one
upload from pinned memory with ``non_blocking=True``), the masks on the device, and eviction time is measured with
CUDA events read at the next token sync (on CPU, where timing is free, with the wall clock).

The eviction scaffold (``../shared/docs/method.md`` §2), per row: after a decode step, when a row holds more than
``budget`` tokens and its count is a multiple of ``window``, its candidates are all held tokens but the ``window`` most
recent; the policy picks ``budget - window`` of them per KV head; the engine gathers them to the front of the row's
storage and moves the recent window behind them, in place. Rows that evict at the same step with the same held length
(and the same kind of policy state) are one event: every layer of them is handed to the policy in one call, the
layer axis folded into the row axis (:mod:`vase.engine.evict`: one scoring, top-k, gather and random draw per event).

Policy-declared variants of the scaffold (:class:`~vase.engine.policy.EvictionPolicy`):

* ``evict_every = E``: the trigger is "held > budget and the row's sequence length (prompt + generated, its next
  position) is a multiple of ``E``". With ``E = window`` (the default) this is the scaffold above: every eviction
  removes a multiple of ``window`` tokens (``budget`` is one), so the held count and the sequence length agree modulo
  ``window``. R-KV's original sets ``E = 128`` (its buffer).
* ``compress_prefill``: a prompt longer than ``budget`` is evicted down to ``budget`` right after its prefill (its
  rows' queries in the ring are the prompt's last ``window``); the prefill itself attended to the whole prompt.
* ``keep_prompt``: row ``r``'s prompt (``prompt_lens[r]`` tokens) stays in slots ``[0, P)``; the candidates are
  ``[P, held - window)``, of which the policy keeps ``budget - window - P``. Rows evict together only with the same
  held length and the same prompt length.

Long module: the cache's rows, its per-step masks (full and sliding-window layers) and the eviction trigger share
one state and are read together.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from transformers.cache_utils import Cache

from vase.engine.attention import MASK_ALIGN, additive_mask
from vase.engine.evict import evict_rows
from vase.engine.geometry import CacheGeometry, LayerCounters, aux_bytes_per_row, cache_capacity, span_of
from vase.engine.layer import VaseLayer
from vase.engine.linear_state import LINEAR, LinearStates, interleave
from vase.engine.policy import Policy
from vase.engine.rng import EVICT_SALT, row_keys
from vase.engine.storage import CacheStorage

logger = logging.getLogger(__name__)

__all__ = [
    "CacheGeometry",
    "VaseCache",
    "VaseLayer",
    "aux_bytes_per_row",
    "cache_capacity",
    "key_buckets",
    "length_bucket",
    "row_bucket",
    "row_buckets",
    "to_device",
]


@functools.cache
def _can_pin() -> bool:
    return torch.cuda.is_available()


def to_device(values: Sequence, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """``values`` (host numbers) as a tensor on ``device`` without blocking the host.

    On CUDA the host copy is allocated in pinned memory (torch's caching host allocator, which keeps the block until
    the copy has run) and copied with ``non_blocking=True``: the copy is queued on the stream, the host goes on. A
    pageable ``torch.tensor(values, device="cuda")`` would wait for the stream to drain first.
    """
    if device.type == "cpu":
        return torch.tensor(values, dtype=dtype)
    host = torch.tensor(values, dtype=dtype, pin_memory=_can_pin())
    return host.to(device, non_blocking=True)


def row_bucket(n: int, rows: int) -> int:
    """The rows a bucketed decode forward covers for ``n`` live rows: the next power of two, at most ``rows``."""
    return min(rows, 1 << max(0, n - 1).bit_length())


#: key-length buckets: each is at most this many times the next smaller one, so a step whose longest row is above the
#: smallest bucket gives the attention at most 1.25x the slots of that row (docs/architecture.md, "Bytes read per step")
KEY_BUCKET_RATIO = 1.25
#: at most this many key-length buckets per capacity (the smallest is about ``capacity * 0.8**7``, 21% of it): the
#: compiled step has at most ``len(row_buckets) * KEY_BUCKETS`` graphs
KEY_BUCKETS = 8
#: every key-length bucket below the capacity is a multiple of this (the mask's row stride stays its buffer's, padded
#: to MASK_ALIGN, whatever the span)
KEY_BUCKET_ALIGN = 8


@functools.cache
def key_buckets(capacity: int) -> tuple[int, ...]:
    """The key lengths a decode step's K/V views may span for a cache of ``capacity`` slots, ascending.

    ``b_0 = capacity``, ``b_{k+1} = ceil(b_k / KEY_BUCKET_RATIO)`` rounded up to :data:`KEY_BUCKET_ALIGN`, at most
    :data:`KEY_BUCKETS` of them: ``b_k / b_{k+1} <= KEY_BUCKET_RATIO`` for every pair.
    """
    if capacity < 1:
        raise ValueError(f"key_buckets: capacity must be >= 1, got {capacity}")
    out = [capacity]
    while len(out) < KEY_BUCKETS:
        nxt = -(-math.ceil(out[-1] / KEY_BUCKET_RATIO) // KEY_BUCKET_ALIGN) * KEY_BUCKET_ALIGN
        if nxt >= out[-1]:
            break
        out.append(nxt)
    return tuple(reversed(out))


def length_bucket(length: int, capacity: int) -> int:
    """The slots a decode step's K/V views span: the smallest of :func:`key_buckets` ``(capacity)`` that holds
    ``length`` (the longest row after the step's append, known on the host: no sync)."""
    for b in key_buckets(capacity):
        if b >= length:
            return b
    raise RuntimeError(f"length_bucket: {length} slots exceed the capacity {capacity}")


def row_buckets(rows: int) -> list[int]:
    """Every bucket :func:`row_bucket` can return for a cache of ``rows`` rows (powers of two, then ``rows``)."""
    return sorted({row_bucket(n, rows) for n in range(1, rows + 1)})


class EvictionClock:
    """Seconds spent evicting, without synchronising the device.

    CPU: wall clock around the work (CPU ops run synchronously, so it is exact). CUDA: a pair of CUDA events around
    the queued work; the intervals are read (``elapsed_time``) by :meth:`resolve`, which the decoder calls right after
    a token sync, when every recorded event has completed. Until then their seconds are pending.
    """

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda" and _can_pin()  # a fake CUDA device (tests, CPU build): the wall clock
        self.pending: list[tuple[Any, Any, Callable[[float], None]]] = []

    def start(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def stop(self, start: Any, sink: Callable[[float], None]) -> None:
        """End the interval begun by :meth:`start`; ``sink(seconds)`` is called now (CPU) or by :meth:`resolve`."""
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.pending.append((start, end, sink))
        else:
            sink(time.perf_counter() - start)

    def resolve(self) -> None:
        """Read the finished CUDA intervals (call after a host sync; an unfinished one waits for its end event)."""
        pending, self.pending = self.pending, []
        for start, end, sink in pending:
            end.synchronize()
            sink(start.elapsed_time(end) / 1000.0)


class VaseCache(Cache):
    """The static cache handed to the model as ``cache=`` (and as ``vase_cache=`` to the attention function).

    Args:
        geometry: static shapes (see :class:`CacheGeometry`); ``geometry.rows`` rows are allocated once.
        policy: the eviction / selection policy.
        scaling: the model's attention softmax scale.
        attn_backend: ``"sdpa"``, ``"eager"`` or ``"flash_attn"`` (see :func:`vase.engine.attention.resolve_backend`).
        check_policy_output: validate every ``keep()`` answer (shape, range, uniqueness); costs a sync per eviction.
        score_dtype: handed to eviction policies as ``EvictionInputs.score_dtype`` (their score math's dtype).

    The decode loop drives it: :meth:`begin_prefill` / :meth:`end_prefill` around a prompt's forward, :meth:`advance`
    after each decode forward, :meth:`evict_due`, :meth:`move_row` / :meth:`release` when rows finish.
    """

    def __init__(
        self,
        geometry: CacheGeometry,
        policy: Policy,
        scaling: float,
        attn_backend: str = "sdpa",
        check_policy_output: bool = False,
        score_dtype: torch.dtype = torch.float32,
    ):
        self.geometry = geometry
        self.policy = policy
        self.scaling = scaling
        self.attn_backend = attn_backend
        self.check_policy_output = check_policy_output
        self.score_dtype = score_dtype
        rows, device = geometry.rows, geometry.device
        self.n_live = 0
        self.lengths = [0] * rows  # held tokens per row (host); every layer holds the same count
        self.next_pos = [0] * rows  # absolute position of each row's next token (true positions)
        self.prompt_lens = [0] * rows  # prompt tokens of each row (pinned in its first slots with keep_prompt)
        self.lengths_t = torch.zeros(rows, dtype=torch.long, device=device)
        self.pos_t = torch.zeros(rows, dtype=torch.long, device=device)
        self.row_index = torch.arange(rows, device=device)
        self.evict_key = torch.zeros((rows, 2), dtype=torch.long, device=device)  # (rows, 2) eviction RNG keys
        self.device = torch.device(device)
        self.clock = EvictionClock(self.device)
        self.row_ids: list[Any] = [None] * rows  # the caller's id of each row (e.g. (problem, sample))
        self.row_evictions = [0] * rows  # eviction calls of the row, summed over layers
        self.row_eviction_seconds = [0.0] * rows
        # selection policies: tokens attended (per KV head) summed over steps and layers
        self.attended = torch.zeros(rows, dtype=torch.float64, device=device) if policy.kind == "selection" else None
        self.prefilling: list[int] | None = None  # rows being admitted by the current forward
        self.max_length_after_append = 0
        # Static decode shapes (docs/architecture.md, "Static decode shapes"): a decode forward covers rows
        # [0, step_rows) (the live rows, or with ``bucketed`` the power-of-two bucket above them; the padding rows are
        # free slots whose writes are masked out) and every layer's K/V views span the whole capacity. The row masks
        # and FlashAttention's lengths are rebuilt in place in these buffers by prepare_step, outside the forward.
        self.step_rows = 0
        self.step_length = 0  # the slots every row's K/V view spans this step (step_span: a key-length bucket)
        self.bucketed = False
        self.stepping = False  # between prepare_step and advance
        cap = geometry.capacity
        self._slots = torch.arange(cap, device=device)
        self.held_mask = torch.zeros((rows, cap), dtype=torch.bool, device=device)  # slot j holds a token of row r
        padded = -(-cap // MASK_ALIGN) * MASK_ALIGN
        self._bias_buf = torch.zeros((rows, 1, 1, padded), dtype=geometry.dtype, device=device)
        self.held_bias = self._bias_buf[..., :cap]  # held_mask as 0 / -inf in the storage dtype
        self.seqlens_t = torch.zeros(rows, dtype=torch.int32, device=device)
        self.write_slot = torch.zeros(rows, dtype=torch.long, device=device)  # bucketed: where each row's token goes
        self.live_t = torch.zeros(rows, dtype=torch.bool, device=device)  # bucketed: the row is live (not padding)
        self._index: dict[tuple[int, ...], torch.Tensor] = {}  # this step's row index tensors (see index())
        self.on_evict = None  # optional callback(layer, row_ids, keep_idx, kept_positions) for analyses
        full, sliding = geometry.full_layers, geometry.layers_of("sliding_attention")
        n_layers = len(full)  # the layers of the stacked storage (the ones the policy sees)
        window = policy.window if policy.needs_queries else None
        ring = geometry.sliding_window or 0
        self.storage = CacheStorage(
            rows,
            n_layers,
            geometry.num_kv_heads,
            geometry.num_q_heads,
            cap,
            geometry.head_dim,
            window,
            ring_layers=len(sliding),
            ring_slots=ring,
        )
        # an eviction event's folded rows (row-major: folded row i is row i // L on full layer i % L), built once
        self.fold_row_ids = torch.arange(rows * n_layers, device=device)  # (rows * L,) slot * L + layer
        self.fold_local_ids = self.fold_row_ids % max(n_layers, 1)  # (rows * L,) the storage layer of each
        full_t = torch.tensor(full or [0], dtype=torch.long, device=device)
        self.fold_layer_ids = full_t[self.fold_local_ids]  # (rows * L,) the model's layer index of each
        # sliding layers: each row's ring slot this step (position % window), its valid slots, as mask and bias
        self._ring_slots = torch.arange(ring, device=device)
        self.ring_slot = torch.zeros(rows, dtype=torch.long, device=device)
        self.ring_mask = torch.zeros((rows, ring), dtype=torch.bool, device=device)
        ring_padded = -(-ring // MASK_ALIGN) * MASK_ALIGN
        self._ring_bias_buf = torch.zeros((rows, 1, 1, ring_padded), dtype=geometry.dtype, device=device)
        self.ring_bias = self._ring_bias_buf[..., :ring]  # ring_mask as 0 / -inf in the storage dtype
        self.ring_seqlens = torch.zeros(rows, dtype=torch.int32, device=device)
        kinds = geometry.types
        store_idx = {i: j for j, i in enumerate(full)} | {i: j for j, i in enumerate(sliding)}
        # the layers holding K and V (full and sliding), by the model's layer index
        self.attention_layers = [
            VaseLayer(i, self, kinds[i], store_idx[i]) for i in range(geometry.num_layers) if kinds[i] != LINEAR
        ]
        # a hybrid model's linear-attention layers: their states, allocated once, move and clear with the storage's
        # rows (vase.engine.linear_state); ``layers`` is every layer in the model's order
        if geometry.linear is not None:
            self.storage.linear = LinearStates(geometry.linear, rows, geometry.dtype, self.device)
        super().__init__(layers=interleave(self.attention_layers, self, self.storage.linear, kinds))
        self.evicting_layers = [self.layers[i] for i in full]  # what an eviction event counts and hands back

    # ---- admission and decode steps ----------------------------------------------------------------------------
    def index(self, slots: Sequence[int]) -> slice | torch.Tensor:
        """Rows ``slots`` as an index: a slice for a contiguous run, else a device tensor built once per step.

        Every layer asks for the same groups of rows (an eviction event, a selection, a prompt's rows): the tensor is
        uploaded once (:func:`to_device`, never blocking) and reused until the next step.
        """
        span = span_of(slots)
        if span is not None:
            return span
        key = tuple(slots)
        idx = self._index.get(key)
        if idx is None:
            idx = self._index[key] = to_device(key, self.device)
        return idx

    def begin_prefill(self, slots: Sequence[int], seeds: Sequence[int], row_ids: Sequence) -> None:
        """The next forward is the prompt of new rows ``slots`` (free slots); ``seeds``: the rows' sample seeds (their
        eviction keys derive from them, :func:`vase.engine.rng.row_key`)."""
        self._index = {}
        self.clock.resolve()  # credit pending seconds before the slots change hands
        for r, rid in zip(slots, row_ids, strict=True):
            self.row_ids[r] = rid
            self.row_evictions[r] = 0
            self.row_eviction_seconds[r] = 0.0
            self.storage.clear_row(r)
        idx = self.index(slots)
        self.evict_key[idx] = to_device(row_keys(seeds, EVICT_SALT), self.device)
        if self.attended is not None:
            self.attended[idx] = 0
        self.prefilling = list(slots)

    def end_prefill(self, prompt_len: int) -> None:
        """The prompt's forward is done: its rows hold ``prompt_len`` tokens (``budget`` if the policy compresses a
        longer prompt at the prefill)."""
        slots = self.prefilling
        for r in slots:
            self.lengths[r] = prompt_len
            self.next_pos[r] = prompt_len
            self.prompt_lens[r] = prompt_len
        idx = self.index(slots)
        self.lengths_t[idx] = prompt_len
        self.pos_t[idx] = prompt_len
        self.prefilling = None
        p = self.policy
        if p.kind == "eviction" and p.compress_prefill and prompt_len > p.budget:
            self._evict(slots)
        if p.kind == "selection":  # the rows' selection state from the prompt, here and not in a decode forward
            for layer in self.evicting_layers:  # selection applies to full-attention layers only
                layer.init_selection_state(slots, prompt_len)

    def prepare_step(self, n_live: int, bucket: int | None = None) -> None:
        """Before a decode forward over rows ``[0, n_live)``: one token is appended to each.

        Sets :attr:`step_rows` (``n_live``, or with :attr:`bucketed` ``bucket``, by default its
        :func:`row_bucket`) and rebuilds, in place and on the
        device, what the forward reads of the rows' lengths: :attr:`held_mask` / :attr:`held_bias` (always built,
        every row masked to its own tokens), :attr:`seqlens_t` (FlashAttention) and, bucketed, :attr:`write_slot` /
        :attr:`live_t`. The forward itself then reads no per-row host state (its shapes depend on ``step_rows`` only).
        """
        if n_live > self.geometry.rows:
            raise RuntimeError(f"{n_live} live rows for a cache of {self.geometry.rows}")
        self.n_live = n_live
        self.max_length_after_append = max(self.lengths[:n_live]) + 1
        if self.max_length_after_append > self.geometry.capacity:
            raise RuntimeError(
                f"cache capacity {self.geometry.capacity} exceeded (a row would hold {self.max_length_after_append}); "
                "this is an engine bug: the eviction trigger should have fired"
            )
        b = (bucket or row_bucket(n_live, self.geometry.rows)) if self.bucketed else n_live
        if not n_live <= b <= self.geometry.rows:
            raise RuntimeError(f"a decode step's bucket of {b} rows for {n_live} live rows of {self.geometry.rows}")
        self.step_rows = b
        self.step_length = self.step_span(self.max_length_after_append)
        self.stepping = True
        for layer in self.attention_layers:
            layer.counters.held = self.max_length_after_append
            if layer.is_sliding:
                layer.counters.held = min(layer.counters.held, layer.window)
        lengths = self.lengths_t[:b]  # the count before this step's append; padding rows: a free slot's stale count
        torch.le(self._slots[None, :], lengths[:, None], out=self.held_mask[:b])
        if self.attn_backend != "eager":
            self.held_bias[:b, 0, 0].copy_(torch.where(self.held_mask[:b], 0.0, float("-inf")))
        if self.attn_backend == "flash_attn":
            self.seqlens_t[:b].copy_(torch.clamp(lengths + 1, max=self.geometry.capacity))
        if self.bucketed:
            torch.clamp(lengths, max=self.geometry.capacity - 1, out=self.write_slot[:b])
            torch.lt(self.row_index[:b], n_live, out=self.live_t[:b])
        if self.storage.ring_layers:  # the new token's ring slot; the valid slots after its write: s <= position
            pos = self.pos_t[:b]
            torch.remainder(pos, self.geometry.sliding_window, out=self.ring_slot[:b])
            torch.le(self._ring_slots[None, :], pos[:, None], out=self.ring_mask[:b])
            if self.attn_backend != "eager":
                self.ring_bias[:b, 0, 0].copy_(torch.where(self.ring_mask[:b], 0.0, float("-inf")))
            if self.attn_backend == "flash_attn":
                self.ring_seqlens[:b].copy_(torch.clamp(pos + 1, max=self.geometry.sliding_window))
        self._index = {}

    def step_span(self, longest: int) -> int:
        """The slots a decode step's K/V views span when its longest row holds ``longest`` tokens after the append:
        :func:`length_bucket` (eager and compiled alike; compiled, one graph per row bucket and key bucket), or the
        capacity when every layer's decode attention is FlashAttention-2 (it reads each row's ``cache_seqlens`` slots
        from the whole storage, so a bucket would only add graphs): flash_attn without a selection policy."""
        if self.attn_backend == "flash_attn" and self.policy.kind != "selection":
            return self.geometry.capacity
        return length_bucket(longest, self.geometry.capacity)

    def seqlens_i32(self) -> torch.Tensor:
        """``(step_rows,)`` int32 tokens each row holds after this step's append (FlashAttention's cache_seqlens)."""
        return self.seqlens_t[: self.step_rows]

    def advance(self) -> None:
        """After a decode forward: every live row holds one more token and moves one position on."""
        n = self.n_live
        for r in range(n):
            self.lengths[r] += 1
            self.next_pos[r] += 1
        self.lengths_t[:n] += 1
        self.pos_t[:n] += 1
        self.stepping = False

    def length_mask(self, n: int, length: int) -> torch.Tensor:
        """``(n, length)`` bool: slot ``j`` of row ``r`` holds a token of the row (``j < lengths[r]`` after the append).

        A view of :attr:`held_mask`, built once per decode step by :meth:`prepare_step` (always, even when every row
        holds ``length`` tokens: the step's graph does not depend on whether the rows are in step).
        """
        return self.held_mask[:n, :length]

    def length_bias(self, n: int, length: int, dtype: torch.dtype) -> torch.Tensor:
        """:meth:`length_mask` as SDPA's fused kernels take it: ``(n, 1, 1, length)`` additive, ``0`` / ``-inf`` in
        ``dtype`` (:func:`vase.engine.attention.additive_mask`): a view of :attr:`held_bias` (built by
        :meth:`prepare_step`) in the storage dtype, else built here."""
        if dtype == self.held_bias.dtype:
            return self.held_bias[:n, :, :, :length]
        return additive_mask(self.length_mask(n, length)[:, None, :], dtype)

    def due_rows(self) -> list[int]:
        """Live rows whose eviction trigger fires now: held > budget and the sequence length is a multiple of the
        policy's eviction period (``window`` by default, where this is "held % window == 0"; see the module doc)."""
        p = self.policy
        if p.kind != "eviction":
            return []
        every = p.eviction_period
        return [r for r in range(self.n_live) if self.lengths[r] > p.budget and self.next_pos[r] % every == 0]

    def evict_due(self) -> list[int]:
        """Run the eviction trigger on every row after a decode step; return the rows that evicted.

        No host synchronisation: the rows are chosen on the host, their index tensors built once for all layers
        (:meth:`index`), the policies' noise drawn from the rows' keys (:mod:`vase.engine.rng`), the time measured by
        :attr:`clock`.
        """
        due = self.due_rows()
        watch = self.observe_rows(due)
        if watch:  # an accumulating policy (H2O) sees the ring's queries before they are overwritten
            evict_rows(self, watch, observe=True)
        if not due:
            return due
        self._evict(due)
        return due

    def observe_rows(self, due: list[int]) -> list[int]:
        """Rows an accumulating policy (``accumulates``: H2O) observes now: not due, with ``window`` decode queries
        since the prompt (every ``window`` steps), and candidates to show.

        Between two calls of ``keep`` (an eviction or an observation) at most ``window`` queries pass, so none leaves
        the query ring unseen: before the first eviction, and after it when the eviction period exceeds ``window``
        (``evict_every > window``; a row then holds more than the budget). With a period of at most ``window`` an
        evicted row's evictions suffice and it is not observed."""
        p = self.policy
        if p.kind != "eviction" or not p.accumulates:
            return []
        w, skip = p.window, set(due)
        out = []
        for r in range(self.n_live):
            steps = self.next_pos[r] - self.prompt_lens[r]
            pinned = self.prompt_lens[r] if p.keep_prompt else 0
            if r in skip or steps <= 0 or steps % w or (self.lengths[r] > p.budget and p.eviction_period <= w):
                continue  # an evicted row whose period is at most ``window`` is called often enough by its evictions
            if self.lengths[r] - p.protected_window - pinned > 0:
                out.append(r)
        return out

    def _evict(self, rows: list[int]) -> None:
        """Evict ``rows`` on every layer, one event per group of rows (:func:`vase.engine.evict.evict_rows`): they
        then hold ``budget`` tokens."""
        evict_rows(self, rows)
        budget = self.policy.budget
        for r in rows:
            self.lengths[r] = budget
        self.lengths_t[self.index(rows)] = budget

    def record_eviction(self, slots: Sequence[int], layers: int = 1) -> None:
        """Count ``layers`` eviction calls (one per layer of an event) for each row of ``slots``."""
        for r in slots:
            self.row_evictions[r] += layers

    def credit_seconds(self, slots: Sequence[int], seconds: float) -> None:
        """Share an eviction call's ``seconds`` among its rows (called by :attr:`clock`)."""
        share = seconds / len(slots)
        for r in slots:
            self.row_eviction_seconds[r] += share

    def add_attended(self, mask: torch.Tensor | None, num_q_heads: int) -> None:
        """Selection policies: add this step's attended tokens per row of the step, summed over the layer's query heads.

        ``mask``: ``(n, Hq, L)`` (per query head) or ``(n, H, L)`` (per KV head: each of the group's ``Hq // H`` query
        heads attends to the KV head's tokens), or ``None`` (every held token, for every query head).
        """
        n = self.step_rows  # every row of the step (a bucket's padding rows are free slots, reset at admission)
        if mask is None:
            self.attended[:n] += num_q_heads * (self.lengths_t[:n] + 1)
        else:
            self.attended[:n] += mask.sum(dim=(1, 2)) * (num_q_heads // mask.shape[1])

    # ---- rows ----------------------------------------------------------------------------------------------------
    def move_row(self, src: int, dst: int) -> None:
        """Move live row ``src`` into the free row ``dst`` (keeps the live rows contiguous)."""
        self.storage.move_row(src, dst, self.lengths[src])
        self.clock.resolve()  # pending seconds are credited to the row's slot before it moves
        for lst in (
            self.lengths,
            self.next_pos,
            self.prompt_lens,
            self.row_ids,
            self.row_evictions,
            self.row_eviction_seconds,
        ):
            lst[dst] = lst[src]
        for t in (self.lengths_t, self.pos_t, self.evict_key, self.attended):
            if t is not None:
                t[dst] = t[src]
        self.release(src)

    def release(self, slot: int, scrub: bool = False) -> None:
        """Row ``slot`` is free (its sample finished). With ``scrub``, zero its storage (after NaN/inf).

        Its storage and length stay readable until the slot is reused (analyses inspect a cache after a decode).
        """
        self.row_ids[slot] = None
        self.storage.clear_row(slot, scrub=scrub)

    def row_stats(self, slot: int) -> dict:
        """What a finished row reports: eviction calls (summed over layers), their seconds, attended tokens.

        Called when a row finishes, after a token sync (reading ``attended`` and resolving CUDA timings is free then).
        """
        self.clock.resolve()
        return {
            "evictions": self.row_evictions[slot],
            "eviction_seconds": self.row_eviction_seconds[slot],
            "attended_tokens_sum": None if self.attended is None else float(self.attended[slot].item()),
        }

    # ---- measurements --------------------------------------------------------------------------------------
    @property
    def n_rows(self) -> int:
        """Live rows."""
        return self.n_live

    @property
    def length(self) -> int:
        """The longest live row's held length (every row's, when the rows are in step)."""
        return max(self.lengths[: self.n_live], default=0)

    def seq_length(self) -> int:
        """What every layer answers to transformers' ``get_seq_length``: :attr:`length`, or during a decode forward
        the span of the step's views (``step_length``), so a compiled step never reads the rows' host lengths."""
        return self.step_length if self.stepping else self.length

    def kv_bytes_by_type(self) -> dict[str, int]:
        """Bytes of K and V storage actually allocated, per layer type (``linear_attention``: a hybrid model's conv and
        recurrent states; ``{}`` before the first prefill)."""
        st = self.storage
        if not st.allocated:
            return {}
        return {kind: sum(t.nbytes for t in ts) for kind, ts in st.kv_tensors().items()}

    def kv_bytes(self) -> int:
        """Bytes of K and V storage actually allocated (the static footprint, every layer type)."""
        return sum(self.kv_bytes_by_type().values())

    def aux_bytes(self) -> int:
        """Bytes of the side buffers: positions (every layer type) and the query ring."""
        st = self.storage
        return sum(t.nbytes for t in (st.positions, st.queries, st.ring_positions) if t is not None)

    def evictions(self) -> int:
        """Eviction calls summed over layers and rows."""
        return sum(layer.counters.evictions for layer in self.evicting_layers)

    def eviction_seconds(self) -> float:
        """Seconds spent evicting, summed over layers (CUDA: the intervals resolved so far, :class:`EvictionClock`)."""
        return sum(layer.counters.eviction_seconds for layer in self.evicting_layers)

    def counters(self) -> list[LayerCounters]:
        """Each K/V layer's counters (full and sliding; a linear-attention layer has none)."""
        return [layer.counters for layer in self.attention_layers]
