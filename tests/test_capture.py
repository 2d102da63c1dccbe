"""CUDA-graph capture preconditions as inductor sees them, proven on the CPU (issue 36, item 1).

Cudagraph trees capture a compiled graph only when every input the graph mutates is a *static input* (an index in the
``static_input_idxs`` inductor is handed); otherwise they log ``skipping cudagraphs due to mutated inputs`` and run the
plain compiled function at every step. Those indices come from AOTAutograd's metadata
(``torch/_inductor/compile_fx.py``: ``get_static_input_idxs`` reads ``fw_metadata.static_input_indices``); when two
mutated graph inputs alias one storage (``keys[:, 0]`` and ``keys[:, 1]`` lifted as separate inputs), AOTAutograd
merges them into a *synthetic base* (``_functorch/_aot_autograd/runtime_wrappers.py``: ``merge_view_inputs``) and the
metadata it rebuilds (``input_output_analysis.py``: ``create_synthetic_base_metadata``) has no static inputs at all.

The test pushes the real decode step (the :class:`~vase.engine.Decoder`'s compiled forward, the function the runner
compiles) through ``torch._inductor.compile_fx.compile_fx`` with ``triton.cudagraphs=True`` and a recording
``inner_compile`` that generates no code: it records what inductor would be handed (``static_input_idxs``, the
graph's inputs and which of them it mutates) and runs the functionalised graph eagerly, so the decode goes on and its
tokens are compared with the eager decoder's.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch._dynamo
from torch._functorch import config as functorch_config
from torch._functorch.aot_autograd import make_boxed_func
from torch._inductor import config as inductor_config
from torch._inductor.compile_fx import compile_fx

from tests.policy_configs import load_small
from tests.test_continuous import MODEL, load_policy, prompts
from vase.engine import Decoder, Request, SamplingConfig, sample_seeds
from vase.engine.cache import cache_capacity
from vase.engine.capture import NO_REASON, BucketCapture, CaptureWatch, merge_reports, observe, verdict
from vase.engine.compiled import MIN_STEPS, drain_bucket, inductor_cache_dir, own_dynamo_cache
from vase.models import tiny_model

ROWS = 2
SAMPLING = SamplingConfig(temperature=1.0, top_p=0.95, top_k=50)
SLOW = pytest.mark.slow  # ~1 min each on the 2-core machine; vase_dkv on qwen3 stays in the default suite
QWEN3 = ["vase_dkv"] + [pytest.param(n, marks=SLOW) for n in ("full", "vase_attnv", "quest", "seer_attention_r")]
HYBRID = [pytest.param(a, marks=SLOW) for a in ("qwen3_5", "gpt_oss")]


def mutated_inputs(gm: torch.fx.GraphModule) -> list[int]:
    """Indices of the placeholders of an AOTAutograd inference graph that it writes: with input mutations kept in
    the graph, every write to an input is an ``aten.copy_`` into the placeholder (the graph's epilogue)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    index = {n: i for i, n in enumerate(placeholders)}
    out = set()
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is torch.ops.aten.copy_.default and node.args[0] in index:
            out.add(index[node.args[0]])
    return sorted(out)


class CaptureRecorder:
    """A ``torch.compile`` backend: inductor's ``compile_fx`` with CUDA graphs on and a recording ``inner_compile``.

    ``records``: one dict per graph: ``static`` (the ``static_input_idxs`` inductor is handed), ``mutated`` (the
    graph inputs it writes), ``dynamo_inputs`` / ``graph_inputs`` (the inputs dynamo lifted and the ones the
    inference graph takes: fewer when AOTAutograd merged aliased inputs into a synthetic base), ``cudagraphs``.
    """

    def __init__(self) -> None:
        self.records: list[dict] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        n_dynamo = len(example_inputs)
        names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]  # dynamo's sources, in the inputs' order

        def inner_compile(graph: torch.fx.GraphModule, inputs, **kwargs):
            self.records.append(
                {
                    "static": sorted(kwargs.get("static_input_idxs") or ()),
                    "mutated": mutated_inputs(graph),
                    "dynamo_inputs": n_dynamo,
                    "graph_inputs": len(inputs),
                    "cudagraphs": bool(kwargs.get("cudagraphs")),
                    "names": names,
                }
            )
            return make_boxed_func(graph.forward)  # no code generation: the functional graph runs eagerly

        patches = {"triton.cudagraphs": True, "fx_graph_cache": False}
        with inductor_config.patch(patches), functorch_config.patch({"enable_autograd_cache": False}):
            return compile_fx(gm, example_inputs, inner_compile=inner_compile)


def run(model, policy, compile: str, backend=None, rows: int = ROWS):
    torch._dynamo.reset()
    reqs = [Request(p, sample_seeds(7 + i, 2), key=i) for i, p in enumerate(prompts((11, 27)))]
    max_new = 12
    cap = max(cache_capacity(policy, len(r.prompt_ids), max_new) for r in reqs)
    dec = Decoder(
        model,
        policy,
        rows=rows,
        capacity=cap,
        sampling=SAMPLING,
        max_new_tokens=max_new,
        compile=compile,
        compile_backend=backend,
    )
    done = {(f.key, f.sample): f.tokens for f in dec.run(reqs)}
    return dec, done


def check_capture(model, policy) -> None:
    _, want = run(model, policy, "off")
    rec = CaptureRecorder()
    dec, got = run(model, policy, "on", rec)
    assert dec.compiled and rec.records, "nothing was compiled"
    for r in rec.records:
        assert r["cudagraphs"]
        assert r["mutated"], r  # the step writes its cache in place
        assert r["graph_inputs"] == r["dynamo_inputs"], f"aliased inputs merged into a synthetic base: {r}"
        missing = sorted(set(r["mutated"]) - set(r["static"]))
        assert not missing, f"mutated inputs {missing} are not static (static_input_idxs={r['static']}): {r}"
    assert got == want


@pytest.fixture(scope="module")
def qwen3():
    return tiny_model("qwen3", **MODEL)


@pytest.mark.parametrize("name", QWEN3)
def test_every_mutated_input_is_static_qwen3(qwen3, name):
    check_capture(qwen3, load_policy(name))


@pytest.mark.parametrize("arch", HYBRID)
def test_every_mutated_input_is_static_hybrid(arch):
    layers = 4 if arch == "qwen3_5" else 2  # qwen3_5: linear, full, linear, full; gpt_oss: sliding, full
    model = tiny_model(arch, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=layers)
    check_capture(model, load_small("vase_dkv", 16, 8, model=model))


# ---- many compiled decoders in one process (issue 36, item 2) ---------------------------------------------------


class GraphCounter:
    """A ``torch.compile`` backend that counts the graphs dynamo hands it and runs them as traced."""

    def __init__(self) -> None:
        self.graphs = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        self.graphs += 1
        return gm.forward


def test_a_new_compiled_decoder_resets_dynamo_once():
    """The fast twin of the test below: dynamo is reset when a compiled decoder other than the last one starts, and
    only then (the same decoder's next run keeps its graphs)."""

    class Dec:  # any object: own_dynamo_cache keeps a weak reference to the decoder that compiled last
        pass

    a, b = Dec(), Dec()
    own_dynamo_cache(a)
    calls = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch._dynamo, "reset", lambda: calls.append(1))
        assert not own_dynamo_cache(a) and calls == []
        assert own_dynamo_cache(b) and calls == [1]
        assert not own_dynamo_cache(b) and calls == [1]
        del b  # a dead decoder's graphs are dropped too
        assert own_dynamo_cache(Dec()) and calls == [1, 1]


@pytest.mark.slow  # ~60 s of CPU (six dynamo traces); its fast twin is the test above
def test_many_compiled_decoders_in_one_process(qwen3):
    """Per-problem batching (a decoder per problem, each of its own capacity) then an in-process sweep over budgets
    (a decoder per cell): six compiled decoders of six capacities in one process, more graphs than one decoder's
    recompile budget, none hitting dynamo's limit, every sample equal to the eager decoder's. (The old code, without
    the reset per decoder, raised ``FailOnRecompileLimitHit`` at the third decoder of this sequence.)"""
    torch._dynamo.reset()
    max_new = 40  # capacities min(P + 40, max(P, budget) + 8): 40, 43, 58 per problem; 24, 32, 53 in the sweep
    cells = [(load_policy("vase_dkv"), [p]) for p in prompts((9, 35, 50))]  # per_problem: one decoder per problem
    cells += [(load_policy("vase_dkv", budget=b), prompts((9, 13))) for b in (16, 24, 48)]  # a sweep over budgets
    capacities = set()
    counter = GraphCounter()
    # the limit at one decoder's budget (compile_forward raises it to its buckets + 1 = 4)
    with torch._dynamo.config.patch(recompile_limit=1):
        for i, (policy, ps) in enumerate(cells):
            reqs = [Request(p, sample_seeds(3 + i, 4 // len(ps)), key=i) for i, p in enumerate(ps)]
            cap = max(cache_capacity(policy, len(r.prompt_ids), max_new) for r in reqs)
            capacities.add(cap)
            want, got = ({}, {})
            for compile, out in (("off", want), ("on", got)):
                dec = Decoder(
                    qwen3,
                    policy,
                    rows=4,
                    capacity=cap,
                    sampling=SAMPLING,
                    max_new_tokens=max_new,
                    eos_token_ids=range(24),  # rows end at different steps: the live rows shrink through the buckets
                    compile=compile,
                    compile_backend=counter if compile == "on" else None,
                )
                out.update({(f.key, f.sample): f.tokens for f in dec.run(reqs)})
            assert dec.compiled and dec.stats.compiled_buckets >= 1
            assert got == want, i
        assert counter.graphs >= len(cells) > torch._dynamo.config.recompile_limit
    assert len(capacities) >= 5, capacities


# ---- capture reporting (issue 36, item 3) -------------------------------------------------------------------------


def test_observe_counts_warmup_record_replay_and_a_skip():
    b = BucketCapture(4)
    for state in ("WARMUP", "RECORDING", "EXECUTION", "EXECUTION"):
        observe(b, 0, [], state)
    assert (b.forwards, b.warmups, b.recorded, b.replayed, b.skipped, b.reason) == (4, 1, 1, 2, 0, None)
    assert verdict("on", b) is None and verdict("auto", b) is None
    s = BucketCapture(8)
    observe(s, 1, ["skipping cudagraphs due to mutated inputs (2 instances)"], None)
    observe(s, 0, [], "EXECUTION")  # the tree manager's state is another bucket's: not this one's replay
    assert (s.forwards, s.replayed, s.skipped) == (2, 0, 1)
    assert s.reason == "skipping cudagraphs due to mutated inputs (2 instances)"
    with pytest.raises(RuntimeError, match=r"compile=on: .*bucket of 8 rows: skipping cudagraphs due to mutated"):
        verdict("on", s)
    assert "runs the compiled step without CUDA graphs" in verdict("auto", s)
    observe(u := BucketCapture(2), 1, [], None)
    assert u.reason == NO_REASON


def skipping_backend(reason: str):
    """A backend that reports a CUDA-graph skip the way torch does (its own function: the counter and the logged
    reason) and runs the graph as traced."""
    from torch._inductor.cudagraph_utils import log_cudagraph_skip_and_bump_counter

    def backend(gm, example_inputs):
        log_cudagraph_skip_and_bump_counter(reason)
        return gm.forward

    return backend


@pytest.mark.parametrize("setting", ["on", True])  # True: YAML's ``compile: true``
def test_an_injected_skip_is_an_error_with_compile_on(qwen3, setting):
    """``generation.compile=on``: torch's skip (counted and logged while the bucket compiles) stops the decode with
    torch's reason; nothing is decoded silently without graphs."""
    torch._dynamo.reset()
    reason = "skipping cudagraphs due to mutated inputs (3 instances)"
    with pytest.raises(RuntimeError, match=r"generation.compile=on: CUDA graphs were not captured .*mutated inputs"):
        run(qwen3, load_policy("vase_dkv"), setting, skipping_backend(reason))


def test_an_injected_skip_is_one_warning_with_auto(caplog):
    """``auto``: one warning line per skipped bucket, whatever the number of its forwards, and the report says so."""
    watch = CaptureWatch(torch.device("cpu"), "auto")
    reason = "skipping cudagraphs due to cpu device (arg3_1)"
    from torch._inductor.cudagraph_utils import log_cudagraph_skip_and_bump_counter

    with caplog.at_level(logging.WARNING, logger="vase.engine.capture"):
        for i in range(3):
            with watch.forward(4):
                if i == 0:
                    log_cudagraph_skip_and_bump_counter(reason)
            with watch.forward(2):
                pass
    lines = [r.getMessage() for r in caplog.records if r.name == "vase.engine.capture"]
    assert len(lines) == 1 and "bucket of 4 rows" in lines[0] and reason in lines[0]
    report = {b["rows"]: b for b in watch.report()}
    assert report[4]["skipped"] == 1 and report[4]["reason"] == reason and report[4]["forwards"] == 3
    assert report[2]["skipped"] == 0 and report[2]["reason"] is None  # on the CPU nothing is recorded or replayed
    assert merge_reports([watch.report(), watch.report()])[1]["forwards"] == 6


# ---- compile cost (issue 36, item 4) -----------------------------------------------------------------------------


def test_drain_bucket():
    many = MIN_STEPS
    assert drain_bucket(16, 9, {16}, many) == 16  # compiled already
    assert drain_bucket(8, 5, {16}, many) == 16  # half the compiled bucket: padding, no compile
    assert drain_bucket(4, 3, {16}, many) == 4  # a quarter, with tokens left to pay for it: compiled
    assert drain_bucket(4, 3, {16}, MIN_STEPS - 1) == 16  # too few tokens left
    assert drain_bucket(2, 2, {16, 4}, many) == 4  # the smallest compiled bucket that holds the rows
    assert drain_bucket(2, 2, set(), many) == 2  # nothing compiled yet


def test_the_drain_compiles_no_tiny_bucket(qwen3):
    """A run whose last rows end one by one: the compiled step keeps the bucket it has (few tokens left), and the
    compile seconds are reported per bucket."""
    torch._dynamo.reset()
    counter = GraphCounter()
    policy = load_policy("vase_dkv")
    reqs = [Request(p, sample_seeds(11, 1), key=i, max_new_tokens=4 + 6 * i) for i, p in enumerate(prompts())]
    cap = max(cache_capacity(policy, len(r.prompt_ids), 40) for r in reqs)
    dec = Decoder(qwen3, policy, rows=4, capacity=cap, max_new_tokens=40, compile="on", compile_backend=counter)
    list(dec.run(reqs))
    report = dec.compile_report()["buckets"]
    # one row bucket (the drain compiled none smaller); one graph per key-length bucket the rows reached
    assert [b["rows"] for b in report] == [4] and {rows for rows, _ in dec._buckets_seen} == {4}
    assert counter.graphs == len(dec._buckets_seen)
    assert report[0]["forwards"] == dec.stats.decode_steps and report[0]["compile_seconds"] > 0


def test_inductor_cache_under_the_model_cache(monkeypatch, tmp_path):
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setenv("VASE_CACHE", str(tmp_path))
    assert inductor_cache_dir() == str(tmp_path / "inductor")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/somewhere/mine")  # a user's own is kept
    assert inductor_cache_dir() == "/somewhere/mine"
