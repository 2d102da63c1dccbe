"""The policy interface shared by every KV-cache policy.

A policy is a small dataclass whose fields are its hyper-parameters. The engine (:mod:`vase.engine.cache`) owns the
storage and calls the policy at two hooks:

* eviction policies (``kind = "eviction"``) implement :meth:`EvictionPolicy.keep`: at each eviction event the engine
  hands the candidates of the rows that evict now (one layer) and gets back, per (row, KV head), the indices of the
  candidates to keep; the engine does the gather and moves the recent window behind them.
* selection policies (``kind = "selection"``, e.g. Quest) keep every token and implement
  :meth:`SelectionPolicy.select`: per decode step and layer, a boolean mask of the held tokens that the step attends to.
* ``kind = "none"`` (the full cache) never evicts nor selects.

Rows of one call may come from different problems (continuous batching): every input is per row, and a policy must
treat rows independently (a row's answer may depend only on that row's tensors, its random stream and its state).

Shapes use ``B`` = rows in the call, ``H`` = KV heads, ``Hq`` = query heads, ``N`` = candidates, ``D`` = head dim.

Policy state: ``inputs.state`` is a dict of row-first tensors ``(B, ...)`` that the engine keeps per row and per layer
between calls (e.g. CurDKV's sketch). A call's rows all have the same keys in their state: an empty dict means these
rows have never stored anything on this layer (new sequences). Put or replace tensors in it; the engine stores each
row's slice and hands it back at the row's next call. A key must keep its per-row shape for the row's lifetime.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from vase.engine.rng import RowRNG


def _check(cond: bool, setting: str, msg: str) -> None:
    if not cond:
        raise ValueError(f"{setting}: {msg}")


@dataclass
class EvictionInputs:
    """What the engine hands an eviction policy at one eviction event of one layer.

    Attributes:
        keys: ``(B, H, N, D)`` post-RoPE keys of the candidates (every held token but the ``window`` most recent).
        values: ``(B, H, N, D)`` values of the candidates.
        positions: ``(B, H, N)`` int64 absolute token positions of the candidates (0 = first prompt token).
        n_keep: how many candidates to keep per (sequence, KV head): ``budget - window``.
        layer_idx: index of the layer.
        scaling: softmax scale of the model's attention (usually ``D ** -0.5``).
        rng: the rows' random streams (:class:`vase.engine.rng.RowRNG`), keyed by each row's eviction key, its
            absolute position at this eviction and the layer; draw through :meth:`rand` / :meth:`randn` (one batched
            draw for all rows) so that a row's choice does not depend on the other rows of the batch.
        state: the rows' persistent state on this layer (see the module docstring): ``{key: (B, ...) tensor}``.
        queries: ``(B, Hq, Wq, D)`` post-RoPE queries of the last ``Wq <= window`` tokens, or ``None`` when the policy
            does not declare ``needs_queries``.
        generators: for inputs built by hand (tests): seeded ``torch.Generator`` s, one per row, whose seeds
            (``initial_seed()``) key ``rng`` at position 0 when ``rng`` is not given. The engine passes ``rng``.
    """

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    n_keep: int
    layer_idx: int
    scaling: float
    rng: RowRNG | None = None
    state: dict = field(default_factory=dict)
    queries: torch.Tensor | None = None
    generators: list[torch.Generator] | None = None

    def __post_init__(self) -> None:
        if self.rng is None:
            b = self.keys.shape[0]
            seeds = [g.initial_seed() for g in self.generators] if self.generators is not None else [0] * b
            if len(seeds) != b:
                raise ValueError(f"EvictionInputs: {len(seeds)} generators for {b} rows")
            self.rng = RowRNG.from_seeds(seeds, stream=self.layer_idx, device=self.keys.device)

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """``(B, H, N, D)``."""
        return tuple(self.keys.shape)  # type: ignore[return-value]

    def rand(self, *shape: int) -> torch.Tensor:
        """Uniform float32 noise in ``(0, 1)`` of shape ``(B, *shape)``: one batched draw, row ``b`` from its own stream
        (each call is a new draw)."""
        return self.rng.uniform(*shape)

    def randn(self, *shape: int) -> torch.Tensor:
        """Standard normal float32 noise of shape ``(B, *shape)``: one batched draw, row ``b`` from its own stream."""
        return self.rng.normal(*shape)


@dataclass
class SelectionInputs:
    """What the engine hands a selection policy at one decode step of one layer.

    The engine calls :meth:`SelectionPolicy.select` at every decode step for every live row (the prompt is encoded
    with full causal attention), so state updated incrementally stays in step with the cache.

    Attributes:
        query: ``(B, Hq, 1, D)`` post-RoPE query of the current step.
        keys: ``(B, H, L, D)`` held keys; row ``b`` holds ``lengths[b] <= L`` tokens (its current token at index
            ``lengths[b] - 1``); slots past a row's length are not its tokens.
        length: ``L``, the longest row's held length after this step's append.
        lengths: ``(B,)`` int64 tokens held by each row (on the device).
        lengths_host: the same as a list of ints (no device synchronisation needed to read it).
        capacity: token slots per row of the static storage (an upper bound for every row's length).
        n_new: tokens appended by this forward call (always 1).
        layer_idx: index of the layer.
        state: the rows' persistent state on this layer (row-first tensors, as for eviction).
    """

    query: torch.Tensor
    keys: torch.Tensor
    length: int
    lengths: torch.Tensor
    lengths_host: list[int]
    capacity: int
    n_new: int
    layer_idx: int
    state: dict = field(default_factory=dict)


@dataclass
class Policy:
    """Base of every policy. Subclasses are dataclasses whose fields are their hyper-parameters.

    Attributes:
        budget: tokens kept per (layer, KV head, sequence) after an eviction (``B``); the cache then oscillates
            between ``budget`` and ``budget + window``. Must be a multiple of ``window``.
        window: recent window ``W``: never evicted, and the number of decode steps between evictions.
    """

    budget: int = 0
    window: int = 64

    name: ClassVar[str] = "policy"
    kind: ClassVar[str] = "none"  # "none" | "eviction" | "selection"
    needs_queries: ClassVar[bool] = False

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
            f"got {self.budget} (try {max(2, round(self.budget / self.window)) * self.window})",
        )

    @property
    def n_keep(self) -> int:
        """Candidates kept at each eviction: ``budget - window``."""
        return self.budget - self.window

    def describe(self) -> dict:
        """The policy's name, kind and hyper-parameters (recorded with every run)."""
        from dataclasses import asdict

        return {"name": self.name, "kind": self.kind, **asdict(self)}


@dataclass
class EvictionPolicy(Policy):
    """Base of eviction policies. Subclasses implement :meth:`keep`.

    Attributes:
        sinks: the first ``sinks`` tokens of the sequence (by absolute position) that the policy never evicts
            (0 = no sink protection).
    """

    sinks: int = 4
    kind: ClassVar[str] = "eviction"

    def validate(self) -> None:
        super().validate()
        _check(
            isinstance(self.sinks, int) and self.sinks >= 0,
            "policy.sinks",
            f"must be an integer >= 0, got {self.sinks!r}",
        )
        _check(
            self.sinks <= self.n_keep,
            "policy.sinks",
            f"must be <= budget - window = {self.n_keep}, got {self.sinks}",
        )

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
    """Base of selection policies: the full cache is kept; each decode step attends to a subset of it."""

    kind: ClassVar[str] = "selection"

    def validate(self) -> None:
        _check(
            isinstance(self.budget, int) and self.budget >= 1,
            "policy.budget",
            f"must be an integer >= 1 (tokens attended per step), got {self.budget!r} (set budget= or ratio=)",
        )

    def select(self, inputs: SelectionInputs) -> torch.Tensor | None:
        """Return a ``(B, H, L)`` bool mask of the held tokens this step attends to, or ``None`` for all of them.

        Slots past a row's length are masked by the engine whatever the policy returns for them.
        """
        raise NotImplementedError


@dataclass
class FullCache(Policy):
    """The full cache: never evicts (the accuracy ceiling and memory reference)."""

    name: ClassVar[str] = "full"
    kind: ClassVar[str] = "none"
