"""The original baselines against their authors' rules (tests/authors_rules_originals.py) beyond the configs' defaults
(tests/test_policies.py and the family matrix check those): each option of ``rkv_original`` and ``curdkv_original``,
kvpress's whole cache (``protect_recent=0``), and the wrong rules the check must reject."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

import baselines.curdkv_original as curdkv_module
import baselines.rkv_original as rkv_module
from tests.authors_rules import check_authors_rule, check_rule_on_geometry, rule_inputs
from tests.policy_configs import CONF
from vase.engine import original_scores

LAYOUTS = {"mha": (4, 4), "gqa": (2, 8)}  # (H, Hq)
DIM = 16
REDUNDANCY = original_scores.rkv_original_redundancy
WRONG = "keeps another set than its authors' rule"


def load(name: str, budget: int = 64, window: int = 16, **overrides):
    cfg = OmegaConf.load(CONF / f"{name}.yaml")
    cfg.budget, cfg.window = budget, window
    for key, value in overrides.items():
        cfg[key] = value
    return instantiate(cfg)


def near_duplicate_inputs(policy, h: int, hq: int, seed: int = 0):
    """:func:`rule_inputs` (two sequences x two layers) where every third candidate key echoes an earlier one and every
    other window key echoes a candidate (80-90 % of the keys have a cosine above R-KV's 0.5 with another key), the
    same on every call."""
    inputs = rule_inputs(policy, h, hq, DIM, 2, [0, 1], seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    keys, window_keys = inputs.keys.clone(), inputs.window_keys.clone()
    n = keys.shape[2]
    for i in range(3, n, 3):
        keys[:, :, i] = keys[:, :, i // 2] + 0.2 * torch.randn(keys[:, :, i].shape, generator=g)
    for i in range(0, window_keys.shape[2], 2):
        window_keys[:, :, i] = keys[:, :, (7 * i) % n] + 0.2 * torch.randn(window_keys[:, :, i].shape, generator=g)
    return dataclasses.replace(inputs, keys=keys, window_keys=window_keys)


def check_rkv(policy, layout: str, seed: int = 0) -> None:
    h, hq = LAYOUTS[layout]
    make = lambda: near_duplicate_inputs(policy, h, hq, seed)  # noqa: E731
    check_authors_rule(policy, make(), make(), "rkv_original")


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize(
    "overrides",
    [{}, {"rkv_lambda": 0.07}, {"pool_kernel": 1, "similarity_threshold": 0.2}, {"rkv_lambda": 0.5, "pool_kernel": 3}],
    ids=["defaults", "their-code-lambda", "no-pool", "lambda-half"],
)
def test_rkv_original_keeps_the_authors_set(overrides, layout):
    """Every setting, on keys with near-duplicates (the redundancy zeroes most keys' newest similar key), at R-KV's
    own window (8) and the harness's 16."""
    check_rkv(load("rkv_original", **overrides), layout)
    check_rkv(load("rkv_original", budget=32, window=8, **overrides), layout, seed=1)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("leverage", ["kv_product", "key", "value", "kv_avg"])
@pytest.mark.parametrize(
    "overrides",
    [{}, {"local_window": 0}, {"local_window": 10}, {"random_projection": True}, {"protect_recent": 0}],
    ids=["defaults", "one-normalisation", "partial-block", "random-projection", "whole-cache"],
)
def test_curdkv_original_keeps_the_authors_set(overrides, leverage, layout):
    """Every leverage type with kvpress's blocks of 16, one global normalisation, blocks that leave a shorter last one
    (96 candidates), a fresh random projection per eviction (drawn as the policy draws), and kvpress's whole cache
    (``protect_recent=0``: every held token a candidate)."""
    h, hq = LAYOUTS[layout]
    policy = load("curdkv_original", leverage=leverage, **overrides)
    check_rule_on_geometry(policy, "curdkv_original", h, hq, DIM, [0, 1])


def _rkv_score_with(**forced):
    real = original_scores.rkv_original_score
    return lambda *args, **kwargs: real(*args, **{**kwargs, **forced})


def _redundancy_sparing_the_oldest(keys, *args, **kwargs):
    """R-KV's redundancy with ``retain_direction="first"``'s intent (the oldest similar key spared): the rule run on the
    keys in reverse storage order."""
    return REDUNDANCY(keys.flip(2), *args, **kwargs).flip(-1)


def test_a_wrong_rkv_rule_fails_the_check(monkeypatch):
    """R-KV without its redundancy term (``λ = 1``), without its max-pool, or sparing the oldest similar key instead
    of the newest keeps another set than the authors' rule."""
    for forced in ({"mix_lambda": 1.0}, {"pool_kernel": 1}):
        monkeypatch.setattr(rkv_module, "rkv_original_score", _rkv_score_with(**forced))
        with pytest.raises(AssertionError, match=WRONG):
            check_rkv(load("rkv_original"), "gqa")
        monkeypatch.undo()
    monkeypatch.setattr(original_scores, "rkv_original_redundancy", _redundancy_sparing_the_oldest)
    with pytest.raises(AssertionError, match=WRONG):
        check_rkv(load("rkv_original"), "gqa")


def test_a_wrong_curdkv_rule_fails_the_check(monkeypatch):
    """kvpress's score without its local blocks, or with the mean of the leverages instead of their product, keeps
    another set than ``CURPress``; so does the policy's projection drawn from another stream than the rule's."""
    real = original_scores.kvpress_cur_score
    h, hq = LAYOUTS["gqa"]
    for wrong in (
        lambda k, v, window, leverage, sketch, dtype: real(k, v, 0, leverage, sketch, dtype=dtype),
        lambda k, v, window, leverage, sketch, dtype: real(k, v, window, "kv_avg", sketch, dtype=dtype),
        lambda k, v, window, leverage, sketch, dtype: real(k, v, window, leverage, sketch.flip(0), dtype=dtype),
    ):
        monkeypatch.setattr(curdkv_module, "kvpress_cur_score", wrong)
        with pytest.raises(AssertionError, match=WRONG):
            check_rule_on_geometry(load("curdkv_original", random_projection=True), "curdkv_original", h, hq, DIM, [0])
        monkeypatch.undo()
