"""Pure tensor math shared by the eviction and selection policies (no model, no cache).

Every function is vectorised over the batch, the heads and the candidates and states its shapes: ``B`` = rows,
``H`` = KV heads, ``Hq`` = query heads (``Hq % H == 0``; query head ``j`` belongs to KV head ``j // (Hq // H)``,
transformers' layout), ``Wq`` = window queries, ``N`` = candidates, ``D`` = head dim, ``P`` = pages, ``r`` = sketch
rank.

The scores compute in ``dtype``: float32 by default (the harness), or bfloat16 to round as the authors' code does
(``protocol=paper``, docs/protocol.md): they compute every score in the KV cache's bf16 with their order of operations,
which rounds the attention logits to ~0.05-0.1 and creates ties at the top-k boundary. The engine hands the choice to
every policy as ``EvictionInputs.score_dtype``; a score comes back in that dtype, so what a policy computes from it
(R-KV's mixture) rounds the same way. Sampling keys are float64 either way.

* :func:`windowed_attention_score` — the SnapKV-style score of SnapKV, R-KV and VaSE-AttnV (method.md §2).
* :func:`value_statistic` — the value-magnitude statistic VaSE protects (range, L2, abs-max, variance).
* :func:`redundancy_score` — R-KV's key redundancy (a quadratic similarity matrix, computed in linear time).
* :func:`cur_score` — the CUR sketch score of CurDKV / VaSE-DKV.
* :func:`topk_with_protection`, :func:`sample_without_replacement` — choosing ``k`` candidates.
* :func:`page_min_max`, :func:`page_upper_bound` — Quest's page summaries and bound.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

VALUE_STATS = ("range", "l2", "absmax", "variance")
#: ``protocol.score_dtype`` -> the dtype of the policies' score math (docs/protocol.md).
SCORE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def score_dtype(name: str) -> torch.dtype:
    """The torch dtype of a ``protocol.score_dtype`` name (``float32`` | ``bfloat16``)."""
    if name not in SCORE_DTYPES:
        raise ValueError(f"protocol.score_dtype: unknown {name!r}; choose one of {', '.join(SCORE_DTYPES)}")
    return SCORE_DTYPES[name]


SMOOTH_ALONG = ("storage", "position")
GROUP_REDUCE = ("none", "max", "sum")


def windowed_attention_score(
    queries: torch.Tensor,
    keys: torch.Tensor,
    scaling: float,
    temperature: float = 1.0,
    smooth_kernel: int = 5,
    positions: torch.Tensor | None = None,
    max_chunk_elements: int | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """How much the recent window attends to each candidate.

    Per (row, KV head): logits ``q·k * scaling / temperature`` for every window query of every query head of the
    group, softmax over the candidates, mean over the window queries, optional 1-D average pool (``smooth_kernel``,
    padding ``smooth_kernel // 2``, stride 1, zero padding counted, as ``F.avg_pool1d`` does by default), mean over the
    query heads of the group. The pool and the group mean are both linear, so they commute: we pool once after the
    group mean.

    Args:
        queries: ``(B, Hq, Wq, D)`` post-RoPE window queries (any order: only their mean matters).
        keys: ``(B, H, N, D)`` post-RoPE candidate keys.
        scaling: the model's softmax scale (``D ** -0.5``).
        temperature: attention temperature ``T_attn`` (> 0); higher flattens the score.
        smooth_kernel: odd pool kernel; 0 or 1 turns smoothing off.
        positions: ``(B, H, N)`` absolute positions. ``None`` pools along the storage axis (neighbours in the cache,
            what the authors' code does); given, pools along increasing position (neighbours in the text).
        max_chunk_elements: bound on the float32 logits held at once (default: 2**19 on CPU, 2**26 on GPU); the
            result does not depend on it.
        dtype: ``torch.float32`` (the formula above, one rounding at the end) or a 16-bit dtype: the authors' order
            of operations in that dtype (:func:`_windowed_attention_rounded`).

    Returns:
        ``(B, H, N)`` in ``dtype``, each (row, head) summing to 1 before smoothing (up to rounding).
    """
    if dtype != torch.float32:
        return _windowed_attention_rounded(
            queries, keys, scaling, temperature, smooth_kernel, positions, max_chunk_elements, dtype
        )
    b, hq, wq, d = queries.shape
    h, n = keys.shape[1], keys.shape[2]
    if hq % h:
        raise ValueError(f"queries: {hq} query heads is not a multiple of {h} KV heads")
    gw = (hq // h) * wq
    q = queries.reshape(b * h, gw, d)  # the group's queries, stacked, per (row, KV head)
    k = keys.reshape(b * h, n, d)
    score = torch.empty((b * h, n), dtype=torch.float32, device=keys.device)
    # The (G*Wq, N) float32 logits of a (row, KV head) are built a few slices at a time: on CPU a chunk then stays in
    # cache (3x faster at 16 rows x 2048 candidates), on GPU it bounds the transient (1 GB at once for a 14B model at
    # batch 16, 6K tokens). Each slice is computed exactly as the one-shot version, so the result is identical.
    step = max(1, (max_chunk_elements or _default_chunk(keys.device)) // max(gw * n, 1))
    for s in range(0, b * h, step):
        logits = torch.matmul(q[s : s + step].float(), k[s : s + step].float().transpose(-1, -2))
        logits.mul_(scaling / temperature)  # (chunk, G*Wq, N)
        score[s : s + step] = logits.softmax(dim=-1).mean(dim=-2)  # mean over window queries and group heads
    score = score.view(b, h, n)
    if smooth_kernel > 1:
        score = _smooth(score, smooth_kernel, positions)
    return score


def _windowed_attention_rounded(
    queries: torch.Tensor,
    keys: torch.Tensor,
    scaling: float,
    temperature: float,
    smooth_kernel: int,
    positions: torch.Tensor | None,
    max_chunk_elements: int | None,
    dtype: torch.dtype,
) -> torch.Tensor:
    """The windowed attention score rounded as the authors' code computes it in ``dtype`` (their ``EvictLayer``).

    Every step below returns a ``dtype`` tensor, so each rounds once: the logits ``q·k`` (a ``dtype`` matmul), their
    division by ``sqrt(D) · T``; the softmax is computed in float32 from the rounded logits and rounded back; the mean
    over the window queries; the average pool, per query head (before the group mean, as their code does); the mean
    over the query heads of the group. Shapes as :func:`windowed_attention_score`; returns ``(B, H, N)`` in ``dtype``.
    """
    q, k = per_kv_head(queries, keys, dtype)
    b, h, n = keys.shape[:3]
    g, wq = q.shape[1], q.shape[2]
    divisor = temperature / scaling  # sqrt(D) * T
    per_head = torch.empty((b * h, g, n), dtype=dtype, device=keys.device)
    step = max(1, (max_chunk_elements or _default_chunk(keys.device)) // max(g * wq * n, 1))
    for s in range(0, b * h, step):
        logits = torch.matmul(q[s : s + step], k[s : s + step].transpose(-1, -2)) / divisor  # (chunk, G, Wq, N)
        probs = logits.softmax(dim=-1, dtype=torch.float32).to(dtype)
        per_head[s : s + step] = probs.mean(dim=-2)
    score = per_head.view(b, h * g, n)  # per query head (transformers' layout: head j uses KV head j // G)
    if smooth_kernel > 1:
        pos = None if positions is None else positions.unsqueeze(2).expand(b, h, g, n).reshape(b, h * g, n)
        score = _smooth(score, smooth_kernel, pos)
    return score.view(b, h, g, n).mean(dim=2)


def _default_chunk(device: torch.device) -> int:
    """Float32 elements of windowed-attention logits built at once: ~2 MB (stays in a CPU core's L2) or 256 MB."""
    return 2**19 if device.type == "cpu" else 2**26


def per_kv_head(queries: torch.Tensor, keys: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``queries (B, Hq, W, D)``, ``keys (B, H, N, D)`` in ``dtype``, grouped per (row, KV head): ``q (B*H, G, W, D)``
    (the group's ``G = Hq / H`` query heads) and ``k (B*H, 1, N, D)``. Hq must be a multiple of H."""
    b, hq, wq, d = queries.shape
    h, n = keys.shape[1], keys.shape[2]
    if hq % h:
        raise ValueError(f"queries: {hq} query heads is not a multiple of {h} KV heads")
    q = queries.to(dtype).reshape(b * h, hq // h, wq, d)
    return q, keys.to(dtype).reshape(b * h, 1, n, d)


def _smooth(score: torch.Tensor, kernel: int, positions: torch.Tensor | None) -> torch.Tensor:
    """Average-pool ``score (B, H, N)`` along the last axis (storage order, or position order if given)."""
    b, h, n = score.shape
    if positions is not None:
        order = positions.argsort(dim=-1)
        score = score.gather(-1, order)
    pooled = F.avg_pool1d(score.reshape(b * h, 1, n), kernel_size=kernel, stride=1, padding=kernel // 2).view(b, h, n)
    if positions is not None:
        pooled = torch.empty_like(pooled).scatter_(-1, order, pooled)
    return pooled


def value_statistic(values: torch.Tensor, stat: str = "range", dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Magnitude of each value vector over the head dimension.

    Args:
        values: ``(B, H, N, D)``.
        stat: ``"range"`` (max − min), ``"l2"`` (Euclidean norm), ``"absmax"`` (largest |v_d|) or ``"variance"``
            (unbiased, ``correction=1``, as ``torch.var`` and the authors' code).
        dtype: computed in this dtype (bfloat16: the authors' rounding, e.g. ``max - min`` rounded once).

    Returns:
        ``(B, H, N)`` in ``dtype``.
    """
    v = values.to(dtype)
    if stat == "range":
        return v.amax(dim=-1) - v.amin(dim=-1)
    if stat == "l2":
        return v.norm(dim=-1)
    if stat == "absmax":
        return v.abs().amax(dim=-1)
    if stat == "variance":
        return v.var(dim=-1)
    raise ValueError(f"value_stat: unknown statistic {stat!r}; choose one of {', '.join(VALUE_STATS)}")


def redundancy_score(keys: torch.Tensor, eps: float = 1e-8, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """R-KV's redundancy of each candidate key: softmax over candidates of its mean cosine similarity to the others.

    The self-similarity is zeroed and the mean divides by ``N`` (the zeroed diagonal included), as in the R-KV and
    VaSE code. Their pairwise similarity matrix ``(B, H, N, N)`` is quadratic in the candidates (``O(N²·D)`` time,
    ``O(N²)`` memory: 8.6 GB in float32 at 16 rows × 8 heads × 4096 candidates). Only its row sums enter the score,
    and ``Σ_{j≠i} k̂_i·k̂_j = k̂_i·(Σ_j k̂_j) − k̂_i·k̂_i``, so we compute the same numbers in ``O(N·D)`` without
    building it (``tests/test_scores.py`` checks this against the explicit matrix).

    In a 16-bit ``dtype`` every similarity is rounded before it is averaged, so the linear form does not reproduce the
    authors' numbers: :func:`_redundancy_rounded` builds the matrix in column blocks instead.

    Args:
        keys: ``(B, H, N, D)``.
        eps: added to the key norms.
        dtype: ``torch.float32`` (linear time) or a 16-bit dtype (the authors' rounding, quadratic time).

    Returns:
        ``(B, H, N)`` in ``dtype``, summing to 1 per (row, head).
    """
    if dtype != torch.float32:
        return _redundancy_rounded(keys, eps, dtype)
    k = keys.float()
    k = k / (k.norm(dim=-1, keepdim=True) + eps)  # k̂
    total = k.sum(dim=-2, keepdim=True)  # (B, H, 1, D)
    row_sum = (k * total).sum(dim=-1) - k.square().sum(dim=-1)  # Σ_{j≠i} k̂_i·k̂_j: (B, H, N)
    return (row_sum / k.shape[-2]).softmax(dim=-1)


def _redundancy_rounded(keys: torch.Tensor, eps: float, dtype: torch.dtype, block: int = 512) -> torch.Tensor:
    """R-KV's redundancy as the authors compute it in ``dtype``: normalised keys, the cosine matrix (each entry
    rounded), the diagonal zeroed, the mean over the first candidate axis, a softmax. Built ``block`` columns at a time
    (the column means are those of the full matrix), so memory is ``O(N·block)``. ``(B, H, N, D)`` -> ``(B, H, N)``."""
    k = keys.to(dtype)
    k = k / (k.norm(dim=-1, keepdim=True) + eps)
    n = k.shape[-2]
    means = torch.empty(k.shape[:-1], dtype=dtype, device=k.device)
    for j in range(0, n, block):
        cols = k[..., j : j + block, :]
        sim = torch.matmul(k, cols.transpose(-1, -2))  # (B, H, N, block): columns j.. of the similarity matrix
        diag = torch.arange(j, j + cols.shape[-2], device=k.device)
        sim[..., diag, diag - j] = 0.0
        means[..., j : j + block] = sim.mean(dim=-2)
    return means.softmax(dim=-1)


def cur_score(
    keys: torch.Tensor, values: torch.Tensor, sketch: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """CUR sketch score ``‖k G‖² · ‖v G‖²``, normalised to sum to 1 over the candidates.

    Args:
        keys, values: ``(B, H, N, D)``.
        sketch: ``(B, D, r)`` Gaussian sketch ``G`` (shared by the heads of a row), or ``(D, r)``.
        dtype: computed in this dtype; bfloat16 rounds the sketch, both products, the squares, their sums, the
            product and the normalisation as the authors' code does.

    Returns:
        ``(B, H, N)`` in ``dtype``.
    """
    g = sketch.to(dtype)
    if g.dim() == 2:
        g = g.unsqueeze(0).expand(keys.shape[0], -1, -1)
    g = g.unsqueeze(1)  # (B, 1, D, r)
    k2 = torch.matmul(keys.to(dtype), g).square().sum(dim=-1)
    v2 = torch.matmul(values.to(dtype), g).square().sum(dim=-1)
    score = k2 * v2
    return score / score.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(dtype).tiny)


def topk_with_protection(
    score: torch.Tensor,
    k: int,
    protected: torch.Tensor | None = None,
    excluded: torch.Tensor | None = None,
) -> torch.Tensor:
    """Deterministic top-``k`` along the last axis; protected items first (+inf), excluded items last (−inf).

    Args:
        score: ``(..., N)``.
        k: items to choose (``<= N``).
        protected: ``(..., N)`` bool, items always chosen (if there are at most ``k`` of them).
        excluded: ``(..., N)`` bool, items chosen only when nothing else is left.

    Returns:
        ``(..., k)`` int64 indices, protected first, then by decreasing score (the order the authors' cache stores
        them in).
    """
    key = score if score.is_floating_point() else score.float()
    if protected is not None:
        key = key.masked_fill(protected, float("inf"))
    if excluded is not None:
        key = key.masked_fill(excluded, float("-inf"))
    return key.topk(k, dim=-1, largest=True, sorted=True).indices


def sample_without_replacement(
    weights: torch.Tensor,
    k: int,
    uniform: torch.Tensor,
    protected: torch.Tensor | None = None,
    excluded: torch.Tensor | None = None,
) -> torch.Tensor:
    """Draw ``k`` items without replacement, each draw proportional to ``weights`` among the items left.

    Gumbel-top-k (the exponential race): key ``log w − log E`` with ``E = −log U ~ Exp(1)``; the ``k`` largest keys
    are a sample of successive draws, in draw order. Zero-weight items come after every positive one (uniformly at
    random among themselves), excluded items after those, protected items before everything.

    Args:
        weights: ``(..., N)`` non-negative (a negative weight counts as zero; not checked, to avoid a device sync).
        k: items to draw (``<= N``).
        uniform: ``(..., N)`` uniform ``[0, 1)`` noise (draw it from the rows' streams: ``inputs.rand``).
        protected: ``(..., N)`` bool, always chosen (first).
        excluded: ``(..., N)`` bool, chosen only when nothing else is left.

    Returns:
        ``(..., k)`` int64 indices: protected first, then in draw order.
    """
    w = weights.double()
    u = uniform.double().clamp(min=1e-300, max=1.0 - 2.0**-53)  # keep log(u) finite and < 0
    gumbel = -torch.log(-torch.log(u))  # in [-6.6, 36.8]
    # log w >= log(1e-45) ≈ -104 for any positive float32 weight: an offset of 1e4 puts zeros after all of them.
    key = torch.where(w > 0, torch.log(w.clamp_min(1e-300)), torch.full_like(w, -1e4)) + gumbel
    if protected is not None:
        key = key.masked_fill(protected, float("inf"))
    if excluded is not None:
        key = key.masked_fill(excluded, float("-inf"))
    return key.topk(k, dim=-1, largest=True, sorted=True).indices


def protect_largest(
    stat: torch.Tensor, n_protect: int, sinks: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The sinks plus the largest-``stat`` candidates: ``n_protect`` in all.

    Args:
        stat: ``(B, H, N)`` value statistic.
        n_protect: protected slots, the sinks included; pass at least the number of sinks per (row, head).
        sinks: ``(B, H, N)`` bool sink tokens.

    Returns:
        ``(indices (B, H, n_protect), mask (B, H, N) bool)``; indices are sinks first, then by decreasing ``stat``.
    """
    idx = topk_with_protection(stat, n_protect, sinks)
    return idx, torch.zeros_like(stat, dtype=torch.bool).scatter_(-1, idx, True)


def page_min_max(keys: torch.Tensor, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Quest's page summaries: element-wise max and min of the keys of each page.

    Args:
        keys: ``(B, H, L, D)``; page ``p`` holds tokens ``[p * page_size, (p + 1) * page_size)``, the last one may be
            partial.
        page_size: tokens per page.

    Returns:
        ``(kmax, kmin)``, each ``(B, H, ceil(L / page_size), D)`` in the keys' dtype.
    """
    b, h, length, d = keys.shape
    full = length // page_size
    body = keys[:, :, : full * page_size].reshape(b, h, full, page_size, d)
    kmax, kmin = body.amax(dim=3), body.amin(dim=3)
    if length > full * page_size:
        tail = keys[:, :, full * page_size :]
        kmax = torch.cat([kmax, tail.amax(dim=2, keepdim=True)], dim=2)
        kmin = torch.cat([kmin, tail.amin(dim=2, keepdim=True)], dim=2)
    return kmax, kmin


def page_upper_bound(
    query: torch.Tensor, kmax: torch.Tensor, kmin: torch.Tensor, group_reduce: str = "max"
) -> torch.Tensor:
    """Quest's bound ``Σ_d max(q_d·kmax_d, q_d·kmin_d)`` ≥ ``max_{k in page} q·k``, per query head or per KV head.

    Computed as ``q⁺·kmax + q⁻·kmin`` (``q⁺ = max(q, 0)``, ``q⁻ = min(q, 0)``): two matmuls, no ``(…, P, D)`` tensor.
    ``group_reduce="none"`` keeps one bound per query head (Quest as published); with GQA ``"max"`` (a page ranks high
    if any head of the group may attend to it strongly; the bound then bounds every head) or ``"sum"`` (bounds the
    summed logit) combines the query heads of a group into one bound per KV head.

    Args:
        query: ``(B, Hq, D)`` or ``(B, Hq, 1, D)`` the current query.
        kmax, kmin: ``(B, H, P, D)`` page summaries.
        group_reduce: ``"none"``, ``"max"`` or ``"sum"``.

    Returns:
        ``(B, Hq, P)`` (``"none"``) or ``(B, H, P)`` float32.
    """
    q = query.float()
    if q.dim() == 4:
        q = q.squeeze(2)
    b, hq, d = q.shape
    h = kmax.shape[1]
    q = q.view(b, h, hq // h, d)
    bound = torch.matmul(q.clamp(min=0), kmax.float().transpose(-1, -2)) + torch.matmul(
        q.clamp(max=0), kmin.float().transpose(-1, -2)
    )  # (B, H, G, P)
    if group_reduce == "none":
        return bound.reshape(b, hq, -1)
    if group_reduce == "max":
        return bound.amax(dim=2)
    if group_reduce == "sum":
        return bound.sum(dim=2)
    raise ValueError(f"group_reduce: unknown reduction {group_reduce!r}; choose one of {', '.join(GROUP_REDUCE)}")
