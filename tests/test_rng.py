"""The counter-based generator (vase/engine/rng.py): exact arithmetic, uniformity, independence, batch-independence.

Every check runs on fixed keys, so it is deterministic: it cannot flake, and a change of the hash that breaks a
property fails it. Bounds are loose multiples of the sampling error (about 5 standard errors).
"""

from __future__ import annotations

import math

import pytest
import torch

from vase.engine.rng import EVICT_SALT, TOKEN_SALT, RowRNG, mix32, mix32_int, row_key, row_keys
from vase.engine.sampling import SamplingConfig, sample_tokens


def _chi2_uniform(u: torch.Tensor, bins: int = 64) -> float:
    counts = torch.histc(u.double().flatten(), bins=bins, min=0.0, max=1.0)
    expected = u.numel() / bins
    return float(((counts - expected) ** 2 / expected).sum())


def _corr(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.corrcoef(torch.stack([a.flatten().double(), b.flatten().double()]))[0, 1])


def test_mix32_tensor_equals_the_host_reference_bit_for_bit():
    """The int64 tensor version never overflows and equals Python's exact integer arithmetic on the full range."""
    x = torch.cat([torch.tensor([0, 1, 2**31 - 1, 2**31, 2**32 - 1]), torch.randint(0, 2**32, (20000,))])
    assert mix32(x).tolist() == [mix32_int(v) for v in x.tolist()]
    assert mix32(x).min() >= 0 and mix32(x).max() < 2**32
    # pinned values: a change of the hash (and so of every sampled stream) must be deliberate
    assert [mix32_int(v) for v in (0, 1, 12345)] == [0, 1753845952, 2435775735]
    assert row_key(0, TOKEN_SALT) != row_key(0, EVICT_SALT)


def test_uniform_range_and_extremes():
    rng = RowRNG.from_seeds(range(8))
    u = rng.uniform(4096)
    assert u.dtype == torch.float32 and u.shape == (8, 4096)
    assert 0 < u.min() and u.max() < 1
    # the extreme hashes map strictly inside (0, 1), so -log(u) is finite and positive
    x = torch.tensor([0, 2**32 - 1])
    ends = (x >> 9).to(torch.float32).mul_(2.0**-23).add_(2.0**-24)
    assert ends.tolist() == [2.0**-24, 1.0 - 2.0**-24]


def test_uniform_is_uniform():
    u = RowRNG.from_seeds(range(64), counter=3, stream=1).uniform(16384)  # 1M values
    chi2 = _chi2_uniform(u)
    assert chi2 < 63 + 5 * math.sqrt(2 * 63), chi2  # 63 degrees of freedom
    assert abs(float(u.mean()) - 0.5) < 5 * math.sqrt(1 / 12 / u.numel())
    assert abs(float(u.var()) - 1 / 12) < 0.001


def test_neighbours_are_independent():
    """Adjacent elements, consecutive counters, seeds s and s+1, layers l and l+1, successive draws: uncorrelated."""
    n = 65536
    bound = 5 / math.sqrt(n)
    key = RowRNG.from_seeds([7]).key

    def draw(counter=0, stream=0, seed_key=key):
        return RowRNG(seed_key, torch.tensor([counter]), stream).uniform(n)[0]

    u = draw()
    assert abs(_corr(u[:-1], u[1:])) < bound  # adjacent elements
    assert abs(_corr(u, draw(counter=1))) < bound  # the next position
    assert abs(_corr(u, draw(stream=1))) < bound  # the next layer
    assert abs(_corr(u, draw(seed_key=RowRNG.from_seeds([8]).key))) < bound  # the next seed
    rng = RowRNG(key, torch.tensor([0]))
    first, second = rng.uniform(n)[0], rng.uniform(n)[0]
    assert torch.equal(first, u) and abs(_corr(first, second)) < bound  # the next draw of one call site
    # pairs (u_j, u_{j+1}) fill the unit square evenly (a serial test on an 8x8 grid)
    cells = (u[:-1] * 8).long() * 8 + (u[1:] * 8).long()
    counts = torch.bincount(cells, minlength=64).double()
    expected = (n - 1) / 64
    assert float(((counts - expected) ** 2 / expected).sum()) < 63 + 5 * math.sqrt(2 * 63)


def test_a_row_does_not_depend_on_its_batch_mates():
    keys = RowRNG.from_seeds([11, 12, 13], counter=0).key
    counters = torch.tensor([5, 900, 17])
    batch = RowRNG(keys, counters, stream=3)
    u, z = batch.uniform(6, 7), batch.normal(10)
    for b in range(3):
        alone = RowRNG(keys[b : b + 1], counters[b : b + 1], stream=3)
        assert torch.equal(alone.uniform(6, 7), u[b : b + 1])
        assert torch.equal(alone.normal(10), z[b : b + 1])


def test_normal_moments():
    z = RowRNG.from_seeds(range(32), stream=5).normal(32768).double().flatten()  # 1M values
    n = z.numel()
    assert abs(float(z.mean())) < 5 / math.sqrt(n)
    assert abs(float(z.var()) - 1) < 5 * math.sqrt(2 / n)
    kurtosis = float((z**4).mean() / z.var() ** 2)
    assert abs(kurtosis - 3) < 0.05
    # the normal CDF at a few points
    for x, p in ((-1.0, 0.158655), (0.0, 0.5), (1.96, 0.975002)):
        assert abs(float((z < x).double().mean()) - p) < 5 * math.sqrt(p * (1 - p) / n)


def test_exponential_race_samples_the_distribution():
    """sample_tokens: over 40K rows (distinct seeds, one position), token frequencies match p (chi-square)."""
    p = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])
    rows = 40000
    logits = p.log().expand(rows, -1)
    rng = RowRNG(RowRNG.from_seeds(range(rows), salt=TOKEN_SALT).key, torch.full((rows,), 100))
    tok = sample_tokens(logits, SamplingConfig(temperature=1.0), rng)
    freq = torch.bincount(tok, minlength=6).double()
    chi2 = float(((freq - rows * p) ** 2 / (rows * p)).sum())
    assert chi2 < 5 + 5 * math.sqrt(10), (chi2, (freq / rows).tolist())


@pytest.mark.parametrize("rows", [1, 9])
def test_a_draw_is_one_batched_computation(rows):
    """The ops of a token draw do not depend on the number of rows, and none is a stateful RNG op."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Names(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    rng = RowRNG.from_seeds(range(rows))
    with Names() as rec:
        rng.exponential(20)
    assert not {"exponential", "uniform", "normal", "random", "rand", "randn", "bernoulli"} & set(rec.ops)
    ref = RowRNG.from_seeds(range(3))
    with Names() as rec3:
        ref.exponential(20)
    assert rec.ops == rec3.ops


def test_a_stream_tensor_draws_what_the_host_streams_draw():
    """One eviction event draws for the rows of every layer at once, each row with its layer as a stream tensor:
    bit-identical to the per-layer draws it replaces (the old path kept here as the reference: one RowRNG per layer
    with the layer as a host int)."""
    layers, rows = 5, 3
    keys = torch.tensor(row_keys([7, 123, 2**40 + 5], EVICT_SALT))
    counters = torch.tensor([17, 4096, 2**31 + 3])
    folded = RowRNG(
        keys.repeat_interleave(layers, 0),
        counters.repeat_interleave(layers),
        stream=torch.arange(layers).repeat(rows),
    )
    per_layer = [RowRNG(keys, counters, stream=li) for li in range(layers)]
    for draw in ("uniform", "normal", "exponential", "uniform"):
        got = getattr(folded, draw)(2, 7).view(rows, layers, 2, 7)
        for li, rng in enumerate(per_layer):
            assert torch.equal(got[:, li], getattr(rng, draw)(2, 7)), (draw, li)
