"""SeerAttention-R for tests: random gates in the published checkpoint format, and a plain reference of the gate.

``gate_config(model_config)`` builds the ``config.json`` the authors' ``distillation_decode.py`` writes (the base
model's config in transformers 4.5x form plus the ``seerattn_*`` fields and ``base_model``); ``write_random_gates``
saves random bf16 gates under the published tensor names next to it. ``reference_logits`` recomputes the gate's
block logits from scratch, token by token, from pre-RoPE queries and keys, as ``AttnGate.forward`` does.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from baselines.seer_gates import GateConfig, save_gates


def gate_config(
    model_config,
    block_size: int = 64,
    gate_hidden: int | None = None,
    k_pooling: str = "Kmaxminavg",
    q_pooling: str = "Qproj",
    qk_norm: bool = True,
    use_rope: bool = True,
    base_model: str = "Qwen/Qwen3-4B",
) -> dict:
    """The gate checkpoint's ``config.json`` for a model of ``model_config``'s geometry."""
    c = model_config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    rope = getattr(c, "rope_parameters", None) or {}
    return {
        "architectures": ["SeerAttnQwen3ForCausalLM"],
        "model_type": "qwen3",
        "base_model": base_model,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_hidden_layers,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": head_dim,
        "rope_theta": rope.get("rope_theta", getattr(c, "rope_theta", 10000.0)),
        "rope_scaling": None,
        "max_position_embeddings": c.max_position_embeddings,
        "vocab_size": c.vocab_size,
        "torch_dtype": "bfloat16",
        "seerattn_sparsity_method": "threshold",
        "seerattn_sliding_window_size": 0,
        "seerattn_token_budget": 4096,
        "seerattn_threshold": 0.0,
        "seerattn_use_rope": use_rope,
        "seerattn_use_qk_norm": qk_norm,
        "seerattn_k_seq_pooling_type": k_pooling,
        "seerattn_q_head_pooling_type": q_pooling,
        "seerattn_training_threshold": 0.0,
        "seerattn_gate_block_size": block_size,
        "seerattn_gate_hidden_size": gate_hidden or head_dim,
        "seerattn_implementation": "seer_sparse",
        "seerattn_start_layer": 0,
        "seerattn_output_sparsity": False,
        "seerattn_loss_slice_ratio": 0.5,
    }


def random_layers(cfg: GateConfig, seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> list[dict]:
    """Random gate tensors of ``cfg``'s shapes (xavier-like scale; norms around 1)."""
    g = torch.Generator().manual_seed(seed)
    layers = []
    for _ in range(cfg.num_layers):
        layer = {}
        for name, shape in cfg.shapes().items():
            if name.endswith("norm"):
                layer[name] = (1.0 + 0.2 * torch.randn(shape, generator=g)).to(dtype)
            else:
                fan = shape[-2] * (shape[1] if len(shape) == 4 else 1)
                layer[name] = (torch.randn(shape, generator=g) / math.sqrt(fan)).to(dtype)
        layers.append(layer)
    return layers


def write_random_gates(directory: str | Path, model_config, seed: int = 0, fmt: str = "pth", **kw) -> Path:
    """Random gates for ``model_config`` in the published format; returns the directory."""
    raw = gate_config(model_config, **kw)
    return save_gates(directory, raw, random_layers(GateConfig.from_dict(raw, "test"), seed), fmt=fmt)


def _rope(x: torch.Tensor, pos: int, theta: float) -> torch.Tensor:
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2).float() / d))
    ang = torch.cat([pos * inv, pos * inv])
    rot = torch.cat([-x[..., d // 2 :], x[..., : d // 2]], dim=-1)
    return x * ang.cos() + rot * ang.sin()


def _norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x / torch.sqrt(x.square().mean(-1, keepdim=True) + 1e-6) * w


def reference_logits(
    cfg: GateConfig, layer: dict, q_nope: torch.Tensor, k_nope: torch.Tensor, prompt_len: int, decode_position: str
) -> torch.Tensor:
    """One row's gate logits ``(H, n_blocks)`` for the query of the last token.

    ``q_nope (Hq, D)``: the current token's pre-RoPE query; ``k_nope (H, T, D)``: pre-RoPE keys of tokens 0..T-1 (the
    current one last, position = index). Blocks complete within the prompt (``prompt_len`` tokens) are rotated at their
    first position; blocks completed while decoding at their last (``decode_position="last"``) or first position; the
    current incomplete block has a zero key.
    """
    w = {k: v.float() for k, v in layer.items()}
    h, t, d = k_nope.shape
    bs, pos = cfg.block_size, t - 1
    g = cfg.num_q_heads // h
    q = q_nope.float().view(h, g, d)
    if cfg.q_pooling == "Qproj":
        q = torch.stack([sum(q[k, j] @ w["attngate_linear_q"][k, j] for j in range(g)) for k in range(h)])
    elif cfg.q_pooling == "Qavgproj":
        q = torch.stack([q[k].mean(0) @ w["attngate_linear_q"][k] for k in range(h)])
    else:
        q = q.mean(1)
    if cfg.qk_norm:
        q = _norm(q, w["attngate_qnorm"])
    if cfg.use_rope:
        q = _rope(q, pos, cfg.rope_theta)
    n_blocks = -(-t // bs)
    keys = torch.zeros(h, n_blocks, q.shape[-1])
    for b in range(t // bs):  # complete blocks
        blk = k_nope[:, b * bs : (b + 1) * bs].float()
        stats = {"max": blk.amax(1), "min": blk.amin(1), "avg": blk.mean(1)}
        feat = torch.cat([stats[s] for s in cfg.k_pooling], dim=-1)  # (H, F)
        kc = torch.stack([feat[k] @ w["attngate_linear_k"][k] for k in range(h)])
        if cfg.qk_norm:
            kc = _norm(kc, w["attngate_knorm"])
        end = (b + 1) * bs - 1
        in_prompt = end < prompt_len
        at = b * bs if in_prompt or decode_position == "first" else end
        if cfg.use_rope:
            kc = _rope(kc, at, cfg.rope_theta)
        keys[:, b] = kc
    return torch.stack([keys[k] @ q[k] for k in range(h)]) / math.sqrt(cfg.gate_hidden)
