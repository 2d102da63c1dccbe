"""The engine's attention: equal to the eager reference, never a mask with ``enable_gqa``, a fused kernel on CUDA.

* :func:`vase.engine.attention.decode_attention` (KV groups packed into the query-length axis) and
  :func:`~vase.engine.attention.prefill_attention` equal :func:`~vase.engine.attention.eager_attention` in fp32 for
  rows of different lengths, GQA 1:1, 2:1 and 8:1, with and without selection masks of both forms;
* over real decodes with rows of different lengths, for every policy config: no SDPA call passes ``attn_mask``
  together with ``enable_gqa=True``, and by torch's CUDA dispatch rules (``tests/sdpa_cuda_reference.py``) every call
  runs on a fused kernel (FlashAttention, memory-efficient or cuDNN), never math, with masks the memory-efficient
  kernel takes without a copy; the old call (a mask with ``enable_gqa``) is flagged by the same rules;
* ``attn_backend=auto`` / an explicit ``flash_attn``: the kernel choice and the setting checks.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hydra.utils import instantiate
from omegaconf import OmegaConf
from torch.overrides import TorchFunctionMode

import vase.engine.attention as va
from tests import sdpa_cuda_reference as ref
from tests.tolerance import close
from vase.engine import Decoder, Request, SamplingConfig, generate
from vase.engine.attention import (
    additive_mask,
    backend_choice,
    decode_attention,
    eager_attention,
    prefill_attention,
    probe_kernels,
    resolve_backend,
    sdpa_attention,
    sdpa_kernel_of,
)
from vase.engine.cache import cache_capacity
from vase.engine.policy import SelectionPolicy
from vase.models import tiny_model

CONF = Path(__file__).resolve().parents[1] / "conf" / "policy"
ALL_POLICIES = sorted(p.stem for p in CONF.glob("*.yaml"))
GROUPS = [1, 2, 8]


def _storage_views(n, h, length, d, g):
    """Keys/values as the engine hands them: ``[:, :, :length]`` views of a longer static buffer."""
    cap = length + 11
    k = torch.randn(n, h, cap, d, generator=g)[:, :, :length]
    v = torch.randn(n, h, cap, d, generator=g)[:, :, :length]
    return k, v


def _query(n, hq, d, g):
    """``(n, Hq, 1, D)`` laid out as transformers produces it: a transposed view of ``(n, 1, Hq, D)``."""
    return torch.randn(n, 1, hq, d, generator=g).transpose(1, 2)


# ---- equal to the eager reference -----------------------------------------------------------------------------------
@pytest.mark.parametrize("selection", [None, "kv_head", "query_head"])
@pytest.mark.parametrize("groups", GROUPS)
def test_decode_attention_equals_eager(groups, selection):
    g = torch.Generator().manual_seed(groups)
    n, h, d, length = 4, 2, 16, 37
    hq = h * groups
    q = _query(n, hq, d, g)
    k, v = _storage_views(n, h, length, d, g)
    held = torch.arange(length)[None, :] < torch.tensor([37, 30, 9, 1])[:, None]  # staggered rows
    if selection is None:
        mask = held[:, None, :]  # (n, 1, L)
    else:
        heads = h if selection == "kv_head" else hq
        mask = (torch.rand(n, heads, length, generator=g) < 0.6) & held[:, None, :]
        mask[..., 0] = True  # every row keeps a token
    bias = additive_mask(mask, q.dtype)
    if selection == "query_head":
        bias = va._group_view(bias, h)
    got = decode_attention(q, k, v, d**-0.5, bias)
    want_mask = mask.repeat_interleave(groups, dim=1) if selection == "kv_head" else mask
    want = eager_attention(q, k, v, d**-0.5, causal=False, mask=want_mask.unsqueeze(2))
    assert got.shape == (n, hq, 1, d)
    torch.testing.assert_close(got, want, **close(torch.float32, d + length))
    if selection is None:  # and rows in step (no mask)
        torch.testing.assert_close(
            decode_attention(q, k, v, d**-0.5, None), eager_attention(q, k, v, d**-0.5, causal=False)
        )


@pytest.mark.parametrize("native", [True, False], ids=["enable_gqa", "repeated_kv"])
@pytest.mark.parametrize("groups", GROUPS)
def test_prefill_attention_equals_eager(groups, native, monkeypatch):
    """Both prefill forms: SDPA's own GQA (CPU; CUDA when FlashAttention takes it) and K/V repeated over the group."""
    monkeypatch.setattr(va, "_prefill_gqa_native", lambda q, k, v: native)
    g = torch.Generator().manual_seed(10 + groups)
    h, d, p = 2, 16, 29
    q = torch.randn(1, p, h * groups, d, generator=g).transpose(1, 2)
    k, v = _storage_views(1, h, p, d, g)
    torch.testing.assert_close(
        prefill_attention(q, k, v, d**-0.5),
        eager_attention(q, k, v, d**-0.5, causal=True),
        **close(torch.float32, d + p),
    )


@pytest.mark.parametrize("groups", GROUPS)
def test_sdpa_attention_keeps_the_general_contract(groups):
    """``sdpa_attention`` (``_sdpa``): bool masks broadcastable to ``(B, Hq, T, L)`` — per row or per query head."""
    g = torch.Generator().manual_seed(20 + groups)
    n, h, d, length = 3, 2, 16, 21
    hq = h * groups
    q = _query(n, hq, d, g)
    k, v = _storage_views(n, h, length, d, g)
    rows = (torch.arange(length)[None, :] < torch.tensor([21, 14, 5])[:, None])[:, None, None, :]
    per_head = (torch.rand(n, hq, 1, length, generator=g) < 0.5) & rows
    per_head[..., 0] = True
    for mask in (rows, per_head, None):
        torch.testing.assert_close(
            sdpa_attention(q, k, v, d**-0.5, False, mask),
            eager_attention(q, k, v, d**-0.5, causal=False, mask=mask),
            **close(torch.float32, d + length),
        )


def test_additive_mask_layout():
    """Additive, in the query's dtype, strides multiples of 16 but the last (1): the efficient kernel copies nothing."""
    mask = torch.rand(3, 2, 37) < 0.5
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        bias = additive_mask(mask, dtype)
        assert bias.shape == (3, 2, 1, 37) and bias.dtype == dtype
        assert bias.stride(-1) == 1 and all(s % va.MASK_ALIGN == 0 for s in bias.stride()[:-1])
        assert torch.equal(bias == 0, mask.unsqueeze(2)) and bool(torch.isneginf(bias[~mask.unsqueeze(2)]).all())


# ---- over real decodes: the SDPA calls ------------------------------------------------------------------------------
class SDPACalls(TorchFunctionMode):
    """Records every ``F.scaled_dot_product_attention`` call (a :class:`ref.Call` and the raw flags)."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[ref.Call, dict]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            q, k, v = args[:3]
            mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
            flags = {
                "mask": mask is not None,
                "enable_gqa": bool(kwargs.get("enable_gqa", False)),
                "is_causal": bool(kwargs.get("is_causal", False)),
            }
            call = ref.Call.of(q, k, v, mask, flags["is_causal"], flags["enable_gqa"])
            self.calls.append((call, flags))
        return func(*args, **kwargs)


def _load(name: str, budget: int = 32, window: int = 8, model=None, tmp_path=None):
    """Config ``name`` at ``budget``/``window``; with ``model``: gates for a policy that loads them (SeerAttention-R,
    random, 8-token blocks) and no dense layers (Quest's first two: the tiny models have two)."""
    cfg = OmegaConf.load(CONF / f"{name}.yaml")
    cfg.budget, cfg.window = budget, window
    if cfg.get("keep_prompt"):  # the prompt (up to 27 tokens below) is pinned: a budget that holds it and some output
        cfg.budget = budget + 16
    if "page_size" in cfg:
        cfg.page_size = 8
    if model is not None and "dense_layers" in cfg:
        cfg.dense_layers = 0
    if model is not None and "gate_path" in cfg:
        from tests.seer_reference import write_random_gates

        cfg.gate_path = str(write_random_gates(tmp_path / "gates", model.config, block_size=8))
        cfg.block_size = 8
    policy = instantiate(cfg)
    if model is not None:  # TriAttention: its query centres from a calibration pass over the model
        from tests.policy_configs import calibrate

        calibrate(policy, model)
    return policy


def _staggered_decode(model, policy, steps: int = 40, **kw):
    """Three prompts of different lengths on 2 rows (continuous batching: rows join at different steps)."""
    g = torch.Generator().manual_seed(3)
    reqs = [Request(torch.randint(0, 256, (n,), generator=g), [i], key=i) for i, n in enumerate((9, 27, 18))]
    cap = max(cache_capacity(policy, len(r.prompt_ids), steps) for r in reqs)
    dec = Decoder(
        model, policy, rows=2, capacity=cap, max_new_tokens=steps, ignore_eos=True, sampling=SamplingConfig(1.0), **kw
    )
    return dec, {(f.key, f.sample): f for f in dec.run(reqs)}


@pytest.fixture(scope="module")
def gqa_model():
    return tiny_model("qwen3", num_attention_heads=8, num_key_value_heads=2, head_dim=16)


@pytest.mark.parametrize("name", ALL_POLICIES)
def test_no_sdpa_call_passes_a_mask_with_enable_gqa_and_every_call_is_fused_on_cuda(gqa_model, name, tmp_path):
    rec = SDPACalls()
    with rec:
        _staggered_decode(gqa_model, _load(name, model=gqa_model, tmp_path=tmp_path))
    calls = rec.calls
    decode = [c for c, f in calls if not f["is_causal"]]
    masked = [c for c, f in calls if f["mask"]]
    assert decode and masked, "the decode should run masked steps (rows of different lengths)"
    for call, flags in calls:
        assert not (flags["mask"] and flags["enable_gqa"]), call
        if not flags["is_causal"]:  # a decode step: the KV groups packed (G queries per KV head), no GQA left
            assert call.q[1] == call.k[1] == 2 and call.q[2] == 4 and not flags["enable_gqa"], call
        for gpu, dtype in ((ref.A100, torch.bfloat16), (ref.A100, torch.float32), (ref.H100, torch.bfloat16)):
            sim = call.with_dtype(dtype)
            if flags["enable_gqa"] and not ref.can_use_flash(sim, gpu):
                # the prefill on CPU uses SDPA's GQA; on this GPU the engine would repeat K/V instead, because
                # torch.backends.cuda.can_use_flash_attention says no (attention._prefill_gqa_native)
                sim = ref.Call(**{**sim.__dict__, "k": call.q, "enable_gqa": False})
            assert ref.cuda_kernel(sim, gpu) != "math", (sim, gpu)
        if flags["mask"]:  # the memory-efficient kernel takes the mask as it is: no conversion, no padding copy
            assert ref.mask_copied(call) == [], (call, ref.mask_copied(call))


def test_the_reference_flags_the_old_decode_call():
    """The call this engine made before (bool row mask together with ``enable_gqa``) lands on math by the same
    rules, with two mask copies — so the test above can fail."""
    n, hq, h, d, length = 4, 8, 2, 128, 300
    q = torch.empty(n, hq, 1, d, dtype=torch.bfloat16)
    k = torch.empty(n, h, length, d, dtype=torch.bfloat16)
    old = ref.Call.of(q, k, k, torch.ones(n, 1, 1, length, dtype=torch.bool), enable_gqa=True)
    assert ref.cuda_kernel(old, ref.A100) == "math"
    assert ref.mask_copied(old)
    new = ref.Call.of(
        q.view(n, h, hq // h, d), k, k, additive_mask(torch.ones(n, 1, length, dtype=torch.bool), q.dtype)
    )
    assert ref.cuda_kernel(new, ref.A100) == "efficient" and ref.cuda_kernel(new, ref.H100) == "cudnn"
    assert ref.mask_copied(new) == []
    assert ref.cuda_kernel(ref.Call.of(q.view(n, h, hq // h, d), k, k), ref.A100) == "flash"  # rows in step


class PerQueryHeadSelection(SelectionPolicy):
    """A selection per query head (the form h21-select adds): each query head keeps a deterministic subset."""

    name = "test_per_query_head"

    def select(self, inputs):
        b, h, length, _ = inputs.keys.shape
        hq = inputs.query.shape[1]
        score = inputs.query.float().sum(-1) * inputs.keys.float().sum(-1).repeat_interleave(hq // h, dim=1)
        return score > score.median(dim=-1, keepdim=True).values  # (B, Hq, L)


@pytest.mark.parametrize("name", ["quest", "per_query_head"])
def test_selection_masks_through_the_engine_equal_the_eager_backend(gqa_model, name):
    """Rows of different lengths, a selection per KV head (Quest) or per query head: SDPA == eager, step by step."""
    runs = {}
    for backend in ("sdpa", "eager"):
        policy = _load("quest", model=gqa_model) if name == "quest" else PerQueryHeadSelection(budget=8)
        steps: dict[int, torch.Tensor] = {}
        dec, done = _staggered_decode(
            gqa_model,
            policy,
            steps=30,
            attn_backend=backend,
            on_logits=lambda s, lg, steps=steps: steps.__setitem__(s, lg.clone()),
        )
        attended = [f.stats["attended_tokens"] for f in done.values()]
        runs[backend] = ({k: f.tokens for k, f in done.items()}, steps, attended)
    (tok_a, log_a, att_a), (tok_b, log_b, att_b) = runs["sdpa"], runs["eager"]
    assert tok_a == tok_b and att_a == att_b
    assert all(a is not None and a < 40 for a in att_a), att_a  # the selection was active (fewer than held)
    c = gqa_model.config  # logits: every layer's sums (attention, MLP) over the widths, in two kernels' orders
    width = c.hidden_size + c.intermediate_size
    for s, lg in log_a.items():
        tol = close(torch.float32, width, scale=lg.abs().max().item(), depth=c.num_hidden_layers + 1)
        torch.testing.assert_close(lg, log_b[s], **tol)


# ---- eviction == masking, in float64 (no rounding to hide a wrong mask) ---------------------------------------------
def test_eviction_equals_masking_in_float64():
    """The engine's SDPA decode (packed GQA, additive masks, out-of-step evictions) against the unmodified model on
    the whole sequence with exactly the evicted entries masked: equal to 1e-10 in float64."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    from baselines.random import RandomEviction

    model = tiny_model("llama", num_attention_heads=8, num_key_value_heads=2, num_hidden_layers=2).double()
    prompt = torch.randint(0, 256, (20,), generator=torch.Generator().manual_seed(1))
    rows, new = 2, 60
    snaps, logits, holder = {}, {}, {}

    def on_step(info):
        cache = holder["cache"]
        snaps[info.step] = [layer.positions[:rows, :, : layer.length].clone() for layer in cache.layers]

    out = generate(
        model,
        prompt,
        RandomEviction(budget=24, window=8),
        n_samples=rows,
        sampling=SamplingConfig(temperature=1.0),
        max_new_tokens=new,
        seed=3,
        ignore_eos=True,
        attn_backend="sdpa",
        on_cache=lambda c: holder.__setitem__("cache", c),
        on_step=on_step,
        on_logits=lambda s, lg: logits.__setitem__(s, lg.clone()),
    )
    assert out.stats["evictions"] > 0
    p, heads = prompt.numel(), model.config.num_key_value_heads
    total = p + new - 1
    seq = torch.stack([torch.cat([prompt, torch.tensor(t[: new - 1])]) for t in out.tokens])
    masks = {}
    for layer in range(model.config.num_hidden_layers):
        mask = torch.zeros(rows, heads, total, total, dtype=torch.bool)
        mask[:, :, :p, :p] = torch.ones(p, p, dtype=torch.bool).tril()
        for i in range(p, total):
            if i == p:
                mask[:, :, i, : i + 1] = True
            else:
                mask[:, :, i].scatter_(-1, snaps[i - p][layer], True)
                mask[:, :, i, i] = True
        masks[layer] = mask

    def reference(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        groups = query.shape[1] // key.shape[1]
        m = masks[module.layer_idx].repeat_interleave(groups, dim=1)
        k, v = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
        w = (query @ k.transpose(2, 3) * scaling).masked_fill(~m, float("-inf")).softmax(-1)
        return (w @ v).transpose(1, 2).contiguous(), None

    AttentionInterface.register("vase_test_f64", reference)
    AttentionMaskInterface.register("vase_test_f64", lambda *a, **k: None)
    model.set_attn_implementation("vase_test_f64")
    try:
        want = model(input_ids=seq, position_ids=torch.arange(total).view(1, -1)).logits
    finally:
        model.set_attn_implementation("sdpa")
    diff = max((logits[s] - want[:, p + s - 1]).abs().max().item() for s in range(1, new))
    assert diff < 1e-10, diff


# ---- the kernel probe recorded in the manifest ----------------------------------------------------------------------
def test_probe_kernels_names_what_runs():
    kernels = probe_kernels(8, 2, 16, torch.float32, torch.device("cpu"))
    assert set(kernels) == {"decode_rows_of_different_lengths", "decode_rows_in_step", "decode_selection", "prefill"}
    assert set(kernels.values()) == {"aten._scaled_dot_product_flash_attention_for_cpu"}
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.randn(2, 2, 4, 16)
    with sdpa_kernel(SDPBackend.MATH):
        assert sdpa_kernel_of(lambda: F.scaled_dot_product_attention(q, q, q)) == "math"
    with torch.inference_mode():  # the kernel is seen through the composite op
        assert sdpa_kernel_of(lambda: F.scaled_dot_product_attention(q, q, q)).endswith("flash_attention_for_cpu")


# ---- attn_backend: auto and an explicit flash_attn ------------------------------------------------------------------
CUDA = torch.device("cuda")


@pytest.fixture
def flash_module(monkeypatch):
    """A flash_attn package whose interface imports (as far as the choice is concerned)."""
    pkg = types.ModuleType("flash_attn")
    pkg.__path__ = []
    monkeypatch.setitem(sys.modules, "flash_attn", pkg)
    monkeypatch.setitem(
        sys.modules, "flash_attn.flash_attn_interface", types.ModuleType("flash_attn.flash_attn_interface")
    )


@pytest.fixture
def broken_flash(monkeypatch, tmp_path):
    """A flash_attn that is installed (find_spec finds it) but built for another torch: its interface fails to load."""
    pkg = tmp_path / "flash_attn"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "flash_attn_interface.py").write_text(
        "raise ImportError('flash_attn_2_cuda.so: undefined symbol: _ZN3c104cuda9SetDeviceEi')\n"
    )
    for key in [k for k in sys.modules if k == "flash_attn" or k.startswith("flash_attn.")]:
        monkeypatch.delitem(sys.modules, key)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    for key in [k for k in sys.modules if k == "flash_attn" or k.startswith("flash_attn.")]:
        del sys.modules[key]


def test_auto_picks_flash_attn_only_with_a_working_import_and_half_precision_on_cuda(flash_module):
    assert backend_choice("auto", CUDA, torch.bfloat16)[0] == "flash_attn"
    assert backend_choice("auto", CUDA, torch.float16)[0] == "flash_attn"
    backend, why = backend_choice("auto", CUDA, torch.float32)
    assert backend == "sdpa" and "fp16 or bf16" in why
    backend, why = backend_choice("auto", torch.device("cpu"), torch.bfloat16)
    assert backend == "sdpa" and "CUDA" in why


def test_auto_falls_back_to_sdpa_when_flash_attn_does_not_import(broken_flash):
    import importlib.util

    assert importlib.util.find_spec("flash_attn") is not None  # found, as the old find_spec check saw it
    backend, why = backend_choice("auto", CUDA, torch.bfloat16)
    assert backend == "sdpa" and "does not import" in why and "undefined symbol" in why


def test_auto_logs_one_line(caplog, flash_module):
    with caplog.at_level("INFO", logger="vase.engine.attention"):
        assert resolve_backend("auto", torch.device("cpu"), torch.float32) == "sdpa"
    lines = [r.getMessage() for r in caplog.records if r.name == "vase.engine.attention"]
    assert len(lines) == 1 and lines[0].startswith("attention backend: sdpa (auto: ")


@pytest.mark.parametrize(
    "device, dtype, fixture, message",
    [
        ("cpu", torch.bfloat16, "flash_module", "needs a CUDA device"),
        ("cuda", torch.float32, "flash_module", "needs fp16 or bf16"),
        ("cuda", torch.bfloat16, "broken_flash", "does not import"),
    ],
)
def test_an_explicit_flash_attn_that_cannot_run_is_refused(device, dtype, fixture, message, request):
    request.getfixturevalue(fixture)
    with pytest.raises(ValueError, match=message) as err:
        backend_choice("flash_attn", torch.device(device), dtype)
    text = str(err.value)
    assert text.startswith("generation.attn_backend=flash_attn: ") and "\n" not in text and "auto" in text


@pytest.mark.parametrize(
    "overrides, fixture, message",
    [
        (["model.device=cuda", "model.dtype=float32"], "flash_module", "needs fp16 or bf16, model.dtype is float32"),
        (["model.device=cuda", "model.dtype=bfloat16"], "broken_flash", "does not import (ImportError: "),
        (["model.device=cpu", "model.dtype=bfloat16"], "flash_module", "needs a CUDA device"),
    ],
)
def test_setting_checks_refuse_an_explicit_flash_attn_that_cannot_run(overrides, fixture, message, request):
    from hydra import compose, initialize_config_dir

    from vase.run.checks import check_settings

    request.getfixturevalue(fixture)
    conf = Path(__file__).resolve().parents[1] / "conf"
    with initialize_config_dir(config_dir=str(conf), version_base=None):
        cfg = compose(config_name="config", overrides=["model=tiny", "generation.attn_backend=flash_attn", *overrides])
    with pytest.raises(ValueError) as err:
        check_settings(cfg)
    text = str(err.value)
    assert text.startswith("generation.attn_backend: ") and message in text and "\n" not in text, text


def test_check_settings_accepts_flash_attn_that_imports_with_bf16_on_cuda(flash_module):
    from hydra import compose, initialize_config_dir

    from vase.run.checks import check_settings

    conf = Path(__file__).resolve().parents[1] / "conf"
    with initialize_config_dir(config_dir=str(conf), version_base=None):
        cfg = compose(
            config_name="config",
            overrides=["model=tiny", "generation.attn_backend=flash_attn", "model.device=cuda", "model.dtype=bf16"],
        )
    check_settings(cfg)
