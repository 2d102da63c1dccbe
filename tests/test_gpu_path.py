"""The CUDA hot path, proven on the CPU: no host synchronisation in a decode step, evicting or not.

1. :class:`SyncDetector` records every aten op of the real :meth:`vase.engine.Decoder.run` (a ``TorchDispatchMode``;
   composite ops decomposed, so ``inference_mode`` hides nothing) and the Python-level reads a dispatch mode cannot
   see on a CPU (``.tolist()``, ``.numpy()``, ``.cpu()``), tagged by decode step. Rows of different prompt lengths,
   evictions at different steps and in groups, ``sync_every=8``: for ``vase_attnv``, ``vase_dkv``, ``snapkv``,
   ``quest`` (and ``full``) no decode step syncs; the syncs are at the token reads and admissions only.
2. The detector can fail: an ``.item()`` injected into the eviction path is caught at exactly the evicting steps, a
   ``.tolist()`` in the sampling at every step.
3. The same steps with every tensor on the ``meta`` device (no data): any data-dependent op (``item``, ``tolist``,
   ``bool``, ``nonzero``, boolean indexing, ``equal``) and any device-to-host copy raises, and each host-to-device
   upload is a visible ``_to_copy``: one per group of rows that evicts together per step (not per layer), queued
   with ``non_blocking=True``. Why ``meta`` and not ``FakeTensorMode`` with a fake CUDA device: on this CPU-only
   torch 2.13 build, indexing a fake CUDA tensor (``THPVariable_getitem``, ``copy_``) constructs a CUDA
   ``DeviceGuard``, which the build does not have ("PyTorch is not linked with support for cuda devices";
   ``torch._C._ensureCUDADeviceGuardSet``, which FakeTensorMode calls for this, is a no-op in a CPU wheel), so a model
   forward cannot run on fake CUDA tensors here. The meta device has the property that matters (no data) and is not
   the CPU, so the engine takes its accelerator branches (uploads through :func:`vase.engine.cache.to_device`).
   What it does not cover: pinned host memory (no pinned allocator without CUDA; the branch is checked separately)
   and the CUDA-event timing (``EvictionClock`` uses the wall clock without CUDA).
4. Randomness: no stateful RNG op in a step; one batched draw per group of rows that evicts together, for all
   layers at once (the layer axis folded into the rows).
5. Weights load straight onto the device (``device_map``).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from torch.utils._python_dispatch import TorchDispatchMode

import vase.engine.cache as engine_cache
from tests.policy_configs import ALL_CONFIGS, CONF, load_small
from vase.engine import Decoder, Request, SamplingConfig
from vase.engine.attention import decompose_composite, vase_attention
from vase.engine.cache import VaseCache, cache_capacity
from vase.engine.decode import _Row
from vase.engine.rng import RowRNG
from vase.models import tiny_model

SYNC_POLICIES = ALL_CONFIGS  # every conf/policy/*.yaml
#: in the default suite: the paper's policies and one of each mechanism (selection, pinned prompt, TriAttention's
#: calibration, curdkv's and h2o's scores); every other config in -m slow (CI's time budget)
DEFAULT_SYNC = {"full", "vase_attnv", "vase_dkv", "snapkv", "rkv", "quest", "seer_attention_r", "curdkv",
                "random_keep_prompt", "triattention", "h2o"}  # fmt: skip
SYNC_CELLS = [n if n in DEFAULT_SYNC else pytest.param(n, marks=pytest.mark.slow) for n in SYNC_POLICIES]
BUDGET, WINDOW, SYNC_EVERY = 32, 8, 8
#: aten ops that make the host wait for the device (their result is read on the host or sizes an output)
SYNC_OPS = {
    "_local_scalar_dense",
    "item",
    "is_nonzero",
    "equal",
    "allclose",
    "nonzero",
    "argwhere",
    "masked_select",
    "unique",
    "_unique",
    "_unique2",
    "unique_consecutive",
    "unique_dim",
    "bincount",
    "histc",
    "multinomial",
}
RNG_OPS = {"exponential", "uniform", "normal", "random", "bernoulli", "rand", "randn", "randint", "randperm"}


def _device_of(x):
    return x.device if isinstance(x, torch.Tensor) else None


class SyncDetector(TorchDispatchMode):
    """Counts host syncs and ops per phase (``("step", k)`` inside decode step ``k``, ``"between"`` elsewhere).

    Syncs: the aten ops of :data:`SYNC_OPS`; indexing with a boolean mask (a hidden ``nonzero``); a
    ``repeat_interleave`` with tensor repeats and no ``output_size``; a copy from a non-CPU device to the CPU; and,
    patched at the Python level because they are invisible to a dispatch mode on a CPU, ``Tensor.tolist``,
    ``Tensor.numpy``, ``Tensor.cpu`` and ``torch.cuda.synchronize``.
    """

    def __init__(self, monkeypatch):
        super().__init__()
        self.phase: object = "between"
        self.syncs: dict[object, list[str]] = defaultdict(list)
        self.ops: dict[object, Counter] = defaultdict(Counter)
        self.uploads: dict[object, list[tuple]] = defaultdict(list)  # host-to-device copies: (shape, non_blocking)
        self.events: list[object] = []  # the order of steps and host reads
        detector = self

        def python_read(name, original):
            def read(self, *args, **kwargs):
                detector.syncs[detector.phase].append(name)
                if detector.phase == "between":
                    detector.events.append(name)
                return original(self, *args, **kwargs)

            return read

        for name in ("tolist", "numpy", "cpu"):
            monkeypatch.setattr(torch.Tensor, name, python_read(name, getattr(torch.Tensor, name)))
        monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: detector.syncs[detector.phase].append("sync"))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = decompose_composite(self, func, args, kwargs)
        if out is not NotImplemented:
            return out
        name = func.overloadpacket.__name__
        self.ops[self.phase][name] += 1
        why = self.sync_reason(name, args, kwargs)
        if why:
            self.syncs[self.phase].append(why)
        if name == "_to_copy" and _device_of(args[0]) is not None:
            dst = kwargs.get("device")
            if dst is not None and args[0].device.type == "cpu" and torch.device(dst).type != "cpu":
                self.uploads[self.phase].append((tuple(args[0].shape), bool(kwargs.get("non_blocking", False))))
        return func(*args, **kwargs)

    @staticmethod
    def sync_reason(name, args, kwargs) -> str | None:
        if name in SYNC_OPS:
            return name
        if name in ("index", "index_put", "index_put_", "_index_put_impl_"):
            indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
            if any(isinstance(t, torch.Tensor) and t.dtype == torch.bool for t in indices):
                return f"{name} with a boolean mask"
        if name == "repeat_interleave" and isinstance(args[0], torch.Tensor) and args[0].dtype == torch.long:
            if kwargs.get("output_size") is None and len(args) < 3:
                return "repeat_interleave with tensor repeats"
        if name in ("_to_copy", "copy_", "_copy_from"):
            src = args[1] if name == "copy_" else args[0]
            dst = kwargs.get("device") if name == "_to_copy" else _device_of(args[0] if name == "copy_" else args[1])
            if _device_of(src) is not None and dst is not None:
                if src.device.type != "cpu" and torch.device(dst).type == "cpu":
                    return "device-to-host copy"
        return None

    def step_syncs(self) -> dict:
        return {phase: s for phase, s in self.syncs.items() if phase != "between" and s}


def load_policy(name: str, model=None, tmp_path: Path | None = None):
    """Config ``name`` for the tiny model: Quest's pages of 8 and no dense layer (the model has two), a declared
    period longer than the window scaled down, SeerAttention-R's random gates and TriAttention's calibration on
    ``model`` (without it: TriAttention gets random centres, on the ``meta`` device)."""
    cfg = OmegaConf.load(CONF / f"{name}.yaml")
    overrides = {"dense_layers": 0} if "dense_layers" in cfg else {}
    budget = 48 if cfg.get("keep_prompt") else BUDGET  # a pinned prompt of up to 37 tokens leaves room
    policy = load_small(name, budget, WINDOW, model, tmp_path, **overrides)
    if model is None and policy.calibration_input() is not None:
        record = {"q_mean": torch.randn(2, 8, 8, 2), "q_abs": torch.rand(2, 8, 8) + 2, "attention_scaling": 1.0}
        policy.load_calibration({**record, "inv_freq": 1.0 / 10000.0 ** (torch.arange(8) / 8)}, device="meta")
    return policy


def evicts_in_step(policy) -> bool:
    """An eviction policy on VaSE's scaffold schedule (every ``window`` steps, nothing pinned or compressed at the
    prefill): its rows evict at the steps the tests below expect."""
    return (
        policy.kind == "eviction"
        and policy.eviction_period == WINDOW
        and not policy.keep_prompt
        and not policy.compress_prefill
    )


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen3", num_attention_heads=8, num_key_value_heads=2, num_hidden_layers=2)


def _requests():
    """Five prompts of different lengths, two samples each: rows evict at different steps, alone and in groups."""
    g = torch.Generator().manual_seed(11)
    return [
        Request(torch.randint(0, 256, (n,), generator=g), [10 * i, 10 * i + 1], key=i)
        for i, n in enumerate((9, 31, 18, 25, 14))
    ]


def run_detected(model, policy, monkeypatch, max_new: int = 48):
    """The real ``Decoder.run`` under a :class:`SyncDetector`; returns it and what each decode step did."""
    detector = SyncDetector(monkeypatch)
    steps: dict[int, dict] = {}
    original = Decoder._decode_step

    def tagged(self, n, pending):
        detector.phase = ("step", self.step + 1)
        detector.events.append(detector.phase)
        try:
            held, tok, evicted = original(self, n, pending)
        finally:
            detector.phase = "between"
        steps[self.step] = {"rows": n, "held": list(held), "evicted": list(evicted)}
        return held, tok, evicted

    monkeypatch.setattr(Decoder, "_decode_step", tagged)
    reqs = _requests()
    cap = max(cache_capacity(policy, len(r.prompt_ids), max_new) for r in reqs)
    dec = Decoder(
        model,
        policy,
        rows=4,
        capacity=cap,
        sampling=SamplingConfig(temperature=1.0, top_p=0.95, top_k=50),
        max_new_tokens=max_new,
        eos_token_ids=range(0, 6),  # some samples end early: slots are refilled at sync points
        sync_every=SYNC_EVERY,
    )
    with detector:
        done = list(dec.run(reqs))
    assert len(done) == 10
    return detector, steps, dec


def _segments(events) -> list[int]:
    """Decode steps between consecutive host reads."""
    runs, count = [], 0
    for e in events:
        if isinstance(e, tuple):
            count += 1
        elif count:
            runs.append(count)
            count = 0
    return runs


@pytest.mark.parametrize("name", SYNC_CELLS)
def test_no_host_sync_in_a_decode_step(model, name, monkeypatch, tmp_path):
    policy = load_policy(name, model, tmp_path)
    detector, steps, dec = run_detected(model, policy, monkeypatch)
    assert detector.step_syncs() == {}
    # the detector was live: the token reads and admissions between steps are seen
    assert "tolist" in detector.syncs["between"] and "_local_scalar_dense" in detector.syncs["between"]
    # tokens reach the host every sync_every steps (or sooner, when a row reaches its limit)
    runs = _segments(detector.events)
    assert max(runs) == SYNC_EVERY and all(r <= SYNC_EVERY for r in runs)
    # rows of different lengths; no stateful RNG in any step
    assert any(len(set(s["held"])) > 1 for s in steps.values())
    step_ops = sum((c for p, c in detector.ops.items() if p != "between"), Counter())
    assert not RNG_OPS & set(step_ops), RNG_OPS & set(step_ops)
    if policy.kind == "eviction":
        assert any(s["evicted"] for s in steps.values()), "rows should evict"
    if evicts_in_step(policy):
        evicting = {k: s["evicted"] for k, s in steps.items() if s["evicted"]}
        assert len(evicting) >= 3, "evictions should happen at several steps"
        assert len({tuple(v) for v in evicting.values()}) > 1, "different rows should evict at different steps"
        assert any(len(v) > 1 for v in evicting.values()), "some rows should evict together (one policy call)"
    if policy.kind == "selection":
        assert dec.cache.attended is not None and any(s["held"] and max(s["held"]) > BUDGET for s in steps.values())


def test_the_detector_catches_an_item_in_the_eviction_path(model, monkeypatch):
    """Mutation: an ``.item()`` added to the eviction path shows up at exactly the evicting steps."""
    original = VaseCache.evict_due

    def evict_due_with_a_sync(self):
        due = original(self)
        if due:
            self.lengths_t[0].item()  # the injected sync
        return due

    monkeypatch.setattr(VaseCache, "evict_due", evict_due_with_a_sync)
    detector, steps, _ = run_detected(model, load_policy("vase_attnv"), monkeypatch)
    flagged = {phase[1] for phase in detector.step_syncs()}
    evicting = {k for k, s in steps.items() if s["evicted"]}
    assert evicting and flagged == evicting
    assert all(s == ["_local_scalar_dense"] for s in detector.step_syncs().values())


def test_the_detector_catches_a_tolist_in_the_sampling(model, monkeypatch):
    """Mutation: a ``.tolist()`` (invisible to a dispatch mode on a CPU) in the sampling shows up at every step."""
    import vase.engine.decode as decode

    original = decode.sample_tokens

    def sample_and_read(*args, **kwargs):
        tok = original(*args, **kwargs)
        tok.tolist()
        return tok

    monkeypatch.setattr(decode, "sample_tokens", sample_and_read)
    detector, steps, _ = run_detected(model, load_policy("snapkv"), monkeypatch, max_new=16)
    assert {phase[1] for phase in detector.step_syncs()} == set(steps)


# ---- the meta device: no data, so any data-dependent op raises ------------------------------------------------------
def _meta_decoder(policy, prompts=(37, 30, 30, 21), rows=4):
    """A decoder on the meta device with ``rows`` rows admitted (each its own prompt), ready to decode."""
    m = tiny_model("qwen3", num_attention_heads=8, num_key_value_heads=2, num_hidden_layers=2).to("meta")
    dec = Decoder(
        m, policy, rows=rows, capacity=80, sampling=SamplingConfig(1.0, top_k=20), max_new_tokens=40, sync_every=8
    )
    with torch.inference_mode(), vase_attention(m):
        for slot, p in enumerate(prompts):
            dec._prefill_forward(torch.arange(p) % 200, [slot], [100 + slot], [slot])
            dec._slots[slot] = _Row(key=slot, sample=0, seed=100 + slot, rid=slot, limit=40, prompt_len=p, first_step=0)
    return dec


@pytest.mark.parametrize("name", SYNC_CELLS)
def test_decode_steps_on_the_meta_device(name, monkeypatch):
    """12 decode steps with every tensor on ``meta``: nothing reads data (it would raise), nothing comes back to the
    host; uploads: one per group of rows that evicts together, whatever the number of layers."""
    if "gate_path" in OmegaConf.load(CONF / f"{name}.yaml"):
        pytest.skip("loads a trained checkpoint (its weights live on the CPU); its decode is checked on the CPU above")
    policy = load_policy(name)
    dec = _meta_decoder(policy)
    detector = SyncDetector(monkeypatch)
    evicted = {}
    with torch.inference_mode(), vase_attention(dec.model), detector:
        for i in range(12):
            detector.phase = ("step", i + 1)
            _, tok, evicted[i + 1] = dec._decode_step(4, i % 8)
            assert tok.device.type == "meta"
    assert detector.step_syncs() == {}
    step_uploads = {p: u for p, u in detector.uploads.items() if p != "between"}
    if evicts_in_step(policy):
        groups = {k: v for k, v in evicted.items() if v}
        assert groups, "rows should evict"
        # rows 1 and 2 (prompts of 30) evict together, rows 0 and 3 alone: (1, 2) is a contiguous slice, no upload
        assert [1, 2] in groups.values() and [0] in groups.values()
        for phase, ups in step_uploads.items():
            assert all(nb for _, nb in ups)  # queued, never blocking
            assert len(ups) <= 1, (phase, ups)  # once per step for a non-contiguous group, not once per layer


def test_meta_decode_steps_raise_on_a_data_dependent_op(monkeypatch):
    """The meta run can fail: an ``.item()`` in the eviction path raises there."""
    original = VaseCache.evict_due

    def evict_due_with_a_sync(self):
        due = original(self)
        if due:
            self.lengths_t[0].item()
        return due

    monkeypatch.setattr(VaseCache, "evict_due", evict_due_with_a_sync)
    dec = _meta_decoder(load_policy("vase_attnv"))
    with pytest.raises(RuntimeError, match="meta"):
        with torch.inference_mode(), vase_attention(dec.model):
            for i in range(12):
                dec._decode_step(4, i % 8)


def test_a_non_contiguous_group_is_uploaded_once_per_step(monkeypatch):
    """Rows 0 and 2 evict together (same length), row 1 not: their index tensor is uploaded once for both layers."""
    dec = _meta_decoder(load_policy("vase_dkv"), prompts=(30, 37, 30), rows=3)
    detector = SyncDetector(monkeypatch)
    draws = Counter()
    bits_at = RowRNG.bits_at  # every draw's hashes (bits, uniform, normal) go through it

    def counted(self, j):
        draws[(detector.phase, isinstance(self.stream, torch.Tensor), self.key.shape[0])] += 1
        return bits_at(self, j)

    monkeypatch.setattr(RowRNG, "bits_at", counted)
    with torch.inference_mode(), vase_attention(dec.model), detector:
        for i in range(12):
            detector.phase = ("step", i + 1)
            _, _, evicted = dec._decode_step(3, i % 8)
            if evicted == [0, 2]:
                phase = detector.phase
    assert detector.step_syncs() == {}
    ups = detector.uploads[phase]
    assert ups == [((2,), True)], ups  # one queued upload of the 2-row index, for both layers
    # the policy's noise (the sketch): one batched draw for the event, its 2 rows x 2 layers folded, each row's layer
    # its stream (a tensor); plus the token draw (a host stream, the 3 rows)
    step_draws = {k: v for k, v in draws.items() if k[0] == phase}
    assert step_draws == {(phase, True, 4): 1, (phase, False, 3): 1}, step_draws


def test_to_device_queues_uploads_from_pinned_memory(monkeypatch):
    """The accelerator branch of ``to_device``: a pinned host copy (where CUDA can pin) sent with ``non_blocking``."""
    seen = {}
    real_tensor = torch.tensor

    def spy(values, dtype=None, pin_memory=False, **kw):
        seen["pin_memory"] = pin_memory
        return real_tensor(values, dtype=dtype, **kw)

    monkeypatch.setattr(engine_cache, "_can_pin", lambda: True)
    monkeypatch.setattr(torch, "tensor", spy)
    out = engine_cache.to_device([3, 1, 2], torch.device("meta"))
    assert seen["pin_memory"] is True and out.device.type == "meta" and out.dtype == torch.long
    monkeypatch.setattr(torch, "tensor", real_tensor)
    assert engine_cache.to_device([3, 1, 2], torch.device("cpu")).tolist() == [3, 1, 2]


# ---- weights straight to the device ---------------------------------------------------------------------------------
def test_weights_load_straight_to_the_device(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    from vase.models import load_model

    model = tiny_model("qwen3")
    model.save_pretrained(tmp_path)
    calls = []
    original = AutoModelForCausalLM.from_pretrained

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return original(*args, **kwargs)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", spy)
    loaded, _ = load_model(str(tmp_path), dtype="float32", device="cpu", load_tokenizer=False)
    assert calls[0]["device_map"] == {"": torch.device("cpu")}
    assert not loaded.training and next(loaded.parameters()).device.type == "cpu"
    for (k, a), b in zip(model.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), k
