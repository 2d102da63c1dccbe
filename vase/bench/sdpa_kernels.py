"""Which SDPA kernel a call reaches: ``F.scaled_dot_product_attention`` calls recorded with the aten kernel they ran.

Torch's default dispatch picks a fused kernel (flash, memory-efficient, cuDNN; on the CPU its flash kernel) from the
shapes, masks and dtype, or falls back to the math kernel. :class:`SdpaKernels` (a ``TorchFunctionMode`` around each
call, a ``TorchDispatchMode`` inside it) counts the kernel each call ran, per phase; :func:`default_kernels` asks it
about the decode layouts of a staggered batch on any device. Only torch is used (no engine code).
"""

from __future__ import annotations

import contextlib
from collections import Counter, defaultdict
from collections.abc import Iterator

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

#: aten op reached by ``F.scaled_dot_product_attention`` -> the kernel's short name
SDPA_KERNELS = {
    "_scaled_dot_product_flash_attention": "flash",
    "_scaled_dot_product_flash_attention_for_cpu": "flash_cpu",
    "_scaled_dot_product_efficient_attention": "efficient",
    "_scaled_dot_product_cudnn_attention": "cudnn",
    "_scaled_dot_product_fused_attention_overrideable": "overrideable",
    "_scaled_dot_product_attention_math": "math",
    "_scaled_dot_product_attention_math_for_mps": "math",
}


class _KernelOps(TorchDispatchMode):
    """The aten ops of one SDPA call (the composite op is decomposed here under ``inference_mode``, where a dispatch
    mode sees it before its kernel is chosen)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.__name__.split(".")[0]
        self.ops.append(name)
        if name == "scaled_dot_product_attention":
            with _KernelOps() as inner:  # the handler runs with this mode popped: see the decomposition's ops
                out = func.decompose(*args, **kwargs)
            self.ops += inner.ops
            if out is not NotImplemented:
                return out
        return func(*args, **kwargs)


class SdpaKernels(TorchFunctionMode):
    """Counts the kernel every ``F.scaled_dot_product_attention`` call reaches, per phase, while :attr:`active`.

    ``counts[phase][kernel]``. The phase is :attr:`phase` when the caller sets it (a decode that packs query heads
    into the query-length axis has queries of several tokens), else ``prefill`` for a query of more than one token,
    ``decode`` otherwise.
    """

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, Counter] = defaultdict(Counter)
        self.active = True
        self.phase: str | None = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.active or getattr(func, "__name__", "") != "scaled_dot_product_attention":
            return func(*args, **kwargs)
        query = args[0] if args else kwargs["query"]
        with _KernelOps() as ops:
            out = func(*args, **kwargs)
        found = [SDPA_KERNELS[o] for o in ops.ops if o in SDPA_KERNELS]
        phase = self.phase or ("prefill" if query.shape[-2] > 1 else "decode")
        self.counts[phase][found[-1] if found else "unknown"] += 1
        return out

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        active, self.active = self.active, False
        try:
            yield
        finally:
            self.active = active

    def summary(self) -> dict[str, dict[str, int]]:
        """``{phase: {kernel: calls}}`` (phases without calls left out)."""
        return {p: dict(sorted(c.items())) for p, c in self.counts.items() if c}


def default_kernels(device: torch.device, dtype: torch.dtype, rows: int = 3, heads: tuple[int, int] = (32, 8)) -> dict:
    """The kernel the default dispatch picks for a staggered decode call in two layouts (``decode_gqa_mask``: GQA
    through ``enable_gqa`` with a per-row mask; ``decode_packed``: a KV group's query heads in the query-length axis,
    the same mask) and for a causal prefill (random tensors; row ``r`` attends to ``L - 7 r`` keys).

    Returns:
        ``{phase: {kernel: calls}}`` for the phases ``decode_gqa_mask``, ``decode_packed``, ``prefill``.
    """
    hq, hkv = heads
    d, length = 128, 64
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(rows, hq, 1, d, device=device, dtype=dtype, generator=g)
    k = torch.randn(rows, hkv, length, d, device=device, dtype=dtype, generator=g)
    mask = torch.arange(length, device=device) < (length - 7 * torch.arange(rows, device=device))[:, None]
    counter = SdpaKernels()
    with torch.inference_mode(), counter:
        counter.phase = "decode_gqa_mask"  # the engine's decode before issue 19: enable_gqa with a per-row mask
        torch.nn.functional.scaled_dot_product_attention(q, k, k, attn_mask=mask[:, None, None], enable_gqa=True)
        counter.phase = "decode_packed"  # the query heads of a KV group in the query-length axis, with the mask
        packed = q.view(rows, hkv, hq // hkv, d)
        torch.nn.functional.scaled_dot_product_attention(packed, k, k, attn_mask=mask[:, None, None])
        counter.phase = "prefill"
        p, kp = q[:1].expand(1, hq, 16, d).contiguous(), k[:1, :, :16]
        torch.nn.functional.scaled_dot_product_attention(p, kp, kp, is_causal=True, enable_gqa=True)
    return counter.summary()
