"""The policy interface shared by every KV-cache policy.

A policy is a small dataclass whose fields are its hyper-parameters. The engine (:mod:`vase.engine.cache`) owns the
storage and calls the policy at two hooks:

* eviction policies (``kind = "eviction"``) implement :meth:`EvictionPolicy.keep`: at each eviction event the engine
  hands the candidates of the rows that evict now, every layer at once (the layer axis folded into the row axis:
  ``B`` = rows x layers, ``EvictionInputs.layer_ids`` the layer of each), and gets back, per (row, KV head), the
  indices of the candidates to keep; the engine does the gather and moves the recent window behind them
  (:mod:`vase.engine.evict`).
* selection policies (``kind = "selection"``, e.g. Quest, SeerAttention-R) keep every token and implement
  :meth:`SelectionPolicy.select`: per decode step and layer, a boolean mask of the held tokens that the step attends to,
  per KV head or per query head.
* ``kind = "none"`` (the full cache) never evicts nor selects.

Rows of one call may come from different problems (continuous batching): every input is per row, and a policy must
treat rows independently (a row's answer may depend only on that row's tensors, its random stream and its state).

Shapes use ``B`` = rows in the call, ``H`` = KV heads, ``Hq`` = query heads, ``N`` = candidates, ``D`` = head dim.

Schedule (eviction policies; fields of :class:`EvictionPolicy`, so a run records them): a row evicts after a decode
step when it holds more than ``budget`` tokens and its sequence length (prompt + generated tokens) is a multiple of
``evict_every`` (default ``window``: VaSE's scaffold, where this is the same as "the held count is a multiple of
``window``"); ``compress_prefill`` also evicts right after the prefill when the prompt is longer than ``budget``
(R-KV). ``keep_prompt`` pins the prompt: it is never a candidate, and the budget counts it.
Before decoding, the decoder calls :meth:`Policy.setup` once with the model's config (a policy that needs the model,
e.g. SeerAttention-R's gates, checks and loads it there).

Policy state: ``inputs.state`` is a dict of row-first tensors ``(B, ...)`` that the engine keeps per row and per layer
between calls (e.g. CurDKV's sketch; an eviction call's rows are (sequence, layer) pairs, so its state rows are too).
A call's rows all have the same keys in their state: an empty dict means these rows have never stored anything
(new sequences). Put or replace tensors in it; the engine stores each
row's slice and hands it back at the row's next call. A key must keep its per-row shape for the row's lifetime.

Long module: the whole contract between the engine and a policy (the inputs' documentation, the schedule's and the
prompt's rules, the hooks) is one page a policy author reads, so it stays in one file.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import torch

from vase.engine.rng import RowRNG

#: Options of every eviction policy that the engine implements (not the policy's rule), with their base defaults.
ENGINE_OPTIONS = {"keep_prompt": False, "evict_every": None, "compress_prefill": False, "protect_recent": None}
_NO_DEFAULT = object()


def _check(cond: bool, setting: str, msg: str) -> None:
    if not cond:
        raise ValueError(f"{setting}: {msg}")


@dataclass
class EvictionInputs:
    """What the engine hands an eviction policy at one eviction event.

    The engine's rows are (sequence, layer) pairs: an event folds every layer of the sequences that evict together
    into the row axis (``B = sequences x layers``; ``layer_ids`` says each row's layer). Inputs built by hand may hold
    one layer (``layer_idx``).

    Attributes:
        keys: ``(B, H, N, D)`` post-RoPE keys of the candidates (every held token but the ``window`` most recent, and
            but the prompt with ``keep_prompt``; but the ``protect_recent`` most recent when the policy declares it).
        values: ``(B, H, N, D)`` values of the candidates.
        positions: ``(B, H, N)`` int64 absolute token positions of the candidates (0 = first prompt token).
        n_keep: how many candidates to keep per (sequence, KV head): ``budget - window`` (``- P`` with
            ``keep_prompt``, ``P`` the rows' prompt length).
        layer_idx: index of the layer when every row is of one layer (inputs built by hand); ``None`` in the
            engine's folded calls: read ``layer_ids``.
        scaling: softmax scale of the model's attention (usually ``D ** -0.5``).
        layer_ids: ``(B,)`` int64 layer of each row (filled from ``layer_idx`` when not given).
        rng: the rows' random streams (:class:`vase.engine.rng.RowRNG`), keyed by each row's eviction key, its
            absolute position at this eviction and its layer; draw through :meth:`rand` / :meth:`randn` (one batched
            draw for all rows) so that a row's choice does not depend on the other rows of the batch.
        state: the rows' persistent state (per row and layer; see the module docstring): ``{key: (B, ...) tensor}``.
        queries: ``(B, Hq, Wq, D)`` post-RoPE queries of the last ``Wq <= window`` tokens, or ``None`` when the policy
            does not declare ``needs_queries``.
        score_dtype: the dtype of the policy's score math (``protocol.score_dtype``, set by the engine): pass it as
            ``dtype=`` to every :mod:`vase.engine.scores` function. float32 by default; bfloat16 rounds as the
            authors' code (docs/protocol.md).
        window_keys: ``(B, H, window, D)`` post-RoPE keys of the recent window (``protect_recent`` keys, possibly
            none, when the policy declares it) (never evicted; for scores that compare
            the candidates with every held key, as the original R-KV's redundancy), or ``None``. The engine always
            passes them.
        window_positions: ``(B, H, window)`` int64 absolute positions of ``window_keys`` (oldest first), or ``None``.
            The engine always passes them.
        query_positions: ``(B, Wq)`` int64 absolute position of each query of the ring, slot by slot (the query of
            position ``p`` sits in slot ``p % window``, so the slots are not in position order), when ``queries`` is
            given. The ring is full at every eviction (a row holds more than ``window`` tokens then).
        n_new_queries: ``(B,)`` int64: how many of the ring's queries are new since this row's previous call on this
            layer (its ``n`` newest positions): ``min(E, window)`` between scheduled evictions, the whole ring at a
            row's first call. An accumulating policy (H2O) counts only these, so no query is counted twice when
            ``evict_every < window``. Given with ``queries``.
        generators: for inputs built by hand (tests): seeded ``torch.Generator`` s, one per row, whose seeds
            (``initial_seed()``) key ``rng`` at position 0 when ``rng`` is not given. The engine passes ``rng``.
        head_span: under tensor parallelism, ``(offset, total)``: ``H`` is the model's KV heads ``offset ..`` of
            ``total`` (this rank's slice); ``None``: every head. :meth:`rand` / :meth:`randn` draw a head axis's noise
            by the model's head index, so the ranks together draw what one process draws.
        layers_per_row: ``L``, the folded layers of one sequence: rows ``[i * L, (i + 1) * L)`` are the ``L`` layers
            (``layer_ids``) of one sequence, which hold the same positions when the policy keeps one set per KV head
            for every layer (TriAttention's per-head mode). The engine passes its full-attention layer count; ``1``
            (default) for inputs built by hand of one layer.
        capacity: the token slots of a row in the engine's storage (a run constant: per-token state padded to it keeps
            one shape for the row's life, :mod:`vase.engine.token_state`); ``None`` for inputs built by hand.
    """

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    n_keep: int
    layer_idx: int | None
    scaling: float
    rng: RowRNG | None = None
    state: dict = field(default_factory=dict)
    queries: torch.Tensor | None = None
    score_dtype: torch.dtype = torch.float32
    window_keys: torch.Tensor | None = None
    generators: list[torch.Generator] | None = None
    window_positions: torch.Tensor | None = None
    query_positions: torch.Tensor | None = None
    n_new_queries: torch.Tensor | None = None
    layer_ids: torch.Tensor | None = None
    head_span: tuple[int, int] | None = None
    layers_per_row: int = 1
    capacity: int | None = None

    def __post_init__(self) -> None:
        if self.layer_ids is None:
            if self.layer_idx is None:
                raise ValueError("EvictionInputs: give layer_idx or layer_ids")
            b = self.keys.shape[0]
            self.layer_ids = torch.full((b,), self.layer_idx, dtype=torch.long, device=self.keys.device)
        if self.rng is None:
            b = self.keys.shape[0]
            seeds = [g.initial_seed() for g in self.generators] if self.generators is not None else [0] * b
            if len(seeds) != b:
                raise ValueError(f"EvictionInputs: {len(seeds)} generators for {b} rows")
            self.rng = RowRNG.from_seeds(seeds, device=self.keys.device)
            self.rng.stream = self.layer_idx if self.layer_idx is not None else self.layer_ids

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """``(B, H, N, D)``."""
        return tuple(self.keys.shape)  # type: ignore[return-value]

    def new_queries(self) -> torch.Tensor:
        """``(B, Wq)`` bool: the ring's queries that are new since the row's previous call (see ``n_new_queries``)."""
        if self.query_positions is None or self.n_new_queries is None:
            raise ValueError("EvictionInputs.new_queries: needs query_positions and n_new_queries (needs_queries=True)")
        newest = self.query_positions.amax(dim=-1, keepdim=True)
        return self.query_positions > newest - self.n_new_queries[:, None]

    def _heads(self, shape: tuple[int, ...]) -> tuple[int, int] | None:
        """``(offset, total)`` of a draw whose first axis is this rank's KV heads (``H``) or query heads (``Hq``)
        under tensor parallelism; ``None`` otherwise (every rank draws the same numbers)."""
        if self.head_span is None or not shape:
            return None
        offset, total = self.head_span
        h = self.keys.shape[1]
        for group in (1, None if self.queries is None else self.queries.shape[1] // h):
            if group and shape[0] == h * group:
                return offset * group, total * group
        return None

    def rand(self, *shape: int) -> torch.Tensor:
        """Uniform float32 noise in ``(0, 1)`` of shape ``(B, *shape)``: one batched draw, row ``b`` from its own stream
        (each call is a new draw). A first axis of ``H`` (or ``Hq``) is the head axis: under tensor parallelism its
        noise is keyed by the model's head index (:attr:`head_span`)."""
        return self.rng.uniform(*shape, heads=self._heads(shape))

    def randn(self, *shape: int) -> torch.Tensor:
        """Standard normal float32 noise of shape ``(B, *shape)``: one batched draw, row ``b`` from its own stream
        (a head axis first: as :meth:`rand`)."""
        return self.rng.normal(*shape, heads=self._heads(shape))


@dataclass
class SelectionInputs:
    """What the engine hands a selection policy at one decode step of one layer.

    The engine calls :meth:`SelectionPolicy.select` at every decode step for every row of the step (the prompt is
    encoded with full causal attention), so state updated incrementally stays in step with the cache. Nothing here is
    per-row host state: the compiled decode step (:mod:`vase.engine.compiled`) traces ``select`` once per bucket of
    rows, so its shapes may depend on ``length`` and ``capacity`` (run constants of a bucket) but never on a row's
    length, which is on the device only.

    Attributes:
        query: ``(B, Hq, 1, D)`` post-RoPE query of the current step.
        keys: ``(B, H, L, D)`` held post-RoPE keys; row ``b`` holds ``lengths[b] <= L`` tokens (its current token at
            index ``lengths[b] - 1``); slots past a row's length are not its tokens. A selection policy's rows are never
            compacted, so slots are in position order.
        length: ``L``, the slots every row's view spans this step (the capacity in a compiled step; at least the
            longest row's held length after this step's append).
        lengths: ``(B,)`` int64 tokens held by each row after this step's append (on the device). In a compiled step
            the padding rows of a bucket (free slots, their output dropped) hold stale lengths in ``[1, L]``.
        capacity: token slots per row of the static storage (an upper bound for every row's length).
        n_new: tokens appended by this forward call (always 1).
        layer_idx: index of the layer.
        state: the rows' persistent state on this layer, ``{key: (B, ...) tensor}``: views of the engine's store,
            created for every row at its prefill by :meth:`SelectionPolicy.init_state`; ``select`` updates them in
            place (it must not add keys). Empty when a caller other than the engine passes no state: the policy then
            creates it (:meth:`SelectionInputs.host_lengths`).
        positions: ``(B, H, L)`` int64 absolute positions of the held tokens (a view of the engine's storage; read
            only), e.g. to undo RoPE (SeerAttention-R's gate works on pre-RoPE queries and keys).
        lengths_host: ``lengths`` as a list of ints, from a caller other than the engine (tests); the engine passes
            ``None`` (a compiled step reads no host state).
    """

    query: torch.Tensor
    keys: torch.Tensor
    length: int
    lengths: torch.Tensor
    capacity: int
    n_new: int
    layer_idx: int
    state: dict = field(default_factory=dict)
    positions: torch.Tensor | None = None
    lengths_host: list[int] | None = None

    def host_lengths(self) -> list[int]:
        """``lengths`` on the host: ``lengths_host`` if given, else read from the device (a sync). Only for creating
        state a caller did not pass (never in the engine's decode, where :meth:`SelectionPolicy.init_state` made it
        at the prefill)."""
        return list(self.lengths_host) if self.lengths_host is not None else self.lengths.tolist()


@dataclass
class Policy:
    """Base of every policy. Subclasses are dataclasses whose fields are their hyper-parameters.

    Attributes:
        budget: tokens kept per (layer, KV head, sequence) after an eviction (``B``); the cache then oscillates
            between ``budget`` and ``budget + window``. Must be a multiple of ``window``.
        window: recent window ``W``: never evicted, and (unless an eviction policy sets ``evict_every``) the number of
            decode steps between evictions.
    """

    budget: int = 0
    window: int = 64

    name: ClassVar[str] = "policy"
    #: how tables and figures name the policy (``None``: the analysis's own label, else ``name``)
    display_name: ClassVar[str | None] = None
    kind: ClassVar[str] = "none"  # "none" | "eviction" | "selection"
    needs_queries: ClassVar[bool] = False
    #: why the policy cannot run on a slice of the KV heads (tensor parallelism, ``parallel.tensor``), ``None`` when
    #: it can: every policy that scores and keeps per (layer, KV head) can; one with per-head parameters indexed by the
    #: model's head (learned gates, calibrated centres) or a choice across heads is refused in this one line
    head_parallel: ClassVar[str | None] = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise one ``ValueError`` naming the bad field. Subclasses extend it (call ``super().validate()``)."""
        if self.kind == "none":
            return
        _check(
            isinstance(self.window, int) and self.window >= 1,
            "policy.window",
            f"must be an integer >= 1, got {self.window!r}",
        )
        _check(
            isinstance(self.budget, int) and self.budget > self.window,
            "policy.budget",
            f"must be an integer greater than window={self.window}, got {self.budget!r} (set budget= or ratio=)",
        )
        _check(
            self.budget % self.window == 0,
            "policy.budget",
            f"must be a multiple of window={self.window} so the eviction trigger (held % window == 0) fires; "
            f"got {self.budget} (try budget={max(2, -(-self.budget // self.window)) * self.window}: the next multiple "
            "up)",
        )

    def setup(self, model_config) -> None:
        """Called once by the decoder with the model's config before anything is decoded (default: nothing).

        A policy that depends on the model checks it here (one-line ``ValueError`` naming the setting and the fix) and
        loads what it needs (SeerAttention-R: its gate checkpoint). Must be idempotent (one decoder per batch plan).
        """

    def calibration_input(self) -> Path | None:
        """A plain-text file (``pathlib.Path``) the runner tokenises and hands to :meth:`calibrate` before decoding,
        or ``None`` (default: the policy needs no calibration pass)."""
        return None

    def calibrate(self, model, input_ids: torch.Tensor) -> dict:
        """Calibrate on the model (``input_ids`` ``(T,)``: the tokenised :meth:`calibration_input`); return what
        :meth:`load_calibration` takes (tensors and numbers; the runner saves it as ``calibration.pt``)."""
        raise NotImplementedError(f"policy {self.name} has no calibration")

    def load_calibration(self, record: dict, device: torch.device | str | None = None) -> None:
        """Use a saved calibration (a resumed run reloads ``calibration.pt`` instead of calibrating again)."""
        raise NotImplementedError(f"policy {self.name} has no calibration")

    @property
    def protected_window(self) -> int:
        """The most recent tokens the engine never hands to :meth:`EvictionPolicy.keep` (``window``; an eviction
        policy may declare fewer with ``protect_recent``)."""
        return self.window

    @property
    def n_keep(self) -> int:
        """Candidates kept at each eviction: ``budget - protected_window`` (less the prompt's ``P`` with
        ``keep_prompt``)."""
        return self.budget - self.protected_window

    def describe(self) -> dict:
        """The policy's name, kind and hyper-parameters (recorded with every run).

        The engine-level options (:data:`ENGINE_OPTIONS`) are left out while they hold the base default and the
        policy's class does not change that default, so adding them left every earlier run's protocol (and run
        directory hash) unchanged; a policy whose class or config sets them records them.
        """
        from dataclasses import asdict, fields

        out = {"name": self.name, "kind": self.kind, **asdict(self)}
        for f in fields(self):
            base = ENGINE_OPTIONS.get(f.name, _NO_DEFAULT)
            if base is not _NO_DEFAULT and f.default == base and out[f.name] == base:
                del out[f.name]
        return out

    def check_prompt(self, prompt_len: int) -> None:
        """Raise one ``ValueError`` if this policy cannot decode a prompt of ``prompt_len`` tokens (default: it can)."""

    def check_model(self, model_config) -> None:
        """Raise one ``ValueError`` naming the field and the fix when a field of this policy does not fit the model
        (its config, before any weight loads: the preflight, :func:`vase.run.planning.plan`). Default: nothing
        depends on the model. Unlike :meth:`setup`, it loads nothing."""

    def held_after(self, prompt_len: int, steps: int) -> int:
        """Tokens a row holds after its prefill and ``steps`` decode steps (appends) under this policy's schedule."""
        return prompt_len + steps


@dataclass
class EvictionPolicy(Policy):
    """Base of eviction policies. Subclasses implement :meth:`keep`.

    Attributes:
        sinks: the first ``sinks`` tokens of the sequence (by absolute position) that the policy never evicts
            (0 = no sink protection).
        keep_prompt: pin the prompt (engine-level, any policy): a row's ``P`` prompt tokens stay in its first ``P``
            slots and are never candidates; the budget counts them, so :meth:`keep` chooses
            ``budget - window - P`` of the generated candidates. A prompt that leaves no room
            (:meth:`min_keep`) is refused before decoding (:meth:`check_prompt`).
        evict_every: the schedule's period ``E`` (``None`` = ``window``, VaSE's scaffold): a row evicts after a decode
            step when it holds more than ``budget`` tokens and its sequence length (prompt + generated) is a multiple
            of ``E``. It then holds ``budget``; between evictions at most ``budget + E``.
        compress_prefill: also evict right after the prefill when the prompt is longer than ``budget`` (R-KV); the
            row then starts decoding with ``budget`` tokens (true positions kept).
        protect_recent: how many of the most recent tokens the engine protects at an eviction (never candidates;
            moved behind the kept ones). ``None`` = ``window`` (VaSE's scaffold); ``0`` makes every held token a
            candidate (TriAttention's HF path, kvpress's KeyDiff); at most ``window``. The query ring and the
            schedule keep ``window``; :meth:`keep` then chooses ``budget - protect_recent`` (``- P``) candidates.
    """

    sinks: int = 4
    keep_prompt: bool = False
    evict_every: int | None = None
    compress_prefill: bool = False
    protect_recent: int | None = None
    kind: ClassVar[str] = "eviction"
    #: the policy counts every query from the prompt on (H2O): the engine seeds its state from the prefill's attention
    #: (:meth:`prefill_state`) and, before a row's first eviction, calls :meth:`keep` with ``n_keep`` = every candidate
    #: each time the query ring holds ``window`` queries the policy has not seen (an observation: nothing is evicted)
    accumulates: ClassVar[bool] = False

    def validate(self) -> None:
        super().validate()
        prot = self.protect_recent
        _check(
            prot is None or (isinstance(prot, int) and not isinstance(prot, bool) and 0 <= prot <= self.window),
            "policy.protect_recent",
            f"must be an integer in [0, window={self.window}] or null (= window), got {prot!r}",
        )
        _check(
            isinstance(self.sinks, int) and self.sinks >= 0,
            "policy.sinks",
            f"must be an integer >= 0, got {self.sinks!r}",
        )
        _check(
            self.sinks <= self.n_keep,
            "policy.sinks",
            f"must be <= budget - {self._protected_name()} = {self.n_keep}, got {self.sinks}",
        )
        for name in ("keep_prompt", "compress_prefill"):
            value = getattr(self, name)
            _check(isinstance(value, bool), f"policy.{name}", f"must be true or false, got {value!r}")
        every = self.evict_every
        _check(
            every is None or (isinstance(every, int) and not isinstance(every, bool) and every >= 1),
            "policy.evict_every",
            f"must be an integer >= 1 or null (= window), got {every!r}",
        )

    @property
    def protected_window(self) -> int:
        """``protect_recent``, or ``window`` when unset (see the class docstring)."""
        p = self.protect_recent
        return self.window if p is None or isinstance(p, bool) or not isinstance(p, int) else p

    def _protected_name(self) -> str:
        return "window" if self.protect_recent is None else "protect_recent"

    @property
    def eviction_period(self) -> int:
        """``E``: ``evict_every``, or ``window`` when unset."""
        return self.window if self.evict_every is None else self.evict_every

    def min_keep(self, prompt_len: int) -> int:
        """Candidates :meth:`keep` needs room for when the prompt (``prompt_len`` tokens) is pinned: at least 1, and
        the sinks the prompt does not cover. Policies that protect more (value protection) raise it."""
        return max(1, self.sinks - prompt_len)

    def check_prompt(self, prompt_len: int) -> None:
        """With ``keep_prompt``: refuse a prompt that, with the window, leaves fewer than :meth:`min_keep` slots.

        A per-sample fallback (evicting that prompt) would mix two methods in one number, so the run is refused
        instead, before anything is decoded.
        """
        if not self.keep_prompt:
            return
        w = self.protected_window
        room, need = self.budget - w - prompt_len, self.min_keep(prompt_len)
        if room >= need:
            return
        # the smallest budget every constraint accepts: room for the prompt, the window and ``need`` candidates, and
        # a multiple of the window (validate); a policy that raises min_keep with the budget is asked again
        budget = -(-(prompt_len + w + need) // self.window) * self.window
        while budget - w - prompt_len < self.min_keep_at(prompt_len, budget):
            budget += self.window
        _check(
            False,
            "policy.keep_prompt",
            f"a prompt of {prompt_len} tokens plus {self._protected_name()}={w} leaves {room} of budget={self.budget} "
            f"for generated tokens, {self.name} needs >= {need}; raise budget to >= {budget} (budget={budget}: a "
            "multiple of the window) or set policy.keep_prompt=false",
        )

    def min_keep_at(self, prompt_len: int, budget: int) -> int:
        """:meth:`min_keep` of this policy with ``budget`` instead of its own (a policy whose protection grows with
        the budget, e.g. a fraction of it, needs more room at a larger one)."""
        from dataclasses import replace

        try:
            return replace(self, budget=budget).min_keep(prompt_len)
        except ValueError:
            return self.min_keep(prompt_len)

    def held_after(self, prompt_len: int, steps: int) -> int:
        """Tokens a row holds after its prefill and ``steps`` decode steps (the schedule above, step by step)."""
        budget, every = self.budget, self.eviction_period
        held, length = prompt_len, prompt_len
        if self.compress_prefill and held > budget:
            held = budget
        for _ in range(steps):
            held += 1
            length += 1
            if held > budget and length % every == 0:
                held = budget
        return held

    def prefill_state(self, positions: torch.Tensor, attention: torch.Tensor, capacity: int) -> dict:
        """An accumulating policy's state of one layer right after a prompt's prefill (``accumulates``).

        Args:
            positions: ``(1, H, P)`` int64 the prompt's positions.
            attention: ``(1, H, P)`` float32: the attention each prompt token received from every prompt query (its
                causal softmax column sums), summed over the query heads of each KV head.
            capacity: the storage's token slots per row (pad per-token state to it).

        Returns:
            ``{key: (1, ...) tensor}``: the state every row of the prompt starts with on this layer.
        """
        raise NotImplementedError(f"policy {self.name} declares accumulates but has no prefill_state")

    def keep(self, inputs: EvictionInputs) -> torch.Tensor:
        """Choose the candidates to keep.

        Args:
            inputs: one layer's candidates (see :class:`EvictionInputs`).

        Returns:
            ``(B, H, n_keep)`` int64 indices into the candidate axis, unique per (row, head), any order.
        """
        raise NotImplementedError


@dataclass
class SelectionPolicy(Policy):
    """Base of selection policies: the full cache is kept; each decode step attends to a subset of it.

    The mask contract (:meth:`select`): ``(B, H, L)`` selects tokens per KV head (every query head of the group attends
    to the same tokens, e.g. SeerAttention-R, Quest with ``group_reduce``), ``(B, Hq, L)`` per query head (query head
    ``j`` belongs to KV head ``j // (Hq // H)``, transformers' layout; e.g. Quest as published). The engine masks slots
    past each row's length, hands the attention kernel a ``(B, Hq, 1, L)`` key mask (a KV-head mask is repeated over
    its group), and counts ``attended_tokens`` per query head (a KV-head mask counts once for each head of its group),
    so the two forms of the same selection report the same number.
    """

    kind: ClassVar[str] = "selection"

    def validate(self) -> None:
        _check(
            isinstance(self.budget, int) and self.budget >= 1,
            "policy.budget",
            f"must be an integer >= 1 (tokens attended per step), got {self.budget!r} (set budget= or ratio=)",
        )

    def init_state(
        self, keys: torch.Tensor, positions: torch.Tensor, lengths: list[int], layer_idx: int, capacity: int
    ) -> dict[str, torch.Tensor]:
        """The per-row state of rows whose first ``lengths[b]`` slots hold their prompt: ``{key: (B, ...) tensor}``,
        each allocated at its final size (e.g. for the whole ``capacity``); ``{}`` (the default) for a stateless policy.

        The engine calls it eagerly, outside the decode forward, right after a prompt's prefill, for every layer,
        with ``B = 1`` (the prompt's keys ``(1, H, P, D)`` and positions ``(1, H, P)``, ``lengths = [P]``) and gives
        every row of the prompt a copy; every row of a decode step therefore has the same state keys, and
        :meth:`select` updates them in place from the first decode step on (the current token is not in the prompt).
        """
        return {}

    def select(self, inputs: SelectionInputs) -> torch.Tensor | None:
        """Return a ``(B, H, L)`` or ``(B, Hq, L)`` bool mask of the held tokens this step attends to (see the class
        docstring), or ``None`` for all of them.

        Slots past a row's length are masked by the engine whatever the policy returns for them. ``None`` must be a
        decision on run constants (``layer_idx``, ``length``), not on a row's length (a compiled step traces it once).
        """
        raise NotImplementedError


@dataclass
class FullCache(Policy):
    """The full cache: never evicts (the accuracy ceiling and memory reference)."""

    name: ClassVar[str] = "full"
    kind: ClassVar[str] = "none"
