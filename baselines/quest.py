"""Quest: query-aware page selection over the full cache (a selection policy: no memory saving).

Keys are grouped into pages of ``page_size`` tokens in storage order (the full cache never reorders). Per decode step,
layer and KV head, each page is scored by the upper bound ``Σ_d max(q_d·kmax_d, q_d·kmin_d)`` of ``q·k`` over its
tokens (:func:`vase.engine.scores.page_upper_bound`); the step attends to the ``budget // page_size`` best
complete pages plus the current (last, possibly partial) page, i.e. at most ``budget`` tokens plus the current page.
With GQA the
group's query heads are combined by ``group_reduce`` (default ``max``: a page ranks by the most optimistic head).

Every token stays in memory: the engine reports ``attended_tokens`` (mean per step, row, KV head and layer) next to
the KV bytes, so Quest is compared "at the same sparsity", never as a memory saving.

Page summaries ``kmax``/``kmin`` ``(B, H, P, D)`` live in ``state`` and are updated incrementally: only the pages
touched by the tokens appended since the previous call are recomputed (all of them the first time, or if the held
length is not the one the state expects).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from vase.engine.policy import SelectionInputs, SelectionPolicy, _check
from vase.engine.scores import GROUP_REDUCE, page_min_max, page_upper_bound


@dataclass
class Quest(SelectionPolicy):
    """Quest page selection.

    Attributes:
        budget: tokens attended per step besides the current page (``budget // page_size`` pages).
        window: unused (kept so every policy config has the same keys).
        page_size: tokens per page (16).
        group_reduce: how the query heads of a KV head's group combine their page bounds: ``max`` | ``sum``.
    """

    page_size: int = 16
    group_reduce: str = "max"

    name: ClassVar[str] = "quest"
    needs_queries: ClassVar[bool] = False

    def validate(self) -> None:
        super().validate()
        ps = self.page_size
        _check(
            isinstance(ps, int) and not isinstance(ps, bool) and ps >= 1,
            "policy.page_size",
            f"must be an integer >= 1, got {ps!r}",
        )
        _check(
            self.budget >= ps,
            "policy.budget",
            f"must be >= page_size = {ps} (budget // page_size pages are attended), got {self.budget}",
        )
        _check(
            self.group_reduce in GROUP_REDUCE,
            "policy.group_reduce",
            f"must be one of {', '.join(GROUP_REDUCE)}, got {self.group_reduce!r}",
        )

    def page_summaries(self, inputs: SelectionInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """``(kmax, kmin)``, each ``(B, H, ceil(L / page_size), D)``, updated in ``inputs.state``."""
        st, ps, length = inputs.state, self.page_size, inputs.length
        prev = st.get("length")
        kmax, kmin = st.get("kmax"), st.get("kmin")
        fresh = (
            prev is None
            or prev != length - inputs.n_new
            or kmax is None
            or kmax.shape[0] != inputs.keys.shape[0]
            or kmax.shape[2] != -(-prev // ps)
        )
        if fresh:
            kmax, kmin = page_min_max(inputs.keys, ps)
        else:
            first = prev // ps  # first page touched by the new tokens
            new_max, new_min = page_min_max(inputs.keys[:, :, first * ps : length], ps)
            kmax = torch.cat([kmax[:, :, :first], new_max], dim=2)
            kmin = torch.cat([kmin[:, :, :first], new_min], dim=2)
        st.update(kmax=kmax, kmin=kmin, length=length)
        return kmax, kmin

    def select(self, inputs: SelectionInputs) -> torch.Tensor | None:
        """``(B, H, L)`` bool: the best pages within the budget plus the current page; ``None`` (all) if they fit."""
        ps, length = self.page_size, inputs.length
        current = (length - 1) // ps  # index of the current page; pages before it are complete
        n_pages = min(self.budget // ps, current)
        if n_pages >= current:
            return None
        kmax, kmin = self.page_summaries(inputs)
        bound = page_upper_bound(inputs.query, kmax[:, :, :current], kmin[:, :, :current], self.group_reduce)
        top = bound.topk(n_pages, dim=-1).indices  # (B, H, n_pages)
        b, h = bound.shape[:2]
        pages = torch.zeros((b, h, current + 1), dtype=torch.bool, device=bound.device)
        pages.scatter_(-1, top, True)
        pages[..., current] = True
        return pages.repeat_interleave(ps, dim=-1)[..., :length]
