"""Tolerances for comparing two floating-point computations of the same quantity that take different paths (another
kernel, another reduction order, another CPU instruction set), derived from the dtype and the reduction length.

A fixed ``atol=1e-5`` on a float32 result holds on one CPU and fails on another: AVX2, AVX-512, AMX and oneDNN's
kernels sum in different orders, and a sum of ``k`` products is only known to within ``k * u * sum(|a_i b_i|)``
(Higham, *Accuracy and Stability of Numerical Algorithms*, 3.1; ``u = eps / 2``). :func:`close` gives that bound,
with a safety factor, for results ``depth`` reductions deep (a layer of a model is one), so a test asserts what the
arithmetic guarantees rather than what one machine happened to round to.
"""

from __future__ import annotations

import torch


def close(dtype: torch.dtype, k: int, *, scale: float = 1.0, depth: int = 1, factor: float = 4.0) -> dict:
    """``{"rtol", "atol"}`` for ``torch.testing.assert_close`` / ``np.testing.assert_allclose`` on results of
    ``dtype`` arithmetic whose every element sums ``k`` terms, ``depth`` such reductions deep, of magnitude ``scale``
    (e.g. the largest absolute value of the reference)."""
    bound = factor * torch.finfo(dtype).eps * k * depth
    return {"rtol": bound, "atol": bound * float(scale)}
