"""The decode loop (ours, not ``generate``): continuous batching of many prompts' samples on one static cache.

:class:`Decoder` takes :class:`Request` s (a prompt and the seeds of its samples) and yields a :class:`Finished`
sample as soon as it ends:

* Rows. The cache has ``rows`` slots, allocated once. When a row finishes, its slot goes to the next pending sample:
  that sample's prompt is prefilled once (batch 1) for all the samples that enter together, and decoding goes on for
  every live row. When nothing is pending, the last live rows move into the holes, so finished rows stop costing
  compute. Rows of different prompts hold different lengths; attention masks each row to its own tokens.
* Position ids come from each row's true token count (``prompt_len + step``), never from the cache length.
* Sampling: temperature / top-k / top-p, or greedy (``temperature=0``). Randomness is counter-based
  (:mod:`vase.engine.rng`): a token's noise is a hash of the row's token key (from its seed) and the token's position,
  a policy's eviction noise a hash of the row's eviction key, its position and the layer; all rows are drawn in one
  batched computation, and a sample's tokens do not depend on which other samples share the batch.
* A sample ends at an EOS token, a stop string, its length limit (``max_length - prompt_len`` new tokens), an
  optional ``stop_when`` predicate (``finish_reason="loop"``: the runner's repetition-loop stop) or a
  numerical failure (non-finite logits: ``finish_reason="nonfinite"``, its tokens kept up to the failure; the row is
  scrubbed and the decode goes on). A prompt that leaves no room under ``max_length`` ends its samples at once
  (``"prompt_too_long"``).
* Host synchronisation: tokens are copied to the host every ``sync_every`` steps (1 on CPU, where it is free; 16 on
  CUDA) and when a row reaches its length limit; new rows enter at those points. Rows that ended in between decode
  a few extra tokens that are discarded. Between these points a step never waits for the device, evicting or not
  (:meth:`Decoder._decode_step`; ``tests/test_gpu_path.py`` counts the syncs).
* Hooks: ``on_step(StepInfo)`` after every decode step, ``on_logits(step, logits)`` after every forward (step 0 is a
  prefill; it may change the logits in place, e.g. teacher forcing: the step's tokens are then drawn after it, from
  the same keys), ``on_cache(cache)`` once.

:func:`vase.engine.generate.generate` is the one-prompt form (its ``n_samples`` rows decoded together), used by
tests, analyses and benchmarks.

Long module: the decode loop's pieces (admission, the step with its row and key buckets, the compiled step's
bookkeeping and CUDA-graph watch, the sync point, compaction) share the decoder's state and read best together.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch

from vase.engine.attention import attention_report, backend_choice, vase_attention
from vase.engine.cache import VaseCache, cache_capacity, key_buckets, row_bucket, row_buckets, to_device
from vase.engine.capture import CaptureWatch
from vase.engine.compiled import (
    compile_choice,
    compile_forward,
    compile_mode,
    compile_setting,
    drain_bucket,
    mark_static,
    own_dynamo_cache,
)
from vase.engine.geometry import has_attention_sinks, model_geometry
from vase.engine.policy import Policy
from vase.engine.requests import DecodeStats, Finished, Request, StepInfo, _Row
from vase.engine.rng import TOKEN_SALT, RowRNG, row_keys
from vase.engine.sampling import SamplingConfig, sample_tokens
from vase.models import check_architecture

logger = logging.getLogger(__name__)

__all__ = ["FINISH_REASONS", "Decoder", "Finished", "Request", "StepInfo", "vase_attention"]

FINISH_REASONS = ("eos", "stop", "length", "loop", "nonfinite", "prompt_too_long")
STOP_WHEN_EVERY = 16  # ``stop_when`` is asked every this many tokens of a row
EMPTY_STATS = {"decode_steps": 0, "evictions": 0, "eviction_seconds": 0.0, "attended_tokens": None}


class Decoder:
    """Decode requests under one policy on one static cache of ``rows`` rows × ``capacity`` slots.

    Args:
        model: a Qwen3 / Qwen2 / Llama causal LM (transformers).
        policy: the cache policy (its ``budget``/``window`` define the eviction schedule).
        rows: rows in flight (slots of the static cache).
        capacity: token slots per row; every request must fit (:func:`~vase.engine.cache.cache_capacity` of its
            prompt and output cap).
        sampling: see :class:`SamplingConfig` (default: temperature 1).
        max_new_tokens / max_length: default output cap and prompt + output cap (the smaller wins per request).
        eos_token_ids: tokens that end a sample; ignored with ``ignore_eos`` (benchmarks).
        stop_strings: strings that end a sample (needs ``tokenizer``).
        stop_when: ``stop_when(tokens) -> bool``, asked every :data:`STOP_WHEN_EVERY` tokens of a row: True ends the
            sample with ``finish_reason="loop"`` (the runner's ``generation.stop_on_loop`` passes the paper's
            repetition-loop detector, so a hopeless sample stops costing compute).
        attn_backend: ``auto`` | ``sdpa`` | ``eager`` | ``flash_attn``.
        sync_every: copy tokens to the host every k steps (default 1 on CPU, 16 on CUDA).
        on_step / on_logits / on_cache: hooks (see the module docstring).
        check_policy_output: validate every eviction's indices (debug; syncs per eviction).
        score_dtype: the dtype of the policy's score math (``EvictionInputs.score_dtype``; bfloat16 = the authors').
        row_id: how a row is named in hooks and in the cache (default ``(key, sample)``).
        compile: ``off`` | ``on`` | ``auto``: compile the decode forward, one graph per bucket of live rows and
            key-length bucket (:mod:`vase.engine.compiled`; CUDA graphs on CUDA); the prefill stays eager.
        compile_backend: ``torch.compile``'s backend (default inductor; tests pass a graph-counting one).
    """

    def __init__(
        self,
        model,
        policy: Policy,
        *,
        rows: int,
        capacity: int,
        sampling: SamplingConfig | None = None,
        max_new_tokens: int | None = None,
        max_length: int | None = None,
        eos_token_ids: Sequence[int] = (),
        stop_strings: Sequence[str] = (),
        stop_when: Callable[[list[int]], bool] | None = None,
        tokenizer=None,
        attn_backend: str = "auto",
        sync_every: int | None = None,
        ignore_eos: bool = False,
        on_step: Callable[[StepInfo], None] | None = None,
        on_logits: Callable[[int, torch.Tensor], None] | None = None,
        on_cache: Callable[[VaseCache], None] | None = None,
        check_policy_output: bool = False,
        row_id: Callable[[Any, int], Any] | None = None,
        score_dtype: torch.dtype = torch.float32,
        compile: str | bool = "off",
        compile_backend: str | Callable | None = None,
    ):
        check_architecture(model.config)
        policy.validate()
        policy.check_model(model.config)  # the runner's preflight check, for a caller of the engine alone
        policy.setup(model.config)
        if not isinstance(rows, int) or rows < 1:
            raise ValueError(f"generation.max_rows: must be an integer >= 1, got {rows!r}")
        if max_new_tokens is None and max_length is None:
            raise ValueError("max_length: set max_length (prompt + output tokens) or max_new_tokens")
        if max_new_tokens is not None and max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: must be >= 1, got {max_new_tokens}")
        if stop_strings and tokenizer is None:
            raise ValueError("stop_strings: a tokenizer is needed to match stop strings")
        if sync_every is not None and (not isinstance(sync_every, int) or sync_every < 1):
            raise ValueError(f"generation.sync_every: must be an integer >= 1 (or null), got {sync_every!r}")
        self.model = model
        self.policy = policy
        self.sampling = sampling or SamplingConfig()
        self.max_new_tokens = max_new_tokens
        self.max_length = max_length
        param = next(model.parameters())
        self.device = param.device
        expected = max_new_tokens if max_new_tokens is not None else max_length
        self.compiled, self.compile_reason = compile_choice(compile, self.device, policy, expected)
        self.compile_setting = compile_setting(compile)
        logger.info("decode step compile: %s (%s)", "on" if self.compiled else "off", self.compile_reason)
        self.backend, self.backend_reason = backend_choice(
            attn_backend, self.device, param.dtype, sinks=has_attention_sinks(model)
        )
        logger.info("attention backend: %s (%s)", self.backend, self.backend_reason)
        if attn_backend == "auto" and self.device.type == "cuda" and self.backend != "flash_attn":
            logger.warning(
                "attn_backend=auto falls back to SDPA: %s (install: pip install flash-attn --no-build-isolation)",
                self.backend_reason.removeprefix("auto: "),
            )
        self.sync_every = sync_every or (16 if self.device.type == "cuda" else 1)
        self.eos = set() if ignore_eos else {int(t) for t in eos_token_ids}
        self.stop_strings = list(stop_strings)
        self.max_stop = max((len(s) for s in stop_strings), default=0)
        self.stop_when = stop_when
        self.tokenizer = tokenizer
        self.on_step, self.on_logits = on_step, on_logits
        self.row_id = row_id or (lambda key, sample: (key, sample))
        self.geometry = model_geometry(model, rows, capacity)
        if self.geometry.heads is not None and policy.head_parallel is not None:
            raise ValueError(
                f"policy {policy.name}: not supported under parallel.tensor={self.geometry.heads.ranks} "
                f"({policy.head_parallel}); run it with parallel.tensor=1"
            )
        head_dim = self.geometry.head_dim
        self.cache = VaseCache(
            self.geometry,
            policy,
            scaling=head_dim**-0.5,
            attn_backend=self.backend,
            check_policy_output=check_policy_output,
            score_dtype=score_dtype,
        )
        if on_cache is not None:
            on_cache(self.cache)
        self.stats = DecodeStats()
        self.step = 0
        self._slots: list[_Row | None] = [None] * rows
        self._next_tok = torch.zeros(rows, dtype=torch.long, device=self.device)
        self._tok_key = torch.zeros((rows, 2), dtype=torch.long, device=self.device)  # token RNG keys (rng.row_key)
        self._buf = torch.zeros((rows, self.sync_every), dtype=torch.long, device=self.device)
        self._finite = torch.ones((rows, self.sync_every), dtype=torch.bool, device=self.device)
        self._t0 = time.perf_counter()
        self._forward = self._decode_forward
        self._static_marked = False
        self._buckets_seen: set[tuple[int, int]] = set()  # (row bucket, key length) graphs that have run (compiled)
        self._draining = False  # no request pending: the live rows only decrease (compiled: drain_bucket)
        # each row bucket's compile and CUDA-graph capture; YAML's true is on (a skip raises), not the string "True"
        self.capture = CaptureWatch(self.device, self.compile_setting)
        if self.compiled:
            self.cache.bucketed = True  # one graph per bucket of live rows and key-length bucket
            buckets = len(row_buckets(rows)) * len(self.key_buckets())
            self._forward = compile_forward(self._decode_forward, self.device, buckets, compile_backend)

    # ---- public ------------------------------------------------------------------------------------------------
    def limit_for(self, prompt_len: int, max_new_tokens: int | None = None) -> int:
        """New tokens a prompt of ``prompt_len`` may get (< 1: the prompt leaves no room under ``max_length``)."""
        caps = [c for c in (max_new_tokens, self.max_new_tokens) if c is not None]
        limit = min(caps) if caps else None
        if self.max_length is not None:
            room = self.max_length - prompt_len
            limit = room if limit is None else min(limit, room)
        return int(limit)

    def compile_report(self) -> dict:
        """How the decode step runs, for the run's manifest: the setting, on/off and why, the mode and buckets."""
        return {
            "setting": str(self.compile_setting),
            "compiled": self.compiled,
            "choice": self.compile_reason,
            "mode": compile_mode(self.device) if self.compiled else None,
            "row_buckets": row_buckets(self.geometry.rows) if self.compiled else None,
            "key_buckets": list(self.key_buckets()),
            "cuda_graphs": compile_mode(self.device) == "reduce-overhead" if self.compiled else False,
            # per row bucket so far (over its key buckets): compile seconds, forwards, CUDA graphs recorded / replayed,
            # skips and torch's reason
            "buckets": self.capture.report(),
        }

    def key_buckets(self) -> tuple[int, ...]:
        """The key lengths a decode step's K/V views may span (:meth:`~vase.engine.cache.VaseCache.step_span`)."""
        cap = self.geometry.capacity
        return tuple(sorted({self.cache.step_span(b) for b in key_buckets(cap)}))

    def attention_report(self) -> dict:
        """What the attention runs on, for the run's manifest (:func:`vase.engine.attention.attention_report`)."""
        return attention_report(self.backend, self.backend_reason, self.geometry, self.device)

    @torch.inference_mode()
    def run(self, requests: Iterable[Request]) -> Iterator[Finished]:
        """Decode every sample of ``requests`` (in order of entry; continuous batching); yield each as it ends."""
        queue: deque[tuple[Request, list[int], list[int], int, torch.Tensor]] = deque()
        for req in requests:
            prompt = torch.as_tensor(req.prompt_ids, dtype=torch.long).flatten()
            samples = list(req.samples) if req.samples is not None else list(range(len(req.seeds)))
            if len(samples) != len(req.seeds):
                raise ValueError(f"seeds: {len(req.seeds)} seeds for {len(samples)} samples of request {req.key!r}")
            if prompt.numel() < 1:
                raise ValueError(f"prompt: request {req.key!r} has an empty prompt")
            limit = self.limit_for(prompt.numel(), req.max_new_tokens)
            if limit >= 1:
                self.policy.check_prompt(prompt.numel())  # e.g. keep_prompt: the prompt must fit the budget
                need = cache_capacity(self.policy, prompt.numel(), limit)
                if need > self.geometry.capacity:
                    raise ValueError(
                        f"request {req.key!r}: a prompt of {prompt.numel()} tokens with {limit} new tokens needs "
                        f"{need} cache slots per row, the cache has {self.geometry.capacity}"
                    )
            queue.append((req, samples, list(req.seeds), limit, prompt))
        if self.compiled:
            own_dynamo_cache(self)  # any number of compiled decoders per process (see its docstring)
        with vase_attention(self.model):
            while True:
                yield from self._admit(queue)
                n = self._compact()
                if n == 0:
                    if not queue:
                        break
                    continue
                self._draining = not queue
                yield from self._decode_until_sync(n)

    # ---- admission -----------------------------------------------------------------------------------------
    def _admit(self, queue) -> Iterator[Finished]:
        """Give free rows to pending samples (holes first); a prompt is prefilled once for the samples entering now."""
        while queue:
            req, samples, seeds, limit, prompt = queue[0]
            if limit < 1:  # no room for a single new token: every sample of the prompt ends now
                queue.popleft()
                for s, seed in zip(samples, seeds):
                    self.stats.samples += 1
                    stats = {**EMPTY_STATS, "held_tokens": float(prompt.numel()), "first_step": self.step}
                    stats["last_step"] = self.step
                    yield Finished(req.key, s, seed, [], "prompt_too_long", prompt.numel(), stats)
                continue
            free = [r for r, row in enumerate(self._slots) if row is None]
            if not free:
                return
            k = min(len(free), len(samples))
            slots, take, take_seeds = free[:k], samples[:k], seeds[:k]
            del samples[:k], seeds[:k]
            if not samples:
                queue.popleft()
            yield from self._prefill(req, prompt, slots, take, take_seeds, limit)

    def _prefill(self, req: Request, prompt, slots, samples, seeds, limit) -> Iterator[Finished]:
        t0 = time.perf_counter()
        p = prompt.numel()
        rows = [_Row(req.key, s, seed, self.row_id(req.key, s), limit, p, self.step) for s, seed in zip(samples, seeds)]
        finite, first = self._prefill_forward(prompt, slots, seeds, [row.rid for row in rows])
        # An admission is a sync point: the first tokens (and whether the prompt's logits are finite) reach the host.
        finite, first_host = bool(finite), first.tolist()
        self.stats.prefills += 1
        self.stats.prefill_tokens += p
        self.stats.prefill_seconds += time.perf_counter() - t0
        for r, row, tok in zip(slots, rows, first_host):
            self._slots[r] = row
            row.produced = 1
            reason = self._take(row, tok, finite)
            if reason is not None:
                yield self._finish(r, reason)

    def _prefill_forward(self, prompt: torch.Tensor, slots: list[int], seeds: list[int], rids: list) -> tuple:
        """Prefill ``prompt`` once into rows ``slots`` and sample each row's first token, without a host sync.

        Returns ``(finite, first)``: a 0-d bool tensor (the prompt's last logits are finite) and the ``(k,)`` first
        tokens, both on the device.
        """
        p = prompt.numel()
        cache = self.cache
        cache.begin_prefill(slots, seeds, rids)
        logits = self.model(
            input_ids=prompt.view(1, -1).to(self.device, non_blocking=True),
            position_ids=torch.arange(p, device=self.device).view(1, -1),
            cache=cache,
            use_cache=True,
            logits_to_keep=1,
            vase_cache=cache,
        ).logits[:, -1]
        cache.end_prefill(p)
        if self.on_logits is not None:
            self.on_logits(0, logits)
        idx = cache.index(slots)
        self._tok_key[idx] = to_device(row_keys(seeds, TOKEN_SALT), self.device)
        rng = RowRNG(self._tok_key[idx], cache.pos_t[idx])  # the first token's position: p
        first = sample_tokens(logits.expand(len(slots), -1), self.sampling, rng)
        self._next_tok[idx] = first
        return torch.isfinite(logits.sum(dtype=torch.float32)), first

    def _compact(self) -> int:
        """Move the last live rows into the holes so that rows ``[0, n)`` are the live ones; return ``n``."""
        live = [r for r, row in enumerate(self._slots) if row is not None]
        n = len(live)
        holes = [r for r in range(n) if self._slots[r] is None]
        movers = [r for r in live if r >= n]
        for dst, src in zip(holes, movers):
            self.cache.move_row(src, dst)
            self._slots[dst], self._slots[src] = self._slots[src], None
            self._next_tok[dst] = self._next_tok[src]
            self._tok_key[dst] = self._tok_key[src]
        return n

    # ---- decode steps ----------------------------------------------------------------------------------------
    def _decode_until_sync(self, n: int) -> Iterator[Finished]:
        """Decode the live rows ``[0, n)`` until a sync point, then read their tokens and end the finished ones."""
        cache, rows = self.cache, self._slots[:n]
        t0 = time.perf_counter()
        pending = 0
        self.stats.max_live_rows = max(self.stats.max_live_rows, n)
        while True:
            held, tok, evicted = self._decode_step(n, pending)
            pending += 1
            at_limit = False
            for r, row in enumerate(rows):
                row.held_sum += held[r]
                row.held_max = max(row.held_max, held[r])
                row.steps += 1
                row.produced += 1
                at_limit |= row.produced >= row.limit
            self.stats.decode_steps += 1
            self.stats.row_steps += n
            if self.on_step is not None:
                counts = (cache.length, cache.evictions(), cache.eviction_seconds(), time.perf_counter() - self._t0)
                self.on_step(StepInfo(self.step, n, [row.rid for row in rows], tok, *counts, evicted))
            if pending == self.sync_every or at_limit:
                break
        # The sync point: the tokens of the last ``pending`` steps (and their finiteness) reach the host.
        host = self._buf[:n, :pending].tolist()
        finite = self._finite[:n, :pending].tolist()
        cache.clock.resolve()  # every recorded eviction has run: read its CUDA-event time (free now)
        self.stats.decode_seconds += time.perf_counter() - t0
        for r, row in enumerate(rows):
            for tok, ok in zip(host[r], finite[r]):
                reason = self._take(row, tok, ok)
                if reason is not None:
                    yield self._finish(r, reason)
                    break

    def _decode_step(self, n: int, pending: int) -> tuple[list[int], torch.Tensor, list[int]]:
        """One decode step of the live rows ``[0, n)``: forward, eviction, sampling. No host synchronisation.

        The step's tokens go to ``_next_tok`` (the next input) and column ``pending`` of ``_buf`` (read at the sync
        point). Returns the tokens each row held after the append (host), the tokens (device) and the rows that
        evicted.
        """
        cache = self.cache
        cache.prepare_step(n, self._bucket(n) if self.compiled else None)
        b = cache.step_rows  # n, or its bucket when the step is compiled (padding rows' logits are dropped)
        if self.compiled and not self._static_marked:
            mark_static(cache)  # the layers' storage exists after the first prefill
            self._static_marked = True
        # a logits hook may change the logits (teacher forcing): the tokens are then drawn again after it, from the
        # same keys (the row's token key, the token's position), so an unchanged row draws the same token
        redraw = None if self.on_logits is None else cache.pos_t[:n] + 1
        if self.compiled:
            logits, tok, finite = self._compiled_forward(b)
        else:
            logits, tok, finite = self._forward(self._next_tok[:b].view(b, 1), cache.pos_t[:b].view(b, 1))
        logits, tok = logits[:n], tok[:n]
        cache.advance()
        self.step += 1
        if self.on_logits is not None:
            self.on_logits(self.step, logits)
            tok = sample_tokens(logits, self.sampling, RowRNG(self._tok_key[:n], redraw))
        self._finite[:n, pending] = finite[:n]
        held = cache.lengths[:n]
        evicted = cache.evict_due()  # after the sampling, which does not depend on it
        self._next_tok[:n] = tok
        self._buf[:n, pending] = tok
        return held, tok, evicted

    def _bucket(self, n: int) -> int:
        """A compiled step's row bucket for ``n`` live rows: ``row_bucket``, in the drain ``compiled.drain_bucket``."""
        want = row_bucket(n, self.geometry.rows)
        if not self._draining:
            return want
        remaining = max(row.limit - row.produced for row in self._slots[:n])
        return drain_bucket(want, n, {rows for rows, _ in self._buckets_seen}, remaining)

    def _compiled_forward(self, b: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The compiled forward of the bucket of ``b`` rows and the step's key length (one graph per pair), watched
        (:class:`~vase.engine.capture.CaptureWatch`, per row bucket; ``compile=on`` raises here on a skipped CUDA
        graph); the first forward of each graph timed as its compile."""
        graph = (b, self.cache.step_length)
        first = graph not in self._buckets_seen
        t0 = time.perf_counter() if first else 0.0
        with self.capture.forward(b) as bucket:
            out = self._forward(self._next_tok[:b].view(b, 1), self.cache.pos_t[:b].view(b, 1))
        if first:  # host time only (no sync): dynamo's trace and inductor's compile or cache load dominate it
            seconds = time.perf_counter() - t0
            self._buckets_seen.add(graph)
            bucket.compile_seconds += seconds
            self.stats.compile_seconds += seconds
            self.stats.compiled_buckets += 1
            logger.info("decode step compiled for %d rows x %d key slots in %.1f s (first forward)", *graph, seconds)
        return out

    def _decode_forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The decode forward and sampling of rows ``[0, b)``: ``input_ids``, ``position_ids`` ``(b, 1)`` → the last
        logits ``(b, V)``, the sampled tokens ``(b,)`` and whether each row's logits are finite ``(b,)`` bool.

        Reads only tensors and run-constant host state (``cache.step_rows``, ``cache.step_length`` and
        ``cache.bucketed`` among them), so ``torch.compile(fullgraph=True)`` traces it once per row and key bucket
        (:mod:`vase.engine.compiled`), the sampling's counter-based hash fused into the step's graph. A token's noise is
        keyed by the row's token key and the token's position (``position_ids + 1``), so the padding rows' draws never
        touch a live row's.
        """
        cache = self.cache
        out = self.model(input_ids=input_ids, position_ids=position_ids, cache=cache, use_cache=True, vase_cache=cache)
        logits = out.logits[:, -1]
        b = logits.shape[0]
        tok = sample_tokens(logits, self.sampling, RowRNG(self._tok_key[:b], position_ids.view(b) + 1))
        return logits, tok, torch.isfinite(logits.sum(dim=-1, dtype=torch.float32))

    def _take(self, row: _Row, tok: int, finite: bool) -> str | None:
        """Append a sampled token to ``row``; return its finish reason if the row ends with it."""
        if not finite:  # the logits that produced this token were NaN/inf: the token is not kept
            return "nonfinite"
        row.tokens.append(tok)
        if tok in self.eos:
            return "eos"
        if self.max_stop and _hits_stop(self.tokenizer, row.tokens, self.stop_strings, self.max_stop):
            return "stop"
        if len(row.tokens) >= row.limit:
            return "length"
        if self.stop_when is not None and len(row.tokens) % STOP_WHEN_EVERY == 0 and self.stop_when(row.tokens):
            return "loop"
        return None

    def _finish(self, slot: int, reason: str) -> Finished:
        row = self._slots[slot]
        cache = self.cache
        st = cache.row_stats(slot)
        g = self.geometry
        attended = st.pop("attended_tokens_sum")
        if attended is not None and g.heads is not None:  # this rank's query heads: the group's sum over all of them
            attended = _sum_over(g.heads.group, attended, self.device)
        if attended is not None:
            heads = g.whole().num_q_heads
            attended = attended / (row.steps * heads * len(g.full_layers)) if row.steps else None
        stats = {
            "decode_steps": row.steps,
            "evictions": st["evictions"],
            "eviction_seconds": st["eviction_seconds"],
            "held_tokens": row.held_sum / row.steps if row.steps else float(row.prompt_len),
            "held_tokens_max": max(row.held_max, row.prompt_len),
            "attended_tokens": attended,
            "first_step": row.first_step,
            "last_step": self.step,
        }
        if reason == "nonfinite":
            logger.warning(
                "sample %r of %r: non-finite logits after %d tokens (finish_reason=nonfinite)",
                row.sample,
                row.key,
                len(row.tokens),
            )
        cache.release(slot, scrub=reason == "nonfinite")
        self._slots[slot] = None
        self.stats.samples += 1
        self.stats.tokens += len(row.tokens)
        return Finished(row.key, row.sample, row.seed, row.tokens, reason, row.prompt_len, stats)


def _sum_over(group, value: float, device: torch.device) -> float:
    """``value`` summed over the ranks of a tensor-parallel ``group`` (each holds some heads): one collective, on
    ``device`` (the group's backend: NCCL for CUDA devices)."""
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, group=group)
    return float(t.item())


def _hits_stop(tokenizer, tokens: list[int], stop_strings: Sequence[str], max_stop: int) -> bool:
    """Whether the decoded tail of ``tokens`` contains a stop string (decodes only the last few tokens)."""
    tail = tokenizer.decode(tokens[-(max_stop + 8) :], skip_special_tokens=False)
    return any(s in tail for s in stop_strings)
