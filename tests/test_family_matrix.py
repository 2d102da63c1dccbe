"""The policy matrix of the new families (issue 27): every ``conf/policy/*.yaml`` on tiny ``qwen3_5`` and ``gpt_oss``.

``qwen3_5``: linear, full, linear, full (Gated DeltaNet and full attention with RoPE on 25 % of the head dim);
``gpt_oss``: sliding-window (16) and full layers alternating, learned attention sinks, a MoE MLP, YaRN RoPE. Each cell
(config x family) has one expected outcome, written here:

* it **runs**: the policy's ``check_model`` (the runner's preflight) accepts the model, and
  tests/test_policies_e2e.py's ``run_and_check`` holds (it evicts, sinks kept in every full-attention layer, the
  capacity as planned; a selection policy attends to fewer tokens than it holds); an eviction policy's eviction also
  equals masking (tests/test_engine.py's proof on gpt_oss, in float64; tests/test_hybrid_models.py's stepwise one on
  qwen3_5);
* or it is **refused** (:data:`REFUSED`): ``check_model`` raises one line matching the reason, and so does the engine
  (``generate``) before any forward.

A policy that stops working on a family, or starts accepting a model it cannot handle, fails its cell; a new config
gets cells that must run. The cells CI ran before this matrix stay in the default suite (:data:`DEFAULT`), the rest
are ``slow`` (~1 s each here; CI's time budget). The whole matrix::

    pytest -q tests/test_family_matrix.py -m "slow or not slow"
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from hydra.utils import instantiate

from tests.authors_rules import AUTHORS_RULES, check_rule_on_geometry
from tests.policy_configs import ALL_CONFIGS, calibrate, configs_of_kind, small_config
from tests.test_engine import check_eviction_equals_masking
from tests.test_hybrid_models import TWO_KV, check_stepwise_eviction_equals_masking, masking_model
from tests.test_policies_e2e import run_and_check
from tests.test_sliding_families import _model
from vase.engine import generate
from vase.engine.geometry import config_layer_types
from vase.models import tiny_model

FAMILIES = ("qwen3_5", "gpt_oss")
_PARTIAL = r"RoPE rotates 0\.25 of the head dim \(partial_rotary_factor\): not supported yet"
#: (family, config) -> the whole one-line refusal (a regex). TriAttention and SeerAttention-R model RoPE over the
#: whole head dim (TriAttention's centres and SeerAttention-R's gate live in the pre-RoPE space of every frequency):
#: Qwen3.5's keys rotate only their first 25 %, the rest carries no position; SeerAttention-R's gate also rotates its
#: compressed keys with the default RoPE (its published gates: Qwen3's), not gpt-oss's YaRN frequencies.
REFUSED = {
    (
        "qwen3_5",
        "triattention",
    ): rf"policy\.triattention: assumes RoPE over the whole head dim of every layer; {_PARTIAL}",
    ("qwen3_5", "seer_attention_r"): rf"policy seer_attention_r: undoes RoPE over the whole head dim of every layer; "
    rf"{_PARTIAL}",
    ("gpt_oss", "seer_attention_r"): r"policy seer_attention_r: RoPE type 'yarn' is not supported \(the gates rotate "
    r"with the default RoPE\); use a model with the default RoPE \(Qwen3\)",
}
#: the cells of the default suite (before the matrix: tests/test_hybrid_models.py, tests/test_sliding_families.py)
DEFAULT = {
    "run": {("qwen3_5", n) for n in ("vase_dkv", "snapkv", "quest", "vase_attnv")}
    | {("gpt_oss", "vase_dkv")}
    | {("gpt_oss", "quest")},
    "refused": {("qwen3_5", "triattention"), ("qwen3_5", "seer_attention_r")},
    "masking": {("qwen3_5", "vase_dkv"), ("qwen3_5", "snapkv"), ("gpt_oss", "vase_dkv")},
}


def _cells(kind: str, names: list[str]) -> list:
    """``(family, name)`` params of outcome ``kind``, those outside :data:`DEFAULT` marked slow."""
    out = []
    for family in FAMILIES:
        for name in names:
            if (kind == "refused") != ((family, name) in REFUSED):
                continue
            marks = () if (family, name) in DEFAULT[kind] else (pytest.mark.slow,)
            out.append(pytest.param(family, name, marks=marks, id=f"{family}-{name}"))
    return out


def family_model(family: str):
    """The tiny model of the end-to-end cells: four layers, two of them full attention."""
    return tiny_model("qwen3_5", **TWO_KV) if family == "qwen3_5" else _model("gpt_oss", num_hidden_layers=4)


def uncalibrated(name: str, model, tmp_path: Path):
    """Config ``name`` for ``model`` as :func:`tests.policy_configs.load_small` builds it, without a calibration
    pass (TriAttention's calibrate refuses partial RoPE itself): random SeerAttention-R gates of its geometry."""
    cfg = small_config(name, 32, 8, model.config.num_hidden_layers)
    if "gate_path" in cfg:
        from tests.seer_reference import write_random_gates

        cfg.gate_path = str(write_random_gates(tmp_path / f"gates-{name}", model.config, block_size=16))
        cfg.block_size = 16
    return instantiate(cfg)


def _prompt() -> list[int]:
    return torch.randint(0, 256, (20,), generator=torch.Generator().manual_seed(3)).tolist()


def test_the_matrix_covers_every_config_and_names_only_real_cells():
    assert len(ALL_CONFIGS) >= 19
    for family, name in set(REFUSED) | set().union(*DEFAULT.values()):
        assert family in FAMILIES and name in ALL_CONFIGS, (family, name)
    assert DEFAULT["refused"] <= set(REFUSED) and not (DEFAULT["run"] | DEFAULT["masking"]) & set(REFUSED)
    # the cells the tests below are parametrised with (not _cells again): every (family, config) exactly once, the
    # refused ones exactly REFUSED, every eviction config that runs also in the masking cells
    runs, refused, masking = (_params(f) for f in (test_policy_runs_end_to_end, test_policy_is_refused_in_one_line,
                                                   test_eviction_equals_masking))  # fmt: skip
    every = {(f, n) for f in FAMILIES for n in ALL_CONFIGS}
    assert len(runs) == len(set(runs)) and len(refused) == len(set(refused)), "a cell twice"
    assert set(runs) | set(refused) == every and not set(runs) & set(refused)
    assert set(refused) == set(REFUSED)
    assert set(masking) == {(f, n) for f, n in runs if n in configs_of_kind("eviction")}


def _params(test) -> list[tuple[str, str]]:
    """The ``(family, name)`` cells ``test`` is parametrised with (its ``parametrize`` mark)."""
    (mark,) = [m for m in test.pytestmark if m.name == "parametrize"]
    return [tuple(p.values) for p in mark.args[1]]


def check_rule_on_family(name: str, model, policy) -> None:
    """A config with a port of its authors' rule (tests/authors_rules.py) keeps that rule's set on random inputs of the
    family's geometry (its full-attention layers, KV and query heads, head dim): the cell fails with a wrong rule."""
    if name not in AUTHORS_RULES:
        return
    cfg = model.config
    layer_ids = [i for i, t in enumerate(config_layer_types(cfg)[0]) if t == "full_attention"]
    h, hq = cfg.num_key_value_heads, cfg.num_attention_heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // hq
    policy = calibrate(policy, layers=cfg.num_hidden_layers, q_heads=hq, head_dim=d)
    check_rule_on_geometry(policy, name, h, hq, d, layer_ids)


@pytest.mark.parametrize(("family", "name"), _cells("run", ALL_CONFIGS))
def test_policy_runs_end_to_end(family, name, tmp_path):
    """The preflight accepts the model, and tests/test_policies_e2e.py's checks hold on its full-attention layers."""
    model = family_model(family)
    policy = uncalibrated(name, model, tmp_path)
    policy.check_model(model.config)
    check_rule_on_family(name, model, policy)
    out = run_and_check(model, _prompt(), name, budget=32, window=8, new_tokens=64, tmp_path=tmp_path)
    assert out is not None, f"{name}: refused the prompt (keep_prompt)"


@pytest.mark.parametrize(("family", "name"), _cells("refused", ALL_CONFIGS))
def test_policy_is_refused_in_one_line(family, name, tmp_path):
    """``check_model`` (the preflight, before any weight loads) and ``generate`` refuse the model with the reason."""
    model = family_model(family)
    want = REFUSED[(family, name)]
    with pytest.raises(ValueError) as err:
        uncalibrated(name, model, tmp_path).check_model(model.config)
    assert re.fullmatch(want, str(err.value)), str(err.value)

    def boom(*args, **kwargs):
        raise AssertionError("the model ran before the policy refused it")

    handle = model.register_forward_pre_hook(boom)
    try:
        with pytest.raises(ValueError) as err:
            generate(model, _prompt(), uncalibrated(name, model, tmp_path), max_new_tokens=4)
    finally:
        handle.remove()
    assert re.fullmatch(want, str(err.value)), str(err.value)


@pytest.mark.parametrize(("family", "name"), _cells("masking", configs_of_kind("eviction")))
def test_eviction_equals_masking(family, name, tmp_path):
    """Every eviction config that runs on the family (tests/test_engine.py proves every one on qwen3): gpt_oss with
    its ring and sinks in the masked reference (sliding, full, sliding), in float64; qwen3_5 step by step with
    transformers' own cache (its linear layers step token by token, as ours)."""
    if family == "gpt_oss":
        # in float64 (its experts' eager loop: grouped_mm takes no float64), to 1e-10: in float32 the rounding of
        # this model (3 layers, MoE, sinks) reaches 2e-5 of the largest logit after ~50 steps for some policies
        model = _model("gpt_oss", dtype=torch.float64)
        model.set_experts_implementation("eager")
        check_eviction_equals_masking(model, name, tmp_path, tol=1e-10)
    else:
        check_stepwise_eviction_equals_masking(masking_model("qwen3_5"), name, tmp_path)
