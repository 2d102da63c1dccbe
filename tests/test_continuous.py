"""Continuous batching on the static cache: rows of many problems (different prompt lengths) share one cache.

What must hold (issue: continuous batching):
* a sample's tokens are identical whether it is decoded alone or among rows of other problems that join and leave;
* eviction == masking when rows of different lengths evict at different steps;
* storage is allocated once (data_ptr unchanged while problems join and leave; bytes = rows x capacity);
* numerical failures end one sample (``nonfinite``), never the decode; prompts with no room end as
  ``prompt_too_long``.
"""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path

import pytest
import torch
from hydra.utils import instantiate
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from tests.policy_configs import ALL_CONFIGS, calibrate, small_config
from tests.seer_reference import write_random_gates
from vase.engine import Decoder, Request, SamplingConfig, generate, sample_seeds
from vase.engine.attention import eager_attention
from vase.engine.cache import cache_capacity
from vase.models import tiny_config, tiny_model

#: configs whose samples differ between a batch and alone on this CPU (found when the matrix was widened to every
#: config, issue 28; the same on main before it). Cause, measured for both: a decode step's K/V differ in
#: the last bit (~5e-7) between 3 rows and 1 row in flight (the projections' GEMM rounds differently with the batch
#: size), and at one eviction two candidates' scores are close enough for that to swap them; the other configs pass
#: because no near-tie happens on these prompts. An open engine bug (bitwise batch invariance), not a property.
KNOWN_BATCH_DEPENDENT = {
    "curdkv_original": "sample (1, 0) diverges after 14 tokens: K/V rounding with the batch size flips a near-tie",
    "snapkv_protect": "sample (1, 0) diverges after 31 tokens: K/V rounding with the batch size flips a near-tie",
}
POLICIES = [  # every conf/policy/*.yaml
    pytest.param(n, marks=pytest.mark.xfail(reason=KNOWN_BATCH_DEPENDENT[n], strict=False))
    if n in KNOWN_BATCH_DEPENDENT
    else n
    for n in ALL_CONFIGS
]
BUDGET, WINDOW = 32, 8
MODEL = dict(num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2)
_GATES = tempfile.TemporaryDirectory()


def load_policy(name: str, budget: int = BUDGET, window: int = WINDOW):
    """Config ``name`` for the 2-layer model (:func:`tests.policy_configs.small_config`: Quest's pages of 8 and one
    dense layer, a long declared period scaled down); random SeerAttention-R gates of 8-token blocks; a pinned prompt
    (up to 40 tokens here) gets a budget it fits in; TriAttention calibrated on the model."""
    cfg = small_config(name, budget, window, n_layers=MODEL["num_hidden_layers"])
    if cfg.get("keep_prompt"):
        cfg.budget = 64
    if "gate_path" in cfg:  # random gates of the model's geometry, 8-token blocks
        gates = Path(_GATES.name) / "gates"
        if not gates.exists():
            write_random_gates(gates, tiny_config("qwen3", **MODEL), block_size=8)
        cfg.gate_path, cfg.block_size = str(gates), 8
    policy = instantiate(cfg)
    if policy.calibration_input() is not None:
        calibrate(policy, _calibration_model())
    return policy


@functools.cache
def _calibration_model():
    return tiny_model("qwen3", **MODEL)  # the same weights as the ``model`` fixture (tiny models are seeded)


def prompts(lengths=(11, 27, 19, 40), vocab: int = 256) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, vocab, (n,), generator=g) for n in lengths]


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen3", **MODEL)


def decode_all(model, policy, reqs, rows, max_new, sampling, eos=(), **kw):
    cap = max(cache_capacity(policy, len(r.prompt_ids), max_new) for r in reqs)
    dec = Decoder(
        model, policy, rows=rows, capacity=cap, sampling=sampling, max_new_tokens=max_new, eos_token_ids=eos, **kw
    )
    return dec, {(f.key, f.sample): f for f in dec.run(reqs)}


@pytest.mark.parametrize(
    "greedy", [pytest.param(True, marks=pytest.mark.slow), False], ids=["greedy", "sampled"]
)  # sampled, the stricter (every row draws): for every config by default; greedy with make test-slow
@pytest.mark.parametrize("name", POLICIES)
def test_sample_tokens_do_not_depend_on_the_batch(model, name, greedy):
    """fp32, same seeds: each sample decoded alone == decoded among rows of 4 prompts of different lengths, with
    3 rows in flight for 8 samples (rows finish at EOS at different steps, and new problems take their slots)."""
    policy = load_policy(name)
    sampling = SamplingConfig(temperature=0) if greedy else SamplingConfig(temperature=1.0, top_p=0.95, top_k=50)
    eos = range(0, 12)  # ends some samples early, so slots free up at different steps
    reqs = [Request(p, sample_seeds(100 + i, 2), key=i) for i, p in enumerate(prompts())]
    _, batched = decode_all(model, policy, reqs, rows=3, max_new=60, sampling=sampling, eos=eos)
    assert len(batched) == 8
    lengths = {len(f.tokens) for f in batched.values()}
    assert len(lengths) > 1, "the samples should end at different steps"
    if load_policy(name).kind == "eviction":
        assert sum(f.stats["evictions"] for f in batched.values()) > 0
    for r in reqs:
        for s, seed in enumerate(r.seeds):
            alone = generate(
                model,
                r.prompt_ids,
                load_policy(name),
                n_samples=1,
                seeds=[seed],
                sampling=sampling,
                max_new_tokens=60,
                eos_token_ids=eos,
            )
            got = batched[(r.key, s)]
            assert got.tokens == alone.tokens[0], (r.key, s)
            assert got.finish_reason == alone.finish_reasons[0]
            assert got.stats["evictions"] == alone.stats["evictions"]


# ---- eviction == masking with rows out of step ----------------------------------------------------------------------
_MASKS: dict[int, torch.Tensor] = {}


def _masked_reference_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    mask = _MASKS[module.layer_idx]  # (1, H, L, L) bool
    groups = query.shape[1] // key.shape[1]
    out = eager_attention(query, key, value, scaling, causal=False, mask=mask.repeat_interleave(groups, dim=1))
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register("vase_test_masked_cb", _masked_reference_attention)
AttentionMaskInterface.register("vase_test_masked_cb", lambda *a, **k: None)


def test_eviction_equals_masking_with_rows_of_different_lengths(model):
    """Three prompts of different lengths, two rows in flight: rows evict at different steps. Each step's logits of
    each sample equal the unmodified model on that sample's whole sequence with a per-(layer, KV head) mask hiding
    exactly what its row had evicted before that step."""
    policy = load_policy("random", budget=24, window=8)
    new = 50
    reqs = [Request(p, [7 + i], key=i) for i, p in enumerate(prompts((9, 21, 14)))]
    snaps: dict[tuple, dict[int, list[torch.Tensor]]] = {}  # (key, sample) -> step count -> per-layer held positions
    logits: dict[tuple, list[torch.Tensor]] = {}
    holder: dict = {}
    step_logits: dict[int, torch.Tensor] = {}

    def on_step(info):
        cache = holder["cache"]
        if info.evicted_rows and len(info.evicted_rows) < info.active_rows:
            holder["partial"] = True  # some rows evicted at this step, others did not
        for j, rid in enumerate(info.rows):
            logits.setdefault(rid, []).append(step_logits[info.step][j].clone())
            held = [layer.positions[j, :, : cache.lengths[j]].clone() for layer in cache.layers]
            snaps.setdefault(rid, {})[len(logits[rid])] = held

    _, done = decode_all(
        model,
        policy,
        reqs,
        rows=2,
        max_new=new,
        sampling=SamplingConfig(temperature=1.0),
        ignore_eos=True,
        check_policy_output=True,
        on_cache=lambda c: holder.__setitem__("cache", c),
        on_step=on_step,
        on_logits=lambda s, lg: step_logits.__setitem__(s, lg),
    )
    assert holder.get("partial"), "the rows should evict at different steps"
    for r in reqs:
        rid = (r.key, 0)
        f = done[rid]
        assert f.stats["evictions"] > 0
        p = len(r.prompt_ids)
        total = p + new - 1
        seq = torch.cat([r.prompt_ids, torch.tensor(f.tokens[: new - 1])]).view(1, -1)
        heads = model.config.num_key_value_heads
        for li in range(model.config.num_hidden_layers):
            mask = torch.zeros(1, heads, total, total, dtype=torch.bool)
            mask[:, :, :p, :p] = torch.ones(p, p, dtype=torch.bool).tril()
            for i in range(p, total):  # the token fed at the row's decode step i - p + 1
                step = i - p
                if step == 0:
                    mask[:, :, i, : i + 1] = True
                else:
                    mask[0, :, i].scatter_(-1, snaps[rid][step][li], True)
                    mask[:, :, i, i] = True
            _MASKS[li] = mask
        model.set_attn_implementation("vase_test_masked_cb")
        try:
            ref = model(input_ids=seq, position_ids=torch.arange(total).view(1, -1)).logits[0]
        finally:
            model.set_attn_implementation("sdpa")
        for step in range(1, new):
            diff = (logits[rid][step - 1] - ref[p + step - 1]).abs().max().item()
            assert diff <= 2e-5 * max(1.0, ref[p + step - 1].abs().max().item()), (rid, step, diff)  # fp32 rounding


# ---- static memory ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["snapkv", "quest", "full"])
def test_storage_allocated_once_while_problems_join_and_leave(model, name):
    policy = load_policy(name)
    ptrs, live = set(), []
    holder: dict = {}

    def on_step(info):
        cache = holder["cache"]
        live.append(info.active_rows)
        ptrs.add(
            tuple(
                (layer.keys.data_ptr(), layer.values.data_ptr(), layer.positions.data_ptr()) for layer in cache.layers
            )
        )  # noqa: E501

    reqs = [Request(p, sample_seeds(i, 2), key=i) for i, p in enumerate(prompts((8, 30, 17, 25, 12, 33)))]
    dec, done = decode_all(
        model,
        policy,
        reqs,
        rows=4,
        max_new=40,
        sampling=SamplingConfig(temperature=1.0),
        eos=range(0, 16),
        on_cache=lambda c: holder.__setitem__("cache", c),
        on_step=on_step,
    )
    assert len(done) == 12 and dec.stats.prefills >= 6
    assert len(ptrs) == 1, "storage was re-allocated"
    assert max(live) == 4 and len(set(live)) > 1  # rows left and joined
    g = dec.geometry
    assert dec.cache.kv_bytes() == g.kv_bytes == 4 * g.capacity * g.bytes_per_token
    for layer in dec.cache.layers:
        assert layer.keys.shape == (4, model.config.num_key_value_heads, g.capacity, g.head_dim)


def test_rows_are_compacted_when_nothing_is_pending(model):
    """Without pending work, finished rows leave: the live rows shrink to the survivors (no idle row computes)."""
    live = []
    reqs = [Request(p, [i], key=i) for i, p in enumerate(prompts((8, 12, 16)))]
    decode_all(
        model,
        load_policy("snapkv"),
        reqs,
        rows=3,
        max_new=40,
        sampling=SamplingConfig(temperature=1.0),
        eos=range(0, 24),
        on_step=lambda info: live.append(info.active_rows),
    )
    assert live == sorted(live, reverse=True) and live[-1] < 3


# ---- failures end one sample, never the decode ---------------------------------------------------------------------
def test_nonfinite_logits_end_that_sample_only(model):
    """NaN logits in one row: that sample ends ``nonfinite`` (its tokens kept up to the failure); the others are
    exactly what they are without the fault, and the scrubbed slot serves the next problem."""
    reqs = [Request(p, [3 + i], key=i) for i, p in enumerate(prompts((10, 15, 20)))]
    sampling = SamplingConfig(temperature=0)
    _, clean = decode_all(model, load_policy("snapkv"), reqs, rows=2, max_new=30, sampling=sampling, ignore_eos=True)
    holder: dict = {"step": 0}

    def poison(module, args, output):  # a fault at decode step 5 in the row holding problem 0
        cache = holder["cache"]
        if cache.prefilling is None:
            holder["step"] += 1
            if holder["step"] == 5:
                j = [rid[0] for rid in cache.row_ids[: cache.n_live]].index(0)
                output[j] = float("nan")
        return output

    handle = model.lm_head.register_forward_hook(poison)
    try:
        _, faulty = decode_all(
            model,
            load_policy("snapkv"),
            reqs,
            rows=2,
            max_new=30,
            sampling=sampling,
            ignore_eos=True,
            on_cache=lambda c: holder.__setitem__("cache", c),
        )
    finally:
        handle.remove()
    bad = faulty[(0, 0)]
    assert bad.finish_reason == "nonfinite" and bad.tokens == clean[(0, 0)].tokens[:5]
    for key in ((1, 0), (2, 0)):
        assert faulty[key].finish_reason == "length" and faulty[key].tokens == clean[key].tokens


def test_prompt_without_room_ends_as_prompt_too_long(model):
    ps = prompts((10, 30))
    policy = load_policy("full")
    dec = Decoder(model, policy, rows=2, capacity=32, max_length=32, sampling=SamplingConfig(temperature=0))
    done = {f.key: f for f in dec.run([Request(ps[0], [1], key="short"), Request(ps[1], [2, 3], key="long")])}
    assert done["short"].finish_reason == "length" and len(done["short"].tokens) == 22
    long = [f for f in dec.run([Request(ps[1], [2, 3], key="long", max_new_tokens=1)])]
    assert [f.finish_reason for f in long] == ["length", "length"]
    dec2 = Decoder(model, policy, rows=2, capacity=40, max_length=30, sampling=SamplingConfig(temperature=0))
    out = list(dec2.run([Request(ps[1], [2, 3], key="long")]))
    assert [f.finish_reason for f in out] == ["prompt_too_long"] * 2 and all(f.tokens == [] for f in out)


def test_a_request_that_does_not_fit_the_cache_is_refused_before_decoding(model):
    dec = Decoder(model, load_policy("full"), rows=2, capacity=20, max_new_tokens=16)
    with pytest.raises(ValueError, match="cache slots per row"):
        list(dec.run([Request(prompts((10,))[0], [1])]))


# ---- the FlashAttention-2 path against a reference of flash_attn's contract (CPU) -------------------------------
@pytest.fixture
def fake_flash(monkeypatch):
    """``flash_attn`` = tests/flash_attn_reference.py, and the engine allowed to pick it on CPU."""
    from tests import flash_attn_reference as ref

    ref.install(monkeypatch)

    def flash_decode_cpu(q, k_cache, v_cache, cache_seqlens, scale):  # the vase::flash_decode op's CPU kernel
        return ref.flash_attn_with_kvcache(
            q, k_cache, v_cache, cache_seqlens=cache_seqlens, softmax_scale=scale, causal=True
        )

    monkeypatch.setattr("vase.engine.attention.flash_decode_reference", flash_decode_cpu)
    ref.calls.clear()
    return ref


def _logits_by_row(model, policy_name, backend, reqs, rows):
    out: dict = {}
    step_logits: dict = {}

    def on_step(info):
        for j, rid in enumerate(info.rows):
            out.setdefault(rid, []).append(step_logits[info.step][j].clone())

    _, done = decode_all(
        model,
        load_policy(policy_name),
        reqs,
        rows=rows,
        max_new=30,
        sampling=SamplingConfig(temperature=0),
        ignore_eos=True,
        attn_backend=backend,
        on_step=on_step,
        on_logits=lambda s, lg: step_logits.__setitem__(s, lg),
    )
    return out, done


@pytest.mark.parametrize("name", ["full", "snapkv", "quest", "seer_attention_r"])
def test_flash_attention_path_matches_sdpa_on_rows_of_different_lengths(model, fake_flash, name):
    reqs = [Request(p, [i], key=i) for i, p in enumerate(prompts((9, 26, 17)))]
    want, want_done = _logits_by_row(model, name, "sdpa", reqs, rows=2)
    got, got_done = _logits_by_row(model, name, "flash_attn", reqs, rows=2)
    fns = {c["fn"] for c in fake_flash.calls}
    selects = load_policy(name).kind == "selection"  # a step with a token subset runs SDPA with a mask
    assert fns == {"flash_attn_func", "flash_attn_with_kvcache"} or (selects and "flash_attn_func" in fns)
    seqlens = [c["seqlens"] for c in fake_flash.calls if c["fn"] == "flash_attn_with_kvcache"]
    # a selection policy that returns a mask at every step (SeerAttention-R once the keys span more blocks than its
    # budget, a run constant) runs every decode step through SDPA with its mask: no flash decode call to inspect
    assert any(len(set(s)) > 1 for s in seqlens) or (selects and not seqlens), "the rows should hold different lengths"
    for rid in want:
        assert got_done[rid].tokens == want_done[rid].tokens
        diff = max((a - b).abs().max().item() for a, b in zip(got[rid], want[rid]))
        assert diff <= 1e-5, (rid, diff)


def test_flash_attention_path_catches_a_length_bug(model, fake_flash, monkeypatch):
    """The comparison can fail: cache_seqlens one short (the new token left out) changes the logits."""
    from vase.engine.cache import VaseCache

    reqs = [Request(p, [i], key=i) for i, p in enumerate(prompts((9, 26)))]
    want, _ = _logits_by_row(model, "full", "sdpa", reqs, rows=2)
    monkeypatch.setattr(VaseCache, "seqlens_i32", lambda self: self.lengths_t[: self.n_live].to(torch.int32))
    got, _ = _logits_by_row(model, "full", "flash_attn", reqs, rows=2)
    assert max((a - b).abs().max().item() for rid in want for a, b in zip(got[rid], want[rid])) > 1e-3


def test_stop_when_ends_a_sample_as_a_loop(model):
    """``stop_when`` (the runner's stop_on_loop) is asked every 16 tokens; True ends the sample, the others go on."""
    reqs = [Request(p, [i], key=i) for i, p in enumerate(prompts((10, 15)))]
    seen = []

    def stop(tokens):
        seen.append(len(tokens))
        return len(tokens) >= 32 and tokens[0] == first[0]

    _, clean = decode_all(model, load_policy("snapkv"), reqs, rows=2, max_new=48, sampling=SamplingConfig(0))
    first = clean[(0, 0)].tokens
    _, done = decode_all(
        model, load_policy("snapkv"), reqs, rows=2, max_new=48, sampling=SamplingConfig(0), stop_when=stop
    )
    assert done[(0, 0)].finish_reason == "loop" and done[(0, 0)].tokens == first[:32]
    other_stopped = clean[(1, 0)].tokens[0] == first[0]
    assert other_stopped or (done[(1, 0)].finish_reason == "length" and done[(1, 0)].tokens == clean[(1, 0)].tokens)
    assert set(seen) <= {16, 32, 48} and 16 in seen


def test_loop_stop_fires_on_a_repeated_phrase_only():
    from transformers import AutoTokenizer

    from vase.models import qwen3_tokenizer_dir
    from vase.run.decoding import loop_stop

    tok = AutoTokenizer.from_pretrained(qwen3_tokenizer_dir())
    stop = loop_stop(tok)
    loop = tok("The answer is not yet known. " * 12, add_special_tokens=False)["input_ids"]
    prose = tok(
        "We first sort the list, then walk it once keeping the best pair seen so far; ties keep the earlier "
        "pair, and an empty list returns None, which the docstring's last example checks.",
        add_special_tokens=False,
    )["input_ids"]
    assert stop(loop) and not stop(prose)


@pytest.mark.parametrize("name", ["vase_dkv", "snapkv"])
def test_cpu_eviction_moves_in_pieces_exactly_as_in_one_call(model, name, monkeypatch):
    """On a CPU the event's gather and scatter run in pieces of whole folded rows (vase.engine.evict.CPU_MOVE_BYTES,
    a cache-sized working set): one folded row per piece gives every sample's tokens and every kept position of a
    staggered decode exactly as one call for the whole event."""
    import vase.engine.evict as evict

    reqs = [Request(p, sample_seeds(50 + i, 2), key=i) for i, p in enumerate(prompts())]
    kept = {}

    def run(move_bytes):
        monkeypatch.setattr(evict, "CPU_MOVE_BYTES", move_bytes)
        got = []

        def on_cache(cache):
            cache.on_evict = lambda layer, rows, keep, pos: got.append((layer.layer_idx, rows, pos.clone()))

        _, out = decode_all(model, load_policy(name), reqs, 5, 48, SamplingConfig(temperature=1.0), on_cache=on_cache)
        kept[move_bytes] = got
        return {key: list(f.tokens) for key, f in out.items()}

    assert run(1) == run(1 << 40)
    assert len(kept[1]) > 0 and len(kept[1]) == len(kept[1 << 40])
    for (la, ra, pa), (lb, rb, pb) in zip(kept[1], kept[1 << 40], strict=True):
        assert (la, ra) == (lb, rb) and torch.equal(pa, pb)
