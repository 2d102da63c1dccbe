"""The model families beyond Qwen3 / Qwen2 / Llama whose layers are all plain full attention (issue 27, first step).

``mistral`` (plain GQA, no window), ``qwen3_moe`` (Qwen3 attention, a mixture-of-experts MLP), ``phi3`` (fused QKV
projection, partial RoPE) and ``smollm3`` (NoPE layers: no rotary embedding, positions recorded as usual), each as a
tiny random model (fp32, initializer_range 0.3, no downloads). What must hold on each:

* ``policy=full``, greedy: the same tokens as transformers' own ``generate`` with its own cache, for rows of prompts
  of different lengths and output caps under continuous batching (rows released and admitted mid-run), 64+ tokens;
* eviction equals masking (the proof of tests/test_engine.py), and eviction policies run end to end
  (tests/test_policies_e2e.py's checks);
* the ``model=tiny_<family>`` preset loads and a short offline run through the runner finishes;
* the engine's guarantees, here and on ``olmo3``: no host sync in a decode step, a sample never depends on its
  batch-mates, and the compiled step gives the eager tokens with one graph per row bucket (slow);
* an architecture with linear-attention layers is still refused in one line, and so is a config whose every layer
  slides (no full-attention layer for the budget). Sliding-window layers and sinks: tests/test_sliding_families.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig

from tests.policy_configs import ALL_CONFIGS
from tests.test_continuous import decode_all, prompts
from tests.test_engine import check_eviction_equals_masking
from tests.test_policies_e2e import run_and_check
from vase.engine import Request, SamplingConfig
from vase.engine.geometry import partial_rope
from vase.engine.policy import FullCache
from vase.models import SUPPORTED_ARCHITECTURES, check_architecture, tiny_config, tiny_model

ROOT = Path(__file__).resolve().parents[1]

FAMILIES = ["mistral", "qwen3_moe", "phi3", "smollm3"]
MODEL = dict(num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2)  # GQA 2:1
POLICIES = ["vase_dkv", "snapkv"]


def test_tiny_configs_are_all_full_attention_and_keep_each_family_s_feature():
    for arch in FAMILIES:
        cfg = tiny_config(arch)
        check_architecture(cfg)
        assert getattr(cfg, "sliding_window", None) is None, arch
        assert set(getattr(cfg, "layer_types", None) or ["full_attention"]) == {"full_attention"}, arch
    moe = tiny_config("qwen3_moe")
    assert moe.num_experts == 4 and moe.decoder_sparse_step == 1 and moe.mlp_only_layers == []  # every layer MoE
    assert type(tiny_model("qwen3_moe").model.layers[0].mlp).__name__ == "Qwen3MoeSparseMoeBlock"
    phi = tiny_model("phi3")
    assert hasattr(phi.model.layers[0].self_attn, "qkv_proj")  # fused QKV
    assert phi.model.rotary_emb.inv_freq.numel() * 2 < phi.config.hidden_size // phi.config.num_attention_heads
    smol = tiny_config("smollm3")
    assert smol.no_rope_layers == [1, 0]  # layer 1 is NoPE


@pytest.mark.parametrize("arch", FAMILIES)
def test_full_cache_greedy_equals_transformers_generate_under_continuous_batching(arch):
    """Four prompts (8 to 27 tokens) with output caps of 64 to 80 tokens through 2 rows: rows end at different steps
    and the next prompts take their slots mid-run; each sample's tokens equal transformers' generate of it alone."""
    model = tiny_model(arch, **MODEL)
    caps = [64, 80, 70, 66]
    reqs = [Request(p, [0], key=i, max_new_tokens=caps[i]) for i, p in enumerate(prompts((11, 27, 19, 8)))]
    _, done = decode_all(model, FullCache(), reqs, rows=2, max_new=max(caps), sampling=SamplingConfig(temperature=0))
    assert len(done) == len(reqs)
    assert len({f.stats["first_step"] for f in done.values()}) > 2, "prompts should be admitted at different steps"
    for r in reqs:
        f = done[(r.key, 0)]
        assert len(f.tokens) == r.max_new_tokens
        ids = r.prompt_ids.view(1, -1)  # an explicit mask: a prompt token equal to pad_token_id is still attended
        gen = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=r.max_new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
        want = gen[0, ids.shape[1] :]
        assert f.tokens == want.tolist(), (arch, r.key)


@pytest.mark.parametrize("name", POLICIES)
@pytest.mark.parametrize("arch", FAMILIES)
def test_eviction_equals_masking(arch, name, tmp_path):
    """tests/test_engine.py's proof on every family: each step's logits equal the unmodified model's over the whole
    sequence with a per-(layer, KV head) mask hiding exactly what was evicted before that step."""
    model = tiny_model(arch, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3)
    check_eviction_equals_masking(model, name, tmp_path)


#: policies that model RoPE over the whole head dim: refused on partial RoPE / NoPE (the test below)
ROPE_POLICIES = {"triattention", "seer_attention_r"}
#: every policy config end to end: VaSE-DKV and SnapKV by default, the rest with ``make test-slow``
E2E = [n if n in POLICIES else pytest.param(n, marks=pytest.mark.slow) for n in ALL_CONFIGS]


@pytest.mark.parametrize("name", E2E)
@pytest.mark.parametrize("arch", FAMILIES)
def test_policy_runs_end_to_end(arch, name, tmp_path):
    """tests/test_policies_e2e.py's checks (evicts, sinks kept, capacity as planned; selection attends to fewer)."""
    model = tiny_model(arch, **MODEL)
    if name in ROPE_POLICIES and partial_rope(model.config) is not None:
        pytest.skip(f"{name} refuses {arch} (test_policies_that_undo_rope_refuse_partial_rope_and_nope)")
    prompt = torch.randint(0, 256, (20,), generator=torch.Generator().manual_seed(3)).tolist()
    assert run_and_check(model, prompt, name, budget=32, window=8, new_tokens=64, tmp_path=tmp_path) is not None


def test_unsupported_architectures_are_refused_in_one_line():
    for arch in ("jamba",):  # Mamba layers
        with pytest.raises(ValueError, match=f"architecture '{arch}' is not supported") as err:
            check_architecture(AutoConfig.for_model(arch))
        msg = str(err.value)
        assert "\n" not in msg and all(a in msg for a in SUPPORTED_ARCHITECTURES), msg
    with pytest.raises(ValueError, match="unknown tiny architecture 'jamba'"):
        tiny_config("jamba")


@pytest.mark.parametrize(
    "arch,fields,match",
    [
        ("mistral", {"sliding_window": 64}, "every layer of this mistral config is sliding-window .sliding_window=64"),
        ("phi3", {"sliding_window": 64}, "every layer of this phi3 config is sliding-window"),
        ("qwen3_moe", {"use_sliding_window": True, "sliding_window": 64}, "sliding_window=64"),
        (
            "phi3",
            {
                "rope_parameters": {
                    "rope_type": "longrope",
                    "rope_theta": 1e4,
                    "short_factor": [1.0] * 8,
                    "long_factor": [2.0] * 8,
                    "original_max_position_embeddings": 256,
                }
            },
            "rope_type 'longrope'",
        ),
    ],
)
def test_a_supported_family_with_windowed_layers_or_batch_dependent_rope_is_refused(arch, fields, match):
    """A config whose every layer slides (Mistral and Phi-3 apply a window to all layers, so do Qwen3-MoE's) leaves no
    full-attention layer for a policy's budget; longrope / dynamic RoPE switch frequencies on the batch's longest
    position, so a row would depend on its batch-mates. Refused before anything runs, in one line."""
    cfg = tiny_config(arch, **fields)
    with pytest.raises(ValueError, match=match) as err:
        check_architecture(cfg)
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match=match):  # tiny_model checks the config before building the model
        tiny_model(arch, **fields)


@pytest.mark.parametrize("arch", FAMILIES)
def test_tiny_preset_loads_the_family(arch):
    """``model=tiny_<family>`` (conf/model/tiny_<family>.yaml) composes, passes the preflight's config check and loads
    a model of the family with the Qwen3 tokenizer's vocabulary."""
    from hydra.utils import instantiate

    from tests.conftest import compose
    from vase.run.preflight import model_config

    spec = instantiate(compose([f"model=tiny_{arch}"]).model)
    assert spec.key == f"tiny_{arch}" and spec.name == f"tiny:{arch}"
    assert model_config(spec).model_type == arch
    model, tokenizer = spec.load()
    assert model.config.model_type == arch and model.config.vocab_size == len(tokenizer)


@pytest.mark.parametrize(  # CI runs mistral; the others in -m slow (CI's time budget)
    "arch", [a if a == "mistral" else pytest.param(a, marks=pytest.mark.slow) for a in FAMILIES]
)
def test_a_short_offline_run_per_family(arch, tmp_path):
    """``python run.py model=tiny_<family> policy=vase_dkv`` on one gsm_symbolic problem, two samples: it finishes,
    evicts and records the family's model."""
    from tests.conftest import TINY_RUN, compose
    from vase.run.runner import run

    overrides = [o for o in TINY_RUN if not o.startswith("model=")]
    cfg = compose([*overrides, f"model=tiny_{arch}", "policy=vase_dkv", "limit=1", f"results_dir={tmp_path}"])
    metrics = run(cfg, progress=False)
    assert metrics["complete"] and metrics["samples"] == 2 and metrics["evictions"] > 0
    assert f"tiny_{arch}" in metrics["run_dir"]


@pytest.mark.parametrize("name", ["triattention", "seer_attention_r"])
@pytest.mark.parametrize("arch,why", [("phi3", "partial_rotary_factor"), ("smollm3", "NoPE layers")])
def test_policies_that_undo_rope_refuse_partial_rope_and_nope(arch, why, name, tmp_path):
    """TriAttention and SeerAttention-R model RoPE over the whole head dim of every layer: on a model with partial
    RoPE (Phi-4-mini) or NoPE layers (SmolLM3) they refuse in one line instead of scoring with the wrong rotation,
    from the config alone (``check_model``: the preflight, before any file is written or weight loads)."""
    from tests.policy_configs import load_small

    model = tiny_model(arch, **MODEL)
    with pytest.raises(ValueError, match=f"{why}.*not supported yet") as err:  # load_small may check it already
        policy = load_small(name, 32, 8, model, tmp_path)
        policy.check_model(model.config)
    assert "\n" not in str(err.value)


@pytest.mark.slow  # CI's time budget: test_runner_inputs.py::test_i11 shows a refusal writes nothing
def test_a_rope_refusal_writes_nothing(tmp_path):
    """``run.py policy=triattention model=tiny_phi3``: the one-line error, exit 2, and no file under results_dir."""
    r = subprocess.run(
        [
            sys.executable,
            str(ROOT / "run.py"),
            "policy=triattention",
            "model=tiny_phi3",
            f"results_dir={tmp_path / 'r'}",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1"},
    )
    assert r.returncode == 2, r.stderr[-2000:]
    assert "error: policy.triattention:" in r.stderr and "partial_rotary_factor" in r.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "preset,hub,sampling",
    [
        ("qwen3_30b_a3b", "Qwen/Qwen3-30B-A3B", (0.6, 0.95, 20)),
        ("phi4_reasoning", "microsoft/Phi-4-reasoning", (0.8, 0.95, 50)),
        ("smollm3_3b", "HuggingFaceTB/SmolLM3-3B", (0.6, 0.95, 0)),
    ],
)
def test_hub_presets_compose(preset, hub, sampling):
    """The presets of real checkpoints of these families: hub id, revision ``main`` (resolved and recorded at run
    time), the model card's sampling, thinking on (no download here)."""
    from hydra.utils import instantiate

    from tests.conftest import compose

    spec = instantiate(compose([f"model={preset}"]).model)
    assert spec.key == preset and spec.name == hub and spec.revision == "main" and spec.thinking
    assert (spec.temperature, spec.top_p, spec.top_k) == sampling


# ---- the engine's guarantees on every family (gpt_oss and the hybrid families: their own test files) -------------
GUARANTEES = [*FAMILIES, "olmo3"]


def _family(arch: str):
    """The family's tiny model (olmo3 with its 16-token window: tests/test_sliding_families.py)."""
    if arch == "olmo3":
        from tests.test_sliding_families import _model

        return _model("olmo3")
    return tiny_model(arch, **MODEL)


def _one_default(arch: str, keep: str):
    """``arch`` as a parameter, in the default suite only for ``keep`` (the rest: -m slow, CI's time budget)."""
    return arch if arch == keep else pytest.param(arch, marks=pytest.mark.slow)


@pytest.mark.parametrize("arch", [_one_default(a, "qwen3_moe") for a in GUARANTEES])
def test_no_host_sync_in_a_decode_step(arch, monkeypatch, tmp_path):
    """tests/test_gpu_path.py's detector on each family: no decode step synchronises, evicting, rows of different
    lengths admitted and released mid-run (MoE's grouped_mm counts tokens per expert with a ranged histc, which CUDA
    computes without reading the data on the host: tests/test_sliding_families.py)."""
    from tests.test_gpu_path import SyncDetector, load_policy, run_detected

    flagged = SyncDetector.sync_reason

    def reason(name, args, kwargs):
        if name == "histc":
            lo = args[2] if len(args) > 2 else kwargs.get("min", 0)
            hi = args[3] if len(args) > 3 else kwargs.get("max", 0)
            if lo < hi:
                return None
        return flagged(name, args, kwargs)

    monkeypatch.setattr(SyncDetector, "sync_reason", staticmethod(reason))
    model = _family(arch)
    detector, steps, _ = run_detected(model, load_policy("vase_dkv", model, tmp_path), monkeypatch)
    assert detector.step_syncs() == {}
    assert "tolist" in detector.syncs["between"]  # the detector was live
    assert any(s["evicted"] for s in steps.values()) and any(len(set(s["held"])) > 1 for s in steps.values())


@pytest.mark.parametrize("arch", [_one_default(a, "smollm3") for a in GUARANTEES])
def test_a_sample_never_depends_on_its_batch_mates(arch):
    """tests/test_continuous.py's check on each family: sampled (T=1, top-p, top-k) with vase_dkv, every sample
    decoded among rows of prompts of different lengths (3 rows for 8 samples, EOS ending rows early, new problems
    taking their slots) equals the same sample decoded alone."""
    from tests.test_continuous import load_policy
    from vase.engine import generate, sample_seeds

    model = _family(arch)
    sampling = SamplingConfig(temperature=1.0, top_p=0.95, top_k=50)
    eos = range(0, 12)
    reqs = [Request(p, sample_seeds(100 + i, 2), key=i) for i, p in enumerate(prompts())]
    _, batched = decode_all(model, load_policy("vase_dkv"), reqs, rows=3, max_new=60, sampling=sampling, eos=eos)
    assert len({len(f.tokens) for f in batched.values()}) > 1
    assert sum(f.stats["evictions"] for f in batched.values()) > 0
    for r in reqs:
        for s, seed in enumerate(r.seeds):
            alone = generate(model, r.prompt_ids, load_policy("vase_dkv"), n_samples=1, seeds=[seed],
                             sampling=sampling, max_new_tokens=60, eos_token_ids=eos)  # fmt: skip
            assert batched[(r.key, s)].tokens == alone.tokens[0], (arch, r.key, s)


@pytest.mark.slow
@pytest.mark.parametrize("arch", GUARANTEES)
def test_compiled_decode_equals_eager_with_one_graph_per_bucket(arch):
    """tests/test_compiled.py's staggered decode (>= 300 steps) on each family: the compiled step (dynamo, fullgraph)
    gives the eager step's tokens, traces at most one graph per row bucket, and its buffers never move."""
    from tests.test_compiled import GraphCounter, staggered

    model = _family(arch)
    _, want, _, _ = staggered(model, "vase_dkv", "off")
    counter = GraphCounter()
    dec, got, buckets, addresses = staggered(model, "vase_dkv", "on", backend=counter)
    assert dec.compiled and len(buckets) > 2
    assert 1 <= len(counter.graphs) <= len(buckets), (len(counter.graphs), sorted(buckets))
    assert all(a == addresses[0] for a in addresses), "a buffer of the compiled step moved"
    assert {k: f.tokens for k, f in got.items()} == {k: f.tokens for k, f in want.items()}
