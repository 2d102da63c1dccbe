"""Quest as published: query-aware page selection over the full cache (a selection policy: no memory saving).

What mit-han-lab/Quest does (read at commit 01c1623), and this policy with its defaults:

* Keys are grouped into pages of ``page_size`` tokens in storage order (the full cache never reorders), summarised by
  their element-wise ``kmax``/``kmin``. Per decode step, layer and **query head**, a page is scored by the upper bound
  ``Σ_d max(q_d·kmax_d, q_d·kmin_d)`` of ``q·k`` over its tokens (:func:`vase.engine.scores.page_upper_bound`).
  Quest's kernels are MHA-only (``InferenceController`` uses ``num_heads`` for the KV heads); its evaluation code
  (``evaluation/quest_attention.py``) repeats the KV heads (``repeat_kv``) and selects per query head, so with GQA
  each query head selects its own pages.
* The page budget counts the current page: ``budget // page_size`` pages in all (``quest_init``: ``page_budget =
  token_budget // page_size``, "real page budget including the last page"). The current (last, possibly partial)
  page is always attended and never scored; the other ``budget // page_size - 1`` pages are the best complete pages
  by the bound (``decode_estimate`` and ``decode_topk`` exclude the last page; ``decode_sparse_attn`` adds it). A
  row holding at most ``budget // page_size`` pages attends to everything (``need_estimate``).
* The first ``dense_layers = 2`` layers attend to every token (``_quest_skip_layer = 2``).

``group_reduce`` (``max`` or ``sum``) is the grouped variant this harness used before: one page set per KV head,
the group's query heads' bounds combined. It is kept as an option because it is what a GQA kernel can exploit (every
selected page is read once per KV head, as SeerAttention-R's per-KV-head blocks are), whereas per-query-head pages
can make a KV head read up to ``Hq / H`` times the budget. Its budget counts the current page too.

Every token stays in memory: the engine reports ``attended_tokens`` (mean tokens attended per step, row, query head
and layer, the dense layers included) next to the KV bytes, so Quest is compared "at the same sparsity", never as
a memory saving.

Page summaries ``kmax``/``kmin`` ``(B, H, ceil(capacity / page_size), D)`` live in ``state``, made for each row from
its prompt right after the prefill (:meth:`Quest.init_state`, outside the decode forward); after that only the page of
each row's new token is updated (the engine calls ``select`` at every decode step of every live row, so the summaries
stay in step). Rows hold different lengths (continuous batching): every row is scored over the pages the step's keys
span and ranks only its own complete pages, so a step's work depends on no row's length on the host (the compiled
step, :mod:`vase.engine.compiled`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from vase.engine.policy import SelectionInputs, SelectionPolicy, _check
from vase.engine.scores import GROUP_REDUCE, page_min_max, page_upper_bound


@dataclass
class Quest(SelectionPolicy):
    """Quest page selection (as published by default; see the module docstring).

    Attributes:
        budget: tokens attended per step and head: ``budget // page_size`` pages, the current page included.
        window: unused (kept so every policy config has the same keys).
        page_size: tokens per page (16).
        dense_layers: the first ``dense_layers`` layers attend to every held token (Quest: 2).
        group_reduce: ``none`` selects pages per query head (Quest); ``max`` | ``sum`` selects one set per KV head,
            combining its query heads' bounds.
    """

    page_size: int = 16
    dense_layers: int = 2
    group_reduce: str = "none"

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
            f"must be >= page_size = {ps} (budget // page_size pages are attended, the current one included), "
            f"got {self.budget}",
        )
        dl = self.dense_layers
        _check(
            isinstance(dl, int) and not isinstance(dl, bool) and dl >= 0,
            "policy.dense_layers",
            f"must be an integer >= 0, got {dl!r}",
        )
        _check(
            self.group_reduce in GROUP_REDUCE,
            "policy.group_reduce",
            f"must be one of {', '.join(GROUP_REDUCE)}, got {self.group_reduce!r}",
        )

    def check_model(self, model_config) -> None:
        """``dense_layers`` at most the model's ``num_hidden_layers`` (all of them: every layer attends densely)."""
        layers = getattr(model_config, "num_hidden_layers", None)
        _check(
            not isinstance(layers, int) or self.dense_layers <= layers,
            "policy.dense_layers",
            f"must be <= the model's num_hidden_layers = {layers}, got {self.dense_layers}; e.g. "
            f"policy.dense_layers={min(2, layers) if isinstance(layers, int) else 2} (Quest's 2, or fewer on a "
            "smaller model)",
        )

    @property
    def n_pages(self) -> int:
        """Pages attended per step and head, the current page included."""
        return self.budget // self.page_size

    def init_state(
        self, keys: torch.Tensor, positions: torch.Tensor, lengths: list[int], layer_idx: int, capacity: int
    ) -> dict[str, torch.Tensor]:
        """``kmax``/``kmin`` ``(B, H, ceil(capacity / page_size), D)``: each row's pages of its first ``lengths[b]``
        tokens summarised (zero past them); ``{}`` in the dense layers (no selection there)."""
        if layer_idx < self.dense_layers:
            return {}
        ps = self.page_size
        b, h, _, d = keys.shape
        pages = -(-capacity // ps)
        kmax, kmin = keys.new_zeros((b, h, pages, d)), keys.new_zeros((b, h, pages, d))
        for i, length in enumerate(lengths):
            if length:
                mx, mn = page_min_max(keys[i : i + 1, :, :length], ps)
                kmax[i, :, : mx.shape[2]] = mx[0]
                kmin[i, :, : mn.shape[2]] = mn[0]
        return {"kmax": kmax, "kmin": kmin}

    def page_summaries(self, inputs: SelectionInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """``(kmax, kmin)``, each ``(B, H, ceil(capacity / page_size), D)``, kept up to date in ``inputs.state``: the
        page of each row's new token takes it in (the state summarises the tokens before it: the engine's from the
        prompt on, :meth:`init_state`; a caller that passes none gets it made here)."""
        st, ps = inputs.state, self.page_size
        keys = inputs.keys
        if "kmax" not in st:  # not the engine's call: summarise the tokens before each row's current one
            before = [n - 1 for n in inputs.host_lengths()]
            st.update(self.init_state(keys, inputs.positions, before, inputs.layer_idx, inputs.capacity))
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
        """``(B, Hq, L)`` (``group_reduce=none``) or ``(B, H, L)`` bool: each row's current page plus its
        ``n_pages - 1`` best complete pages (all of them when it holds at most ``n_pages`` pages); ``None`` in the
        dense layers or when the keys handed in span at most ``n_pages`` pages (then no row holds more).

        Every row is scored over the same pages, the ``ceil(L / page_size)`` the keys span (no host maximum, so a
        compiled step traces it once); pages a row has not completed are masked out of its ranking."""
        if inputs.layer_idx < self.dense_layers:
            return None
        ps, n_pages = self.page_size, self.n_pages
        kmax, kmin = self.page_summaries(inputs)  # kept up to date at every step
        n_total = -(-inputs.length // ps)  # the pages the keys span
        if n_total <= n_pages:
            return None
        bound = page_upper_bound(inputs.query, kmax[:, :, :n_total], kmin[:, :, :n_total], self.group_reduce)
        b, heads = bound.shape[:2]
        cur = torch.div(inputs.lengths - 1, ps, rounding_mode="floor")  # (B,) pages before it are complete
        complete = torch.arange(n_total, device=bound.device)[None, :] < cur[:, None]  # (B, P)
        bound = bound.masked_fill(~complete[:, None, :], float("-inf"))
        top = bound.topk(n_pages - 1, dim=-1).indices  # a row with fewer complete pages gets all of them
        pages = torch.zeros((b, heads, n_total), dtype=torch.bool, device=bound.device)
        pages.scatter_(-1, top, True)
        pages &= complete[:, None, :]
        pages.scatter_(-1, cur.view(b, 1, 1).expand(b, heads, 1), True)  # the current page, always
        return pages.repeat_interleave(ps, dim=-1)[..., : inputs.length]
