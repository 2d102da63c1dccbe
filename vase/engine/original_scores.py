"""The original baselines' scores (R-KV as Zefan-Cai/R-KV computes it, CurDKV as NVIDIA/kvpress's ``CURPress``).

Pure tensor math, vectorised over rows and heads, no model and no cache. VaSE's versions of the same methods are in
:mod:`vase.engine.scores` (``redundancy_score``, ``cur_score``); what differs is listed in ``baselines/rkv_original.py``
and ``baselines/curdkv_original.py``, with file and line references into the original code.

``dtype`` is the precision the originals hold their tensors in (their code runs in the model's dtype, bf16): inputs are
cast to it before each product and intermediate results are rounded to it where the original's tensors are in the
model's dtype; reductions (softmax, sums) accumulate in float32, as their CUDA kernels do. The default, float32,
computes everything in float32. Shapes: ``B`` rows, ``H`` KV heads, ``Hq`` query heads (query head ``j`` belongs to
KV head ``j // (Hq // H)``), ``Wq`` window queries, ``N`` candidates, ``W`` recent-window keys, ``L = N + W``, ``D``
head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vase.engine.scores import _default_chunk, per_kv_head

LEVERAGE_TYPES = ("key", "value", "kv_avg", "kv_product")
#: columns of R-KV's similarity matrix built at once per (row, head) (fixed: see :func:`rkv_original_redundancy`)
SIMILARITY_COLUMNS = 512


def rkv_original_attention(
    queries: torch.Tensor,
    keys: torch.Tensor,
    scaling: float,
    pool_kernel: int = 7,
    dtype: torch.dtype = torch.float32,
    max_chunk_elements: int | None = None,
) -> torch.Tensor:
    """R-KV's importance: group max of the logits, softmax over the candidates, mean over the window, max-pool.

    Per (row, KV head): logits ``q·k * scaling`` of every window query of every query head of the group against every
    candidate, **max over the group's query heads** (before the softmax), softmax over the candidates (float32), mean
    over the window queries, rounded to ``dtype``, then a 1-D **max** pool (``pool_kernel``, padding
    ``pool_kernel // 2``, stride 1) along the candidate axis (storage order).

    Args:
        queries: ``(B, Hq, Wq, D)`` post-RoPE window queries (any order).
        keys: ``(B, H, N, D)`` post-RoPE candidate keys (the recent window excluded: R-KV's softmax runs over
            ``[: -window]``).
        scaling: softmax scale (R-KV divides by ``sqrt(D)``; the model's scale, ``D ** -0.5``, for Qwen/Llama).
        pool_kernel: odd max-pool kernel (R-KV: 7); 1 turns the pool off.
        dtype: see the module docstring.
        max_chunk_elements: bound on the logits held at once; the result does not depend on it.

    Returns:
        ``(B, H, N)`` in ``dtype``.
    """
    q, k = per_kv_head(queries, keys, dtype)
    b, h, n = keys.shape[:3]
    g, wq = q.shape[1], q.shape[2]
    score = torch.empty((b * h, n), dtype=dtype, device=keys.device)
    step = max(1, (max_chunk_elements or _default_chunk(keys.device)) // max(g * wq * n, 1))
    for s in range(0, b * h, step):
        logits = torch.matmul(q[s : s + step], k[s : s + step].transpose(-1, -2)) * scaling  # (c, G, Wq, N)
        logits = logits.amax(dim=1)  # the group's max, before the softmax
        score[s : s + step] = logits.float().softmax(dim=-1).mean(dim=-2).to(dtype)
    score = score.view(b, h, n)
    if pool_kernel > 1:
        score = F.max_pool1d(score, kernel_size=pool_kernel, stride=1, padding=pool_kernel // 2)
    return score


def rkv_original_redundancy(
    keys: torch.Tensor,
    threshold: float = 0.5,
    dtype: torch.dtype = torch.float32,
    eps: float = 1e-8,
    max_chunk_elements: int | None = None,
) -> torch.Tensor:
    """R-KV's redundancy over every key it is given (candidates and recent window alike).

    With ``k̂`` the keys divided by their norm (+ ``eps``) and ``S = k̂ k̂ᵀ`` (``L × L``) per (row, head): zero the
    diagonal; for each row ``i`` find the newest ``j`` with ``S[i, j] > threshold`` (``0`` when there is none, as
    R-KV's ``max`` over ``where(mask, arange, 0)``) and zero ``S[i, j]``; take the mean of each **column** over the
    ``L`` rows, then a softmax over the ``L`` keys. The newest of a group of similar keys thus loses one similarity
    term and ranks as less redundant: it is the one kept.

    ``S`` is built :data:`SIMILARITY_COLUMNS` columns at a time, twice (``O(L²·D)`` time as R-KV, bounded memory): a
    first pass finds each row's newest similar key (an integer maximum), the second zeroes those entries and the
    diagonal and sums each column over the rows. The block width is fixed (BLAS and the sums round differently for
    other shapes), and ``max_chunk_elements`` only sets how many (row, head) pairs run at once, so the result depends
    neither on it nor on the other rows of a batch.

    Args:
        keys: ``(B, H, L, D)`` post-RoPE keys of every held token in storage order (candidates first, the recent
            window last).
        threshold: similarity above which a pair counts as redundant (R-KV: 0.5).
        dtype, eps: see the module docstring; ``eps`` is added to the key norms (R-KV: 1e-8).
        max_chunk_elements: bound on the similarities held at once (at least one block); the result does not depend
            on it.

    Returns:
        ``(B, H, L)`` in ``dtype``, summing to 1 per (row, head) (slice the candidates' ``[:N]`` yourself).
    """
    b, h, length, d = keys.shape
    k = keys.float()
    kn = (k / (k.norm(dim=-1, keepdim=True) + eps)).to(dtype).reshape(b * h, length, d)
    ar = torch.arange(length, device=keys.device)
    width = min(length, SIMILARITY_COLUMNS)
    pairs = max(1, (max_chunk_elements or _default_chunk(keys.device)) // (length * width))
    col_sum = torch.empty((b * h, length), dtype=torch.float32, device=keys.device)
    for p in range(0, b * h, pairs):
        kp = kn[p : p + pairs]  # (c, L, D)

        def columns(s: int, kp: torch.Tensor = kp) -> tuple[torch.Tensor, torch.Tensor]:
            """``S[:, :, s : s + width]`` of these pairs with its diagonal zeroed, and the columns' indices."""
            cols = ar[s : s + width]
            sim = torch.matmul(kp, kp[:, s : s + width].transpose(-1, -2))  # (c, L, w)
            sim[:, cols, torch.arange(cols.numel(), device=keys.device)] = 0
            return sim, cols

        newest = torch.zeros(kp.shape[:2], dtype=torch.long, device=keys.device)  # 0 when a row has no similar key
        for s in range(0, length, width):
            sim, cols = columns(s)
            newest = torch.maximum(newest, torch.where(sim > threshold, cols, torch.zeros_like(cols)).amax(dim=-1))
        for s in range(0, length, width):
            sim, cols = columns(s)
            sim = sim.masked_fill(newest.unsqueeze(-1) == cols, 0)  # each row's newest similar key
            col_sum[p : p + pairs, s : s + width] = sim.float().sum(dim=-2)
    mean = (col_sum.view(b, h, length) / length).to(dtype)
    return mean.float().softmax(dim=-1).to(dtype)


def rkv_original_score(
    queries: torch.Tensor,
    keys: torch.Tensor,
    window_keys: torch.Tensor,
    scaling: float,
    mix_lambda: float = 0.1,
    pool_kernel: int = 7,
    threshold: float = 0.5,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """R-KV's final score of the candidates: ``λ·importance − (1 − λ)·redundancy``.

    Args:
        queries: ``(B, Hq, Wq, D)`` window queries.
        keys: ``(B, H, N, D)`` candidate keys.
        window_keys: ``(B, H, W, D)`` keys of the recent window (in R-KV's redundancy, not among the candidates).
        scaling, pool_kernel: of :func:`rkv_original_attention`; threshold: of :func:`rkv_original_redundancy`.
        mix_lambda: ``λ`` (R-KV paper and README: 0.1; its code's default: 0.07).
        dtype: see the module docstring (the combination itself is computed in it, as R-KV does in bf16).

    Returns:
        ``(B, H, N)`` float32 (higher = keep).
    """
    n = keys.shape[2]
    attn = rkv_original_attention(queries, keys, scaling, pool_kernel, dtype)
    red = rkv_original_redundancy(torch.cat([keys, window_keys], dim=2), threshold, dtype)[:, :, :n]
    return (attn * mix_lambda - red * (1 - mix_lambda)).to(dtype).float()


def kvpress_cur_score(
    keys: torch.Tensor,
    values: torch.Tensor,
    local_window: int = 16,
    leverage: str = "kv_product",
    sketch: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """kvpress ``CURPress``'s leverage score (the sinks are the caller's: it forces them to the top).

    Optionally project keys and values on ``sketch`` (``use_random_leverage``); ``k2 = ‖k‖²``, ``v2 = ‖v‖²`` per
    token; with ``local_window > 0`` each of ``k2`` and ``v2`` is divided by its sum over consecutive blocks of
    ``local_window`` tokens along the token axis (the last block zero-padded: normalised over its real tokens);
    combine (``key``: k2, ``value``: v2, ``kv_avg``: (k2 + v2) / 2, ``kv_product``: k2·v2) and normalise over the
    tokens.

    Args:
        keys, values: ``(B, H, N, D)`` in storage order (the blocks follow it, as kvpress's follow its cache).
        local_window: block length (kvpress: 16); 0 = one global normalisation (``use_local_approximation=False``).
        leverage: one of :data:`LEVERAGE_TYPES`.
        sketch: ``(B, D, r)`` projection shared by a row's heads, or ``None`` (kvpress's default: no projection).
        dtype: see the module docstring.

    Returns:
        ``(B, H, N)`` float32, summing to 1 per (row, head).
    """
    if leverage not in LEVERAGE_TYPES:
        raise ValueError(f"leverage: unknown type {leverage!r}; choose one of {', '.join(LEVERAGE_TYPES)}")
    k, v = keys.to(dtype), values.to(dtype)
    if sketch is not None:
        g = sketch.to(dtype).unsqueeze(1)  # (B, 1, D, r)
        k, v = torch.matmul(k, g), torch.matmul(v, g)
    k2 = k.float().square().sum(dim=-1).to(dtype)  # (B, H, N)
    v2 = v.float().square().sum(dim=-1).to(dtype)
    tiny = torch.finfo(torch.float32).tiny
    if local_window > 0:
        b, h, n = k2.shape
        pad = (local_window - n % local_window) % local_window

        def local(x: torch.Tensor) -> torch.Tensor:
            blocks = F.pad(x.float(), (0, pad)).view(b, h, -1, local_window)
            return (blocks / blocks.sum(dim=-1, keepdim=True).clamp_min(tiny)).view(b, h, -1)[:, :, :n].to(dtype)

        k2, v2 = local(k2), local(v2)
    if leverage == "key":
        score = k2
    elif leverage == "value":
        score = v2
    elif leverage == "kv_avg":
        score = (k2 + v2) / 2
    else:
        score = k2 * v2
    score = score.float()
    return score / score.sum(dim=-1, keepdim=True).clamp_min(tiny)
