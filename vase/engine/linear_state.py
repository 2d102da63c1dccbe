"""Linear-attention layers of hybrid models (Qwen3.5, Qwen3-Next: Gated DeltaNet): a fixed-size state per row.

A hybrid model interleaves full-attention layers (the static eviction cache, :mod:`vase.engine.layer`) with
linear-attention layers, whose whole memory of a sequence is two fixed-size tensors per row: the causal
convolution's last ``kernel`` inputs ``(conv_dim, kernel)`` and the gated delta rule's recurrent state
``(value heads, key head dim, value head dim)``. This module holds them for every linear layer and row, allocated once
with the cache (:class:`LinearStates`: ``conv (Ll, rows, conv_dim, kernel)`` in the model's dtype, ``recurrent (Ll,
rows, Hv, Dk, Dv)`` in float32, the dtype transformers' gated delta rule returns it in), and the transformers layer
object the model's ``GatedDeltaNet`` talks to (:class:`LinearLayer`, a ``LinearAttentionCacheLayerMixin``). Layers
first: a layer's rows ``[0, b)`` are one contiguous block, as the fused kernels (causal-conv1d,
flash-linear-attention) expect their state arguments.

What the model does with the cache (transformers 5.24 and 5.25, ``modeling_qwen3_5.py`` /
``modeling_qwen3_next.py``), and what :class:`LinearLayer` answers:

* ``cache.get_conv_state`` / ``get_recurrent_state`` read ``layer.has_previous_state[0]`` and
  ``layer.conv_states[0]`` / ``layer.recurrent_states[0]``: during a prefill (``owner.prefilling``) there is no
  previous state (``None``: the prompt starts from zeros); during a decode step they are the views of rows
  ``[0, owner.step_rows)``, which the model's ``causal_conv1d_update`` updates in place.
* ``cache.update_conv_state`` (prefill only): the prompt's conv inputs ``(1, conv_dim, P)``; their last ``kernel``
  columns (zero padded on the left for a shorter prompt) are written to every row of the prompt; the padded inputs
  are returned, as transformers' ``LinearAttentionLayer`` returns them.
* ``cache.update_recurrent_state``: the prefill's final state ``(1, Hv, Dk, Dv)`` to every row of the prompt, or the
  decode step's ``(b, Hv, Dk, Dv)`` to rows ``[0, b)`` (a compiled step's padding rows keep their state:
  ``torch.where(live, new, old)``; their conv state, updated in place by the model, is scratch, as a free slot's).

A row's state moves and is cleared with the row (:class:`~vase.engine.storage.CacheStorage` calls
:meth:`LinearStates.move_row` / :meth:`LinearStates.clear_row` at admission, release and ``move_row``). No policy sees
these layers: the eviction event and selection run on the full-attention layers only (``geometry.full_layers``; a
policy's layer index is the model's own, as for a sliding model). No host synchronisation and static shapes: every
write is a device copy into the same storage.

This module imports nothing else of the engine (the cache is duck-typed as ``owner``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from transformers.cache_utils import LinearAttentionCacheLayerMixin

#: the layer type transformers' hybrid configs give a Gated DeltaNet layer (``config.layer_types``)
LINEAR = "linear_attention"
#: the dtype of the recurrent state (transformers' and flash-linear-attention's gated delta rule keep it in fp32)
RECURRENT_DTYPE = torch.float32


def text_config(config):
    """The language model's config: ``config.text_config`` of a multimodal checkpoint (Qwen3.5), else ``config``."""
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


@dataclass(frozen=True)
class LinearShape:
    """The per-row state of a model's linear-attention layers.

    Attributes:
        layer_ids: model indices of the linear-attention layers (``Ll`` of them).
        conv_dim, kernel: the causal convolution's channels (``2 * key_dim + value_dim``) and kernel size.
        v_heads, k_dim, v_dim: the recurrent state's value heads and key / value head dims.
    """

    layer_ids: tuple[int, ...]
    conv_dim: int
    kernel: int
    v_heads: int
    k_dim: int
    v_dim: int

    @classmethod
    def of(cls, config) -> LinearShape | None:
        """The shape of ``config``'s linear layers, or ``None`` for a model without any."""
        cfg = text_config(config)
        ids = tuple(i for i, t in enumerate(getattr(cfg, "layer_types", None) or ()) if t == LINEAR)
        if not ids:
            return None
        k_heads, v_heads = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        k_dim, v_dim = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        conv_dim = 2 * k_heads * k_dim + v_heads * v_dim
        return cls(ids, conv_dim, cfg.linear_conv_kernel_dim, v_heads, k_dim, v_dim)

    def bytes_per_row(self, dtype: torch.dtype) -> int:
        """State bytes of one row over every linear layer: conv ``(conv_dim, kernel)`` in ``dtype`` (the model's) and
        recurrent ``(Hv, Dk, Dv)`` in :data:`RECURRENT_DTYPE`."""
        conv = self.conv_dim * self.kernel * torch.empty((), dtype=dtype).element_size()
        rec = self.v_heads * self.k_dim * self.v_dim * torch.empty((), dtype=RECURRENT_DTYPE).element_size()
        return len(self.layer_ids) * (conv + rec)


class LinearStates:
    """The conv and recurrent states of every linear layer and row, allocated once, zero filled.

    Attributes:
        conv: ``(Ll, rows, conv_dim, kernel)`` in ``dtype``.
        recurrent: ``(Ll, rows, Hv, Dk, Dv)`` in :data:`RECURRENT_DTYPE`.
    """

    def __init__(self, shape: LinearShape, rows: int, dtype: torch.dtype, device: torch.device):
        self.shape = shape
        n = len(shape.layer_ids)
        self.conv = torch.zeros((n, rows, shape.conv_dim, shape.kernel), dtype=dtype, device=device)
        self.recurrent = torch.zeros(
            (n, rows, shape.v_heads, shape.k_dim, shape.v_dim), dtype=RECURRENT_DTYPE, device=device
        )

    def tensors(self) -> list[torch.Tensor]:
        return [self.conv, self.recurrent]

    @property
    def nbytes(self) -> int:
        return self.conv.nbytes + self.recurrent.nbytes

    def move_row(self, src: int, dst: int) -> None:
        """Row ``src``'s state of every linear layer into row ``dst`` (device copies)."""
        self.conv[:, dst] = self.conv[:, src]
        self.recurrent[:, dst] = self.recurrent[:, src]

    def clear_row(self, slot: int) -> None:
        """Zero row ``slot``'s state (a new sequence starts from zeros; its prefill overwrites it whole anyway)."""
        self.conv[:, slot].zero_()
        self.recurrent[:, slot].zero_()


class LinearLayer(LinearAttentionCacheLayerMixin):
    """Layer ``layer_idx`` (the model's index) of a hybrid cache: views of :class:`LinearStates` at its ordinal
    ``slot`` among the linear layers (see the module docstring for what the model reads and writes).

    ``conv``: ``(rows, conv_dim, kernel)``, ``recurrent``: ``(rows, Hv, Dk, Dv)``, contiguous views of the stacked
    states.
    """

    kind = LINEAR
    is_sliding = False
    supports_early_init = False
    record_past = False
    is_croppable = False
    number_of_states = 1

    def __init__(self, layer_idx: int, slot: int, owner: Any, states: LinearStates):
        # not LinearAttentionCacheLayerMixin.__init__: the states exist already, and has_previous_state / conv_states
        # / recurrent_states are views chosen per forward (properties below)
        self.layer_idx, self.slot, self.owner, self.states = layer_idx, slot, owner, states
        self._conv, self._recurrent = states.conv[slot], states.recurrent[slot]  # eager: the views taken once
        self.kernel = states.shape.kernel
        self.device, self.dtype = states.conv.device, states.conv.dtype
        self.is_conv_states_initialized = {0: True}
        self.is_recurrent_states_initialized = {0: True}
        self.conv_kernel_size = {0: self.kernel}

    @property
    def conv(self) -> torch.Tensor:
        """``states.conv[slot]``: taken once (eager), or indexed inside a compiled step so that the graph's inputs are
        the stacked states alone (no two mutated inputs alias: ``vase.engine.layer.storage_view``)."""
        return self.states.conv[self.slot] if torch.compiler.is_compiling() else self._conv

    @property
    def recurrent(self) -> torch.Tensor:
        """``states.recurrent[slot]`` (as :attr:`conv`)."""
        return self.states.recurrent[self.slot] if torch.compiler.is_compiling() else self._recurrent

    # ---- what transformers' Cache reads ------------------------------------------------------------------------
    @property
    def has_previous_state(self) -> dict[int, bool]:
        """A prefill starts from no state; a decode step continues each row's."""
        return {0: self.owner.prefilling is None}

    @property
    def conv_states(self) -> dict[int, torch.Tensor]:
        """``{0: (step_rows, conv_dim, kernel)}``: this step's rows (updated in place by the model)."""
        return {0: self.conv[: self.owner.step_rows]}

    @property
    def recurrent_states(self) -> dict[int, torch.Tensor]:
        """``{0: (step_rows, Hv, Dk, Dv)}``: this step's rows."""
        return {0: self.recurrent[: self.owner.step_rows]}

    def get_seq_length(self) -> int:
        """What a full-attention layer answers (transformers 5.25's ``Cache.get_seq_length`` asks layer 0, a linear
        layer in Qwen3.5): the cache's ``seq_length()``."""
        return self.owner.seq_length()

    def increase_count(self, state_idx: int = 0) -> None:
        """Nothing to count (transformers >= 5.25 calls this at every single-token conv update): the cache holds each
        row's length itself."""

    def lazy_initialization(self, conv_states=None, recurrent_states=None, state_idx: int = 0, **kwargs) -> None:
        """Nothing to do: the states were allocated with the cache."""

    def update_conv_state(self, conv_states: torch.Tensor, state_idx: int = 0, **kwargs) -> torch.Tensor:
        """The prompt's conv inputs ``(1, conv_dim, P)``: their last ``kernel`` columns (zero padded on the left when
        ``P < kernel``) to every row of the prompt; returns the padded inputs ``(1, conv_dim, max(P, kernel))``."""
        owner = self.owner
        if owner.prefilling is None:
            raise RuntimeError(
                f"layer {self.layer_idx}: a multi-token forward after the prefill (the vase engine decodes one token "
                "per row per step; the model's single-token path updates the conv state in place)"
            )
        full = conv_states
        if full.shape[-1] < self.kernel:
            full = F.pad(full, (self.kernel - full.shape[-1], 0), value=0)
        slots = owner.prefilling
        self.conv[owner.index(slots)] = full[..., -self.kernel :].expand(len(slots), -1, -1)
        return full

    def update_recurrent_state(self, recurrent_states: torch.Tensor, state_idx: int = 0, **kwargs) -> torch.Tensor:
        """The prefill's final state ``(1, Hv, Dk, Dv)`` to every row of the prompt, or a decode step's
        ``(b, Hv, Dk, Dv)`` to rows ``[0, b)`` (padding rows of a compiled step keep theirs). A list (transformers
        >= 5.25 returns the last states of a forward when past states are recorded, which this cache never asks for)
        is taken at its last state."""
        if not isinstance(recurrent_states, torch.Tensor):
            recurrent_states = recurrent_states[-1]
        owner = self.owner
        if owner.prefilling is not None:
            slots = owner.prefilling
            self.recurrent[owner.index(slots)] = recurrent_states.expand(len(slots), -1, -1, -1)
            return recurrent_states
        b = owner.step_rows
        view = self.recurrent[:b]
        new = recurrent_states
        if owner.bucketed:
            new = torch.where(owner.live_t[:b, None, None, None], new.to(view.dtype), view)
        view.copy_(new)
        return view

    # ---- the rest of the layer API -----------------------------------------------------------------------------
    def reset(self) -> None:
        self.conv.zero_()
        self.recurrent.zero_()

    def offload(self) -> None:
        """Never offloaded (the states are static)."""

    def prefetch(self) -> None:
        """Never offloaded (the states are static)."""

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("the vase cache does not run beam search (rows move with VaseCache.move_row)")

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("the vase cache does not crop (no speculative decoding)")


def interleave(attention_layers: list, owner: Any, states: LinearStates | None, types: Sequence[str]) -> list:
    """The cache's ``layers`` in the model's order: the K/V layers ``attention_layers`` (full and sliding, in order)
    at their indices, a :class:`LinearLayer` at each linear index of ``types`` (each model layer's type)."""
    if states is None:
        return list(attention_layers)
    out, kv, lin = [], iter(attention_layers), 0
    for i, t in enumerate(types):
        if t == LINEAR:
            out.append(LinearLayer(i, lin, owner, states))
            lin += 1
        else:
            out.append(next(kv))
    return out
