"""Every policy config end to end through the engine: a tiny random Qwen3 (GQA) model and the real offline model (slow).

Each run must finish without error, actually evict (eviction policies) or attend to fewer tokens than it holds
(Quest, SeerAttention-R), and never lose a sink token.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.policy_configs import ALL_CONFIGS, load_small
from vase.engine import SamplingConfig, generate

SAMPLING = SamplingConfig(temperature=0.6, top_p=0.95, top_k=20)
ROOT = Path(__file__).resolve().parents[1]


def load_policy(name: str, budget: int, window: int, model=None, tmp_path: Path | None = None):
    """Config ``name`` at ``budget``/``window``, scaled to the model (:func:`tests.policy_configs.load_small`: a
    declared period longer than the window becomes ``2 * window``, random SeerAttention-R gates of the model's
    geometry, Quest's dense layers leave a sparse one, TriAttention calibrated on the model)."""
    return load_small(name, budget, window, model, tmp_path)


@pytest.fixture(scope="module")
def tiny():
    from vase.models import tiny_model

    model = tiny_model("qwen3")
    assert model.config.num_attention_heads > model.config.num_key_value_heads  # GQA
    return model


def run_and_check(model, prompt: list[int], name: str, budget: int, window: int, new_tokens: int, tmp_path: Path):
    policy = load_policy(name, budget, window, model, tmp_path)
    if policy.kind == "eviction" and policy.keep_prompt and len(prompt) + window >= budget:
        with pytest.raises(ValueError, match="policy.keep_prompt"):  # refused before decoding
            generate(model, prompt, policy, max_new_tokens=new_tokens)
        return None
    caches = []
    out = generate(
        model,
        prompt,
        policy,
        n_samples=2,
        sampling=SAMPLING,
        max_new_tokens=new_tokens,
        seed=0,
        ignore_eos=True,
        check_policy_output=True,
        on_cache=caches.append,
    )
    assert [len(t) for t in out.tokens] == [new_tokens, new_tokens]
    stats = out.stats
    if policy.kind == "eviction":
        assert stats["evictions"] > 0
        every, p = policy.eviction_period, len(prompt)
        want = max(p, budget + every) if policy.compress_prefill else max(p, budget) + every
        assert stats["capacity"] == min(p + new_tokens, want)
        # Sinks survive every eviction, in every (full-attention) layer, row and KV head; a kept prompt stays whole.
        for layer in caches[0].evicting_layers:
            held = layer.positions[: layer.n_rows, :, : layer.length]
            for s in range(policy.sinks):
                assert (held == s).any(dim=-1).all(), f"{name}: sink {s} evicted in layer {layer.layer_idx}"
            if policy.keep_prompt:
                assert torch.equal(held[..., :p], torch.arange(p).expand(*held.shape[:2], p)), name
    elif policy.kind == "selection":
        assert stats["evictions"] == 0
        assert stats["attended_tokens"] is not None and stats["attended_tokens"] < stats["held_tokens"]
        assert stats["capacity"] == len(prompt) + new_tokens  # selection keeps everything: no memory saving
    else:
        assert stats["evictions"] == 0
    return out


@pytest.mark.parametrize("name", ALL_CONFIGS)
def test_policy_runs_on_tiny_model(tiny, name, tmp_path):
    prompt = torch.randint(0, tiny.config.vocab_size, (20,), generator=torch.Generator().manual_seed(0)).tolist()
    run_and_check(tiny, prompt, name, budget=32, window=8, new_tokens=100, tmp_path=tmp_path)  # ~10 evictions per layer


@pytest.mark.parametrize("name", ALL_CONFIGS)
def test_policy_runs_with_prompt_longer_than_budget(tiny, name, tmp_path):
    """A prompt of 70 tokens against budget 32: eviction starts at the prompt, Quest selects from the first step."""
    prompt = torch.randint(0, tiny.config.vocab_size, (70,), generator=torch.Generator().manual_seed(1)).tolist()
    run_and_check(tiny, prompt, name, budget=32, window=8, new_tokens=40, tmp_path=tmp_path)


@pytest.mark.parametrize("name", ["vase_attnv", "vase_dkv"])
def test_stochastic_policies_are_reproducible_end_to_end(tiny, name, tmp_path):
    prompt = list(range(1, 21))
    a = run_and_check(tiny, prompt, name, budget=32, window=8, new_tokens=40, tmp_path=tmp_path)
    b = run_and_check(tiny, prompt, name, budget=32, window=8, new_tokens=40, tmp_path=tmp_path)
    assert a.tokens == b.tokens


@pytest.fixture(scope="module")
def real():
    from vase.models import load_model

    try:
        return load_model("qwen2.5_coder_0.5b")
    except ValueError as err:  # the wheels are not installed
        pytest.skip(str(err))


@pytest.mark.slow
@pytest.mark.parametrize("name", ALL_CONFIGS)
def test_policy_runs_on_real_model(real, name, tmp_path):
    model, tok = real
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "Write a Python function that checks whether a number is prime."}],
        add_generation_prompt=True,
        tokenize=True,
    )
    prompt = list(prompt["input_ids"] if isinstance(prompt, dict) or hasattr(prompt, "keys") else prompt)
    run_and_check(model, prompt, name, budget=64, window=16, new_tokens=120, tmp_path=tmp_path)


@pytest.mark.parametrize(  # CI runs h2o; the others in -m slow (CI's time budget)
    "name",
    ["h2o", pytest.param("keydiff", marks=pytest.mark.slow), pytest.param("triattention", marks=pytest.mark.slow)],
)
def test_new_baseline_runs_end_to_end_through_run_py(name, tmp_path):
    """The 2026 baselines through ``run.py`` offline on the tiny model, with every keep() answer checked
    (``generation.check_policy_output=true``) and the schedule set without ``+``; TriAttention's calibration is saved
    in the run directory and recorded in the manifest."""
    import json
    import os
    import subprocess
    import sys

    budget = 128 if name == "triattention" else 32  # TriAttention pins the ~80-token prompt (the authors' default)
    settings = f"model=tiny task=gsm_symbolic policy={name} limit=1 n_samples=1 budget={budget} window=16 "
    settings += "policy.evict_every=16 generation.max_length=320 generation.check_policy_output=true logger=none"
    cmd = [sys.executable, str(ROOT / "run.py"), *settings.split(), "progress=false", f"results_dir={tmp_path}"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "disabled"}
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    (run_dir,) = (tmp_path / "gsm_symbolic" / "tiny").iterdir()
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["evictions"] > 0 and metrics["nonfinite_rate"] == 0
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["policy"]["name"] == name and manifest["policy"]["evict_every"] == 16
    if name == "triattention":
        import hashlib

        import torch

        calib = manifest["calibration"]
        text = (ROOT / "baselines" / "data" / "triattention_calibration.txt").read_bytes()
        assert calib["text_sha256"] == hashlib.sha256(text).hexdigest() and calib["tokens"] > 1000
        record = torch.load(run_dir / "calibration.pt", weights_only=True)
        assert record["q_mean"].shape[:2] == (2, 4) and torch.isfinite(record["q_mean"]).all()
        assert calib["file_sha256"] == hashlib.sha256((run_dir / "calibration.pt").read_bytes()).hexdigest()
    else:
        assert "calibration" not in manifest and not (run_dir / "calibration.pt").exists()
