"""Value-magnitude analysis: how large the value states get, where the large ones sit, and how they quantize.

From a full-cache decoding (:class:`~vase.engine.policy.FullCache`, so the cache holds every token's value state), per
selected layer, KV head and token:

* the value statistics of :func:`~vase.engine.scores.value_statistic` (``range = max - min`` over the head dimension,
  the one VaSE protects; ``l2``; ``absmax``);
* the quantization error of the token's value vector under per-group asymmetric min-max quantization (KIVI-style:
  groups of ``g`` consecutive channels, ``b`` bits, scale ``(max - min) / (2^b - 1)``, zero point ``min``; the
  default, ``quantizer="minmax"``) or the paper's HQQ (``quantizer="hqq"``: :mod:`vase.analysis.hqq`), as the
  relative L2 error ``‖v - Q(v)‖ / ‖v‖`` (and the absolute one).

Analyses: per-layer distributions and the share of tokens above ``k ×`` the median range of their (layer, head); where
the large-value tokens sit (sink tokens, position buckets, prompt vs output, which text tokens); the per-layer
Spearman correlation between a token's value range and its quantization error, and the paper's Pearson correlation
of the range with the per-token mean squared error, the sink positions left out (``quantize_hqq.py``).

Layer types (``layer_type`` in every per-layer table): a full-attention layer gives every token, a sliding-window
layer the tokens its ring holds at the end (true positions), a linear-attention layer nothing (refused); by default
(:func:`default_layers`) five full-attention layers are analysed.

The figures and the output files: :mod:`vase.analysis.value_figures`. Run it with ``scripts/value_analysis.py`` (see
``docs/analysis.md``).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import torch

from vase.analysis.hqq import hqq_quantize
from vase.engine.scores import value_statistic

logger = logging.getLogger(__name__)

STATS = ("range", "l2", "absmax")
#: the layer types (vase.engine.geometry.LAYER_TYPES): full-attention and sliding layers hold per-token values
FULL, SLIDING, LINEAR_TYPE = "full_attention", "sliding_attention", "linear_attention"
SINKS = 4
POSITION_BUCKETS = (
    (0, 4, "sink 0-3"),
    (4, 16, "4-15"),
    (16, 64, "16-63"),
    (64, 256, "64-255"),
    (256, 1024, "256-1023"),
    (1024, None, "1024+"),
)


# ------------------------------------------------------------------------------------------------ tensor math


def value_stats(values: torch.Tensor) -> dict[str, torch.Tensor]:
    """``range``, ``l2`` and ``absmax`` of each value vector of ``values (..., D)`` (float32, shape ``(...)``)."""
    v = values.float()
    return {s: value_statistic(v, s) for s in STATS}


def quantize_groups(x: torch.Tensor, bits: int, group_size: int) -> torch.Tensor:
    """Quantize-dequantize ``x (..., D)`` per token: asymmetric min-max with ``bits`` bits over groups of
    ``group_size`` consecutive channels (a last group may be shorter; ``group_size >= D`` is one group).

    Per group: ``scale = (max - min) / (2^bits - 1)``, ``q = clamp(round((x - min) / scale), 0, 2^bits - 1)``,
    ``x̂ = q * scale + min``; a constant group (``max == min``) is reproduced exactly. Returns float32 ``(..., D)``.
    """
    if bits < 1:
        raise ValueError(f"bits: must be >= 1, got {bits}")
    if group_size < 1:
        raise ValueError(f"group_size: must be >= 1, got {group_size}")
    levels = 2**bits - 1
    out = []
    for g in torch.split(x.float(), group_size, dim=-1):
        lo = g.amin(dim=-1, keepdim=True)
        hi = g.amax(dim=-1, keepdim=True)
        scale = (hi - lo) / levels
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = torch.round((g - lo) / safe).clamp(0, levels)
        out.append(torch.where(scale > 0, q * safe + lo, g))
    return torch.cat(out, dim=-1)


#: the quantizers of the analysis: name -> quantize-dequantize ``(x (..., D), bits, group_size) -> (..., D)``
QUANTIZERS: dict[str, Callable[[torch.Tensor, int, int], torch.Tensor]] = {
    "minmax": quantize_groups,
    "hqq": hqq_quantize,
}


def quantization_error(
    x: torch.Tensor, bits: int, group_size: int, quantizer: str = "minmax"
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(relative, absolute)`` L2 error of the quantizer (:data:`QUANTIZERS`) per vector of ``x (..., D)``: ``(...)``
    each.

    ``relative = ‖x - x̂‖ / ‖x‖`` (0 for a zero vector).
    """
    if quantizer not in QUANTIZERS:
        raise ValueError(f"quantizer: must be one of {', '.join(QUANTIZERS)}, got {quantizer!r}")
    x = x.float()
    err = (x - QUANTIZERS[quantizer](x, bits, group_size)).norm(dim=-1)
    norm = x.norm(dim=-1)
    rel = torch.where(norm > 0, err / norm.clamp_min(torch.finfo(torch.float32).tiny), torch.zeros_like(err))
    return rel, err


def spearman(x: Sequence[float] | np.ndarray, y: Sequence[float] | np.ndarray) -> float:
    """Spearman rank correlation (average ranks for ties); NaN with fewer than 3 points or a constant input."""
    a, b = pd.Series(np.asarray(x, dtype=float)), pd.Series(np.asarray(y, dtype=float))
    ok = a.notna() & b.notna()
    if ok.sum() < 3:
        return float("nan")
    ra, rb = a[ok].rank().to_numpy(), b[ok].rank().to_numpy()
    if ra.std() == 0 or rb.std() == 0:
        return float("nan")
    return float(np.corrcoef(ra, rb)[0, 1])


def pearson(x: Sequence[float] | np.ndarray, y: Sequence[float] | np.ndarray) -> float:
    """Pearson correlation (as ``torch.corrcoef`` in the authors' ``quantize_hqq.py``); NaN with fewer than 3 points
    or a constant input."""
    a, b = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    ok = ~(np.isnan(a) | np.isnan(b))
    a, b = a[ok], b[ok]
    if len(a) < 3 or a.std() == 0 or b.std() == 0:
        return float("nan")
    return float(np.corrcoef(a, b)[0, 1])


# ------------------------------------------------------------------------------------------------- capture


@dataclass
class ValueCapture:
    """The value states of selected layers after one full-cache generation (one sample).

    Attributes:
        problem_id: the problem.
        token_ids: ``(T,)`` the token at each cache position (prompt, then output; the last sampled token is never
            fed, so it is not in the cache).
        prompt_len: prompt tokens.
        values: layer (the model's index) -> ``(H, T_l, D)`` float32 value states, in position order: ``T_l = T`` on
            a full-attention layer, the ``min(T, window)`` tokens its ring holds at the end on a sliding layer.
        positions: layer -> ``(T_l,)`` the absolute position of each of its value states (``0..T-1`` on a full
            layer; the last ``window`` positions on a sliding one); a layer missing here: ``0..T_l-1``.
        layer_types: layer -> ``full_attention`` or ``sliding_attention``; missing: ``full_attention``.
    """

    problem_id: str
    token_ids: np.ndarray
    prompt_len: int
    values: dict[int, np.ndarray]
    positions: dict[int, np.ndarray] = field(default_factory=dict)
    layer_types: dict[int, str] = field(default_factory=dict)


def model_layer_types(model) -> tuple[str, ...]:
    """The type of each of the model's layers (:func:`vase.engine.geometry.config_layer_types` of its language
    model's config): ``full_attention``, ``sliding_attention`` or ``linear_attention``."""
    from vase.engine.geometry import config_layer_types
    from vase.engine.linear_state import text_config

    return config_layer_types(text_config(model.config))[0]


def default_layers(types: Sequence[str], n: int = 5) -> list[int]:
    """The analysis's default layers: ``n`` spread evenly over the model's full-attention layers (the first, every
    ``1/(n-1)`` of them, the last; on a 24-layer model of full attention only: 0, 6, 12, 18, 23), by the model's
    layer index. Full-attention layers hold every token's value state (and the policy's budget applies to them);
    sliding-window layers hold only their window's last tokens and linear-attention layers no per-token values, so
    they are left out (a sliding layer is analysed when named)."""
    full = [i for i, t in enumerate(types) if t == FULL]
    if not full:
        raise ValueError("layers: the model has no full-attention layer; name sliding-window layers explicitly")
    picks = {full[min(len(full) - 1, round(k * len(full) / (n - 1)))] for k in range(n - 1)} | {full[-1]}
    return sorted(picks)


def select_layers(types: Sequence[str], layers: Sequence[int] | None) -> list[int]:
    """``layers`` checked against the model's layer ``types`` (one-line ``ValueError`` for an index out of range or
    a linear-attention layer, which keeps no per-token values), or :func:`default_layers` for ``None`` (one log line
    naming the layers chosen and the sliding / linear layers left out)."""
    n_layers = len(types)
    if layers is None:
        chosen = default_layers(types)
        left = ", ".join(f"{types.count(t)} {t}" for t in (SLIDING, LINEAR_TYPE) if t in types)
        logger.info("value analysis: full-attention layers %s%s", chosen, f" (left out: {left} layers)" if left else "")
        return chosen
    bad = [x for x in layers if not 0 <= x < n_layers]
    if bad:
        raise ValueError(f"layers: {bad} out of range for a model with {n_layers} layers")
    kv = [i for i, t in enumerate(types) if t != LINEAR_TYPE]
    linear = [x for x in layers if x not in kv]
    if linear:  # a hybrid model's Gated DeltaNet layers keep a fixed state, no per-token values
        raise ValueError(f"layers: {linear} are linear-attention layers (no value cache); full-attention layers: {kv}")
    return list(layers)


def capture_values(
    model,
    prompt_ids: Sequence[int],
    layers: Sequence[int] | None,
    *,
    max_new_tokens: int,
    sampling=None,
    eos_token_ids: Sequence[int] = (),
    seed: int = 0,
    problem_id: str = "",
) -> ValueCapture:
    """Decode one sample with the full cache through :func:`vase.engine.decode.generate`; return the layers' values.

    The cache is taken through generate's ``on_cache`` hook and read after decoding (one row, so no row ever leaves
    the batch and the cache holds every token's value state). ``layers`` are the model's layer indices
    (:func:`select_layers`; ``None``: :func:`default_layers`). A full-attention layer gives every token's value, a
    sliding-window layer the tokens its ring holds at the end (the last ``window`` positions, sorted by position; the
    ring's slot of position ``p`` is ``p % window``); a linear-attention layer is refused (no per-token values).
    """
    from vase.engine import SamplingConfig, generate
    from vase.engine.policy import FullCache

    types = model_layer_types(model)
    layers = select_layers(types, layers)
    holder: list = []
    out = generate(
        model,
        list(prompt_ids),
        FullCache(),
        n_samples=1,
        sampling=sampling or SamplingConfig(greedy=True),
        max_new_tokens=max_new_tokens,
        eos_token_ids=eos_token_ids,
        seed=seed,
        on_cache=holder.append,
    )
    cache = holder[0]
    length = cache.length
    all_ids = np.asarray(list(prompt_ids) + list(out.tokens[0]), dtype=np.int64)
    values, positions = {}, {}
    for li in layers:
        layer = cache.layers[li]
        if layer.is_sliding:  # the ring: the last min(length, window) positions, slot p % window
            ring = layer.positions[0, 0].cpu().numpy()
            slots = np.flatnonzero(ring >= 0)
            slots = slots[np.argsort(ring[slots], kind="stable")]
            pos = ring[slots]
            if not np.array_equal(pos, np.arange(max(0, length - layer.window), length)):
                raise RuntimeError(f"layer {li}: the ring does not hold the last {layer.window} of {length} positions")
            values[li] = layer.values[0][:, torch.from_numpy(slots).to(layer.values.device)].float().cpu().numpy()
        else:
            pos = layer.positions[0, 0, :length].cpu().numpy()
            if not np.array_equal(pos, np.arange(length)):
                raise RuntimeError(f"layer {li}: full-cache positions are not 0..{length - 1}; was the cache evicted?")
            values[li] = layer.values[0, :, :length].float().cpu().numpy()
        positions[li] = pos.astype(np.int64)
    kinds = {li: types[li] for li in layers}
    return ValueCapture(str(problem_id), all_ids[:length], len(prompt_ids), values, positions, kinds)


def token_records(
    capture: ValueCapture,
    bits: Sequence[int] = (2, 4),
    group_sizes: Sequence[int] = (32, 64),
    quantizer: str = "minmax",
) -> pd.DataFrame:
    """One row per (layer, head, position): ``problem_id``, ``layer`` (the model's index), ``layer_type``
    (``full_attention`` / ``sliding_attention``), ``head``, ``position`` (absolute), ``token_id``, ``is_prompt``,
    ``range``, ``l2``, ``absmax``, and per (b, g) ``qerr_b{b}_g{g}`` (relative) and ``qabs_b{b}_g{g}`` (absolute)
    quantization errors under ``quantizer`` (:data:`QUANTIZERS`; HQQ quantizes one layer of the sample at once, as
    the authors do per example)."""
    frames = []
    for li, vals in capture.values.items():
        v = torch.from_numpy(vals)  # (H, T_l, D)
        h, t, _ = v.shape
        pos = capture.positions.get(li, np.arange(t))
        cols: dict[str, np.ndarray] = {
            "problem_id": np.full(h * t, capture.problem_id, dtype=object),
            "layer": np.full(h * t, li, dtype=np.int32),
            "layer_type": np.full(h * t, capture.layer_types.get(li, FULL), dtype=object),
            "head": np.repeat(np.arange(h, dtype=np.int32), t),
            "position": np.tile(pos.astype(np.int32), h),
            "token_id": np.tile(capture.token_ids[pos], h),
            "is_prompt": np.tile(pos < capture.prompt_len, h),
        }
        for name, stat in value_stats(v).items():
            cols[name] = stat.reshape(-1).numpy()
        for b in bits:
            for g in group_sizes:
                rel, err = quantization_error(v, b, g, quantizer)
                cols[f"qerr_b{b}_g{g}"] = rel.reshape(-1).numpy()
                cols[f"qabs_b{b}_g{g}"] = err.reshape(-1).numpy()
        frames.append(pd.DataFrame(cols))
    return pd.concat(frames, ignore_index=True)


# ------------------------------------------------------------------------------------------------ analyses


def parse_large(large: float | str) -> tuple[str, float]:
    """``5`` / ``"5x"`` -> ``("x", 5.0)`` (range > 5 × median); ``"top1%"`` -> ``("top", 0.01)`` (largest 1 %)."""
    if isinstance(large, (int, float)):
        return "x", float(large)
    text = str(large).strip().lower()
    m = re.fullmatch(r"([0-9.]+)x", text)
    if m:
        return "x", float(m.group(1))
    m = re.fullmatch(r"top([0-9.]+)%", text)
    if m and 0 < float(m.group(1)) <= 100:
        return "top", float(m.group(1)) / 100
    raise ValueError(f"large: expected e.g. 5x (k x median) or top1% (largest fraction), got {large!r}")


def large_label(large: float | str) -> str:
    """Human-readable definition: ``range > 5× median`` or ``largest 1% of ranges``."""
    kind, v = parse_large(large)
    return f"range > {v:g}× median" if kind == "x" else f"largest {100 * v:g}% of ranges"


def flag_large(df: pd.DataFrame, large: float | str = 5.0, stat: str = "range") -> pd.Series:
    """Large-value tokens, per (layer, head) over all tokens analysed: ``stat`` above ``k ×`` the median
    (``large=k`` or ``"kx"``), or among the largest fraction (``"top1%"``; ties at the threshold included)."""
    kind, v = parse_large(large)
    grouped = df.groupby(["layer", "head"])[stat]
    if kind == "x":
        return df[stat] > v * grouped.transform("median")
    return df[stat] >= grouped.transform(lambda x: x.quantile(1 - v))


def _layer_type(sub: pd.DataFrame) -> str:
    """The ``layer_type`` of one layer's records (records written before the column: ``full_attention``)."""
    return str(sub["layer_type"].iloc[0]) if "layer_type" in sub.columns and len(sub) else FULL


def per_layer_stats(df: pd.DataFrame, ks: Sequence[float] = (3, 5, 10)) -> pd.DataFrame:
    """Per layer (and its ``layer_type``): tokens, median / p90 / p99 / max of range and L2, max/median range ratio,
    the share of tokens whose range exceeds ``k ×`` their (layer, head) median for each ``k``, and the sinks'
    (positions 0-3) median range relative to the layer's median (NaN on a sliding layer whose ring no longer holds
    them)."""
    rows = []
    flags = {k: flag_large(df, k) for k in ks}
    for li, sub in df.groupby("layer"):
        row = {
            "layer": int(li),
            "layer_type": _layer_type(sub),
            "tokens": int(len(sub)),
            "heads": int(sub["head"].nunique()),
        }
        for s in ("range", "l2"):
            q = sub[s].quantile([0.5, 0.9, 0.99]).to_numpy()
            row.update({f"{s}_median": q[0], f"{s}_p90": q[1], f"{s}_p99": q[2], f"{s}_max": float(sub[s].max())})
        row["range_max_over_median"] = row["range_max"] / row["range_median"] if row["range_median"] else np.nan
        for k in ks:
            row[f"share_above_{k:g}x_median"] = float(flags[k][sub.index].mean())
        sinks = sub.loc[sub["position"] < SINKS, "range"]
        row["sink_range_median"] = float(sinks.median()) if len(sinks) else np.nan
        row["sink_over_median"] = row["sink_range_median"] / row["range_median"] if row["range_median"] else np.nan
        rows.append(row)
    return pd.DataFrame(rows)


def position_bucket(position: np.ndarray | pd.Series) -> np.ndarray:
    """The :data:`POSITION_BUCKETS` label of each absolute position."""
    pos = np.asarray(position)
    out = np.empty(len(pos), dtype=object)
    for lo, hi, label in POSITION_BUCKETS:
        out[(pos >= lo) & (pos < (hi if hi is not None else np.iinfo(np.int64).max))] = label
    return out


def large_value_locations(df: pd.DataFrame, large: float | str = 5.0) -> pd.DataFrame:
    """Per layer and position bucket (and prompt vs output): share of the large-value tokens (:func:`flag_large`)
    that sit there, against the share of all tokens there (``enrichment = large_share / all_share``)."""
    d = df.assign(
        bucket=position_bucket(df["position"]),
        large=flag_large(df, large),
        part=np.where(df["is_prompt"], "prompt", "output"),
    )
    rows = []
    for li, sub in d.groupby("layer"):
        n_large = int(sub["large"].sum())
        for col, labels in (("bucket", [b[2] for b in POSITION_BUCKETS]), ("part", ["prompt", "output"])):
            for label in labels:
                here = sub[col] == label
                all_share = float(here.mean())
                large_share = float((here & sub["large"]).sum() / n_large) if n_large else np.nan
                rows.append(
                    {
                        "definition": large_label(large),
                        "layer": int(li),
                        "layer_type": _layer_type(sub),
                        "kind": col,
                        "where": label,
                        "tokens": int(here.sum()),
                        "large_tokens": int((here & sub["large"]).sum()),
                        "large_share": large_share,
                        "all_share": all_share,
                        "enrichment": large_share / all_share if all_share and not np.isnan(large_share) else np.nan,
                    }
                )
    return pd.DataFrame(rows)


def large_value_tokens(
    df: pd.DataFrame, token_text: Callable[[int], str] | None = None, large: float | str = 5.0, top: int = 20
) -> pd.DataFrame:
    """The text tokens most often large-valued, over all analysed layers and heads: ``token_id``, ``text``,
    ``large`` (large (layer, head, position) entries), ``occurrences`` (all entries of that token), ``rate`` and
    ``sink_position`` (the token's position when it also occurs as a sink, else -1)."""
    d = df.assign(large=flag_large(df, large))
    g = d.groupby("token_id")["large"].agg(["sum", "count"]).rename(columns={"sum": "large", "count": "occurrences"})
    g = g[g["large"] > 0].sort_values(["large", "occurrences"], ascending=[False, True]).head(top)
    g["rate"] = g["large"] / g["occurrences"]
    g = g.reset_index()
    g["text"] = [token_text(int(t)) if token_text else str(t) for t in g["token_id"]]
    sinks = d[d["position"] < SINKS].groupby("token_id")["position"].min()
    g["sink_position"] = [int(sinks[t]) if t in sinks.index else -1 for t in g["token_id"]]
    g.insert(0, "definition", large_label(large))
    return g[["definition", "token_id", "text", "large", "occurrences", "rate", "sink_position"]]


def quant_error_correlation(df: pd.DataFrame) -> pd.DataFrame:
    """Per layer and (bits, group size): Spearman correlation of the value range with the relative and the absolute
    quantization error, Pearson with the relative error, the paper's Pearson with the per-token mean squared error
    (``pearson_mse``: ``qabs²`` up to the constant ``1 / D``, the first :data:`SINKS` positions left out, as
    ``quantize_hqq.py``), and the mean relative error of the top-1 % range tokens vs the others."""
    rows = []
    cols = sorted(c for c in df.columns if c.startswith("qerr_b"))
    for li, sub in df.groupby("layer"):
        top = sub["range"] >= sub["range"].quantile(0.99)
        rest = sub[sub["position"] >= SINKS]
        for c in cols:
            b, g = c[len("qerr_b") :].split("_g")
            rows.append(
                {
                    "layer": int(li),
                    "layer_type": _layer_type(sub),
                    "bits": int(b),
                    "group_size": int(g),
                    "spearman_relative": spearman(sub["range"], sub[c]),
                    "spearman_absolute": spearman(sub["range"], sub[c.replace("qerr", "qabs")]),
                    "pearson_relative": pearson(sub["range"], sub[c]),
                    "pearson_mse": pearson(rest["range"], rest[c.replace("qerr", "qabs")] ** 2),
                    "mean_rel_error": float(sub[c].mean()),
                    "mean_rel_error_top1pct": float(sub.loc[top, c].mean()),
                    "mean_rel_error_rest": float(sub.loc[~top, c].mean()),
                }
            )
    return pd.DataFrame(rows)


# ------------------------------------------------------------------------------------------------- pipeline


@dataclass
class ValueAnalysis:
    """Results of :func:`analyze`: the per-token records and the derived tables.

    ``locations`` and ``tokens`` hold one block per definition of "large" (column ``definition``).
    """

    records: pd.DataFrame
    per_layer: pd.DataFrame
    locations: pd.DataFrame
    tokens: pd.DataFrame
    correlation: pd.DataFrame
    definitions: tuple[str, ...]


def analyze(
    records: pd.DataFrame,
    token_text: Callable[[int], str] | None = None,
    large: Sequence[float | str] = ("5x", "top1%"),
    ks: Sequence[float] = (3, 5, 10),
    top: int = 20,
) -> ValueAnalysis:
    """Every table of the analysis from the per-token records (:func:`token_records` of each capture).

    Args:
        large: the definitions of a large-value token for the location and token tables (:func:`flag_large`); a
            k × median one alone may select nothing in a model without outliers, the top-fraction one always does.
        ks: the multiples of the median whose exceedance shares :func:`per_layer_stats` reports.
    """
    ks = tuple(sorted(set(ks) | {v for kind, v in map(parse_large, large) if kind == "x"}))
    if "layer_type" not in records.columns:  # records written before the column: full-attention layers
        records = records.assign(layer_type=FULL)
    return ValueAnalysis(
        records,
        per_layer_stats(records, ks),
        pd.concat([large_value_locations(records, x) for x in large], ignore_index=True),
        pd.concat([large_value_tokens(records, token_text, x, top) for x in large], ignore_index=True),
        quant_error_correlation(records),
        tuple(large_label(x) for x in large),
    )
