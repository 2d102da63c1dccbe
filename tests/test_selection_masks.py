"""The engine's selection path takes a mask per KV head ``(n, H, L)`` or per query head ``(n, Hq, L)``.

A test policy attends, for query head ``j`` at a decode step, to the held tokens ``t`` with ``(t + f(j)) % 3 != 0``
plus the current one, ``f(j) = j`` (per query head) or ``f(j) = j // G`` (the same rule per KV head, written either
way). The engine must (1) decode exactly as the unmodified model does with that per-head mask over the whole
sequence, rows of different lengths included, (2) give the same tokens and ``attended_tokens`` for the two ways of
writing a per-KV-head selection, and (3) report ``attended_tokens`` = the mean over decode steps, layers and query
heads of the tokens each head attends to.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from vase.engine import Decoder, Request, SamplingConfig
from vase.engine.attention import eager_attention
from vase.engine.policy import SelectionInputs, SelectionPolicy
from vase.models import tiny_model

HEADS, KV_HEADS = 4, 2
G = HEADS // KV_HEADS


@dataclass
class ModThree(SelectionPolicy):
    """Head ``j`` attends to tokens ``t`` with ``(t + f(j)) % 3 != 0`` and the current token (see the module)."""

    form: str = "query"  # "query": f(j) = j, per query head; "kv": f = KV head, per KV head; "kv_as_query"

    name: ClassVar[str] = "test_mod_three"

    def select(self, inputs: SelectionInputs) -> torch.Tensor:
        b, h, length, _ = inputs.keys.shape
        hq = inputs.query.shape[1]
        heads = h if self.form == "kv" else hq
        offset = torch.arange(heads)
        if self.form == "kv_as_query":
            offset = offset // (hq // h)
        slots = torch.arange(length)
        mask = (slots[None, :] + offset[:, None]) % 3 != 0  # (heads, L)
        current = slots[None, :] == (inputs.lengths - 1)[:, None]  # (B, L)
        return mask[None] | current[:, None]


def offset_of(form: str, j: int) -> int:
    return j if form == "query" else j // G


def expected_attended(form: str, prompt: int, steps: int) -> float:
    """Mean over decode steps, layers and query heads of the tokens a head attends to (``prompt + s`` held)."""
    total = 0
    for s in range(1, steps + 1):
        n = prompt + s
        for j in range(HEADS):
            total += sum(1 for t in range(n) if (t + offset_of(form, j)) % 3 != 0 or t == n - 1)
    return total / steps / HEADS  # every layer attends alike


_MASK: dict = {}


def _reference_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    out = eager_attention(query, key, value, scaling, causal=False, mask=_MASK["mask"])  # (1, Hq, T, T) per query head
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register("vase_test_mod_three", _reference_attention)
AttentionMaskInterface.register("vase_test_mod_three", lambda *a, **k: None)


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen3", num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, num_hidden_layers=2)


def decode(model, form: str, prompts, new: int):
    policy = ModThree(budget=8, form=form)
    logits: dict = {}
    step_logits: dict = {}

    def on_step(info):
        for j, rid in enumerate(info.rows):
            logits.setdefault(rid, []).append(step_logits[info.step][j].clone())

    dec = Decoder(
        model,
        policy,
        rows=2,
        capacity=max(len(p) for p in prompts) + new,
        sampling=SamplingConfig(temperature=0),
        max_new_tokens=new,
        ignore_eos=True,
        attn_backend="sdpa",
        on_step=on_step,
        on_logits=lambda s, lg: step_logits.__setitem__(s, lg),
    )
    done = {f.key: f for f in dec.run([Request(p, [i], key=i) for i, p in enumerate(prompts)])}
    return done, logits


def test_per_query_head_masks_decode_as_the_model_with_that_mask(model):
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (n,), generator=g) for n in (7, 12)]  # rows of different lengths
    new = 12
    done, logits = decode(model, "query", prompts, new)
    for key, prompt in enumerate(prompts):
        f = done[key]
        p = len(prompt)
        total = p + new - 1
        mask = torch.zeros(1, HEADS, total, total, dtype=torch.bool)
        mask[:, :, :p, :p] = torch.ones(p, p, dtype=torch.bool).tril()
        for i in range(p, total):  # the query of the token at position i (a decode step), over tokens 0..i
            for j in range(HEADS):
                mask[0, j, i, : i + 1] = torch.tensor([(t + j) % 3 != 0 or t == i for t in range(i + 1)])
        _MASK["mask"] = mask
        seq = torch.cat([prompt, torch.tensor(f.tokens[: new - 1])]).view(1, -1)
        model.set_attn_implementation("vase_test_mod_three")
        try:
            ref = model(input_ids=seq, position_ids=torch.arange(total).view(1, -1)).logits[0]
        finally:
            model.set_attn_implementation("sdpa")
        for step in range(1, new):
            diff = (logits[(key, 0)][step - 1] - ref[p + step - 1]).abs().max().item()
            assert diff <= 1e-4, (key, step, diff)
        assert f.stats["decode_steps"] == new - 1  # the first token comes from the prefill
        assert f.stats["attended_tokens"] == pytest.approx(expected_attended("query", p, new - 1))


def test_a_kv_head_selection_gives_the_same_result_written_per_kv_head_or_per_query_head(model):
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (n,), generator=g) for n in (9, 5)]
    by_kv, logits_kv = decode(model, "kv", prompts, 10)
    by_q, logits_q = decode(model, "kv_as_query", prompts, 10)
    for key, prompt in enumerate(prompts):
        assert by_kv[key].tokens == by_q[key].tokens
        torch.testing.assert_close(torch.stack(logits_kv[(key, 0)]), torch.stack(logits_q[(key, 0)]))
        want = expected_attended("kv", len(prompt), 9)
        assert by_kv[key].stats["attended_tokens"] == pytest.approx(want)
        assert by_q[key].stats["attended_tokens"] == pytest.approx(want)
    # the per-query-head rule is a different selection: a different count
    assert expected_attended("query", 9, 10) != expected_attended("kv", 9, 10)


@dataclass
class CountSteps(SelectionPolicy):
    """Attends to everything; its state counts each row's decode steps (made at the prefill, updated in place), or,
    with ``lazy``, is created inside ``select`` (refused: a compiled step could not give new rows their own)."""

    lazy: bool = False

    name: ClassVar[str] = "test_count_steps"

    def init_state(self, keys, positions, lengths, layer_idx, capacity):
        if self.lazy:
            return {}
        return {"steps": torch.zeros(keys.shape[0], dtype=torch.long), "prompt": torch.tensor(lengths)}

    def select(self, inputs: SelectionInputs) -> None:
        if self.lazy:
            inputs.state.setdefault("steps", torch.zeros(inputs.keys.shape[0], dtype=torch.long))
        else:
            inputs.state["steps"].add_(1)
        return None


def test_selection_state_is_made_at_each_rows_prefill_and_updated_in_place(model):
    """Rows admitted at different steps into reused slots (continuous batching): each row's state is its own from its
    prefill on (its prompt length, its decode steps since), whatever the slot held before; a policy that adds state
    inside ``select`` is refused in one line."""
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 256, (n,), generator=g) for n in (7, 12, 5, 9)]
    seen: list[tuple] = []

    def on_step(info):
        store = dec.cache.storage.state.store
        for r, rid in enumerate(info.rows):
            for layer in range(2):
                seen.append((rid, int(store["steps"][r, layer]), int(store["prompt"][r, layer])))

    dec = Decoder(model, CountSteps(budget=8), rows=2, capacity=40, sampling=SamplingConfig(temperature=0),
                  max_length=20, ignore_eos=True, on_step=on_step)  # fmt: skip
    done = {f.key: f for f in dec.run([Request(p, [0], key=i) for i, p in enumerate(prompts)])}
    assert len(done) == 4
    for (key, _), _, prompt in seen:
        assert prompt == len(prompts[key])
    for key, p in enumerate(prompts):
        counts = [s for (k, _), s, _ in seen if k == key]
        assert counts == [s for s in range(1, 20 - len(p)) for _ in range(2)], key  # one per step and layer
    lazy = Decoder(model, CountSteps(budget=8, lazy=True), rows=2, capacity=40, max_new_tokens=3)
    with pytest.raises(RuntimeError, match=r"select\(\) added state\['steps'\]; create per-row state in init_state"):
        list(lazy.run([Request(prompts[0], [0], key=0)]))
