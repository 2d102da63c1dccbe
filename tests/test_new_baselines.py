"""The 2026 baselines against small references of their published rules on random tensors: KeyDiff (keys least
similar to the mean key), TriAttention (the trigonometric score from the query centres, its normalisation and group
reduction, its calibration pass). H2O's reference, step by step over several evictions, is in
``tests/test_policy_authoring.py`` (the walkthrough)."""

from __future__ import annotations

import math

import pytest
import torch

from baselines.keydiff import KeyDiff, keydiff_score
from baselines.triattention import TriAttention, geometric_offsets, invert_rope, triattention_score
from tests.policy_configs import calibrate
from tests.scaffold import run_scaffold
from tests.tolerance import close
from vase.models import tiny_model

LAYOUTS = {"mha": (4, 4), "gqa": (2, 8)}


# ---- KeyDiff -------------------------------------------------------------------------------------------------------
def _cos(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b))
    return dot / (math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b)))


@pytest.mark.parametrize("sinks", [0, 4])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_keydiff_keeps_the_keys_least_similar_to_the_mean_key(layout, sinks):
    """Reference, one (row, head) at a time in Python floats: the anchor is the mean of the unit-normalised held keys
    (candidates and window), the score minus the cosine to it, the top ``n_keep`` kept (sinks first)."""
    h, hq = LAYOUTS[layout]
    policy = KeyDiff(budget=64, window=16, sinks=sinks)
    for call in run_scaffold(policy, [5, 6], h, hq, calls=3):
        inp = call.inputs
        got = keydiff_score(inp.keys, inp.window_keys)
        for b in range(2):
            for hh in range(h):
                keys = inp.keys[b, hh].double().tolist()
                pool = keys + inp.window_keys[b, hh].double().tolist()
                unit = [[x / math.sqrt(sum(y * y for y in k)) for x in k] for k in pool]
                anchor = [sum(col) / len(unit) for col in zip(*unit)]
                want = [-_cos(k, anchor) for k in keys]
                assert got[b, hh].tolist() == pytest.approx(want, abs=1e-5)
                pos = inp.positions[b, hh].tolist()
                order = sorted(range(len(keys)), key=lambda i: (pos[i] >= sinks, -want[i]))
                assert set(call.keep[b, hh].tolist()) == set(order[: inp.n_keep]), (b, hh)


# ---- TriAttention --------------------------------------------------------------------------------------------------
def _rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Transformers' RoPE (rotate_half layout): ``x (..., N, D)`` at ``positions (..., N)``."""
    angle = positions[..., None].double() * inv_freq.double()  # (..., N, D/2)
    cos, sin = torch.cat([angle.cos()] * 2, -1), torch.cat([angle.sin()] * 2, -1)
    d = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., d:], x[..., :d]], -1) * sin


def tri_reference(k_pre, pos, now, q_mean, q_abs, inv_freq, offsets, aggregation="mean", trig=True, mlr=True):
    """The authors' HF form, one key at a time: pre-RoPE key pairs, ``Δ = now - p + offset``, amplitude
    ``|q̄||k|``, phase ``arg(q̄ conj k)``, the norm term ``(m - |q̄|)|k|``; mean or max over the offsets."""
    f = k_pre.shape[-1] // 2
    kc = torch.complex(k_pre[..., :f].double(), k_pre[..., f:].double())
    qm = q_mean.to(torch.complex128)
    amp = qm.abs() * kc.abs()
    phi = torch.angle(qm * kc.conj())
    coef = (q_abs.double() - qm.abs()) if mlr else q_abs.double()
    extra = (coef * kc.abs()).sum(-1)
    per = []
    for o in offsets.tolist():
        delta = now - pos.double() + o
        per.append((amp * torch.cos(delta[..., None] * inv_freq.double() + phi)).sum(-1) if trig else 0 * extra)
    per = torch.stack(per)
    base = per.mean(0) if aggregation == "mean" else per.amax(0)
    return base + extra


@pytest.mark.parametrize("aggregation", ["mean", "max"])
@pytest.mark.parametrize("trig,mlr", [(True, True), (False, True), (True, False)])
def test_triattention_score_equals_the_rope_inverted_form(aggregation, trig, mlr):
    """Scoring the post-RoPE keys the cache holds (phase from the query position only) equals the authors' form on
    the RoPE-inverted keys with their positions, for every query head of a GQA group."""
    g = torch.Generator().manual_seed(0)
    b, h, hq, n, d = 2, 2, 8, 30, 16
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, d, 2).float() / d))
    k_pre = torch.randn(b, h, n, d, generator=g)
    pos = torch.stack([torch.randperm(500, generator=g)[:n] for _ in range(b * h)]).view(b, h, n)
    keys = _rope(k_pre.double(), pos, inv_freq).float()
    q_mean = torch.complex(torch.randn(hq, d // 2, generator=g), torch.randn(hq, d // 2, generator=g))
    q_abs = q_mean.abs() + torch.rand(hq, d // 2, generator=g)
    now = torch.tensor([503, 611])
    offsets = geometric_offsets(65536)
    got = triattention_score(keys, now, q_mean, q_abs, inv_freq, 1.0, offsets, aggregation, trig, mlr)
    assert got.shape == (b, hq, n)
    for j in range(hq):
        kv = j // (hq // h)
        want = tri_reference(k_pre[:, kv], pos[:, kv], now[:, None].double(), q_mean[j], q_abs[j], inv_freq,
                             offsets, aggregation, trig, mlr)  # fmt: skip
        scale = want.abs().max().item()
        assert (got[:, j].double() - want).abs().max().item() <= 1e-4 * scale, j


@pytest.mark.parametrize("group_reduce", ["max", "mean"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_triattention_keeps_the_top_normalised_group_reduced_scores(layout, group_reduce):
    """keep(): per query head z-scored over the candidates (population std), reduced over the group (max: the
    authors' per-(layer, KV head) mode), top ``n_keep``; the prompt pinned, compression every ``evict_every``."""
    h, hq = LAYOUTS[layout]
    policy = calibrate(TriAttention(budget=64, window=16, evict_every=16, group_reduce=group_reduce), q_heads=hq)
    calls = run_scaffold(policy, [1, 2], h, hq, calls=3)
    for call in calls:
        inp = call.inputs
        assert inp.positions.min() >= 24  # the prompt is never a candidate
        now = inp.window_positions.amax(dim=(1, 2)) + 1
        raw = triattention_score(inp.keys, now, policy._q_mean[0], policy._q_abs[0], policy._omega, 1.0,
                                 geometric_offsets(65536))  # fmt: skip
        z = (raw - raw.mean(-1, keepdim=True)) / raw.std(-1, unbiased=False, keepdim=True)
        grouped = z.view(2, h, hq // h, -1)
        score = grouped.amax(2) if group_reduce == "max" else grouped.mean(2)
        for b in range(2):
            for hh in range(h):
                kept = set(call.keep[b, hh].tolist())
                order = score[b, hh].argsort(descending=True).tolist()
                want = set(order[: inp.n_keep])
                if kept != want:  # only a tie within the 1e-6 tie-break may differ
                    gap = score[b, hh, order[inp.n_keep - 1]] - score[b, hh, order[inp.n_keep]]
                    assert gap < 3e-6, (b, hh, float(gap))


@pytest.mark.parametrize("arch", ["qwen3", "gpt_oss"])
def test_invert_rope_undoes_the_models_rope(arch):
    """With the model's own rotary embedding and ``apply_rotary_pos_emb``: Qwen3's ``(T, D)`` cos/sin; gpt-oss's
    ``(T, D/2)`` ones (one per frequency) and YaRN's attention scaling (cos/sin scaled by it)."""
    import importlib

    apply_rotary_pos_emb = importlib.import_module(f"transformers.models.{arch}.modeling_{arch}").apply_rotary_pos_emb
    model = tiny_model(arch)
    rotary = model.model.rotary_emb
    x = torch.randn(1, 4, 12, 16)
    pos = torch.arange(12)[None]
    cos, sin = rotary(x, pos)
    assert cos.shape[-1] == (16 if arch == "qwen3" else 8)
    scale = float(getattr(rotary, "attention_scaling", 1.0))
    assert (scale == 1.0) == (arch == "qwen3")
    rotated, _ = apply_rotary_pos_emb(x, x, cos, sin)
    assert torch.allclose(invert_rope(rotated, cos[0], sin[0], scale), x, atol=1e-5)


def authors_calibration(model, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A port of the authors' ``scripts/calibrate.py`` (read, not copied): a forward pre-hook on every ``self_attn``
    recomputes ``q_proj`` of its input (no ``q_norm``), applies RoPE times the attention scaling, inverts it, and
    keeps per (layer, head) the complex mean and mean modulus of the pairs ``x_f + i x_{f+D/2}``; float64 here."""
    cfg, rotary = model.config, model.model.rotary_emb
    hq, d = cfg.num_attention_heads, cfg.head_dim
    scale = float(getattr(rotary, "attention_scaling", 1.0))
    captured = {}

    def hook(i):
        def fn(module, args, kwargs):
            hidden = args[0] if args else kwargs["hidden_states"]
            t = hidden.shape[1]
            q = module.q_proj(hidden).double().view(1, t, hq, d).transpose(1, 2)
            cos, sin = rotary(torch.zeros(1, t, d), torch.arange(t)[None])
            cos, sin = cos.double()[:, None], sin.double()[:, None]
            half = torch.cat((-q[..., d // 2 :], q[..., : d // 2]), dim=-1)
            captured[i] = (q * cos + half * sin) * scale  # as their hook: rotated, times the scaling

        return fn

    handles = [layer.self_attn.register_forward_pre_hook(hook(i), with_kwargs=True)
               for i, layer in enumerate(model.model.layers)]  # fmt: skip
    with torch.no_grad():
        model(ids[None])
    for handle in handles:
        handle.remove()
    t = ids.shape[0]
    cos, sin = rotary(torch.zeros(1, t, d), torch.arange(t)[None])
    cos, sin = cos.double()[:, None], sin.double()[:, None]
    means, mods = [], []
    for i in range(cfg.num_hidden_layers):
        base = captured[i] / scale
        cu, su = cos / scale, sin / scale
        q = base * cu - torch.cat((-base[..., d // 2 :], base[..., : d // 2]), dim=-1) * su  # their _invert_rope
        z = torch.complex(q[0, ..., : d // 2], q[0, ..., d // 2 :])  # (Hq, T, F)
        means.append(z.mean(dim=1))
        mods.append(z.abs().mean(dim=1))
    return torch.stack(means), torch.stack(mods)


def fixed_text_ids(vocab: int, n: int = 120) -> torch.Tensor:
    """A fixed text: the first ``n`` bytes of the default calibration text as token ids (the tiny model has no
    tokenizer)."""
    from baselines.triattention import DEFAULT_TEXT

    return torch.tensor(list(DEFAULT_TEXT.read_bytes()[:n]), dtype=torch.long) % vocab


def test_triattention_calibration_equals_the_authors_statistics_on_a_fixed_text():
    """The default calibration (``query_source=q_proj``) equals the port of the authors' ``calibrate.py``; the former
    default (the queries attended with, after Qwen3's ``q_norm``) does not: the failing-first run, kept."""
    model = tiny_model("qwen3")
    cfg = model.config
    ids = fixed_text_ids(cfg.vocab_size)
    want_mean, want_abs = authors_calibration(model, ids)
    policy = TriAttention(budget=64, window=16)
    record = policy.calibrate(model, ids)
    assert record["q_mean"].shape == (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.head_dim // 2, 2)
    assert record["tokens"] == ids.numel()
    got = torch.view_as_complex(record["q_mean"]).to(torch.complex128)
    # a mean over the text of float32 queries that are sums over the hidden width, against float64
    tol = close(torch.float32, ids.numel() + cfg.hidden_size, scale=want_abs.max().item())
    torch.testing.assert_close(got, want_mean, **tol)
    torch.testing.assert_close(record["q_abs"].double(), want_abs, **tol)
    assert torch.equal(record["inv_freq"], model.model.rotary_emb.inv_freq.float())
    old = TriAttention(budget=64, window=16, query_source="attention").calibrate(model, ids)
    assert (torch.view_as_complex(old["q_mean"]).to(torch.complex128) - want_mean).abs().max().item() > 100 * tol[
        "atol"
    ]
    # the policy uses what it calibrated, and a reload gives the same answers
    policy.setup(cfg)
    other = TriAttention(budget=64, window=16)
    other.load_calibration(record)
    assert torch.equal(other._q_mean, policy._q_mean)


def test_triattention_attention_source_is_the_mean_pre_rope_query_attended_with():
    """``query_source=attention``: the pre-RoPE queries after Qwen3's ``q_norm`` (recomputed from layer 0's weights)."""
    model = tiny_model("qwen3")
    cfg = model.config
    ids = torch.randint(0, cfg.vocab_size, (80,), generator=torch.Generator().manual_seed(0))
    record = TriAttention(budget=64, window=16, query_source="attention").calibrate(model, ids)
    hq, d = cfg.num_attention_heads, cfg.head_dim
    attn = model.model.layers[0].self_attn
    with torch.no_grad():
        hidden = model.model.layers[0].input_layernorm(model.model.embed_tokens(ids[None]))
        q = attn.q_norm(attn.q_proj(hidden).view(1, 80, hq, d))[0].transpose(0, 1)  # (Hq, T, D) pre-RoPE
    z = torch.complex(q[..., : d // 2], q[..., d // 2 :])
    # a mean over 80 tokens of queries that are sums over the hidden width: float32 sums in the model's order
    tol = close(torch.float32, 80 + cfg.hidden_size, scale=z.abs().max().item())
    torch.testing.assert_close(torch.view_as_complex(record["q_mean"][0]), z.mean(1), **tol)
    torch.testing.assert_close(record["q_abs"][0], z.abs().mean(1), **tol)


def test_triattention_reads_the_authors_statistics_file(tmp_path):
    """``stats_file``: calibrate.py's output format is read instead of a pass (layer/head keys, real/imag/abs)."""
    model = tiny_model("qwen3")
    cfg = model.config
    mean, mod = authors_calibration(model, fixed_text_ids(cfg.vocab_size))
    stats = {
        f"layer{li:02d}_head{hi:02d}": {
            "q_mean_real": mean[li, hi].real.float(),
            "q_mean_imag": mean[li, hi].imag.float(),
            "q_abs_mean": mod[li, hi].float(),
        }
        for li in range(cfg.num_hidden_layers)
        for hi in range(cfg.num_attention_heads)
    }
    path = tmp_path / "stats.pt"
    torch.save({"metadata": {"head_dim": cfg.head_dim}, "stats": stats}, path)
    record = TriAttention(budget=64, window=16, stats_file=str(path)).calibrate(model, torch.zeros(4, dtype=torch.long))
    assert torch.equal(torch.view_as_complex(record["q_mean"]), mean.to(torch.complex64))
    assert torch.equal(record["q_abs"], mod.float())
    del stats["layer01_head03"]
    torch.save({"stats": stats}, path)
    with pytest.raises(ValueError, match=r"^policy\.stats_file: .* has no statistics for layer 1 head 3"):
        TriAttention(budget=64, window=16, stats_file=str(path)).calibrate(model, torch.zeros(4, dtype=torch.long))


def test_triattention_refuses_to_decode_uncalibrated_or_with_another_models_centres():
    from vase.models import tiny_config

    policy = TriAttention(budget=64, window=16)
    with pytest.raises(ValueError, match="policy.triattention: not calibrated"):
        policy.setup(tiny_config("qwen3"))
    calibrate(policy, layers=5, q_heads=4, head_dim=16)
    with pytest.raises(ValueError, match="policy.triattention: centres of shape"):
        policy.setup(tiny_config("qwen3"))


@pytest.mark.parametrize(
    "overrides,message",
    [
        ({"score_aggregation": "median"}, "policy.score_aggregation: must be one of mean, max"),
        ({"group_reduce": "sum"}, "policy.group_reduce: must be one of max, mean"),
        ({"calibration_text": "/no/such.txt"}, "policy.calibration_text: no such file"),
        ({"offset_max_length": 0}, "policy.offset_max_length: must be an integer >= 1"),
    ],
)
def test_triattention_validation_names_the_field(overrides, message):
    with pytest.raises(ValueError, match=message):
        TriAttention(budget=64, window=16, **overrides)
