"""SeerAttention-R: a trained gate picks the key blocks each decode step attends to (a selection policy).

What microsoft/SeerAttention's decode gate does (read at commit aba03e3: ``seer_attn/decode_sparse/attn_gate_inf.py``
``AttnGate.forward``, ``qwen3/modeling_qwen3_seerattn_inference.py``, ``cache_utils.KCompressionCache``), and this
policy with the published gates (:mod:`baselines.seer_gates`: checkpoint format and hub ids):

* Keys are cut into blocks of ``block_size = 64`` tokens in position order. The gate works on the **pre-RoPE**
  queries and keys (after Qwen3's ``q_norm``/``k_norm``): a block is summarised by the max, min and mean of its keys
  per KV head (``Kmaxminavg``), projected per KV head to ``gate_hidden = 128`` dims (``attngate_linear_k``),
  RMS-normalised (``attngate_knorm``) and rotated by RoPE at one position: a block complete in the prompt at its first
  token's position, a block that completes while decoding at the position of the token that completes it
  (``decode_block_position="last"``, their fix #37; ``"first"`` uses the first token, as training does). The current,
  incomplete block has a zero key (``KCompressionCache.update`` appends zeros when a block opens).
* The gate query is one per KV head, shared by its group (GQA): the group's pre-RoPE queries mapped by
  ``attngate_linear_q`` (``Qproj``: ``einsum('kgi,kgio->ko')``), RMS-normalised, rotated at the current position.
* Logits ``q·k / sqrt(gate_hidden)`` over the row's blocks (a softmax, which does not change the order); with the
  token budget, the top ``budget // block_size`` blocks are kept (all of them when the row holds no more blocks), and
  the current block is always added (``mask[:, :, -1] = True``): the step attends to ``budget // block_size`` or
  ``budget // block_size + 1`` blocks per KV head. Every layer is sparse (``seerattn_start_layer = 0``).

The cache keeps every token (no memory saving): the engine reports ``attended_tokens`` as for Quest.

How the harness feeds the gate: the engine hands selection policies post-RoPE queries and keys and, since this
policy, the held tokens' positions (``SelectionInputs.positions``); the policy undoes the model's RoPE (a rotation by
the negative angle, with the rope parameters of the model's config, read in :meth:`SeerAttentionR.setup`) to get the
pre-RoPE tensors. In float32 that is exact to rounding; in a bf16 run the stored keys carry bf16 rounding, the same
order as the authors' bf16 gate arithmetic. The gate runs in float32 (the authors': the model dtype).

State per row and layer (``SelectionInputs.state``), updated incrementally so a step costs O(blocks), not O(tokens):
``kc (B, H, ceil(capacity / block_size), gate_hidden)`` the compressed keys (keys' dtype; zero for incomplete
blocks) and ``pmax``/``pmin``/``psum (B, H, D)`` float32, the running pool of each row's current block. The engine
summarises a row's prompt right after its prefill (:meth:`SeerAttentionR.init_state`, outside the decode forward);
from its first decode step on only its new token is folded in, so a step reads no per-row host state (the compiled
step, :mod:`vase.engine.compiled`).

The gates load by hub id (:data:`baselines.seer_gates.GATES`, the model's own unless ``gate_repo`` is set) or from a
local ``gate_path``, in :meth:`SeerAttentionR.setup`, which refuses a model they were not trained for.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch

from baselines.seer_gates import (
    CONFIG_FILE,
    GATE_REVISIONS,
    GATES,
    Gates,
    fetch_gates,
    load_gates,
    read_gate_config,
    resolve_gates,
)
from vase.engine.geometry import partial_rope
from vase.engine.policy import SelectionInputs, SelectionPolicy, _check

BLOCK_POSITIONS = ("last", "first")
RMS_EPS = 1e-6  # the gate's RMSNorm eps (AttnGate: RMSNorm(gate_hidden, eps=1e-06))


# ---- pure tensor math -----------------------------------------------------------------------------------------------


def rope_inv_freq(theta: float, dim: int) -> torch.Tensor:
    """``(dim / 2,)`` float32 inverse frequencies of the default RoPE (as transformers computes them)."""
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)``, each ``(*positions.shape, D)`` float32, of the default RoPE at ``positions``."""
    angle = positions.float()[..., None] * inv_freq.to(positions.device)  # (..., D/2)
    angle = torch.cat([angle, angle], dim=-1)
    return angle.cos(), angle.sin()


def rotate(
    x: torch.Tensor,
    positions: torch.Tensor | None,
    inv_freq: torch.Tensor | None,
    inverse: bool = False,
    cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """RoPE (``rotate_half`` convention) of ``x (..., D)`` at ``positions`` (broadcastable to ``x.shape[:-1]``), or its
    inverse (rotation by the negative angle). Float32. ``cos_sin`` (from :func:`rope_cos_sin`) replaces
    ``positions``/``inv_freq``."""
    cos, sin = cos_sin if cos_sin is not None else rope_cos_sin(positions, inv_freq)
    x = x.float()
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos - rot * sin if inverse else x * cos + rot * sin


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = RMS_EPS) -> torch.Tensor:
    """``x / sqrt(mean(x²) + eps) * weight`` over the last axis (float32)."""
    x = x.float()
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * weight


def pool_blocks(keys: torch.Tensor, block_size: int, pooling: tuple[str, ...]) -> torch.Tensor:
    """``keys (H, nb * block_size, D)`` → ``(H, nb, len(pooling) * D)``: per block, each statistic over its tokens
    (``max``, ``min``, ``avg``), concatenated in ``pooling`` order."""
    h, n, d = keys.shape
    body = keys.float().view(h, n // block_size, block_size, d)
    stats = {"max": lambda: body.amax(2), "min": lambda: body.amin(2), "avg": lambda: body.mean(2)}
    return torch.cat([stats[p]() for p in pooling], dim=-1)


# ---- the policy -----------------------------------------------------------------------------------------------------


def _rope_type(model_config) -> str:
    """The config's RoPE type (``rope_parameters`` or the older ``rope_scaling``; ``default`` when neither says)."""
    rope = getattr(model_config, "rope_parameters", None) or getattr(model_config, "rope_scaling", None) or {}
    return rope.get("rope_type", rope.get("type", "default"))


@dataclass
class SeerAttentionR(SelectionPolicy):
    """SeerAttention-R's decode gate over the full cache (see the module docstring).

    Attributes:
        budget: tokens per step and KV head: the top ``budget // block_size`` blocks by the gate, plus the current
            block (always).
        window: unused (kept so every policy config has the same keys).
        block_size: tokens per block; must equal the gates' ``seerattn_gate_block_size`` (64 for the published ones).
        model_name: the run's model (``${model.name}``): picks the published gates and refuses gates trained for another
            model before anything loads. ``None``: the model's own config name at :meth:`setup`.
        gate_repo: hub id of the gates; ``None``: the ones published for ``model_name`` (:data:`.seer_gates.GATES`).
        gate_revision: commit of ``gate_repo``; ``None``: the verified one if known, else ``main`` (with a warning).
        gate_path: a local checkpoint directory (``config.json`` + ``attn_gate_weights.pth``); wins over ``gate_repo``.
        decode_block_position: RoPE position of a block completed while decoding: ``last`` (the token completing it,
            the authors' inference code) or ``first`` (its first token, as in training and for prompt blocks).
    """

    block_size: int = 64
    model_name: str | None = None
    gate_repo: str | None = None
    gate_revision: str | None = None
    gate_path: str | None = None
    decode_block_position: str = "last"

    name: ClassVar[str] = "seer_attention_r"
    needs_queries: ClassVar[bool] = False

    def __post_init__(self) -> None:
        self._gates: Gates | None = None
        self._device_gates: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
        self._inv_freq: torch.Tensor | None = None  # the model's RoPE (undone), also the gate's
        super().__post_init__()

    # ---- configuration ----------------------------------------------------------------------------------------
    def validate(self) -> None:
        super().validate()
        bs = self.block_size
        _check(
            isinstance(bs, int) and not isinstance(bs, bool) and bs >= 1,
            "policy.block_size",
            f"must be an integer >= 1, got {bs!r}",
        )
        _check(
            self.budget >= bs,
            "policy.budget",
            f"must be >= block_size = {bs} (budget // block_size blocks are chosen), got {self.budget}",
        )
        _check(
            self.decode_block_position in BLOCK_POSITIONS,
            "policy.decode_block_position",
            f"must be one of {', '.join(BLOCK_POSITIONS)}, got {self.decode_block_position!r}",
        )
        # Which gates, and for which model: checked now (no download), before anything is written or loaded.
        if self.gate_path is not None:
            cfg_file = Path(str(self.gate_path)) / CONFIG_FILE
            _check(
                cfg_file.is_file(),
                "policy.gate_path",
                f"{self.gate_path!r} is not a gate checkpoint directory (no {CONFIG_FILE}); point it at a directory "
                "holding config.json and attn_gate_weights.pth",
            )
            read_gate_config(self.gate_path, "policy.gate_path")  # a broken config.json: one line now, not at setup
            setting, trained_for = "policy.gate_path", _base_model(cfg_file)
        elif self.model_name is None:
            return  # decided in setup() from the model's config
        else:
            repo = self.gate_repo or GATES.get(self.model_name)
            _check(repo is not None, "policy.gate_repo", _no_gates(self.model_name))
            setting, trained_for = "policy.gate_repo", next((m for m, r in GATES.items() if r == repo), None)
        if (
            self.model_name is not None
            and trained_for
            and _hub_like(self.model_name)
            and trained_for != self.model_name
        ):
            raise ValueError(
                f"{setting}: these gates were trained for {trained_for}, not model {self.model_name!r}; use "
                f"{GATES.get(self.model_name, 'the gates trained for your model')}"
            )

    def check_model(self, model_config) -> None:
        """Refuse partial RoPE, NoPE and a RoPE type other than the default (gpt-oss's YaRN) from the model's
        config, in the preflight (before any file or weight): the gate rotates its keys with the default RoPE. Gates
        from the hub are resolved here too (their ``config.json``, not the weights): an unreachable ``gate_repo`` or
        revision is one line before anything is written."""
        partial = partial_rope(model_config)
        _check(
            partial is None,
            "policy seer_attention_r",
            f"undoes RoPE over the whole head dim of every layer; {partial}: not supported yet",
        )
        rope_type = _rope_type(model_config)
        _check(
            rope_type == "default",
            "policy seer_attention_r",
            f"RoPE type {rope_type!r} is not supported (the gates rotate with the default RoPE); use a model with the "
            "default RoPE (Qwen3)",
        )
        if self.gate_path is None and self._gates is None:
            repo = self.gate_repo or GATES.get(self.model_name or getattr(model_config, "_name_or_path", "") or "")
            if repo is not None:
                resolve_gates(repo, self.gate_revision or GATE_REVISIONS.get(repo))

    def setup(self, model_config) -> None:
        """Load the gates (once) and refuse a model they were not trained for (one line)."""
        if self._gates is None:
            self._gates = self._load(getattr(model_config, "_name_or_path", None))
        gates, cfg = self._gates, self._gates.config
        where = f"policy seer_attention_r (gates {gates.source})"
        rope = getattr(model_config, "rope_parameters", None) or getattr(model_config, "rope_scaling", None) or {}
        theta = rope.get("rope_theta", getattr(model_config, "rope_theta", None))
        rope_type = _rope_type(model_config)
        heads = model_config.num_attention_heads
        head_dim = getattr(model_config, "head_dim", None) or model_config.hidden_size // heads
        model = (
            model_config.num_hidden_layers,
            heads,
            model_config.num_key_value_heads,
            head_dim,
            model_config.hidden_size,
            float(theta) if theta is not None else None,
        )
        trained = (cfg.num_layers, cfg.num_q_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size, cfg.rope_theta)
        if model != trained:
            raise ValueError(
                f"{where}: trained for {cfg.base_model or 'another model'} ({cfg.geometry()}), not this model "
                f"({model[0]} layers, {model[1]} query heads, {model[2]} KV heads, head_dim {model[3]}, hidden_size "
                f"{model[4]}, rope_theta {model[5]}); use the gates of the model you run"
            )
        if rope_type != "default" or cfg.rope_type != "default":
            raise ValueError(f"{where}: RoPE type {rope_type!r} is not supported (the gates use the default RoPE)")
        if cfg.block_size != self.block_size:
            raise ValueError(
                f"policy.block_size: {self.block_size}, but the gates {gates.source} were trained with blocks of "
                f"{cfg.block_size}; set policy.block_size={cfg.block_size}"
            )
        if cfg.use_rope and cfg.gate_hidden != cfg.head_dim:
            raise ValueError(
                f"{where}: seerattn_gate_hidden_size {cfg.gate_hidden} != head_dim {cfg.head_dim} with RoPE in the "
                "gate (the authors' inference code rotates the gate with the model's head_dim too)"
            )
        self._inv_freq = rope_inv_freq(cfg.rope_theta, cfg.head_dim)

    def _load(self, config_name: str | None) -> Gates:
        if self.gate_path is not None:
            return load_gates(self.gate_path)
        model = self.model_name or config_name
        repo = self.gate_repo or GATES.get(model or "")
        if repo is None:
            raise ValueError(f"policy.gate_repo: {_no_gates(model)}")
        return fetch_gates(repo, self.gate_revision or GATE_REVISIONS.get(repo))

    def gates(self, layer_idx: int, device: torch.device) -> dict[str, torch.Tensor]:
        """Layer ``layer_idx``'s gate tensors (and the RoPE ``inv_freq``) in float32 on ``device``, moved once."""
        key = (layer_idx, str(device))
        if key not in self._device_gates:
            if self._gates is None:
                raise RuntimeError("policy seer_attention_r: setup(model_config) was not called (the decoder calls it)")
            layer = self._gates.layers[layer_idx]
            moved = {k: v.to(device=device, dtype=torch.float32) for k, v in layer.items()}
            self._device_gates[key] = {**moved, "inv_freq": self._inv_freq.to(device)}
        return self._device_gates[key]

    # ---- the gate -----------------------------------------------------------------------------------------------
    def _compress(self, feats: torch.Tensor, w: dict, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Pooled features ``(..., H, N, F)`` → compressed keys ``(..., H, N, gh)``, rotated by ``cos_sin``
        (``(..., N, gh)`` each, :func:`rope_cos_sin` of the blocks' positions)."""
        cfg = self._gates.config
        k = torch.einsum("...hni,hio->...hno", feats, w["attngate_linear_k"])
        if cfg.qk_norm:
            k = rms_norm(k, w["attngate_knorm"])
        if cfg.use_rope:
            cos, sin = cos_sin
            k = rotate(k, None, None, cos_sin=(cos.unsqueeze(-3), sin.unsqueeze(-3)))
        return k

    def init_state(
        self, keys: torch.Tensor, positions: torch.Tensor, lengths: list[int], layer_idx: int, capacity: int
    ) -> dict[str, torch.Tensor]:
        """The rows' prompt summaries (the first ``lengths[b]`` tokens of row ``b``): ``kc (B, H, ceil(capacity /
        block_size), gate_hidden)`` (its complete blocks compressed, rotated at their first position; zero after) and
        the float32 pool ``pmax``/``pmin``/``psum (B, H, D)`` of its incomplete last block (zero if none)."""
        cfg, bs = self._gates.config, self.block_size
        w = self.gates(layer_idx, keys.device)
        b, h, _, d = keys.shape
        kc = keys.new_zeros((b, h, -(-capacity // bs), cfg.gate_hidden))
        pmax, pmin, psum = (keys.new_zeros((b, h, d), dtype=torch.float32) for _ in range(3))
        for i, prompt in enumerate(lengths):
            p = positions[i, 0, :prompt]
            k = rotate(keys[i, :, :prompt], p, w["inv_freq"], inverse=True)  # (H, prompt, D) pre-RoPE
            nb = prompt // bs
            if nb:
                feats = pool_blocks(k[:, : nb * bs], bs, cfg.k_pooling)
                at = rope_cos_sin(p[: nb * bs : bs], w["inv_freq"])  # prompt blocks: their first position
                kc[i, :, :nb] = self._compress(feats, w, at).to(kc.dtype)
            rest = k[:, nb * bs :]
            if rest.shape[1]:
                pmax[i], pmin[i], psum[i] = rest.amax(1), rest.amin(1), rest.sum(1)
        return {"kc": kc, "pmax": pmax, "pmin": pmin, "psum": psum}

    def update_state(self, inputs: SelectionInputs) -> None:
        """Fold each row's new token into its block summaries (the state summarises the tokens before it: the
        engine's from the prompt on, :meth:`init_state`; a caller that passes none gets it made here)."""
        cfg, bs = self._gates.config, self.block_size
        st, keys, pos = inputs.state, inputs.keys, inputs.positions
        w = self.gates(inputs.layer_idx, keys.device)
        b, h, _, d = keys.shape
        if "kc" not in st:  # not the engine's call: summarise every token before each row's current one
            before = [n - 1 for n in inputs.host_lengths()]
            st.update(self.init_state(keys, pos, before, inputs.layer_idx, inputs.capacity))
        kc, pmax, pmin, psum = st["kc"], st["pmax"], st["pmin"], st["psum"]
        rows = torch.arange(b, device=keys.device)
        last = inputs.lengths - 1  # slot (= position order) of each row's new token
        p_new = pos[rows, 0, last]
        now = rope_cos_sin(p_new[:, None], w["inv_freq"])  # (B, 1, D) each
        k_new = rotate(keys[rows, :, last], None, None, inverse=True, cos_sin=now)  # (B, H, D) pre-RoPE
        opens = (last % bs == 0)[:, None, None]
        pmax.copy_(torch.where(opens, k_new, torch.maximum(pmax, k_new)))
        pmin.copy_(torch.where(opens, k_new, torch.minimum(pmin, k_new)))
        psum.copy_(torch.where(opens, k_new, psum + k_new))
        stats = {"max": pmax, "min": pmin, "avg": psum / bs}  # avg only matters when the block is complete
        feats = torch.cat([stats[s] for s in cfg.k_pooling], dim=-1)[:, :, None]  # (B, H, 1, F)
        block = torch.div(last, bs, rounding_mode="floor")
        at = (
            now if self.decode_block_position == "last" else rope_cos_sin(pos[rows, 0, block * bs, None], w["inv_freq"])
        )
        new = self._compress(feats, w, at)[:, :, 0].to(kc.dtype)  # (B, H, gh)
        completes = ((last + 1) % bs == 0)[:, None, None]
        kc[rows, :, block] = torch.where(completes, new, kc[rows, :, block])

    def block_logits(self, inputs: SelectionInputs) -> torch.Tensor:
        """``(B, H, ceil(L / block_size))`` float32 gate logits ``q·k / sqrt(gate_hidden)`` (the order the top-k
        uses); blocks past a row's current block are ignored by :meth:`select`."""
        cfg = self._gates.config
        w = self.gates(inputs.layer_idx, inputs.keys.device)
        b, h = inputs.keys.shape[:2]
        rows = torch.arange(b, device=inputs.keys.device)
        now = rope_cos_sin(inputs.positions[rows, 0, inputs.lengths - 1, None], w["inv_freq"])  # (B, 1, D) each
        q = rotate(inputs.query[:, :, 0], None, None, inverse=True, cos_sin=now)  # (B, Hq, D) pre-RoPE
        q = q.view(b, h, -1, q.shape[-1])  # (B, H, G, D): query head j belongs to KV head j // G
        if cfg.q_pooling == "Qproj":
            q = torch.einsum("bhgi,hgio->bho", q, w["attngate_linear_q"])
        elif cfg.q_pooling == "Qavgproj":
            q = torch.einsum("bhi,hio->bho", q.mean(2), w["attngate_linear_q"])
        else:  # Qavg
            q = q.mean(2)
        if cfg.qk_norm:
            q = rms_norm(q, w["attngate_qnorm"])
        if cfg.use_rope:
            q = rotate(q, None, None, cos_sin=now)
        n_blocks = -(-inputs.length // self.block_size)
        kc = inputs.state["kc"][:, :, :n_blocks].float()
        return torch.einsum("bhd,bhnd->bhn", q, kc) / math.sqrt(cfg.gate_hidden)

    def select(self, inputs: SelectionInputs) -> torch.Tensor | None:
        """``(B, H, L)`` bool: per KV head, the top ``budget // block_size`` blocks by the gate plus the current
        block (every block, for a row holding at most ``budget // block_size``); ``None`` when the keys handed in
        span at most ``budget // block_size`` blocks (then no row holds more). Every row is scored over the blocks the
        keys span (no host maximum: a compiled step traces it once)."""
        if self._gates is None:
            raise RuntimeError("policy seer_attention_r: setup(model_config) was not called (the decoder calls it)")
        self.update_state(inputs)
        bs, k = self.block_size, self.budget // self.block_size
        if -(-inputs.length // bs) <= k:
            return None
        logits = self.block_logits(inputs)
        b, h, n_blocks = logits.shape
        cur = torch.div(inputs.lengths - 1, bs, rounding_mode="floor")  # (B,)
        valid = torch.arange(n_blocks, device=logits.device)[None, :] <= cur[:, None]  # (B, NB)
        top = logits.masked_fill(~valid[:, None, :], float("-inf")).topk(k, dim=-1).indices
        blocks = torch.zeros((b, h, n_blocks), dtype=torch.bool, device=logits.device).scatter_(-1, top, True)
        blocks &= valid[:, None, :]
        blocks.scatter_(-1, cur.view(b, 1, 1).expand(b, h, 1), True)  # the current block, always
        return blocks.repeat_interleave(bs, dim=-1)[..., : inputs.length]


def _no_gates(model: str | None) -> str:
    return (
        f"no SeerAttention-R gates are published for model {model!r} (known: {', '.join(GATES)}); set "
        "policy.gate_path=<dir with config.json and attn_gate_weights.pth> or policy.gate_repo=<hub id>"
    )


def _base_model(cfg_file: Path) -> str | None:
    """The ``base_model`` a local checkpoint's config names (``None`` if unreadable: :func:`load_gates` reports it)."""
    try:
        value = json.loads(cfg_file.read_text()).get("base_model")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, str) else None


def _hub_like(name: str) -> bool:
    """Whether ``name`` reads as a hub id (``owner/name``, not a local directory)."""
    return "/" in name and not Path(name).exists() and not name.startswith(("/", ".", "~"))
