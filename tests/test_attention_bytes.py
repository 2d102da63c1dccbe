"""Bytes read per decode step (issue 36): the attention is given close to what the rows hold.

* Key-length buckets (``vase.engine.cache.key_buckets``): each at most 1.25x the next smaller, at most 8 per capacity,
  the capacity the largest; a step's span is the smallest that holds its longest row.
* ``vase::flash_decode`` (FlashAttention-2 as a custom operator): its CPU kernel equals flash-attn's contract
  (``tests/flash_attn_reference.py``) and a float64 reference, reads only each row's ``cache_seqlens`` slots (the
  rest poisoned with NaN), passes ``torch.library.opcheck`` (the fake implementation) and is traced by
  ``torch.compile(fullgraph=True)``.
* Measured over the staggered 300-step decode (``vase.bench.attention_bytes``, a ``TorchDispatchMode`` around each
  eager forward and inside each compiled graph): ``vase_dkv`` is given <= 1.25x the K/V bytes its rows hold at steady
  state; ``full`` <= 1.25x its live rows padded to the longest (what no padded SDPA call can beat; the rows' spread
  of lengths is the rest); FlashAttention-2 exactly what the rows hold.
"""

from __future__ import annotations

import pytest
import torch

from tests import flash_attn_reference as ref
from tests.test_continuous import MODEL, load_policy
from vase.bench.attention_bytes import CountingBackend, staggered_decode
from vase.engine.attention import flash_decode, flash_decode_reference
from vase.engine.cache import KEY_BUCKET_ALIGN, KEY_BUCKET_RATIO, KEY_BUCKETS, key_buckets, length_bucket, row_buckets
from vase.models import tiny_model

ROWS = 5


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return tiny_model("qwen3", **MODEL)


@pytest.mark.parametrize("capacity", [1, 7, 48, 56, 200, 1000, 4096, 32_768, 131_072])
def test_key_buckets(capacity):
    b = key_buckets(capacity)
    assert b[-1] == capacity and list(b) == sorted(set(b)) and 1 <= len(b) <= KEY_BUCKETS
    assert all(x % KEY_BUCKET_ALIGN == 0 for x in b[:-1])
    assert all(hi <= KEY_BUCKET_RATIO * lo for lo, hi in zip(b, b[1:]))
    for length in range(1, capacity + 1, max(1, capacity // 997)):
        span = length_bucket(length, capacity)
        assert span >= length and span in b and all(x < length for x in b if x < span)
        assert length <= b[0] or span <= KEY_BUCKET_RATIO * length


def _flash_inputs(poison: bool = False):
    g = torch.Generator().manual_seed(3)
    q = torch.randn(4, 1, 6, 16, generator=g)
    store_k = torch.randn(4, 3, 40, 16, generator=g)  # (b, H, S, D) as the static storage
    store_v = torch.randn(4, 3, 40, 16, generator=g)
    seqlens = torch.tensor([1, 17, 40, 29], dtype=torch.int32)
    if poison:  # what the rows do not hold
        held = torch.arange(40)[None, :] < seqlens[:, None].long()
        store_k = store_k.masked_fill(~held[:, None, :, None], float("nan"))
        store_v = store_v.masked_fill(~held[:, None, :, None], float("nan"))
    return q, store_k.transpose(1, 2), store_v.transpose(1, 2), seqlens  # flash-attn's (b, S, H, D) views


def test_flash_decode_is_the_flash_contract_and_reads_only_held_slots():
    q, k, v, seqlens = _flash_inputs()
    got = torch.ops.vase.flash_decode(q, k, v, seqlens, 0.25)
    want = ref.flash_attn_with_kvcache(q, k, v, cache_seqlens=seqlens, softmax_scale=0.25, causal=True)
    assert got.shape == q.shape and got.is_contiguous()
    assert (got - want).abs().max() <= 8 * torch.finfo(torch.float32).eps
    exact = flash_decode_reference(q.double(), k.double(), v.double(), seqlens, 0.25)
    assert (got.double() - exact).abs().max() <= 64 * torch.finfo(torch.float32).eps
    poisoned = torch.ops.vase.flash_decode(*_flash_inputs(poison=True), 0.25)
    assert torch.equal(poisoned, got)  # NaN beyond each row's length never reached the output
    wrong = seqlens.clone()
    wrong[1] += 1  # one slot too many: the check can fail
    assert not torch.equal(torch.ops.vase.flash_decode(q, k, v, wrong, 0.25), got)
    with pytest.raises(ValueError, match="cache_seqlens must be int32"):
        flash_decode_reference(q, k, v, seqlens.long(), 0.25)


def test_flash_decode_opcheck_and_compiles_in_a_full_graph():
    q, k, v, seqlens = _flash_inputs()
    torch.library.opcheck(flash_decode, (q, k, v, seqlens, 0.25))  # fake impl, schema, AOT dispatch

    def step(q, k, v, seqlens):
        return torch.ops.vase.flash_decode(q * 2, k, v, seqlens, 0.25) + 1

    torch._dynamo.reset()
    counter = CountingBackend()
    out = torch.compile(step, fullgraph=True, dynamic=False, backend=counter)(q, k, v, seqlens)
    assert len(counter.graphs) == 1
    targets = [str(n.target) for n in counter.graphs[0].graph.nodes if n.op == "call_function"]
    assert "vase.flash_decode" in targets, targets  # the operator itself, in the graph
    assert torch.equal(out, step(q, k, v, seqlens))
    torch._dynamo.reset()
    aot = torch.compile(step, fullgraph=True, dynamic=False, backend="aot_eager")(q, k, v, seqlens)
    assert torch.equal(aot, out)


def _check(report, *, steady_max: float, longest_max: float) -> None:
    assert len(report.steps) >= 300
    assert sum(s.live == ROWS for s in report.steps) >= 100, "too few steps with every row live"
    assert len({s.longest for s in report.steps}) > 10, "the rows should hold different lengths"
    assert all(s.given > 0 and s.held > 0 for s in report.steps)
    assert report.ratio(steady=True) <= steady_max, report.ratio(steady=True)
    assert report.ratio_to_longest(steady=True) <= longest_max, report.ratio_to_longest(steady=True)
    old = sum(s.rows * report.capacity * report.token_bytes for s in report.steps)  # the whole capacity
    assert sum(s.given for s in report.steps) < old


def test_bytes_read_eager_full(model):
    full = staggered_decode(model, load_policy("full"), "full", compiled=False, rows=ROWS)
    _check(full, steady_max=2.0, longest_max=1.25)
    assert full.ratio(steady=True) > 1.25  # the rows' spread of lengths: what padded SDPA cannot avoid (documented)
    assert {s.key_slots for s in full.steps} <= set(full.key_buckets) and len(full.key_buckets) > 4


def test_bytes_read_compiled_vase_dkv(model):
    dkv = staggered_decode(model, load_policy("vase_dkv"), "vase_dkv", compiled=True, rows=ROWS)
    _check(dkv, steady_max=1.25, longest_max=1.25)
    met = {(s.rows, s.key_slots) for s in dkv.steps}
    assert 1 <= dkv.graphs <= len(met) <= len(row_buckets(ROWS)) * len(dkv.key_buckets)


@pytest.mark.slow  # eager against compiled: tokens equal (test_compiled checks it for vase_dkv in the default suite)
def test_bytes_read_eager_vase_dkv_equals_compiled(model):
    eager = staggered_decode(model, load_policy("vase_dkv"), "vase_dkv", compiled=False, rows=ROWS)
    dkv = staggered_decode(model, load_policy("vase_dkv"), "vase_dkv", compiled=True, rows=ROWS)
    _check(eager, steady_max=1.25, longest_max=1.25)
    assert dkv.tokens == eager.tokens


@pytest.mark.slow  # 60 s: the compiled full cache (the fast twin above runs it eager, and vase_dkv compiled)
def test_bytes_read_compiled_full(model):
    eager = staggered_decode(model, load_policy("full"), "full", compiled=False, rows=ROWS)
    full = staggered_decode(model, load_policy("full"), "full", compiled=True, rows=ROWS)
    _check(full, steady_max=2.0, longest_max=1.25)
    assert full.tokens == eager.tokens
    met = {(s.rows, s.key_slots) for s in full.steps}
    assert 1 <= full.graphs <= len(met) <= len(row_buckets(ROWS)) * len(full.key_buckets)


@pytest.fixture
def cpu_flash(monkeypatch):
    """``flash_attn`` = tests/flash_attn_reference.py (the prefill's ``flash_attn_func``), the engine allowed to pick
    it on the CPU; the decode runs the ``vase::flash_decode`` operator's own CPU kernel."""
    ref.install(monkeypatch)


@pytest.mark.slow  # 90 s: eager and compiled; the operator itself is traced and checked in the default suite
def test_flash_attention_compiled_reads_exactly_what_rows_hold(model, cpu_flash):
    eager = staggered_decode(model, load_policy("full"), "full", compiled=False, rows=ROWS, attn_backend="flash_attn")
    comp = staggered_decode(model, load_policy("full"), "full", compiled=True, rows=ROWS, attn_backend="flash_attn")
    for r in (eager, comp):
        _check(r, steady_max=1.0, longest_max=1.0)
        assert r.key_buckets == (r.capacity,)  # one key bucket: flash reads cache_seqlens slots of the storage
    assert comp.tokens == eager.tokens
    assert 1 <= comp.graphs <= len(row_buckets(ROWS))
