"""The policy-declared eviction schedule (``evict_every``, ``compress_prefill``) and ``keep_prompt``, on the engine.

What must hold:
* the engine evicts exactly when the declared schedule says (a reference simulation of each row's held length), with
  rows of different prompts admitted mid-run (continuous batching);
* VaSE's scaffold (the default) is unchanged: the same held lengths as "held > budget and held % window == 0";
* the static capacity is never exceeded, and :func:`cache_capacity` bounds every schedule;
* eviction == masking: each step's logits equal the unmodified model's with a mask hiding what the row had evicted,
  for prefill compression, a period shorter than the window (overlapping window moves) and a pinned prompt;
* ``keep_prompt``: the prompt stays in the first slots, the budget counts it, the policy sees only generated
  candidates, a sample's tokens do not depend on the batch, and a prompt that does not fit is refused up front.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from baselines.random import RandomEviction, RandomKeepPrompt
from baselines.rkv_original import RKVOriginal
from baselines.snapkv import SnapKV
from vase.engine import Decoder, Request, SamplingConfig, generate
from vase.engine.attention import eager_attention
from vase.engine.cache import VaseCache, cache_capacity
from vase.engine.policy import EvictionInputs
from vase.models import tiny_model
from vase.policies.attnv import VaSEAttnV


def prompts(lengths, vocab: int = 256) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, vocab, (n,), generator=g) for n in lengths]


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen3", num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2)


# ---- the schedule as a reference simulation ------------------------------------------------------------------------


def ref_held(prompt_len: int, steps: int, budget: int, every: int, compress_prefill: bool) -> list[tuple[int, bool]]:
    """``[(held after step k, evicted at step k)]`` for k = 0 (the prefill) .. steps, by the declared rule: evict when
    held > budget and the sequence length (prompt + tokens appended) is a multiple of ``every``."""
    held, length = prompt_len, prompt_len
    out = [(held, False)]
    if compress_prefill and held > budget:
        out = [(budget, True)]
        held = budget
    for _ in range(steps):
        held += 1
        length += 1
        evict = held > budget and length % every == 0
        if evict:
            held = budget
        out.append((held, evict))
    return out


def ref_vase_scaffold(prompt_len: int, steps: int, budget: int, window: int) -> list[int]:
    """VaSE's scaffold as method.md §2 words it: held > budget and held % window == 0."""
    held, out = prompt_len, [prompt_len]
    for _ in range(steps):
        held += 1
        if held > budget and held % window == 0:
            held = budget
        out.append(held)
    return out


@pytest.mark.parametrize("prompt_len", [1, 7, 31, 32, 33, 40, 57, 100])
def test_default_schedule_is_vase_scaffold(prompt_len):
    policy = RandomEviction(budget=32, window=8)
    want = ref_vase_scaffold(prompt_len, 120, 32, 8)
    assert [h for h, _ in ref_held(prompt_len, 120, 32, 8, False)] == want
    assert [policy.held_after(prompt_len, s) for s in range(121)] == want


@pytest.mark.parametrize("compress", [False, True])
@pytest.mark.parametrize("every,window,budget", [(8, 8, 32), (12, 8, 24), (4, 8, 24), (128, 8, 64), (5, 4, 20)])
def test_capacity_bounds_every_schedule(every, window, budget, compress):
    policy = RandomEviction(budget=budget, window=window, evict_every=every, compress_prefill=compress)
    for prompt_len in [1, 5, budget - 1, budget, budget + 1, budget + 3 * every + 2, 3 * budget]:
        for new in [1, 7, 300]:
            cap = cache_capacity(policy, prompt_len, new)
            sim = ref_held(prompt_len, new - 1, budget, every, compress)  # the last token is never appended
            most = max([prompt_len] + [h for h, _ in sim[1:]])  # the prefill writes the whole prompt
            # held after a step's append, before its eviction
            appended = [sim[k][0] + 1 for k in range(len(sim) - 1)]
            assert cap >= max([most, *appended]), (prompt_len, new)
            if compress and new == 300:  # tight: the row does reach budget + every (or the prompt's length)
                assert cap == max(prompt_len, budget + every)
            assert [policy.held_after(prompt_len, s) for s in range(new)] == [h for h, _ in sim]


def _record_prefill(monkeypatch, into: dict) -> None:
    """Record each admitted row's held positions per layer right after its prefill (and any prefill compression)."""
    original = VaseCache.end_prefill

    def end_prefill(self, prompt_len):
        slots = list(self.prefilling)
        original(self, prompt_len)
        for r in slots:
            held = [layer.positions[r, :, : self.lengths[r]].clone() for layer in self.layers]
            into[self.row_ids[r]] = {"held": self.lengths[r], "positions": held, "prompt_len": prompt_len}

    monkeypatch.setattr(VaseCache, "end_prefill", end_prefill)


def _decode(model, policy, reqs, rows, new, **kw):
    cap = max(cache_capacity(policy, len(r.prompt_ids), new) for r in reqs)
    dec = Decoder(model, policy, rows=rows, capacity=cap, max_new_tokens=new, ignore_eos=True, **kw)
    return dec, {(f.key, f.sample): f for f in dec.run(reqs)}


@pytest.mark.parametrize(
    "policy",
    [
        RandomEviction(budget=24, window=8, evict_every=12, compress_prefill=True),
        RandomEviction(budget=24, window=8, evict_every=4),
        RandomEviction(budget=24, window=8),
        RKVOriginal(budget=24, window=4, evict_every=10),
    ],
    ids=["every12-prefill", "every4", "vase", "rkv_original"],
)
def test_engine_evicts_exactly_on_the_declared_schedule(model, policy, monkeypatch):
    """Rows of 4 prompts (some longer than the budget), 2 rows in flight: each row's held length after every step,
    and the steps it evicts at, are the reference simulation's; the capacity is never exceeded."""
    after_prefill: dict = {}
    _record_prefill(monkeypatch, after_prefill)
    seen: dict = {}
    holder: dict = {}

    def on_step(info):
        cache = holder["cache"]
        assert max(cache.lengths[: info.active_rows]) <= cache.geometry.capacity
        for j, rid in enumerate(info.rows):
            seen.setdefault(rid, []).append((cache.lengths[j], j in info.evicted_rows))

    lengths = (9, 40, 23, 61)
    reqs = [Request(p, [3 + i], key=i) for i, p in enumerate(prompts(lengths))]
    new = 45
    dec, done = _decode(
        model,
        policy,
        reqs,
        rows=2,
        new=new,
        sampling=SamplingConfig(temperature=1.0),
        check_policy_output=True,
        on_cache=lambda c: holder.__setitem__("cache", c),
        on_step=on_step,
    )
    assert dec.geometry.capacity == max(cache_capacity(policy, n, new) for n in lengths)
    for i, p in enumerate(lengths):
        rid = (i, 0)
        want = ref_held(p, new - 1, policy.budget, policy.eviction_period, policy.compress_prefill)
        assert (after_prefill[rid]["held"], False) == (want[0][0], False)
        got = seen[rid][: new - 1]
        assert got == want[1:], (p, [k for k, (a, b) in enumerate(zip(got, want[1:])) if a != b][:3])
        assert done[rid].stats["evictions"] == policy_evictions(want, dec)
        if policy.compress_prefill and p > policy.budget:  # compressed at the prefill, true positions kept
            for held in after_prefill[rid]["positions"]:
                assert held.shape[-1] == policy.budget and (held < p).all()
                window = torch.arange(p - policy.window, p).expand(held.shape[0], -1)
                assert torch.equal(held[:, -policy.window :], window)


def policy_evictions(want, dec) -> int:
    """Eviction calls the stats count for a row: one per layer per eviction (the prefill's and the last step's
    included)."""
    return sum(e for _, e in want) * dec.geometry.num_layers


# ---- eviction == masking --------------------------------------------------------------------------------------------
_MASKS: dict[int, torch.Tensor] = {}


def _masked_reference_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    mask = _MASKS[module.layer_idx]  # (1, H, L, L) bool
    groups = query.shape[1] // key.shape[1]
    out = eager_attention(query, key, value, scaling, causal=False, mask=mask.repeat_interleave(groups, dim=1))
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register("vase_test_masked_schedule", _masked_reference_attention)
AttentionMaskInterface.register("vase_test_masked_schedule", lambda *a, **k: None)


def assert_eviction_equals_masking(model, policy, lengths, rows, new, monkeypatch) -> dict:
    """Decode ``lengths`` prompts with ``rows`` rows in flight; each sample's logits at every step must equal the
    unmodified model on its whole sequence with a per-(layer, KV head) mask of what its row held before that step
    (what its prefill left, then what each step's eviction left). Returns the per-row held positions."""
    after_prefill: dict = {}
    _record_prefill(monkeypatch, after_prefill)
    snaps: dict = {}
    logits: dict = {}
    holder: dict = {}
    step_logits: dict = {}

    def on_step(info):
        cache = holder["cache"]
        for j, rid in enumerate(info.rows):
            logits.setdefault(rid, []).append(step_logits[info.step][j].clone())
            held = [layer.positions[j, :, : cache.lengths[j]].clone() for layer in cache.layers]
            snaps.setdefault(rid, {})[len(logits[rid])] = held

    reqs = [Request(p, [7 + i], key=i) for i, p in enumerate(prompts(lengths))]
    _, done = _decode(
        model,
        policy,
        reqs,
        rows=rows,
        new=new,
        sampling=SamplingConfig(temperature=1.0),
        check_policy_output=True,
        on_cache=lambda c: holder.__setitem__("cache", c),
        on_step=on_step,
        on_logits=lambda s, lg: step_logits.__setitem__(s, lg),
    )
    heads = model.config.num_key_value_heads
    for r in reqs:
        rid = (r.key, 0)
        f = done[rid]
        assert f.stats["evictions"] > 0
        snaps[rid][0] = after_prefill[rid]["positions"]
        p = len(r.prompt_ids)
        total = p + new - 1
        seq = torch.cat([r.prompt_ids, torch.tensor(f.tokens[: new - 1])]).view(1, -1)
        for li in range(model.config.num_hidden_layers):
            mask = torch.zeros(1, heads, total, total, dtype=torch.bool)
            mask[:, :, :p, :p] = torch.ones(p, p, dtype=torch.bool).tril()  # the prefill attends to the whole prompt
            for i in range(p, total):  # the token fed at the row's decode step i - p + 1 attends to what it held
                mask[0, :, i].scatter_(-1, snaps[rid][i - p][li], True)
                mask[:, :, i, i] = True
            _MASKS[li] = mask
        model.set_attn_implementation("vase_test_masked_schedule")
        try:
            ref = model(input_ids=seq, position_ids=torch.arange(total).view(1, -1)).logits[0]
        finally:
            model.set_attn_implementation("sdpa")
        for step in range(1, new):
            diff = (logits[rid][step - 1] - ref[p + step - 1]).abs().max().item()
            assert diff <= 1e-4, (rid, step, diff)
    return snaps


@pytest.mark.parametrize(
    "policy",
    [
        RandomEviction(budget=24, window=8, evict_every=12, compress_prefill=True),
        RandomEviction(budget=24, window=8, evict_every=3),  # evicts 3 < window tokens: overlapping window moves
        RKVOriginal(budget=24, window=4, evict_every=10),
    ],
    ids=["prefill-compression", "period-below-window", "rkv_original"],
)
def test_eviction_equals_masking_under_declared_schedules(model, policy, monkeypatch):
    assert_eviction_equals_masking(model, policy, (9, 37, 21), rows=2, new=40, monkeypatch=monkeypatch)


class _OverlappingCopies(TorchDispatchMode):
    """Records every ``copy_`` whose source and destination share elements (undefined on CUDA, where the elements are
    copied in parallel; on the CPU it happens to work, so only recording it catches it)."""

    def __init__(self):
        super().__init__()
        self.found: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.copy_.default:
            dst, src = args[0], args[1]
            same = (dst.storage_offset(), dst.stride(), dst.shape) == (src.storage_offset(), src.stride(), src.shape)
            if dst.untyped_storage().data_ptr() == src.untyped_storage().data_ptr() and not same:  # a self-copy is safe
                if _offsets(dst) & _offsets(src):
                    self.found.append((tuple(dst.shape), dst.storage_offset(), src.storage_offset()))
        return func(*args, **(kwargs or {}))


def _offsets(t: torch.Tensor) -> set[int]:
    """The storage offsets of every element of ``t``."""
    off = torch.tensor(t.storage_offset())
    for size, stride in zip(t.shape, t.stride()):
        off = (off.unsqueeze(-1) + torch.arange(size) * stride).flatten()
    return set(off.tolist())


def test_window_move_never_copies_overlapping_memory(model):
    """A period below the window evicts fewer tokens than the window holds: its move must read a copy."""
    policy = RandomEviction(budget=24, window=8, evict_every=3)
    mode = _OverlappingCopies()
    with mode:
        out = generate(model, prompts((30,))[0], policy, max_new_tokens=14, ignore_eos=True)
    assert out.stats["evictions"] > 2 * model.config.num_hidden_layers
    assert mode.found == []


# ---- keep_prompt ----------------------------------------------------------------------------------------------------
KEEP_LENGTHS = (9, 21, 14, 17)  # with window 8, each leaves room in budget 32


KEEPERS = [RandomKeepPrompt(budget=32, window=8), SnapKV(budget=32, window=8, keep_prompt=True)]


@pytest.mark.parametrize("policy", KEEPERS, ids=["random", "snapkv"])
def test_keep_prompt_pins_the_prompt_and_equals_masking(model, policy, monkeypatch):
    snaps = assert_eviction_equals_masking(model, policy, KEEP_LENGTHS[:3], rows=2, new=50, monkeypatch=monkeypatch)
    for key, p in enumerate(KEEP_LENGTHS[:3]):
        for step, layers in snaps[(key, 0)].items():
            for held in layers:
                assert held.shape[-1] <= policy.budget + policy.window
                assert torch.equal(held[:, :p], torch.arange(p).expand(held.shape[0], p)), (key, step)


@dataclass
class _Recording(RandomEviction):
    """Random eviction that records what each keep() call is handed."""

    name: ClassVar[str] = "recording"
    calls: ClassVar[list] = []

    def keep(self, inputs: EvictionInputs) -> torch.Tensor:
        # one call folds every layer into the rows (row i: sequence i // L, layer i % L); recorded per layer, as the
        # engine's on_evict reports it
        layers = int(inputs.layer_ids.max()) + 1
        for li in range(layers):
            rows = inputs.layer_ids == li
            self.calls.append((inputs.positions[rows].clone(), inputs.n_keep, inputs.window_keys[rows].shape))
        return super().keep(inputs)


def test_keep_prompt_policy_sees_only_generated_candidates(model):
    policy = _Recording(budget=32, window=8, keep_prompt=True)
    _Recording.calls = []
    evicted: list = []
    reqs = [Request(p, [1 + i, 50 + i], key=i) for i, p in enumerate(prompts(KEEP_LENGTHS))]

    def attach(cache):
        cache.on_evict = lambda layer, rids, keep, kept_p: evicted.append((rids, kept_p.clone()))

    _decode(model, policy, reqs, rows=3, new=60, sampling=SamplingConfig(temperature=1.0), on_cache=attach)
    assert len(_Recording.calls) == len(evicted) > 0
    for (positions, n_keep, wshape), (rids, kept_p) in zip(_Recording.calls, evicted):
        for j, (key, _) in enumerate(rids):
            p = KEEP_LENGTHS[key]
            assert n_keep == policy.budget - policy.window - p  # the budget counts the prompt
            assert (positions[j] >= p).all(), "a prompt token was a candidate"
            assert (kept_p[j] >= p).all()
        assert wshape[2] == policy.window
    assert len({n for _, n, _ in _Recording.calls}) > 1  # rows with different prompts were called apart


@pytest.mark.parametrize("name", ["random_keep_prompt", "snapkv_keep_prompt"])
def test_keep_prompt_tokens_do_not_depend_on_the_batch(model, name):
    policy = RandomKeepPrompt(budget=32, window=8) if name == "random_keep_prompt" else None
    policy = policy or SnapKV(budget=32, window=8, keep_prompt=True)
    eos = range(0, 12)
    reqs = [Request(p, [100 + i, 200 + i], key=i) for i, p in enumerate(prompts(KEEP_LENGTHS))]
    sampling = SamplingConfig(temperature=1.0, top_p=0.95, top_k=50)
    cap = max(cache_capacity(policy, len(r.prompt_ids), 60) for r in reqs)
    dec = Decoder(model, policy, rows=3, capacity=cap, sampling=sampling, max_new_tokens=60, eos_token_ids=eos)
    batched = {(f.key, f.sample): f for f in dec.run(reqs)}
    assert sum(f.stats["evictions"] for f in batched.values()) > 0
    for r in reqs:
        for s, seed in enumerate(r.seeds):
            alone = generate(
                model, r.prompt_ids, policy, seeds=[seed], sampling=sampling, max_new_tokens=60, eos_token_ids=eos
            )
            assert batched[(r.key, s)].tokens == alone.tokens[0], (r.key, s)


def test_keep_prompt_refuses_a_prompt_that_does_not_fit(model):
    policy = RandomKeepPrompt(budget=32, window=8)
    policy.check_prompt(23)  # 23 + 8 leaves 1 of 32
    with pytest.raises(ValueError, match=r"^policy\.keep_prompt: a prompt of 24 tokens plus window=8 leaves 0 of "):
        policy.check_prompt(24)
    attnv = VaSEAttnV(budget=64, window=8, keep_prompt=True)  # 16 protected slots among the generated tokens
    attnv.check_prompt(40)
    with pytest.raises(ValueError, match=r"needs >= 16; raise budget to >= 72 \(budget=72: a multiple of the window"):
        attnv.check_prompt(42)  # 42 + 8 + 16 = 66, up to a multiple of the window, where 18 slots are protected
    VaSEAttnV(budget=72, window=8, keep_prompt=True).check_prompt(42)  # the hint is accepted
    RandomEviction(budget=32, window=8).check_prompt(500)  # without keep_prompt, any prompt
    dec = Decoder(model, policy, rows=2, capacity=200, max_new_tokens=10)
    ran = []
    with pytest.raises(ValueError, match="policy.keep_prompt"):
        for f in dec.run([Request(prompts((10,))[0], [1], key="fits"), Request(prompts((30,))[0], [2], key="long")]):
            ran.append(f)
    assert ran == [] and dec.stats.prefills == 0  # refused before anything was decoded


def test_engine_options_are_recorded_only_when_set():
    base = SnapKV(budget=32, window=8).describe()
    assert not {"keep_prompt", "evict_every", "compress_prefill"} & set(base)  # earlier runs' protocols unchanged
    assert SnapKV(budget=32, window=8, keep_prompt=True).describe()["keep_prompt"] is True
    assert RandomEviction(budget=32, window=8, evict_every=16).describe()["evict_every"] == 16
    rkv = RKVOriginal(budget=64).describe()  # its class sets the schedule: recorded
    assert (rkv["evict_every"], rkv["compress_prefill"], "keep_prompt" in rkv) == (128, True, False)


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("evict_every", 0, "policy.evict_every: must be an integer >= 1 or null"),
        ("keep_prompt", "yes", "policy.keep_prompt: must be true or false"),
        ("compress_prefill", 1, "policy.compress_prefill: must be true or false"),
    ],
)
def test_engine_options_are_validated(field, value, message):
    with pytest.raises(ValueError, match=message):
        RandomEviction(budget=32, window=8, **{field: value})


# ---- the runner ------------------------------------------------------------------------------------------------------
RUN = [
    "model=tiny",
    "task=gsm_symbolic",
    "logger=none",
    "limit=1",
    "n_samples=2",
    "budget=32",
    "window=16",
    "generation.max_length=200",
    "progress=false",
]


def _compose(overrides: list[str]):
    from hydra import compose, initialize_config_dir

    conf = Path(__file__).resolve().parents[1] / "conf"
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        return compose(config_name="config", overrides=overrides)


def test_runner_refuses_keep_prompt_before_writing_anything(tmp_path):
    from vase.run.runner import run

    with pytest.raises(ValueError, match=r"^policy\.keep_prompt: a prompt of \d+ tokens plus window=16 leaves"):
        run(_compose([*RUN, "policy=random_keep_prompt", f"results_dir={tmp_path}"]), progress=False)
    assert list(tmp_path.iterdir()) == []


def test_runner_records_the_declared_schedule(tmp_path):
    """rkv_original end to end: its schedule is in the protocol, and each sample's held_tokens_end follows it."""
    import json

    from vase.run.results import read_jsonl_tolerant
    from vase.run.runner import run

    cfg = _compose([*RUN, "policy=rkv_original", "policy.evict_every=24", f"results_dir={tmp_path}"])
    metrics = run(cfg, progress=False)
    assert metrics["complete"] and metrics["evictions"] > 0
    run_dir = Path(metrics["run_dir"])
    policy = json.loads((run_dir / "protocol.json").read_text())["policy"]
    assert (policy["name"], policy["window"], policy["evict_every"], policy["compress_prefill"]) == (
        "rkv_original",
        8,
        24,
        True,
    )
    rkv = RKVOriginal(budget=32, evict_every=24)
    for row in read_jsonl_tolerant(run_dir / "samples.jsonl"):
        p, n = row["prompt_tokens"], row["output_tokens"]
        assert row["held_tokens_end"] == rkv.held_after(p, n - 1) + 1 <= 32 + 24
