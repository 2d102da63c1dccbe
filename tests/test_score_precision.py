"""``protocol.score_dtype``: the policies' scores in bf16 as the authors' code computes them, against a step-by-step
reference of their operations (``tests/authors_bf16_reference.py``), and where bf16 and float32 differ (ties)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from baselines.curdkv import CurDKV
from baselines.evict_large_value import EvictLargeValue
from baselines.rkv import RKV
from baselines.snapkv import SnapKV, SnapKVProtect
from tests import authors_bf16_reference as ref
from vase.engine import Decoder, Request, sample_seeds
from vase.engine.cache import cache_capacity
from vase.engine.policy import EvictionInputs
from vase.engine.scores import (
    SCORE_DTYPES,
    _redundancy_rounded,
    cur_score,
    redundancy_score,
    score_dtype,
    value_statistic,
    windowed_attention_score,
)
from vase.models import tiny_model
from vase.policies.attnv import VaSEAttnV

BF16 = torch.bfloat16


def _randn(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return (scale * torch.randn(*shape, generator=torch.Generator().manual_seed(seed))).to(BF16)


def _window(b=2, hq=8, h=2, wq=16, n=40, d=32, seed=0):
    """Queries and keys as a bf16 cache holds them (scale 3: logits spread over several units, as in real models)."""
    return _randn(b, hq, wq, d, seed=seed, scale=3.0), _randn(b, h, n, d, seed=seed + 1, scale=3.0)


# ---- each score, bit for bit ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [1.0, 2.0])
@pytest.mark.parametrize("smooth", [True, False])
@pytest.mark.parametrize("hq,h", [(8, 2), (2, 2)], ids=["gqa", "mha"])
def test_bf16_attention_score_equals_the_authors_operations(temperature, smooth, hq, h):
    q, k = _window(hq=hq, h=h)
    d = q.shape[-1]
    got = windowed_attention_score(q, k, d**-0.5, temperature, 5 if smooth else 0, dtype=BF16)
    want = ref.attention(q, k, temperature, smooth)
    assert got.dtype == BF16 and want.dtype == BF16
    assert torch.equal(got, want)


@pytest.mark.parametrize("chunk", [1, 5000, 10**9])
def test_bf16_attention_chunking_does_not_change_the_bits(chunk):
    q, k = _window()
    got = windowed_attention_score(q, k, 32**-0.5, max_chunk_elements=chunk, dtype=BF16)
    assert torch.equal(got, ref.attention(q, k))


def test_bf16_attention_smoothed_along_positions_is_storage_smoothing_of_the_sorted_cache():
    q, k = _window(b=1, h=2, n=24)
    perm = torch.randperm(24, generator=torch.Generator().manual_seed(3))
    pos = perm.view(1, 1, 24).expand(1, 2, 24)  # candidate i sits at position perm[i]
    got = windowed_attention_score(q, k, 32**-0.5, positions=pos, dtype=BF16)
    order = perm.argsort()  # storage indices in position order
    want = torch.empty_like(got)
    want[..., order] = ref.attention(q, k[:, :, order])
    assert torch.equal(got, want)


@pytest.mark.parametrize("stat,theirs", [("range", "range"), ("variance", "var"), ("l2", "l2")])
def test_bf16_value_statistic_equals_the_authors_operations(stat, theirs):
    v = _randn(2, 3, 50, 64, seed=4, scale=2.0)
    got = value_statistic(v, stat, dtype=BF16)
    assert got.dtype == BF16 and torch.equal(got, ref.value_magnitude(v, theirs))
    assert torch.equal(value_statistic(v, "absmax", dtype=BF16), v.abs().amax(-1))


@pytest.mark.parametrize("block", [7, 512])
def test_bf16_redundancy_equals_the_full_similarity_matrix(block):
    k = _randn(2, 2, 30, 16, seed=5)
    want = ref.redundancy(k)
    assert torch.equal(_redundancy_rounded(k, 1e-8, BF16, block=block), want)
    assert torch.equal(redundancy_score(k, dtype=BF16), want)


def test_bf16_cur_equals_the_authors_operations():
    k, v = _randn(2, 2, 40, 32, seed=6), _randn(2, 2, 40, 32, seed=7)
    sketch = torch.randn(2, 32, 20, generator=torch.Generator().manual_seed(8)) / 20**0.5  # drawn in float32
    got = cur_score(k, v, sketch, dtype=BF16)
    assert got.dtype == BF16 and torch.equal(got, ref.cur(k, v, sketch))


def test_float32_is_the_default_and_unchanged():
    q, k = _window()
    v = _randn(2, 2, 40, 32, seed=9)
    assert windowed_attention_score(q, k, 32**-0.5).dtype == torch.float32
    assert value_statistic(v).dtype == torch.float32 and redundancy_score(k).dtype == torch.float32
    assert torch.equal(value_statistic(v), v.float().amax(-1) - v.float().amin(-1))
    assert score_dtype("bfloat16") is BF16 and set(SCORE_DTYPES) == {"float32", "bfloat16"}
    with pytest.raises(ValueError, match="protocol.score_dtype"):
        score_dtype("float16")


# ---- the policies: what they keep, from the authors' scores ---------------------------------------------------------


def _inputs(n=60, n_keep=24, dtype=BF16, seed=10, sketch=None) -> EvictionInputs:
    q, k = _window(n=n, seed=seed)
    b, h = k.shape[:2]
    v = _randn(b, h, n, k.shape[-1], seed=seed + 2, scale=2.0)
    pos = torch.arange(n).view(1, 1, n).expand(b, h, n)
    state = {} if sketch is None else {"sketch": sketch}
    gens = [torch.Generator().manual_seed(i) for i in range(b)]
    return EvictionInputs(k, v, pos, n_keep, 0, k.shape[-1] ** -0.5, gens, state, q, score_dtype=dtype)


def _kept_values(score: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """The sorted scores of the kept candidates: equal for two choices that differ only in how ties were broken."""
    return score.float().gather(-1, idx).sort(dim=-1).values


def test_bf16_policies_keep_what_the_authors_scores_select():
    inp = _inputs()
    k_keep = inp.n_keep
    attn = ref.attention(inp.queries, inp.keys)
    # SnapKV (their mode "attn"): top-K of the attention score
    snap = SnapKV(budget=48, window=24).keep(inp)
    assert torch.equal(_kept_values(attn, snap), _kept_values(attn, attn.topk(k_keep).indices))
    # SnapKV + 8 protected value slots (their "range_attn"): the 8 largest ranges, then top-K of the rest
    rng = ref.value_magnitude(inp.values, "range")
    prot = SnapKVProtect(budget=48, window=24, n_protect=8).keep(inp)
    large = rng.topk(8).indices
    assert torch.equal(_kept_values(rng, prot[..., :8]), _kept_values(rng, large))
    rest = attn.scatter(-1, large, float("-inf")).topk(k_keep - 8).indices
    assert torch.equal(_kept_values(attn, prot[..., 8:]), _kept_values(attn, rest))
    # R-KV (their "attn_rkv", λ = 0.5)
    mix = ref.rkv(attn, ref.redundancy(inp.keys), 0.5)
    got = RKV(budget=48, window=24).score(inp)
    assert torch.equal(got, mix)
    # evicting the large values (their "evict_large_range"): the K smallest ranges
    small = EvictLargeValue(budget=48, window=24).keep(inp)
    assert torch.equal(_kept_values(rng, small), _kept_values(rng, rng.topk(k_keep, largest=False).indices))
    # VaSE-AttnV samples proportional to the attention score: the weights it samples from are the authors'
    assert torch.equal(VaSEAttnV(budget=48, window=24).score(inp), attn)


def test_bf16_curdkv_keeps_the_sinks_and_the_top_of_the_authors_cur_score():
    sketch = torch.randn(2, 32, 20, generator=torch.Generator().manual_seed(11)) / 20**0.5
    inp = _inputs(sketch=sketch)
    want = ref.cur(inp.keys, inp.values, sketch)
    want[:, :, :4] = 1.0  # their sinks: the first four slots forced to the top
    got = CurDKV(budget=48, window=24).keep(inp)
    assert torch.equal(_kept_values(want, got), _kept_values(want, want.topk(inp.n_keep).indices))


# ---- where bf16 and float32 differ ----------------------------------------------------------------------------------


def test_bf16_rounds_nearby_value_ranges_into_a_tie_that_float32_breaks():
    # Two candidates whose ranges differ by 0.001: float32 protects the larger one, bf16 (spacing 2^-7 at 1.0) cannot
    # tell them apart.
    v = torch.zeros(1, 1, 2, 4)
    v[0, 0, 0, 0], v[0, 0, 1, 0] = 1.0, 1.001
    f32, b16 = value_statistic(v, "range"), value_statistic(v, "range", dtype=BF16)
    assert f32[0, 0, 1] > f32[0, 0, 0]
    assert b16[0, 0, 1] == b16[0, 0, 0]


def test_bf16_attention_ties_at_the_topk_boundary():
    # Keys 1 and 2 differ by a hair: distinct float32 scores, one bf16 score (the logits round to the same value).
    q = torch.ones(1, 1, 4, 8)
    k = torch.zeros(1, 1, 3, 8)
    k[0, 0, 0] = -1.0
    k[0, 0, 1] = 0.5
    k[0, 0, 2] = 0.5 + 1e-3
    f32 = windowed_attention_score(q, k, 8**-0.5, smooth_kernel=0)
    b16 = windowed_attention_score(q, k, 8**-0.5, smooth_kernel=0, dtype=BF16)
    assert f32[0, 0, 2] > f32[0, 0, 1]
    assert b16[0, 0, 2] == b16[0, 0, 1]


def test_bf16_and_float32_keep_different_sets_on_random_caches():
    inp32 = _inputs(n=400, n_keep=100, dtype=torch.float32, seed=20)
    inp16 = dataclasses.replace(inp32, score_dtype=BF16)
    f32 = windowed_attention_score(inp32.queries, inp32.keys, inp32.scaling, dtype=torch.float32)
    b16 = windowed_attention_score(inp16.queries, inp16.keys, inp16.scaling, dtype=BF16)
    # bf16 has 8 significant bits: many candidates share a score, where float32 has (nearly) all distinct
    assert b16[0, 0].unique().numel() < 0.8 * f32[0, 0].unique().numel()
    # the kept sets differ near the boundary in some (row, head), and agree on most of the cache
    keep32 = SnapKV(budget=120, window=20).keep(inp32).sort(dim=-1).values
    keep16 = SnapKV(budget=120, window=20).keep(inp16).sort(dim=-1).values
    assert not torch.equal(keep32, keep16)
    overlap = (
        sum(len(set(a.tolist()) & set(c.tolist())) for a, c in zip(keep32.flatten(0, 1), keep16.flatten(0, 1)))
        / keep32[..., 0].numel()
    )
    assert overlap > 0.9 * 100


# ---- the engine hands the setting to the policy ---------------------------------------------------------------------


@dataclasses.dataclass
class _Spy(SnapKV):
    seen: list = dataclasses.field(default_factory=list)

    def keep(self, inputs: EvictionInputs) -> torch.Tensor:
        self.seen.append(inputs.score_dtype)
        return super().keep(inputs)


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_the_decoder_sets_score_dtype_on_every_eviction(dtype):
    model = tiny_model("qwen3", num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2)
    policy = _Spy(budget=32, window=8)
    prompt = torch.arange(12) % 200
    dec = Decoder(
        model,
        policy,
        rows=1,
        capacity=cache_capacity(policy, 12, 48),
        max_new_tokens=48,
        score_dtype=dtype,
    )
    done = list(dec.run([Request(prompt, sample_seeds(0, 1))]))
    assert done and done[0].stats["evictions"] > 0
    assert policy.seen and set(policy.seen) == {dtype}
