"""TriAttention (Mao et al., arXiv 2604.04921; code: github.com/WeianMao/triattention, read at ``c3744ee``).

The rule (its ``triattention/methods/pruning_utils.py`` and ``triattention.py``, HF path): the pre-RoPE queries of a
head concentrate around a fixed centre, so the attention a future query at position ``t`` pays a key at position
``p`` is predicted from the centre alone. Per frequency ``f`` of RoPE (the ``D/2`` complex pairs ``x_f + i x_{f+D/2}``,
angular speed ``ω_f``), with ``q̄_f`` the mean pre-RoPE query, ``m_f`` the mean of ``|q_f|`` and ``k_f`` the pre-RoPE
key::

    score(t) = Σ_f s_f² |q̄_f| |k_f| cos(ω_f (t - p) + arg(q̄_f conj(k_f)))      # the trigonometric distance term
             + Σ_f s_f² (m_f - |q̄_f|) |k_f|                                      # the norm term ("MLR")

``s_f`` is RoPE's attention scaling (1 for the default RoPE). The score is averaged over future offsets
``t = now + 1, 2, 4, ..., offset_max_length`` (geometric), z-normalised over the candidates per query head, a ``1e-6``
uniform tie-break added, and reduced over the query heads of each KV head (max: the authors' per-(layer, KV head)
mode); the top ``n_keep`` are kept. Here it is computed from the post-RoPE keys the cache holds: ``k̃_f = k_f e^{iω_f
p}``, so ``Re(q̄_f conj(k̃_f) e^{iω_f t})`` is the cosine term with the key's own position folded in (their vLLM
scorer's form; ``tests/test_triattention.py`` checks it against the RoPE-inverted form above).

Defaults are the authors' launch defaults (``scripts/cli.py``): the prompt is kept and counts in the budget
(``count_prompt_tokens``, prefill never compressed: ``keep_prompt=true``), compression every 128 steps
(``divide_length``: ``evict_every=128``, the slack trigger ``budget + 128``), offsets up to 65536, mean over
offsets, z-score normalisation, and their per-head mode (``per_head_pruning=True`` in ``cli.py`` and their experiment
configs): ``selection=per_head`` keeps **one set per KV head shared by every layer of a row**, scored by the mean over
the layers of the per-layer group max (their ``_select_per_head_independent``); the engine hands every full layer of
a row to one :meth:`TriAttention.keep` call (``EvictionInputs.layers_per_row``), so the layers of a row hold the same
positions throughout. ``selection=per_layer_head`` is their optional ``per_layer_perhead_pruning`` mode (one set per
(layer, KV head), group max). The window as their HF path runs it: ``protect_recent=0``, every decode token is a
candidate (their vLLM path protects 128: ``protect_recent=128`` with ``window=128``).

Calibration, as the authors do it (``scripts/calibrate.py``): one forward pass of the model over a plain text
(default: ``baselines/data/triattention_calibration.txt``, 13,191 tokens with Qwen3's tokenizer; at most
``calibration_tokens`` tokens, their ``--max-length`` 32768: give a longer text with ``calibration_text``), and per
(layer, query head, frequency) the complex mean ``q̄`` and the mean modulus ``m`` of the pre-RoPE queries.
``query_source=q_proj`` (default, theirs): a forward pre-hook on each ``self_attn`` records ``q_proj`` of its input,
without Qwen3's ``q_norm`` (times RoPE's attention scaling, as their rotate-then-invert leaves it);
``query_source=attention``: the queries the model attends with (after ``q_norm``), RoPE inverted. The runner tokenises
the text, calls :meth:`TriAttention.calibrate` before decoding and saves the centres in the run directory
(``calibration.pt``) with the text's sha256 and token count in ``manifest.json``; a resumed run reloads them.
``stats_file``: the authors' own statistics file (``calibrate.py``'s output, ``{"metadata", "stats":
{"layerLL_headHH": {"q_mean_real", "q_mean_imag", "q_abs_mean"}}}``) is used instead of a calibration pass (the
runner still reads the text; the model's rotary embedding gives the frequencies).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch

from vase.engine.attention import vase_attention
from vase.engine.geometry import partial_rope
from vase.engine.policy import EvictionInputs, EvictionPolicy, _check
from vase.engine.scores import topk_with_protection

logger = logging.getLogger(__name__)

DEFAULT_TEXT = Path(__file__).resolve().parent / "data" / "triattention_calibration.txt"
AGGREGATIONS = ("mean", "max")
GROUP_REDUCE = ("max", "mean")
SELECTIONS = ("per_head", "per_layer_head")
QUERY_SOURCES = ("q_proj", "attention")


def complex_pairs(x: torch.Tensor) -> torch.Tensor:
    """``(..., D)`` → ``(..., D/2)`` complex64: the pairs ``x_f + i x_{f+D/2}`` (transformers' rotate_half layout)."""
    f = x.shape[-1] // 2
    x = x.float()
    return torch.complex(x[..., :f].contiguous(), x[..., f:].contiguous())


def invert_rope(rotated: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """Undo RoPE: ``rotated (..., T, D)`` with the model's ``cos``/``sin`` ``(T, D)`` (which include ``scale``), or
    ``(T, D/2)``: one per frequency (gpt-oss's rotary embedding; its ``_apply_rotary_emb`` rotates the same halves)."""
    d = rotated.shape[-1] // 2
    if cos.shape[-1] == d:
        cos, sin = torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)
    half = torch.cat([-rotated[..., d:], rotated[..., :d]], dim=-1)
    return (rotated * cos - half * sin) / (scale * scale)


def geometric_offsets(max_length: int) -> torch.Tensor:
    """``(O,)`` float64 ``1, 2, 4, ..., <= max_length``."""
    out, v = [], 1
    while v <= max_length:
        out.append(float(v))
        v *= 2
    return torch.tensor(out, dtype=torch.float64)


def triattention_score(
    keys: torch.Tensor,
    now: torch.Tensor,
    q_mean: torch.Tensor,
    q_abs: torch.Tensor,
    omega: torch.Tensor,
    freq_scale_sq: float,
    offsets: torch.Tensor,
    aggregation: str = "mean",
    trig: bool = True,
    mlr: bool = True,
) -> torch.Tensor:
    """TriAttention's predicted attention of each query head for each key (see the module docstring).

    Args:
        keys: ``(B, H, N, D)`` post-RoPE keys.
        now: ``(B,)`` the rows' current position (their sequence length; the authors' ``round_start``).
        q_mean: ``(Hq, D/2)`` complex64 mean pre-RoPE query per query head (query head ``j`` uses KV head
            ``j // (Hq // H)``), or ``(B, Hq, D/2)``: each row's own (the rows of an eviction event are of
            different layers).
        q_abs: ``(Hq, D/2)`` or ``(B, Hq, D/2)`` float32 mean modulus ``m_f``.
        omega: ``(D/2,)`` RoPE's angular frequencies (``inv_freq``).
        freq_scale_sq: ``s_f²`` (RoPE's attention scaling squared).
        offsets: ``(O,)`` future offsets.
        aggregation: over the offsets, ``mean`` or ``max``.
        trig, mlr: the distance term; the norm term as ``m - |q̄|`` (else ``m``) — the authors' ablations.

    Returns:
        ``(B, Hq, N)`` float32.
    """
    b, h, n, _ = keys.shape
    hq, f = q_mean.shape[-2:]
    g = hq // h
    k = complex_pairs(keys)  # (B, H, N, F)
    qm = q_mean.reshape(-1, h, g, f)[:, :, :, None, :]  # (1 or B, H, G, 1, F)
    prod = qm * k.conj()[:, :, None]  # (B, H, G, N, F)
    t = now.to(torch.float64)[:, None] + offsets.to(device=keys.device, dtype=torch.float64)[None]  # (B, O)
    phase = t[..., None] * omega.to(device=keys.device, dtype=torch.float64)  # (B, O, F)
    rot = torch.polar(torch.ones_like(phase), phase).to(torch.complex64)  # e^{i ω t}
    if not trig:
        base = torch.zeros(b, h, g, n, device=keys.device)
    elif aggregation == "mean":  # linear in e^{iωt}: average the rotations first
        base = (prod * rot.mean(dim=1)[:, None, None, None, :]).real.sum(-1) * freq_scale_sq
    else:
        per = (prod[:, :, :, :, None, :] * rot[:, None, None, None]).real.sum(-1) * freq_scale_sq  # (B,H,G,N,O)
        base = per.amax(dim=-1)
    coef = q_abs - q_mean.abs() if mlr else q_abs
    extra = (k.abs()[:, :, None] * coef.reshape(-1, h, g, f)[:, :, :, None, :]).sum(-1) * freq_scale_sq
    return (base + extra).reshape(b, hq, n)


class _QueryStats:
    """Sums of the pre-RoPE query pairs per (layer, query head) over a calibration pass (``vase_on_query``)."""

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor, scale: float):
        self.cos, self.sin, self.scale = cos, sin, scale
        self.mean: dict[int, torch.Tensor] = {}
        self.abs: dict[int, torch.Tensor] = {}

    def __call__(self, layer: int, query: torch.Tensor) -> None:  # query: (1, Hq, T, D) post-RoPE
        z = complex_pairs(invert_rope(query.float(), self.cos, self.sin, self.scale))[0]  # (Hq, T, F)
        self.mean[layer] = z.mean(dim=1)
        self.abs[layer] = z.abs().mean(dim=1)


def _q_proj_hooks(model, stats: dict[int, tuple[torch.Tensor, torch.Tensor]], scale: float) -> list:
    """Forward pre-hooks on every ``self_attn`` recording, per layer, the complex mean ``(Hq, F)`` and mean modulus of
    ``q_proj`` of the attention's input (``(1, T, hidden)``), without ``q_norm``, times ``scale`` (the authors')."""
    heads = model.config.num_attention_heads
    handles = []
    for i, layer in enumerate(model.model.layers):
        attn = getattr(layer, "self_attn", None)
        if attn is None:
            continue

        def hook(module, args, kwargs, i=i):
            hidden = args[0] if args else kwargs["hidden_states"]
            q = module.q_proj(hidden).float() * scale  # (1, T, Hq * D)
            z = complex_pairs(q.view(q.shape[1], heads, -1).transpose(0, 1))  # (Hq, T, F)
            stats[i] = (z.mean(dim=1), z.abs().mean(dim=1))

        handles.append(attn.register_forward_pre_hook(hook, with_kwargs=True))
    return handles


def read_stats_file(path: str | Path, layers: int, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The authors' statistics file (``scripts/calibrate.py``'s output) as ``q_mean (L, Hq, F, 2)``, ``q_abs (L, Hq,
    F)`` float32; one line naming ``policy.stats_file`` when a (layer, head) of the model is missing."""
    payload = torch.load(path, map_location="cpu", weights_only=False)
    _check(isinstance(payload, dict) and "stats" in payload, "policy.stats_file", f"{path}: no 'stats' entry")
    mean, mod = [], []
    for layer in range(layers):
        for head in range(heads):
            entry = payload["stats"].get(f"layer{layer:02d}_head{head:02d}")
            _check(
                entry is not None,
                "policy.stats_file",
                f"{path} has no statistics for layer {layer} head {head}; calibrate for this model",
            )
            mean.append(torch.stack([entry["q_mean_real"].float(), entry["q_mean_imag"].float()], dim=-1))
            mod.append(entry["q_abs_mean"].float())
    f = mod[0].shape[-1]
    return torch.stack(mean).view(layers, heads, f, 2), torch.stack(mod).view(layers, heads, f)


def _check_rope(model_config) -> None:
    """TriAttention models RoPE over the whole head dim of every layer: refuse partial RoPE and NoPE (one line)."""
    partial = partial_rope(model_config)
    _check(
        partial is None,
        "policy.triattention",
        f"assumes RoPE over the whole head dim of every layer; {partial}: not supported yet",
    )


def read_calibration_text(path: Path) -> str:
    """The calibration text of ``path``: UTF-8 text with at least one character that is not white space.

    Raises:
        ValueError: one line naming ``policy.calibration_text``, the file and what is wrong (empty, binary: the byte
            offset of the first byte that is not UTF-8, or unreadable).
    """
    fix = f"give a plain-text (UTF-8) file, or policy.calibration_text=null for {DEFAULT_TEXT.name}"
    try:
        raw = Path(path).read_bytes()
    except OSError as err:
        raise ValueError(f"policy.calibration_text: cannot read {str(path)!r} ({err.strerror}); {fix}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(
            f"policy.calibration_text: {str(path)!r} is not UTF-8 text (byte {err.start} is {raw[err.start]:#04x}); "
            f"{fix}"
        ) from None
    if "\x00" in text:
        raise ValueError(f"policy.calibration_text: {str(path)!r} is binary (it holds NUL bytes); {fix}")
    if not text.strip():
        raise ValueError(f"policy.calibration_text: {str(path)!r} is empty (no text to calibrate on); {fix}")
    return text


@dataclass
class TriAttention(EvictionPolicy):
    """TriAttention; fields as in the module docstring.

    Attributes:
        sinks: first tokens always kept (0; the prompt is kept anyway with ``keep_prompt``).
        offset_max_length: the largest future offset (geometric offsets ``1, 2, ..., 65536``).
        score_aggregation: ``mean`` or ``max`` over the offsets.
        normalize: z-score the scores per query head over the candidates before the group reduction.
        group_reduce: ``max`` or ``mean`` over the query heads of a KV head.
        trig, mlr: keep the distance term; use ``m - |q̄|`` in the norm term (``False``: the authors' ablations).
        calibration_text: the plain-text file of the calibration pass (``None``: the harness's own).
        calibration_tokens: at most this many tokens of it (the authors' ``--max-length``).
        selection: ``per_head`` (one set per KV head for every layer of a row; the authors' runs) or
            ``per_layer_head`` (one per (layer, KV head); their ``per_layer_perhead_pruning``).
        query_source: ``q_proj`` (the authors' calibration: ``q_proj`` outputs, no ``q_norm``) or ``attention``.
        stats_file: the authors' statistics ``.pt`` used instead of a calibration pass (``None``: calibrate).
        protect_recent: the recent tokens the engine protects (``0``: none, the authors' HF path).
    """

    sinks: int = 0
    keep_prompt: bool = True
    evict_every: int | None = 128
    offset_max_length: int = 65536
    score_aggregation: str = "mean"
    normalize: bool = True
    group_reduce: str = "max"
    trig: bool = True
    mlr: bool = True
    calibration_text: str | None = None
    calibration_tokens: int = 32768
    selection: str = "per_head"
    query_source: str = "q_proj"
    stats_file: str | None = None
    protect_recent: int | None = 0

    name: ClassVar[str] = "triattention"
    head_parallel: ClassVar[str | None] = "its calibrated Q centres are per query head of the whole model"
    display_name: ClassVar[str] = "TriAttention"

    def validate(self) -> None:
        super().validate()
        m = self.offset_max_length
        _check(isinstance(m, int) and m >= 1, "policy.offset_max_length", f"must be an integer >= 1, got {m!r}")
        _check(
            self.score_aggregation in AGGREGATIONS,
            "policy.score_aggregation",
            f"must be one of {', '.join(AGGREGATIONS)}, got {self.score_aggregation!r}",
        )
        _check(
            self.group_reduce in GROUP_REDUCE,
            "policy.group_reduce",
            f"must be one of {', '.join(GROUP_REDUCE)}, got {self.group_reduce!r}",
        )
        for field_name, allowed in (("selection", SELECTIONS), ("query_source", QUERY_SOURCES)):
            value = getattr(self, field_name)
            _check(value in allowed, f"policy.{field_name}", f"must be one of {', '.join(allowed)}, got {value!r}")
        _check(
            self.stats_file is None or Path(self.stats_file).is_file(),
            "policy.stats_file",
            f"no such file {self.stats_file!r}; give the authors' statistics .pt (calibrate.py's output) or null",
        )
        for flag in ("normalize", "trig", "mlr"):
            _check(isinstance(getattr(self, flag), bool), f"policy.{flag}", "must be true or false")
        t = self.calibration_tokens
        _check(isinstance(t, int) and t >= 2, "policy.calibration_tokens", f"must be an integer >= 2, got {t!r}")
        path = self.text_path()
        _check(
            path.is_file(),
            "policy.calibration_text",
            f"no such file {str(path)!r}; give a plain-text file (or null for {DEFAULT_TEXT.name})",
        )
        read_calibration_text(path)  # empty or not UTF-8 text: one line now, before anything is written

    # ---- calibration --------------------------------------------------------------------------------------------
    def text_path(self) -> Path:
        """The calibration text's path."""
        return DEFAULT_TEXT if self.calibration_text is None else Path(self.calibration_text)

    def calibration_input(self) -> Path:
        """The plain text the runner tokenises for :meth:`calibrate` (at most ``calibration_tokens`` tokens)."""
        return self.text_path()

    def calibrate(self, model, input_ids: torch.Tensor) -> dict:
        """The authors' calibration pass: one forward of ``input_ids`` ``(T,)``; returns (and keeps) the centres.

        Returns ``{"q_mean": (L, Hq, F, 2) float32, "q_abs": (L, Hq, F), "inv_freq": (F,), "attention_scaling",
        "tokens"}`` (what :meth:`load_calibration` takes and the runner saves).
        """
        _check_rope(model.config)
        rotary = model.model.rotary_emb
        scale = float(getattr(rotary, "attention_scaling", 1.0))
        cfg = model.config
        if self.stats_file is not None:  # the authors' shipped statistics: no pass
            q_mean, q_abs = read_stats_file(self.stats_file, cfg.num_hidden_layers, cfg.num_attention_heads)
            record = {"q_mean": q_mean, "q_abs": q_abs, "inv_freq": rotary.inv_freq.float().cpu()}
            record.update({"attention_scaling": scale, "tokens": 0})
            self.load_calibration(record, device=next(model.parameters()).device)
            logger.info("triattention: Q centres read from %s", self.stats_file)
            return record
        ids = input_ids.reshape(1, -1)[:, : self.calibration_tokens].to(next(model.parameters()).device)
        t = ids.shape[1]
        if t < self.calibration_tokens:
            logger.warning(
                "triattention: the calibration text has %d tokens, fewer than calibration_tokens=%d (the authors'"
                " 32768); give a longer policy.calibration_text to calibrate as they do",
                t,
                self.calibration_tokens,
            )
        pos = torch.arange(t, device=ids.device)[None]
        found: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        if self.query_source == "q_proj":
            handles = _q_proj_hooks(model, found, scale)
            try:
                with torch.inference_mode():
                    model(input_ids=ids, position_ids=pos, use_cache=False, logits_to_keep=1)
            finally:
                for handle in handles:
                    handle.remove()
            means, mods = {i: m for i, (m, _) in found.items()}, {i: a for i, (_, a) in found.items()}
        else:
            probe = torch.zeros(1, t, 1, dtype=torch.float32, device=ids.device)
            cos, sin = rotary(probe, pos)
            stats = _QueryStats(cos[0].float(), sin[0].float(), scale)
            with torch.inference_mode(), vase_attention(model):
                model(input_ids=ids, position_ids=pos, use_cache=False, logits_to_keep=1, vase_on_query=stats)
            means, mods = stats.mean, stats.abs
        layers = sorted(means)
        record = {
            "q_mean": torch.stack([torch.view_as_real(means[i]) for i in layers]).cpu(),
            "q_abs": torch.stack([mods[i] for i in layers]).cpu(),
            "inv_freq": rotary.inv_freq.float().cpu(),
            "attention_scaling": scale,
            "tokens": t,
        }
        self.load_calibration(record, device=ids.device)
        logger.info("triattention: calibrated the Q centres of %d layers on %d tokens (%s)", len(layers), t,
                    self.query_source)  # fmt: skip
        return record

    def load_calibration(self, record: dict, device: torch.device | str | None = None) -> None:
        """Use the centres of ``record`` (from :meth:`calibrate` or a run's ``calibration.pt``), on ``device``."""
        dev = device if device is not None else "cpu"
        self._q_mean = torch.view_as_complex(record["q_mean"].float().contiguous()).to(dev)  # (L, Hq, F)
        self._q_abs = record["q_abs"].float().to(dev)
        self._omega = record["inv_freq"].float().to(dev)
        self._scale_sq = float(record["attention_scaling"]) ** 2
        self._offsets = geometric_offsets(self.offset_max_length).to(dev)

    @property
    def calibrated(self) -> bool:
        """Whether centres are loaded (by :meth:`calibrate` or :meth:`load_calibration`)."""
        return getattr(self, "_q_mean", None) is not None

    def check_model(self, model_config) -> None:
        """Refuse partial RoPE and NoPE from the model's config, in the preflight (before any file or weight)."""
        _check_rope(model_config)

    def setup(self, model_config) -> None:
        """Refuse to decode without centres, or with centres of another model's geometry (one line)."""
        heads = model_config.num_attention_heads
        head_dim = getattr(model_config, "head_dim", None) or model_config.hidden_size // heads
        want = (model_config.num_hidden_layers, heads, head_dim // 2)
        _check(
            self.calibrated,
            "policy.triattention",
            "not calibrated; the runner calibrates it before decoding (or call policy.calibrate(model, input_ids))",
        )
        have = tuple(self._q_mean.shape)
        _check(have == want, "policy.triattention", f"centres of shape {have} for a model of {want}; recalibrate")

    # ---- the rule -----------------------------------------------------------------------------------------------
    def keep(self, inputs: EvictionInputs) -> torch.Tensor:
        """``(B, H, n_keep)`` int64: the sinks, then by decreasing normalised, group-reduced TriAttention score; with
        ``selection=per_head`` one set per KV head for the ``inputs.layers_per_row`` layers of each row (their
        per-layer group-reduced scores averaged), else per (layer, KV head)."""
        b, h, n, _ = inputs.shape
        held = (
            inputs.positions
            if inputs.window_positions is None
            else torch.cat([inputs.positions, inputs.window_positions], dim=-1)
        )
        now = held.amax(dim=(1, 2)) + 1  # (B,) the rows' sequence length
        score = triattention_score(
            inputs.keys,
            now,
            self._q_mean[inputs.layer_ids],  # (B, Hq, F): each row's layer's centres
            self._q_abs[inputs.layer_ids],
            self._omega,
            self._scale_sq,
            self._offsets,
            self.score_aggregation,
            self.trig,
            self.mlr,
        )  # (B, Hq, N)
        if self.normalize:
            mean = score.mean(dim=-1, keepdim=True)
            std = score.std(dim=-1, unbiased=False, keepdim=True).clamp_min(1e-6)
            score = (score - mean) / std
        hq = score.shape[1]
        score = score + 1e-6 * inputs.rand(hq, n)  # the authors' tie-break
        grouped = score.view(b, h, hq // h, n)
        score = grouped.amax(dim=2) if self.group_reduce == "max" else grouped.mean(dim=2)  # (B, H, N)
        if self.selection == "per_layer_head":
            return topk_with_protection(score, inputs.n_keep, protected=inputs.positions < self.sinks)
        per_row = inputs.layers_per_row  # the layers of a row hold the same positions (one set per KV head)
        rows = b // per_row
        score = score.view(rows, per_row, h, n).mean(dim=1)  # mean over the layers of the per-layer group max
        protected = inputs.positions.view(rows, per_row, h, n)[:, 0] < self.sinks
        keep = topk_with_protection(score, inputs.n_keep, protected=protected)  # (rows, H, n_keep)
        return keep[:, None].expand(rows, per_row, h, inputs.n_keep).reshape(b, h, inputs.n_keep)
