"""Quest: query-aware page selection over the full cache (a selection policy: no memory saving).

Keys are grouped into pages of ``page_size`` tokens in storage order (the full cache never reorders). Per decode step,
layer and KV head, each page is scored by the upper bound ``Σ_d max(q_d·kmax_d, q_d·kmin_d)`` of ``q·k`` over its
tokens (:func:`vase.engine.scores.page_upper_bound`); the step attends to the ``budget // page_size`` best
complete pages plus the current (last, possibly partial) page, i.e. at most ``budget`` tokens plus the current page.
With GQA the
group's query heads are combined by ``group_reduce`` (default ``max``: a page ranks by the most optimistic head).

Every token stays in memory: the engine reports ``attended_tokens`` (mean per step, row, KV head and layer) next to
the KV bytes, so Quest is compared "at the same sparsity", never as a memory saving.

Page summaries ``kmax``/``kmin`` ``(B, H, ceil(capacity / page_size), D)`` live in ``state``, allocated once per row
when the row first needs a selection; after that only the page of each row's new token is updated (the engine calls
``select`` at every decode step of every live row, so the summaries stay in step). Rows hold different lengths
(continuous batching): each row ranks only its own complete pages.
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
        """``(kmax, kmin)``, each ``(B, H, ceil(capacity / page_size), D)``, kept up to date in ``inputs.state``."""
        st, ps = inputs.state, self.page_size
        keys = inputs.keys
        if "kmax" not in st:  # rows new to selection: summarise every page they hold
            b, h, _, d = keys.shape
            pages = -(-inputs.capacity // ps)
            kmax, kmin = keys.new_zeros((b, h, pages, d)), keys.new_zeros((b, h, pages, d))
            for i, length in enumerate(inputs.lengths_host):
                mx, mn = page_min_max(keys[i : i + 1, :, :length], ps)
                kmax[i, :, : mx.shape[2]] = mx[0]
                kmin[i, :, : mn.shape[2]] = mn[0]
            st.update(kmax=kmax, kmin=kmin)
            return kmax, kmin
        kmax, kmin = st["kmax"], st["kmin"]
        rows = torch.arange(keys.shape[0], device=keys.device)
        last = inputs.lengths - 1  # slot of each row's new token
        page = torch.div(last, ps, rounding_mode="floor")
        starts = (last % ps == 0)[:, None, None]  # the new token opens a page
        new = keys[rows, :, last]  # (B, H, D)
        kmax[rows, :, page] = torch.where(starts, new, torch.maximum(kmax[rows, :, page], new))
        kmin[rows, :, page] = torch.where(starts, new, torch.minimum(kmin[rows, :, page], new))
        return kmax, kmin

    def select(self, inputs: SelectionInputs) -> torch.Tensor | None:
        """``(B, H, L)`` bool: each row's best pages within the budget plus its current page; ``None`` if all fit."""
        ps = self.page_size
        current = [(length - 1) // ps for length in inputs.lengths_host]  # pages before it are complete
        n_pages = self.budget // ps
        fits = max(current) <= n_pages
        if fits and "kmax" not in inputs.state:
            return None
        kmax, kmin = self.page_summaries(inputs)
        if fits:
            return None
        n_complete = max(current)
        bound = page_upper_bound(inputs.query, kmax[:, :, :n_complete], kmin[:, :, :n_complete], self.group_reduce)
        b, h = bound.shape[:2]
        cur = torch.div(inputs.lengths - 1, ps, rounding_mode="floor")  # (B,)
        complete = torch.arange(n_complete, device=bound.device)[None, :] < cur[:, None]  # (B, P)
        bound = bound.masked_fill(~complete[:, None, :], float("-inf"))
        top = bound.topk(min(n_pages, n_complete), dim=-1).indices  # (B, H, k)
        n_total = max(n_complete + 1, -(-inputs.length // ps))  # pages spanning the keys handed in
        pages = torch.zeros((b, h, n_total), dtype=torch.bool, device=bound.device)
        pages.scatter_(-1, top, True)
        pages[..., :n_complete] &= complete[:, None, :]
        pages[..., n_complete + 1 :] = False
        pages.scatter_(-1, cur.view(b, 1, 1).expand(b, h, 1), True)
        return pages.repeat_interleave(ps, dim=-1)[..., : inputs.length]
