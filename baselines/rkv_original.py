"""R-KV as its authors released it (Zefan-Cai/R-KV), beside VaSE's version (``baselines/rkv.py``).

Read from github.com/Zefan-Cai/R-KV at ``d15c976`` (2025-06-13; ``rkv/`` is unchanged since ``76b94cd``, its first
commit). The rule, and where it is in their code:

* Score (``rkv/compression/r1_kv.py`` ``R1KV.update_kv``, lines 43-82): ``final = λ·attn − (1 − λ)·sim``, keep the
  top ``budget − window_size`` candidates (all held tokens but the last ``window_size``), then the window.
* ``attn`` (``rkv/utils.py`` ``compute_attention_scores`` lines 8-39, ``pooling="max"``; ``r1_kv.py`` 49-67): logits
  ``q·k / sqrt(D)`` of the last ``window_size`` queries against every held key, **max over the query heads of a KV
  group before the softmax** (``utils.py`` 35-36); softmax over the candidates only (``[..., -window:, :-window]``,
  float32), mean over the window queries, cast to the model dtype (line 58), then ``F.max_pool1d`` with **kernel 7**
  (padding 3, stride 1; ``kernel_size=7`` in the constructor, line 13).
* ``sim`` (``utils.py`` ``cal_similarity`` lines 42-94, called with ``threshold=0.5``, ``retain_direction="last"``):
  cosine similarities of **all held keys, the window included** (the ``[:, :-window]`` slice is taken after, line
  73); diagonal zeroed; for each key the **newest key with similarity > 0.5** has its similarity zeroed (lines
  57-71, 92); mean over rows, **softmax over all held keys**, then the candidates' part.
* λ: the R-KV paper and its README ("Default Hyper-parameters": λ = 0.1) say 0.1; the code's defaults say 0.07
  (``R1KV.__init__`` ``mix_lambda=0.07``, r1_kv.py line 14; ``run_math.py`` ``--mix_lambda`` default 0.07, line 140).
  We use **0.1**, the value the paper reports its results with and the README documents as the default;
  ``rkv_lambda=0.07`` reproduces a run of their script as released.
* Window: ``window_size = 8`` (README: ``α`` = 8 observation tokens; ``run_math.py`` has no default, line 138).
* Schedule (``rkv/modeling.py`` ``CausalLM_forward`` lines 560-611, ``divide_method="step_length"``,
  ``divide_length=128``, ``run_math.py`` lines 149-154; the README's ``B_buffer`` = 128): after every forward the
  flag "sequence length % 128 == 0" is set and the next forward appends its token, then compresses the whole cache
  if it holds ``>= budget`` tokens (``modeling.py`` 152-168 in ``LlamaAttention_forward``, the same in the Qwen2/Qwen3
  copies; ``r1_kv.py`` 46). The cache so holds between ``budget``
  and ``budget + 128`` tokens. Here: ``evict_every=128`` (the engine's schedule: held > budget and the sequence
  length a multiple of 128).
* Prefill (``modeling.py`` 130-150: ``compression`` starts as ``None``, ``run_math.py`` line 184): the prompt's keys
  are compressed to ``budget`` right after the prefill when it holds ``>= budget`` tokens; the prefill's own attention
  sees the whole prompt. Here: ``compress_prefill=True``.
* No sink tokens (``first_tokens`` is passed but unused by ``R1KV``), deterministic top-k, kept tokens stored in
  decreasing score order (``topk``), the window behind them: as here.

What we do not reproduce, and why:

* Their counter ``self.length`` is never reset between problems (``modeling.py`` 560-563) and ``compression`` is not
  reset to ``None`` after the first problem, so in a multi-problem run the phase of the 128-step schedule, and
  whether a later problem's prompt is compressed at the prefill, depend on the problems decoded before it. We
  follow their first problem (the intent): every prompt is compressed at its prefill, and the phase follows the
  sequence length. On that first problem their flag, set after forward ``t``, compresses at forward ``t + 1``: one
  step after ours (same period).
* ``cal_similarity`` uses ``key_states[0]`` (the first sequence of the batch) for every sequence (``utils.py`` 48);
  their runs use batch 1. We compute it per sequence.
* When the cache holds exactly ``budget`` at a trigger, theirs re-sorts it by score without evicting; ours skips it
  (no token leaves either way; only the storage order the next max-pool runs along differs).
* ``compression_content="think"`` (stop compressing after ``</think>``) and ``divide_method="newline"`` are options
  their script does not use by default; not implemented.
* ``rkv/compression/__init__.py`` imports ``.rkv`` and ``.simkv``, which the snapshot does not contain (the class is
  in ``r1_kv.py``): their package does not import as released; we read the code, we did not run it.

Precision: theirs holds the pooled attention, the similarities and the final score in the model's dtype (bf16). The
score functions take a ``dtype`` (float32 by default, as every score of the harness).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from vase.engine.original_scores import rkv_original_score
from vase.engine.policy import EvictionInputs, EvictionPolicy, _check
from vase.engine.scores import topk_with_protection


@dataclass
class RKVOriginal(EvictionPolicy):
    """R-KV (Zefan-Cai/R-KV) with its own defaults (see the module docstring).

    Attributes:
        window: R-KV's ``window_size`` (8): the observation queries and the recent tokens never evicted.
        sinks: 0 (R-KV protects none).
        evict_every: 128 (R-KV's buffer); compress_prefill: True.
        rkv_lambda: ``λ`` in [0, 1] (0.1; their code: 0.07).
        pool_kernel: odd max-pool kernel along the candidates (7); 1 = off.
        similarity_threshold: cosine similarity above which the newest similar key is spared (0.5).
    """

    window: int = 8
    sinks: int = 0
    evict_every: int | None = 128
    compress_prefill: bool = True
    rkv_lambda: float = 0.1
    pool_kernel: int = 7
    similarity_threshold: float = 0.5

    name: ClassVar[str] = "rkv_original"
    needs_queries: ClassVar[bool] = True

    def validate(self) -> None:
        super().validate()
        lam = self.rkv_lambda
        _check(
            isinstance(lam, (int, float)) and not isinstance(lam, bool) and 0 <= lam <= 1,
            "policy.rkv_lambda",
            f"must be in [0, 1], got {lam!r}",
        )
        k = self.pool_kernel
        _check(
            isinstance(k, int) and not isinstance(k, bool) and k >= 1 and k % 2 == 1,
            "policy.pool_kernel",
            f"must be an odd integer >= 1 (1 = no pooling), got {k!r}",
        )
        t = self.similarity_threshold
        _check(
            isinstance(t, (int, float)) and not isinstance(t, bool) and -1 <= t <= 1,
            "policy.similarity_threshold",
            f"must be a cosine similarity in [-1, 1], got {t!r}",
        )

    def score(self, inputs: EvictionInputs) -> torch.Tensor:
        """``(B, H, N)`` float32 R-KV score of the candidates (needs ``inputs.queries`` and ``inputs.window_keys``)."""
        if inputs.queries is None or inputs.window_keys is None:
            raise ValueError(f"policy {self.name}: needs the window queries and the window keys, got none")
        return rkv_original_score(
            inputs.queries,
            inputs.keys,
            inputs.window_keys,
            inputs.scaling,
            mix_lambda=self.rkv_lambda,
            pool_kernel=self.pool_kernel,
            threshold=self.similarity_threshold,
            dtype=inputs.score_dtype,
        )

    def keep(self, inputs: EvictionInputs) -> torch.Tensor:
        """``(B, H, n_keep)`` int64: the sinks (none by default), then by decreasing score (R-KV's storage order)."""
        return topk_with_protection(self.score(inputs), inputs.n_keep, protected=inputs.positions < self.sinks)
