"""The committed configs of the hub presets (conf/model/configs, vase.configs): every hub preset has one, it loads
with AutoConfig, and the parameters it gives (counted on the meta device, nothing allocated) match the size the model
card advertises within 3 %; and the offline fallback of :func:`vase.configs.hub_config` (hub first, then the copy,
logged)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
import yaml

from vase.configs import COMMITTED, committed_config_dir, hub_config

ROOT = Path(__file__).resolve().parents[1]

#: the size each model card advertises (parameters; the language model, which AutoModelForCausalLM builds)
ADVERTISED = {
    "Qwen/Qwen3-4B": 4.0e9,
    "Qwen/Qwen3-8B": 8.2e9,
    "Qwen/Qwen3-14B": 14.8e9,
    "Qwen/Qwen3-30B-A3B": 30.5e9,
    "Qwen/Qwen3-Next-80B-A3B-Thinking": 80e9,
    "Qwen/Qwen3.5-27B": 27e9,
    "Qwen/Qwen3.5-35B-A3B": 35e9,
    "openai/gpt-oss-20b": 21e9,
    "allenai/Olmo-3-7B-Think": 7.3e9,
    "microsoft/Phi-4-reasoning": 14.7e9,
    "HuggingFaceTB/SmolLM3-3B": 3.08e9,
}


def hub_presets() -> list[str]:
    """The ``name`` of every preset that names a hub model (``org/model``), not a tiny or wheel model."""
    names = [yaml.safe_load(p.read_text())["name"] for p in sorted((ROOT / "conf" / "model").glob("*.yaml"))]
    return [n for n in names if "/" in n and not n.startswith("tiny:")]


def test_every_hub_preset_has_a_committed_config():
    assert sorted(hub_presets()) == sorted(ADVERTISED)
    missing = [n for n in hub_presets() if committed_config_dir(n) is None]
    assert missing == [], f"no committed config for {missing} under {COMMITTED}"


@pytest.mark.parametrize("name", sorted(ADVERTISED))
def test_committed_config_gives_the_advertised_parameter_count(name):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(committed_config_dir(name))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    count = sum(p.numel() for p in model.parameters())
    assert abs(count / ADVERTISED[name] - 1) < 0.03, f"{name}: {count / 1e9:.2f}B vs {ADVERTISED[name] / 1e9}B"


def test_hub_config_falls_back_to_the_committed_copy_and_says_so(tmp_path, caplog):
    name = "vase-test-org/not-a-hub-model"  # never in a hub cache; the tests run offline (conftest)
    folder = tmp_path / "vase-test-org--not-a-hub-model"
    folder.mkdir()
    (folder / "config.json").write_text(
        json.dumps({"model_type": "qwen3", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4})
    )
    with caplog.at_level(logging.WARNING, logger="vase.configs"):
        config = hub_config(name, root=tmp_path)
    assert (config.model_type, config.hidden_size, config.num_hidden_layers) == ("qwen3", 64, 2)
    assert "using the committed copy" in caplog.text and name in caplog.text


def test_hub_config_without_a_copy_raises_the_hub_error(tmp_path):
    with pytest.raises(OSError):
        hub_config("vase-test-org/not-a-hub-model", root=tmp_path)
