"""The policy configs every shared test matrix runs over: discovered from ``conf/policy/*.yaml``, never listed by hand.

A new ``conf/policy/<name>.yaml`` is picked up by the contract tests (``tests/test_policies.py``, state carried
across calls included), the no-host-sync and meta-device tests (``tests/test_gpu_path.py``), batch independence
(``tests/test_continuous.py``), eviction = masking (``tests/test_engine.py``) and the end-to-end runs
(``tests/test_policies_e2e.py``). What a test must adapt for a small model lives here, once.
"""

from __future__ import annotations

from pathlib import Path

import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

CONF = Path(__file__).resolve().parents[1] / "conf" / "policy"
ALL_CONFIGS = sorted(p.stem for p in CONF.glob("*.yaml"))


def kind_of(name: str) -> str:
    """The ``kind`` (``none`` | ``eviction`` | ``selection``) of config ``name``'s class, without instantiating it."""
    from hydra.utils import get_class

    return get_class(OmegaConf.load(CONF / f"{name}.yaml")["_target_"]).kind


def configs_of_kind(*kinds: str) -> list[str]:
    return [n for n in ALL_CONFIGS if kind_of(n) in kinds]


def small_config(name: str, budget: int, window: int, n_layers: int | None = None):
    """Config ``name`` at ``budget``/``window``, scaled to a small model: a declared eviction period longer than the
    window (R-KV's 128, TriAttention's 128) becomes ``2 * window``; Quest's pages shrink to the window and its dense
    layers leave one sparse layer of ``n_layers``."""
    cfg = OmegaConf.load(CONF / f"{name}.yaml")
    cfg.budget, cfg.window = budget, window
    if cfg.get("evict_every") is not None and cfg.evict_every > window:
        cfg.evict_every = 2 * window
    if "page_size" in cfg:
        cfg.page_size = min(cfg.page_size, window)
    if n_layers is not None and "dense_layers" in cfg:
        cfg.dense_layers = min(cfg.dense_layers, n_layers - 1)
    return cfg


def calibrate(policy, model=None, *, layers: int = 1, q_heads: int = 8, head_dim: int = 16, seed: int = 0):
    """Calibrate a policy that asks for it (``calibration_input()``; TriAttention) and return it; others unchanged.

    With ``model``: the policy's own calibration pass over 96 random token ids. Without: random centres of the given
    geometry (for keep() on random tensors).
    """
    if policy.calibration_input() is None:
        return policy
    g = torch.Generator().manual_seed(seed)
    if model is not None:
        policy.calibrate(model, torch.randint(0, model.config.vocab_size, (96,), generator=g))
        return policy
    f = head_dim // 2
    q_mean = torch.randn(layers, q_heads, f, 2, generator=g)
    policy.load_calibration(
        {
            "q_mean": q_mean,
            "q_abs": torch.view_as_complex(q_mean).abs() + torch.rand(layers, q_heads, f, generator=g),
            "inv_freq": 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim)),
            "attention_scaling": 1.0,
            "tokens": 0,
        }
    )
    return policy


def load_small(name: str, budget: int, window: int, model=None, tmp_path: Path | None = None, **overrides):
    """Config ``name`` instantiated for a small model (:func:`small_config`), calibrated on ``model`` if it asks, with
    random SeerAttention-R gates of ``model``'s geometry (16-token blocks) when it loads a checkpoint."""
    n_layers = None if model is None else model.config.num_hidden_layers
    cfg = small_config(name, budget, window, n_layers)
    if model is not None and "gate_path" in cfg:
        from tests.seer_reference import write_random_gates

        block = min(16, budget)
        cfg.gate_path = str(write_random_gates(tmp_path / f"gates-{name}", model.config, block_size=block))
        cfg.block_size = block
    for key, value in overrides.items():
        cfg[key] = value
    policy = instantiate(cfg)
    if model is not None:
        calibrate(policy, model)
    return policy
