"""vase/bench/step_profile.py: the operator groups, and a profiled eager decode at a fixed row count."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vase.bench.step_profile import op_group, op_shares, profile_decode


def test_operator_groups_and_shares():
    events = [
        SimpleNamespace(key="aten::mm", self_cpu_time_total=60.0),
        SimpleNamespace(key="aten::addmm", self_cpu_time_total=20.0),
        SimpleNamespace(key="aten::_scaled_dot_product_flash_attention_for_cpu", self_cpu_time_total=10.0),
        SimpleNamespace(key="## Call CompiledFxGraph abc ##", self_cpu_time_total=5.0),
        SimpleNamespace(key="aten::topk", self_cpu_time_total=5.0),
    ]
    assert [op_group(e.key) for e in events] == ["matmul", "matmul", "attention", "compiled kernels", "other"]
    shares = op_shares(events)
    assert shares == pytest.approx({"matmul": 0.8, "attention": 0.1, "compiled kernels": 0.05, "other": 0.05})
    with pytest.raises(ValueError, match="no CPU time"):
        op_shares([])


def test_a_profiled_eager_decode_covers_every_row_at_every_step():
    from tests.test_continuous import MODEL, load_policy
    from vase.models import tiny_model

    torch.manual_seed(0)
    model = tiny_model("qwen3", **MODEL)
    r = profile_decode(model, load_policy("vase_dkv"), rows=3, prompt_len=20, new_tokens=24, compile="off",
                       window=(4, 12))  # fmt: skip
    assert r.steps == 23 and len(r.step_ms) == 22  # the prefill samples the first token; one step per token after
    assert r.shares is not None and sum(r.shares.values()) == pytest.approx(1.0)
    assert r.shares["matmul"] > 0 and r.top_ops and r.tokens_per_second > 0


def test_fewer_prompts_than_rows_and_a_bad_live_count():
    from tests.test_continuous import MODEL, load_policy
    from vase.models import tiny_model

    torch.manual_seed(0)
    model = tiny_model("qwen3", **MODEL)
    r = profile_decode(model, load_policy("full"), rows=4, live=3, prompt_len=12, new_tokens=8, compile="off")
    assert r.rows == 3 and r.steps == 7 and r.shares is None
    with pytest.raises(ValueError, match="live: must be between 1 and rows=4"):
        profile_decode(model, load_policy("full"), rows=4, live=5, prompt_len=12, new_tokens=8, compile="off")
