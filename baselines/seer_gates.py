"""SeerAttention-R's gate checkpoints: the published format, reading and writing it, and fetching it from the hub.

The format is what microsoft/SeerAttention writes and reads (read at commit aba03e3; ``distillation_decode.py`` saves,
``SeerDecodingQwen3ForCausalLM.from_pretrained`` loads), in one directory or hub repository:

* ``config.json`` — the base model's config plus the gate's settings: ``base_model`` (the hub id the gates were
  trained for), ``seerattn_gate_block_size`` (64), ``seerattn_gate_hidden_size`` (128), ``seerattn_k_seq_pooling_type``
  (``"Kmaxminavg"``: the key block is summarised by its max, min and mean, concatenated in that order),
  ``seerattn_q_head_pooling_type`` (``"Qproj"``: one linear map from the group's query heads to one gate query per
  KV head), ``seerattn_use_qk_norm`` (RMSNorm on the gate's query and keys), ``seerattn_use_rope`` (RoPE in the gate).
* ``attn_gate_weights.pth`` — ``torch.save`` of a state dict with, for each layer ``i``, tensors named
  ``model.layers.{i}.self_attn.attn_gate.<name>.weight`` (bf16, as trained):

  ===========================  =======================================  ==================================
  name                         shape                                    when
  ===========================  =======================================  ==================================
  ``attngate_linear_q``        ``(H, Hq // H, D, gate_hidden)``          ``Qproj``
  ``attngate_linear_q``        ``(H, D, gate_hidden)``                   ``Qavgproj`` (none for ``Qavg``)
  ``attngate_linear_k``        ``(H, n_pool * D, gate_hidden)``          always (``n_pool`` = 3 for maxminavg)
  ``attngate_qnorm``           ``(gate_hidden,)``                        ``seerattn_use_qk_norm``
  ``attngate_knorm``           ``(gate_hidden,)``                        ``seerattn_use_qk_norm``
  ===========================  =======================================  ==================================

  with ``H`` KV heads, ``Hq`` query heads and ``D`` the head dim of the base model. (Qwen3-4B: 36 layers x
  (8·4·128·128 + 8·384·128 + 2·128) bf16 values = 66.1 MB, the size the README lists.)

``attn_gate_weights.safetensors`` (the same names) is read too, for local conversions. The published decode gates are
listed in :data:`GATES`; no commit of them is referenced anywhere in the authors' code, so they load from ``main``
with a warning that names the commit it resolved to (pin one with ``policy.gate_revision``).
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from vase.hub import ensure_hub_mode, hub_error, is_commit_sha, snapshot_sha

logger = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "attn_gate_weights.pth"
WEIGHTS_SAFETENSORS = "attn_gate_weights.safetensors"

#: The decode (SeerAttention-R) gates microsoft/SeerAttention publishes for the models this harness runs (its README,
#: "SeerAttention-R" table): base model hub id -> gate repository.
GATES: dict[str, str] = {
    "Qwen/Qwen3-4B": "SeerAttention/SeerAttention-Decode-Qwen3-4B-AttnGates",
    "Qwen/Qwen3-8B": "SeerAttention/SeerAttention-Decode-Qwen3-8B-AttnGates",
    "Qwen/Qwen3-14B": "SeerAttention/SeerAttention-Decode-Qwen3-14B-AttnGates",
}
#: A verified commit of each gate repository (``None``: none known; ``main`` is resolved and the commit logged).
GATE_REVISIONS: dict[str, str | None] = {repo: None for repo in GATES.values()}

POOLINGS = ("max", "min", "avg")
Q_POOLINGS = ("Qproj", "Qavgproj", "Qavg")
GATE_FALLBACK = "set policy.gate_path to a local directory holding config.json and attn_gate_weights.pth"


def weight_name(layer: int, name: str) -> str:
    """The state-dict key of a gate tensor, e.g. ``model.layers.3.self_attn.attn_gate.attngate_linear_k.weight``."""
    return f"model.layers.{layer}.self_attn.attn_gate.{name}.weight"


def parse_pooling(kind: str, where: str) -> tuple[str, ...]:
    """``"Kmaxminavg"`` → ``("max", "min", "avg")`` (the concatenation order of the pooled key features)."""
    parts = re.findall("max|min|avg", kind[1:]) if kind.startswith("K") else []
    if not parts or "K" + "".join(parts) != kind or len(set(parts)) != len(parts):
        raise ValueError(f"{where}: seerattn_k_seq_pooling_type {kind!r} is not K + max/min/avg (e.g. Kmaxminavg)")
    return tuple(parts)


@dataclass(frozen=True)
class GateConfig:
    """The fields of a gate checkpoint's ``config.json`` that the gate and the model check use."""

    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    rope_theta: float
    rope_type: str
    block_size: int
    gate_hidden: int
    k_pooling: tuple[str, ...]
    q_pooling: str
    qk_norm: bool
    use_rope: bool
    base_model: str | None = None

    @classmethod
    def from_dict(cls, raw: dict, where: str) -> GateConfig:
        """Parse a ``config.json`` (one-line ``ValueError`` naming ``where`` and the missing or bad field)."""

        def need(key: str):
            if key not in raw:
                raise ValueError(f"{where}: config.json has no {key!r}; is this a SeerAttention-R gate checkpoint?")
            return raw[key]

        heads = int(need("num_attention_heads"))
        head_dim = raw.get("head_dim") or int(need("hidden_size")) // heads
        rope = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
        theta = raw.get("rope_theta", rope.get("rope_theta"))
        if theta is None:
            raise ValueError(f"{where}: config.json has no 'rope_theta'")
        q_pooling = need("seerattn_q_head_pooling_type")
        if q_pooling not in Q_POOLINGS:
            choices = ", ".join(Q_POOLINGS)
            raise ValueError(f"{where}: seerattn_q_head_pooling_type {q_pooling!r} is not one of {choices}")
        return cls(
            num_layers=int(need("num_hidden_layers")),
            num_q_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            hidden_size=int(need("hidden_size")),
            rope_theta=float(theta),
            rope_type=str(rope.get("rope_type", rope.get("type", "default"))),
            block_size=int(need("seerattn_gate_block_size")),
            gate_hidden=int(need("seerattn_gate_hidden_size")),
            k_pooling=parse_pooling(need("seerattn_k_seq_pooling_type"), where),
            q_pooling=q_pooling,
            qk_norm=bool(raw.get("seerattn_use_qk_norm", False)),
            use_rope=bool(raw.get("seerattn_use_rope", True)),
            base_model=raw.get("base_model"),
        )

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """The shape of each of one layer's tensors (see the module docstring)."""
        h, d, gh = self.num_kv_heads, self.head_dim, self.gate_hidden
        out: dict[str, tuple[int, ...]] = {"attngate_linear_k": (h, len(self.k_pooling) * d, gh)}
        if self.q_pooling == "Qproj":
            out["attngate_linear_q"] = (h, self.num_q_heads // h, d, gh)
        elif self.q_pooling == "Qavgproj":
            out["attngate_linear_q"] = (h, d, gh)
        if self.qk_norm:
            out["attngate_qnorm"] = (gh,)
            out["attngate_knorm"] = (gh,)
        return out

    def geometry(self) -> str:
        return (
            f"{self.num_layers} layers, {self.num_q_heads} query heads, {self.num_kv_heads} KV heads, head_dim "
            f"{self.head_dim}, hidden_size {self.hidden_size}, rope_theta {self.rope_theta:g}"
        )


@dataclass
class Gates:
    """A loaded checkpoint: its config, ``layers[i] = {name: tensor}`` (as stored) and where it came from."""

    config: GateConfig
    layers: list[dict[str, torch.Tensor]]
    source: str
    commit: str | None = None
    extra: dict = field(default_factory=dict)


def read_gate_config(directory: str | Path, where: str | None = None, weights: bool = True) -> GateConfig:
    """The parsed ``config.json`` of a gate checkpoint directory, without loading its tensors (the preflight's check).

    Args:
        weights: also require the weights file (``.pth`` or ``.safetensors``) to be there.

    Raises:
        ValueError: one line starting with ``where`` (default ``policy.gate_path=<directory>``) naming the file and
            what is wrong: absent, not UTF-8 JSON, not an object, a missing field or one of the wrong type.
    """
    path = Path(directory)
    where = where or f"policy.gate_path={path}"
    cfg_file = path / CONFIG_FILE
    if not cfg_file.is_file():
        raise ValueError(f"{where}: no {CONFIG_FILE} in {path}; {GATE_FALLBACK}")
    try:
        raw = json.loads(cfg_file.read_text(encoding="utf-8"))
    except (ValueError, OSError) as err:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        reason = " ".join(str(err).split())[:200]
        raise ValueError(f"{where}: {cfg_file} is not JSON ({reason}); fix the file, or {GATE_FALLBACK}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: {cfg_file} is not a JSON object (it holds a {type(raw).__name__}); {GATE_FALLBACK}")
    try:
        config = GateConfig.from_dict(raw, where)
    except (TypeError, ValueError, AttributeError) as err:
        if isinstance(err, ValueError) and str(err).startswith(where):
            raise
        reason = " ".join(str(err).split())[:200]
        raise ValueError(f"{where}: {cfg_file} has a field of the wrong type ({reason}); {GATE_FALLBACK}") from None
    if weights and not ((path / WEIGHTS_FILE).is_file() or (path / WEIGHTS_SAFETENSORS).is_file()):
        raise ValueError(f"{where}: no {WEIGHTS_FILE} (or {WEIGHTS_SAFETENSORS}) in {path}; {GATE_FALLBACK}")
    return config


def _gate_error(exc: Exception, repo: str, requested: str) -> Exception:
    """The one-line error for gates that cannot be fetched from ``repo`` at ``requested`` (:func:`hub_error`)."""
    return hub_error(
        exc,
        f"policy seer_attention_r: cannot load gates {repo}@{requested}",
        repo,
        "model",
        requested,
        "policy.gate_revision",
        GATE_FALLBACK,
    )


def resolve_gates(repo: str, revision: str | None) -> tuple[GateConfig, str | None]:
    """``repo``'s gate ``config.json`` at ``revision`` (downloaded, or found in the hub cache offline) and the commit
    it resolved to, without the weights: the preflight's check that the gates can be reached at all.

    Raises:
        ValueError: one line naming the repository, the revision and the fix (:func:`vase.hub.hub_error`).
    """
    requested = revision or "main"
    ensure_hub_mode()
    try:
        from huggingface_hub import hf_hub_download

        cfg = hf_hub_download(repo, CONFIG_FILE, revision=requested)
    except Exception as exc:
        raise _gate_error(exc, repo, requested) from None
    commit = snapshot_sha(cfg)
    return read_gate_config(Path(cfg).parent, f"policy.gate_repo={repo}@{commit or requested}", weights=False), commit


def load_gates(directory: str | Path, where: str | None = None) -> Gates:
    """Read a gate checkpoint directory (``config.json`` + ``attn_gate_weights.pth`` or ``.safetensors``) and check
    every layer's tensors against the config (one-line ``ValueError`` starting with ``where``, default
    ``policy.gate_path=<directory>``, and naming the file and the tensor)."""
    path = Path(directory)
    where = where or f"policy.gate_path={path}"
    config = read_gate_config(path, where)
    if (path / WEIGHTS_FILE).is_file():
        weights_file = path / WEIGHTS_FILE
        state = torch.load(weights_file, map_location="cpu", weights_only=True)
    elif (path / WEIGHTS_SAFETENSORS).is_file():
        from safetensors.torch import load_file

        weights_file = path / WEIGHTS_SAFETENSORS
        state = load_file(weights_file)
    else:
        raise ValueError(f"{where}: no {WEIGHTS_FILE} (or {WEIGHTS_SAFETENSORS}) in {path}; {GATE_FALLBACK}")
    if not isinstance(state, dict):
        raise ValueError(f"{where}: {weights_file.name} does not hold a state dict")
    shapes = config.shapes()
    layers = []
    for i in range(config.num_layers):
        layer = {}
        for name, shape in shapes.items():
            key = weight_name(i, name)
            if key not in state:
                geometry = config.geometry()
                raise ValueError(f"{where}: {weights_file.name} has no tensor {key!r} (config.json: {geometry})")
            t = state[key]
            if tuple(t.shape) != shape:
                raise ValueError(f"{where}: {weights_file.name}[{key!r}] has shape {tuple(t.shape)}, expected {shape}")
            if not t.is_floating_point() or not torch.isfinite(t).all():
                raise ValueError(f"{where}: {weights_file.name}[{key!r}] is not a finite floating-point tensor")
            layer[name] = t
        layers.append(layer)
    extra = sorted(k for k in state if not re.match(r"model\.layers\.(\d+)\.self_attn\.attn_gate\.", k))
    if extra:
        raise ValueError(f"{where}: {weights_file.name} holds tensors that are not gate weights, e.g. {extra[0]!r}")
    return Gates(config, layers, str(path), snapshot_sha(weights_file))


def save_gates(directory: str | Path, config: dict, layers: list[dict[str, torch.Tensor]], fmt: str = "pth") -> Path:
    """Write a checkpoint in the published format: ``config.json`` and ``attn_gate_weights.pth`` (``torch.save``, as
    the authors' ``distillation_decode.py``) or ``.safetensors``. ``config`` is the full config dict (base model's
    fields and ``seerattn_*``); ``layers[i]`` maps tensor names (``attngate_linear_k``, ...) to tensors."""
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    (path / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True))
    state = {weight_name(i, name): t.contiguous() for i, layer in enumerate(layers) for name, t in layer.items()}
    if fmt == "pth":
        torch.save(state, path / WEIGHTS_FILE)
    elif fmt == "safetensors":
        from safetensors.torch import save_file

        save_file(state, path / WEIGHTS_SAFETENSORS)
    else:
        raise ValueError(f"fmt: must be pth or safetensors, got {fmt!r}")
    return path


def fetch_gates(repo: str, revision: str | None) -> Gates:
    """Download (or find in the hub cache) ``repo`` at ``revision`` and load it; one-line error when it cannot."""
    requested = revision or "main"
    ensure_hub_mode()
    try:
        from huggingface_hub import hf_hub_download

        cfg = hf_hub_download(repo, CONFIG_FILE, revision=requested)
        directory = Path(cfg).parent
        try:
            hf_hub_download(repo, WEIGHTS_FILE, revision=snapshot_sha(cfg) or requested)
        except Exception as exc:  # a repository may ship safetensors only
            if type(exc).__name__ not in ("EntryNotFoundError", "RemoteEntryNotFoundError"):
                raise
            hf_hub_download(repo, WEIGHTS_SAFETENSORS, revision=snapshot_sha(cfg) or requested)
    except Exception as exc:
        raise _gate_error(exc, repo, requested) from None
    commit = snapshot_sha(cfg)
    if not is_commit_sha(revision):
        logger.warning(
            "gates %s are not pinned (revision %r resolved to %s); pin them with policy.gate_revision=%s",
            repo,
            requested,
            commit,
            commit or "<sha>",
        )
    gates = load_gates(directory, where=f"policy.gate_repo={repo}@{commit or requested}")
    gates.source = f"{repo}@{commit or requested}"
    return gates
