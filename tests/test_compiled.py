"""The compiled decode step (``generation.compile``), proven on the CPU.

What must hold (issue 26):

* No recompiles: ``torch.compile(fullgraph=True)`` of the decode forward over a >= 300-step staggered
  continuous-batching run (prompts of different lengths, rows ending at EOS at different steps and new problems taking
  their slots, evictions at different steps) compiles at most one graph per (bucket of live rows, key-length bucket)
  it meets (``vase.engine.cache.key_buckets``), never breaks a graph
  (``fullgraph=True`` raises on one), and every sample's tokens equal the eager run's in float32; for the selection
  policies (Quest, SeerAttention-R) their attended-token counts too.
* The check can fail: the old step (K/V sliced to the longest row, a guard on host state) is caught.
* CUDA-graph preconditions: the buffers the step reads and writes keep their storage addresses at every step, and the
  graph's inputs are tensors only.
* One plan per bucket: the decode's SDPA calls have at most as many distinct shapes as there are (row, key) buckets.

The graphs are counted with a backend that returns the traced graph itself (``gm.forward``): what is checked here is
what dynamo guards on and traces, which is independent of the code generator; one test runs inductor (slow).
"""

from __future__ import annotations

import re

import pytest
import torch
import torch._dynamo
from torch.utils._python_dispatch import TorchDispatchMode

import vase.engine.compiled as compiled
from tests.test_continuous import MODEL, load_policy, prompts
from vase.engine import Decoder, Request, SamplingConfig, sample_seeds
from vase.engine.attention import SDPA_KERNELS, decompose_composite
from vase.engine.cache import cache_capacity, key_buckets, row_bucket, row_buckets
from vase.engine.compiled import compile_choice, static_inputs
from vase.engine.layer import VaseLayer
from vase.models import tiny_model

ROWS = 5  # buckets 1, 2, 4, 5
FAST = ["vase_dkv", "quest"]
SLOW = ["full", "vase_attnv", "snapkv", "rkv_original", "seer_attention_r"]  # SeerAttention-R: random 8-token gates
SAMPLING = SamplingConfig(temperature=1.0, top_p=0.95, top_k=50)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return tiny_model("qwen3", **MODEL)


class GraphCounter:
    """A ``torch.compile`` backend that records each graph dynamo hands it (one per compile or recompile)."""

    def __init__(self) -> None:
        self.graphs: list[torch.fx.GraphModule] = []
        self.inputs_tensors_only = True

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        self.graphs.append(gm)
        self.inputs_tensors_only &= all(isinstance(x, torch.Tensor) for x in example_inputs)
        return gm.forward


class SdpaShapes(TorchDispatchMode):
    """Records the input shapes of every SDPA kernel call made while ``dec.cache.prefilling is None`` (decode)."""

    def __init__(self, dec: Decoder) -> None:
        super().__init__()
        self.dec, self.shapes = dec, set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = decompose_composite(self, func, args, kwargs)
        if out is not NotImplemented:
            return out
        if func.overloadpacket.__name__ in SDPA_KERNELS and self.dec.cache.prefilling is None:
            self.shapes.add(tuple(tuple(a.shape) for a in args[:3]))
        return func(*args, **kwargs)


def sdpa_shapes(graphs: list[torch.fx.GraphModule]) -> set:
    """The distinct (query, key) shapes of the SDPA calls in traced graphs (each graph has fixed shapes)."""
    shapes = set()
    for gm in graphs:
        for node in gm.graph.nodes:
            if node.op == "call_function" and "scaled_dot_product" in str(node.target):
                q, k = (a.meta["example_value"].shape for a in node.args[:2])
                shapes.add((tuple(q), tuple(k)))
    return shapes


def staggered(model, name: str, compile: str, backend=None, on_step=None, steps_at_least: int = 300):
    """A continuous-batching decode: 6 prompts x 2 samples, 5 rows, EOS ends rows early, new problems take slots."""
    torch._dynamo.reset()
    policy = load_policy(name)
    reqs = [Request(p, sample_seeds(100 + i, 2), key=i) for i, p in enumerate(prompts((11, 27, 19, 40, 9, 33, 14, 22)))]
    max_new = 160
    cap = max(cache_capacity(policy, len(r.prompt_ids), max_new) for r in reqs)
    buckets: set[tuple[int, int]] = set()  # (row bucket, key length) of every step
    addresses: list[dict] = []

    def step(info):
        buckets.add((row_bucket(info.active_rows, ROWS), dec.cache.step_length))
        addresses.append(static_inputs(dec.cache))
        if on_step is not None:
            on_step(dec, info)

    dec = Decoder(
        model,
        policy,
        rows=ROWS,
        capacity=cap,
        sampling=SAMPLING,
        max_new_tokens=max_new,
        eos_token_ids=range(0, 2),
        on_step=step,
        compile=compile,
        compile_backend=backend,
    )
    with pytest.MonkeyPatch.context() as mp:
        # every bucket the live rows pass through is compiled (a run's drain keeps a compiled bucket over a tiny one,
        # vase.engine.compiled.drain_bucket; tests/test_capture.py): the padding of every bucket is proven here
        mp.setattr(compiled, "DRAIN_SHRINK", 1)
        mp.setattr(compiled, "MIN_STEPS", 0)
        done = {(f.key, f.sample): f for f in dec.run(reqs)}
    assert dec.stats.decode_steps >= steps_at_least, dec.stats.decode_steps
    return dec, done, buckets, addresses


def check_compiled(model, name: str) -> None:
    eager, want, _, _ = staggered(model, name, "off")
    counter = GraphCounter()
    dec, got, buckets, addresses = staggered(model, name, "on", backend=counter)
    assert dec.compiled and dec.cache.bucketed
    # the first forward of each bucket is timed as the compile (throughput.jsonl, metrics.json: compile_seconds)
    assert dec.stats.compiled_buckets == len(buckets) and 0 < dec.stats.compile_seconds < dec.stats.decode_seconds
    assert eager.stats.compiled_buckets == 0 and eager.stats.compile_seconds == 0.0
    assert len(buckets) > 2, buckets  # the run crossed several buckets
    assert 1 <= len(counter.graphs) <= len(buckets), (len(counter.graphs), sorted(buckets))
    assert counter.inputs_tensors_only
    assert len(sdpa_shapes(counter.graphs)) <= len(buckets)
    assert all(a == addresses[0] for a in addresses), "a buffer of the compiled step moved"
    assert {k: f.tokens for k, f in got.items()} == {k: f.tokens for k, f in want.items()}
    kind = dec.policy.kind
    assert kind != "eviction" or sum(f.stats["evictions"] for f in want.values()) > 0
    if kind == "selection":  # the selection was at work (fewer tokens attended than held), the same when compiled
        assert any(f.stats["attended_tokens"] < f.stats["held_tokens"] for f in want.values())
        assert {k: f.stats["attended_tokens"] for k, f in got.items()} == {
            k: f.stats["attended_tokens"] for k, f in want.items()
        }
    assert {f.finish_reason for f in got.values()} >= {"eos"}


@pytest.mark.parametrize("name", FAST)
def test_compiled_decode_one_graph_per_bucket(model, name):
    check_compiled(model, name)


@pytest.mark.slow
@pytest.mark.parametrize("name", SLOW)
def test_compiled_decode_one_graph_per_bucket_slow(model, name):
    check_compiled(model, name)


@pytest.mark.slow  # shown once; the no-recompile tests stay in the default suite
def test_a_guard_on_host_state_is_caught(model, monkeypatch):
    """The old decode step (K/V sliced to the longest row's host length) recompiles at every new length: caught."""
    original = VaseLayer.update

    def sliced(self, key_states, value_states, *args, **kwargs):
        k, v = original(self, key_states, value_states, *args, **kwargs)
        if self.owner.prefilling is not None:
            return k, v
        length = self.owner.max_length_after_append  # per-row host state read inside the compiled step
        return k[:, :, :length], v[:, :, :length]

    monkeypatch.setattr(VaseLayer, "update", sliced)
    counter = GraphCounter()
    with pytest.raises(torch._dynamo.exc.FailOnRecompileLimitHit):  # fullgraph=True: a hard failure, not a fallback
        staggered(model, "vase_dkv", "on", backend=counter, steps_at_least=1)
    assert len(counter.graphs) > len(row_buckets(ROWS))


def test_decode_sdpa_shapes_one_per_bucket(model):
    """Over a 300-step staggered decode the SDPA calls take one shape per number of rows and key-length bucket, never
    one per step: the key length is always one of ``key_buckets(capacity)`` (one cuDNN plan per bucket when compiled,
    see ``check_compiled``)."""
    policy = load_policy("vase_dkv")
    reqs = [Request(p, sample_seeds(100 + i, 2), key=i) for i, p in enumerate(prompts((11, 27, 19, 40, 9, 33, 14, 22)))]
    cap = max(cache_capacity(policy, len(r.prompt_ids), 128) for r in reqs)
    live: set[tuple[int, int]] = set()
    dec = Decoder(
        model,
        policy,
        rows=ROWS,
        capacity=cap,
        sampling=SAMPLING,
        max_new_tokens=128,
        eos_token_ids=range(0, 3),
        on_step=lambda info: live.add((info.active_rows, dec.cache.step_length)),
    )
    rec = SdpaShapes(dec)
    with rec:
        list(dec.run(reqs))
    assert dec.stats.decode_steps >= 300
    assert len({rows for rows, _ in live}) > 2
    assert 1 <= len(rec.shapes) <= len(live), (rec.shapes, live)
    assert {shapes[1][2] for shapes in rec.shapes} <= set(key_buckets(cap))
    assert len({shapes[1][2] for shapes in rec.shapes}) > 1  # the key length follows the longest row


def test_compile_choice_rules():
    cpu = torch.device("cpu")
    assert compile_choice("off", cpu, load_policy("vase_dkv"), 10_000) == (False, "off: set explicitly")
    on, why = compile_choice("auto", cpu, load_policy("quest"), 10_000)
    assert not on and "off on cpu" in why  # the CPU rule, not the policy: selection policies compile
    with pytest.raises(ValueError, match="generation.compile: must be one of"):
        compile_choice("sometimes", cpu, load_policy("full"), 10)
    on, why = compile_choice("auto", cpu, load_policy("full"), 100_000)
    assert not on and "off on cpu" in why
    cuda = torch.device("cuda")
    on, why = compile_choice("auto", cuda, load_policy("full"), 16)
    assert not on and "amortise" in why
    for name in ("vase_dkv", "quest", "seer_attention_r"):
        on, why = compile_choice("auto", cuda, load_policy(name), 4096)
        assert on and why.startswith("auto: on"), (name, why)
    assert compile_choice("on", cuda, load_policy("vase_dkv"), 4096) == (True, "on: set explicitly")


#: aten ops that only make a view (no kernel launch on CUDA)
VIEW_OPS = {"slice", "unsqueeze", "view", "select", "expand", "alias", "_unsafe_view", "t", "transpose", "as_strided"}


def test_sampling_launches_at_qwen3_4b_shapes():
    """Eager sampling of 16 rows over Qwen3-4B's 151,936-token vocabulary (top-k 20, top-p 0.95, T = 0.6) launches at
    most 80 kernels (77 measured; 100 before the round keys' two chains were computed together, the same samples);
    the compiled step samples inside its graph, fused (next test)."""
    from vase.engine.attention import _OpNames
    from vase.engine.rng import RowRNG
    from vase.engine.sampling import sample_tokens

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(16, 151_936, generator=g)
    rng = RowRNG(torch.randint(0, 2**32, (16, 2), generator=g), torch.arange(16) + 1000)
    with torch.inference_mode(), _OpNames() as rec:
        sample_tokens(logits, SamplingConfig(temperature=0.6, top_p=0.95, top_k=20), rng)
    launches = [op for op in rec.ops if op not in VIEW_OPS]
    assert len(launches) <= 80, len(launches)


def _kernel_calls(code: str) -> list[str]:
    """The kernel launches of inductor's generated ``call()``: its fused kernels and the aten / extern fallbacks."""
    body = code[code.index("def call(") :]
    calls = []
    for line in body.splitlines()[1:]:
        if line and not line.startswith(" "):
            break  # the end of call()
        s = line.strip()
        if re.match(r"(\w+ = )?(cpp_fused_\w+|triton_\w+|extern_kernels\.\w+|torch\.ops\.aten\.\w+)", s):
            calls.append(s.split("(")[0])
    return calls


@pytest.mark.slow
def test_compiled_sampling_launches_at_qwen3_4b_shapes():
    """The compiled step samples inside its graph (``Decoder._decode_forward``): the same sampling of 16 rows over
    Qwen3-4B's vocabulary, compiled by inductor with ``fullgraph=True``, is at most 30 kernel launches (4 on this
    CPU: top-k, one fused kernel for the scaling and softmax, cumsum, one fused kernel for top-p, the counter-based
    hash, the race and the gather) and draws exactly the eager tokens."""
    from torch._inductor.utils import run_and_get_code

    from vase.engine.rng import RowRNG
    from vase.engine.sampling import sample_tokens

    cfg = SamplingConfig(temperature=0.6, top_p=0.95, top_k=20)

    def sample(logits, key, pos):
        return sample_tokens(logits, cfg, RowRNG(key, pos))

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(16, 151_936, generator=g)
    key = torch.randint(0, 2**32, (16, 2), generator=g)
    pos = torch.arange(16) + 1000
    torch._dynamo.reset()
    compiled = torch.compile(sample, fullgraph=True, dynamic=False)
    tokens, codes = run_and_get_code(compiled, logits, key, pos)
    calls = [c for code in codes for c in _kernel_calls(code)]
    assert 0 < len(calls) <= 30, calls
    assert torch.equal(tokens, sample(logits, key, pos))
