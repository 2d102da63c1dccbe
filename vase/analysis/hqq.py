"""Half-Quadratic Quantization (HQQ; Badri & Shaji, 2023), the quantizer of the paper's value-cache analysis.

The authors (terarachang/VaSE ``eval/reasoning_tasks/quantize_hqq.py``) call ``hqq.core.quantize.Quantizer.quantize``
on each layer's value cache of one example, reshaped to ``(tokens, D)``, with ``axis=1`` (groups of ``group_size``
consecutive channels of a token), ``optimize=True`` and ``round_zero=False``. What that does, written here from the
published algorithm so the analysis needs no new dependency:

1. per group, the min-max start: ``scale = (2^b - 1) / (max - min)`` (clamped at 2e4, which also covers a constant
   group) and ``zero = -min * scale``; a value quantizes to ``q = clamp(round(x * scale + zero), 0, 2^b - 1)`` and
   dequantizes to ``(q - zero) / scale``;
2. the scale stays; the zero point is refined by half-quadratic splitting of ``min ||x - dequant(quant(x))||_p^p``
   (``p = 0.7``): an auxiliary error ``e`` takes the generalised soft-threshold (``shrink``) of the residual, then
   ``zero`` is the group mean of ``q - (x - e) * scale``; ``beta`` grows by ``kappa`` each step. It runs at most
   ``iters`` (20) steps and stops at the first step whose mean absolute residual (over the whole tensor) does not
   improve on the best so far (HQQ starts that best at 1e4; here at infinity);
3. the values are quantized once more with the final zero point.

HQQ runs this in float16 on CUDA; here it is float32 on any device (as the authors' ``x.to(torch.float32)`` intends).
"""

from __future__ import annotations

import torch

#: HQQ's defaults for the proximal solver (``optimize_weights_proximal``)
LP_NORM, BETA, KAPPA, ITERS = 0.7, 10.0, 1.01, 20
SCALE_MAX = 2e4


def shrink(x: torch.Tensor, beta: float, lp_norm: float = LP_NORM) -> torch.Tensor:
    """The generalised soft-threshold of the l_p proximal step: ``sign(x) * relu(|x| - |x|^(p-1) / beta)`` (for
    ``p = 1`` the plain soft-threshold ``sign(x) * relu(|x| - 1 / beta)``). Same shape as ``x``."""
    a = x.abs()
    cut = torch.full_like(a, 1.0 / beta) if lp_norm == 1 else a.pow(lp_norm - 1) / beta
    return torch.sign(x) * torch.relu(a - cut)


def optimize_zero(
    w: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    levels: int,
    iters: int = ITERS,
    lp_norm: float = LP_NORM,
    beta: float = BETA,
    kappa: float = KAPPA,
) -> torch.Tensor:
    """HQQ's zero point for groups ``w (G, g)`` with fixed ``scale (G, 1)``, starting at ``zero (G, 1)``; returns the
    new ``(G, 1)`` zero points (see the module docstring, step 2)."""
    best = float("inf")
    for _ in range(iters):
        q = torch.round(w * scale + zero).clamp(0, levels)
        r = (q - zero) / scale
        e = shrink(w - r, beta, lp_norm)
        zero = (q - (w - e) * scale).mean(dim=1, keepdim=True)
        beta *= kappa
        error = float((w - r).abs().mean())
        if error < best:
            best = error
        else:
            break
    return zero


def hqq_quantize(x: torch.Tensor, bits: int, group_size: int, iters: int = ITERS) -> torch.Tensor:
    """Quantize-dequantize ``x (..., D)`` with HQQ over groups of ``group_size`` consecutive channels of each vector
    (``group_size >= D``: one group per vector; else ``D`` must be a multiple of it, as HQQ requires). The stopping
    rule looks at all of ``x`` at once, as the authors' call does on one example's layer. ``iters=0`` is plain
    min-max quantization. Returns float32 ``(..., D)``."""
    if bits < 1:
        raise ValueError(f"bits: must be >= 1, got {bits}")
    if group_size < 1:
        raise ValueError(f"group_size: must be >= 1, got {group_size}")
    d = x.shape[-1]
    g = min(group_size, d)
    if d % g:
        raise ValueError(f"group_size: HQQ needs the head dimension {d} to be a multiple of it, got {group_size}")
    levels = 2**bits - 1
    w = x.float().reshape(-1, g)
    lo, hi = w.amin(dim=1, keepdim=True), w.amax(dim=1, keepdim=True)
    scale = (levels / (hi - lo)).clamp(max=SCALE_MAX)
    zero = optimize_zero(w, scale, -lo * scale, levels, iters)
    q = torch.round(w * scale + zero).clamp(0, levels)
    return ((q - zero) / scale).reshape(x.shape)
