"""The policy contract over every config in ``conf/policy/`` and the behaviours each policy promises (method.md §3)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.utils._python_dispatch
from hydra.utils import get_class, instantiate
from omegaconf import OmegaConf

from baselines.evict_large_value import EvictLargeValue
from baselines.rkv import RKV
from baselines.snapkv import SnapKV
from tests.authors_rules import AUTHORS_RULES, check_rule_on_geometry, rule_inputs
from tests.authors_rules_vase import VASE_RULES, authors_storage_key, avg_pool
from tests.policy_configs import ALL_CONFIGS, CONF, calibrate  # every conf/policy/*.yaml
from vase.engine.policy import EvictionInputs, SelectionInputs
from vase.engine.scores import (
    page_min_max,
    page_upper_bound,
    redundancy_score,
    value_statistic,
    windowed_attention_score,
)
from vase.policies.attnv import VaSEAttnV
from vase.policies.dkv import VaSEDKV

BUDGET, WINDOW = 64, 16
N_KEEP, N_CAND, DIM = BUDGET - WINDOW, 80, 16
LAYOUTS = {"mha": (4, 4), "gqa": (2, 8)}  # (H, Hq)


def load_policy(name: str, budget: int = BUDGET, window: int = WINDOW, **overrides):
    cfg = OmegaConf.load(CONF / f"{name}.yaml")
    cfg.budget, cfg.window = budget, window
    for key, value in overrides.items():
        cfg[key] = value
    return instantiate(cfg)


def kinds(kind: str) -> list[str]:
    return [n for n in ALL_CONFIGS if load_policy(n).kind == kind]


def make_inputs(
    b: int,
    h: int,
    hq: int,
    seeds=None,
    n: int = N_CAND,
    n_keep: int = N_KEEP,
    data_seed: int = 0,
    state: dict | None = None,
) -> EvictionInputs:
    """Random candidates; per (row, head) a shuffled set of distinct positions that includes 0..3 (the sinks)."""
    g = torch.Generator().manual_seed(data_seed)
    values = torch.randn(b, h, n, DIM, generator=g)
    values[:, :, ::7] *= 6.0  # a few large value states
    positions = torch.empty(b, h, n, dtype=torch.long)
    for bi in range(b):
        for hi in range(h):
            rest = torch.randperm(4 * n, generator=g)[: n - 4] + 4
            positions[bi, hi] = torch.cat([torch.arange(4), rest])[torch.randperm(n, generator=g)]
    seeds = seeds if seeds is not None else list(range(100, 100 + b))
    window_positions = torch.arange(4 * n, 4 * n + WINDOW).expand(b, h, WINDOW).clone()  # newer than every candidate
    ring = torch.arange(4 * n, 4 * n + WINDOW)
    return EvictionInputs(
        keys=torch.randn(b, h, n, DIM, generator=g),
        values=values,
        positions=positions,
        n_keep=n_keep,
        layer_idx=0,
        scaling=DIM**-0.5,
        generators=[torch.Generator().manual_seed(s) for s in seeds],
        state={} if state is None else state,
        queries=torch.randn(b, hq, WINDOW, DIM, generator=g),
        window_keys=torch.randn(b, h, WINDOW, DIM, generator=g),
        window_positions=window_positions,
        query_positions=ring[(ring % WINDOW).argsort()].expand(b, WINDOW).clone(),  # slot s holds p % WINDOW == s
        n_new_queries=torch.full((b,), WINDOW),
    )


def row(inputs: EvictionInputs, r: int, seed: int) -> EvictionInputs:
    """Row ``r`` of ``inputs`` alone, with a fresh generator seeded ``seed``."""
    return EvictionInputs(
        keys=inputs.keys[r : r + 1],
        values=inputs.values[r : r + 1],
        positions=inputs.positions[r : r + 1],
        n_keep=inputs.n_keep,
        layer_idx=0,
        scaling=inputs.scaling,
        generators=[torch.Generator().manual_seed(seed)],
        state={},
        queries=inputs.queries[r : r + 1],
        window_keys=inputs.window_keys[r : r + 1],
        window_positions=inputs.window_positions[r : r + 1],
        query_positions=inputs.query_positions[r : r + 1],
        n_new_queries=inputs.n_new_queries[r : r + 1],
    )


def expected_protected(policy, inputs: EvictionInputs) -> torch.Tensor:
    """``(B, H, N)`` bool: the sinks plus, for value-protecting policies, the largest values (reference by sorting)."""
    sinks = inputs.positions < policy.sinks
    count = getattr(policy, "protect_count", 0)
    if count == 0:
        return sinks
    stat = value_statistic(inputs.values, policy.value_stat)
    out = sinks.clone()
    b, h, n = stat.shape
    for bi in range(b):
        for hi in range(h):
            order = sorted(range(n), key=lambda i: (not bool(sinks[bi, hi, i]), -float(stat[bi, hi, i])))
            out[bi, hi, order[:count]] = True
    return out


# ---- the contract matrix --------------------------------------------------------------------------------------------


def test_every_config_instantiates_with_its_name():
    for name in ALL_CONFIGS:
        policy = load_policy(name)
        assert policy.name == name, f"{name}.yaml builds a policy named {policy.name!r}"
        assert policy.budget == BUDGET and policy.window == WINDOW
    assert {
        "full",
        "streaming",
        "random",
        "snapkv",
        "snapkv_sample",
        "snapkv_protect",
        "rkv",
        "curdkv",
        "vase_attnv",
        "vase_dkv",
        "evict_large_value",
        "quest",
        "rkv_original",
        "curdkv_original",
        "random_keep_prompt",
        "seer_attention_r",
        "h2o",
        "keydiff",
        "triattention",
    } <= set(ALL_CONFIGS)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("name", kinds("eviction"))
def test_eviction_contract(name, layout):
    h, hq = LAYOUTS[layout]
    policy = calibrate(load_policy(name), layers=1, q_heads=hq, head_dim=DIM)  # TriAttention: random centres
    inputs = make_inputs(3, h, hq)
    idx = policy.keep(inputs)

    assert idx.shape == (3, h, N_KEEP) and idx.dtype == torch.int64
    assert idx.min() >= 0 and idx.max() < N_CAND
    assert (idx.sort(dim=-1).values.diff(dim=-1) > 0).all(), "duplicate indices"
    kept = torch.zeros(3, h, N_CAND, dtype=torch.bool).scatter_(-1, idx, True)
    must = expected_protected(policy, inputs)
    assert not (must & ~kept).any(), "a sink or protected token was evicted"
    if getattr(policy, "protect_count", 0):
        assert must.sum(-1).eq(policy.protect_count).all()

    # The same seeds give the same choice; a row's choice does not depend on the other rows.
    assert torch.equal(policy.keep(make_inputs(3, h, hq)), idx)
    assert torch.equal(policy.keep(row(inputs, 1, seed=101)), idx[1:2])


def selection_inputs(query, keys, state=None, lengths=None, capacity=None, layer_idx=0) -> SelectionInputs:
    """What the engine hands a selection policy at a decode step: rows hold ``lengths`` (default: all of ``keys``)."""
    b, h, length, _ = keys.shape
    lengths = [length] * b if lengths is None else list(lengths)
    return SelectionInputs(
        query=query,
        keys=keys,
        length=length,
        lengths=torch.tensor(lengths),
        lengths_host=lengths,
        capacity=capacity or length,
        n_new=1,
        layer_idx=layer_idx,
        state={} if state is None else state,
        positions=torch.arange(length).expand(b, h, length).clone(),
    )


def ready_selection_policy(name: str, h: int, hq: int, tmp_path: Path, budget: int = 32):
    """Config ``name`` set up for a model of ``h`` KV heads, ``hq`` query heads and head dim ``DIM`` (a policy that
    loads a checkpoint gets random gates of that geometry, with 16-token blocks)."""
    from vase.models import tiny_config

    config = tiny_config("qwen3", num_hidden_layers=3, num_attention_heads=hq, num_key_value_heads=h, head_dim=DIM)
    overrides = {}
    if "gate_path" in OmegaConf.load(CONF / f"{name}.yaml"):
        from tests.seer_reference import write_random_gates

        overrides = {"gate_path": str(write_random_gates(tmp_path / name, config, block_size=16)), "block_size": 16}
    policy = load_policy(name, budget=budget, **overrides)
    policy.setup(config)
    return policy


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("name", kinds("selection"))
def test_selection_contract(name, layout, tmp_path):
    """Every selection policy: a bool mask per KV head or per query head, the current token always attended, fewer
    tokens than held once the rows hold several budgets, and each row's mask independent of the other rows."""
    h, hq = LAYOUTS[layout]
    policy = ready_selection_policy(name, h, hq, tmp_path)
    g = torch.Generator().manual_seed(3)
    keys = torch.randn(3, h, 170, DIM, generator=g)
    lengths = [160, 131, 97]
    state: dict = {}
    alone: list[dict] = [{} for _ in lengths]
    for step in range(3):  # three decode steps: the state is created, then updated
        now = [n - 2 + step for n in lengths]
        query = torch.randn(3, hq, 1, DIM, generator=g)
        span = max(now) + 5  # the engine may hand slots past every row of the call (longer rows of other calls)
        mask = policy.select(selection_inputs(query, keys[:, :, :span], state, now, 192, layer_idx=2))
        assert mask is not None and mask.dtype == torch.bool and mask.shape in ((3, h, span), (3, hq, span))
        for i, n in enumerate(now):
            assert mask[i, :, n - 1].all(), "the current token must be attended"
            assert (mask[i, :, :n].sum(-1) < n).all()
            one = policy.select(selection_inputs(query[i : i + 1], keys[i : i + 1, :, :n], alone[i], capacity=192,
                                                 layer_idx=2))  # fmt: skip
            assert torch.equal(mask[i : i + 1, :, :n], one), (name, step, i)


class _Ops(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the aten ops run under it."""

    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


# Ops that read a device value on the host (a CUDA synchronisation) or have a data-dependent output shape.
HOST_READS = ("_local_scalar_dense", "aten.item", "aten.nonzero", "aten.is_nonzero", "aten.equal", "masked_select")


@pytest.mark.parametrize("name", kinds("selection"))
def test_selection_decode_step_reads_nothing_back_from_the_device(name, tmp_path):
    """Once a row's state exists, a decode step's select() only launches device work: no value is read on the host
    (CUDA sync) and no output shape depends on data. Checked on CPU by recording the aten ops."""
    policy = ready_selection_policy(name, 2, 8, tmp_path)
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(2, 2, 100, DIM, generator=g)
    state: dict = {}
    policy.select(selection_inputs(torch.randn(2, 8, 1, DIM), keys[:, :, :98], state, [98, 90], 128, layer_idx=2))
    with _Ops() as ops:
        mask = policy.select(selection_inputs(torch.randn(2, 8, 1, DIM), keys[:, :, :99], state, [99, 91], 128, 2))
    assert mask is not None and ops.names
    bad = [n for n in ops.names if any(h in n for h in HOST_READS)]
    assert not bad, bad


def quest_reference(query, keys, lengths, budget, page_size, group_reduce="none") -> torch.Tensor:
    """Quest as published, one row and one head at a time: a row holding at most ``budget // page_size`` pages attends
    to all of them; otherwise to its current page plus the ``budget // page_size - 1`` complete pages with the largest
    bound ``Σ_d max(q_d kmax_d, q_d kmin_d)`` (per query head, or the group's max/sum per KV head)."""
    b, hq = query.shape[:2]
    h, length = keys.shape[1], keys.shape[2]
    g = hq // h
    heads = hq if group_reduce == "none" else h
    n_pages = budget // page_size
    out = torch.zeros(b, heads, length, dtype=torch.bool)
    for i in range(b):
        n = lengths[i]
        cur = (n - 1) // page_size
        for hh in range(heads):
            if cur + 1 <= n_pages:
                out[i, hh, :n] = True
                continue
            kv, q_heads = (hh // g, [hh]) if group_reduce == "none" else (hh, range(hh * g, hh * g + g))
            scores = []
            for p in range(cur):
                page = keys[i, kv, p * page_size : (p + 1) * page_size]
                kmax, kmin = page.amax(0), page.amin(0)
                per = [float(torch.maximum(query[i, j, 0] * kmax, query[i, j, 0] * kmin).sum()) for j in q_heads]
                scores.append(sum(per) if group_reduce == "sum" else max(per))
            for p in sorted(range(cur), key=lambda x: -scores[x])[: n_pages - 1] + [cur]:
                out[i, hh, p * page_size : min((p + 1) * page_size, n)] = True
    return out


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_quest_as_published_selects_per_query_head_with_the_current_page_in_the_budget(layout):
    h, hq = LAYOUTS[layout]
    policy = load_policy("quest", budget=32)
    assert (policy.page_size, policy.dense_layers, policy.group_reduce) == (16, 2, "none")
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(3, h, 100, DIM, generator=g)
    query = torch.randn(3, hq, 1, DIM, generator=g)
    mask = policy.select(selection_inputs(query, keys, layer_idx=2))
    assert mask.shape == (3, hq, 100) and mask.dtype == torch.bool  # one set per query head
    assert mask[..., 96:].all(), "the current page (tokens 96..99) must always be attended"
    assert mask.sum(-1).eq(16 + 4).all()  # budget // 16 = 2 pages in all: the best complete page + the current page
    assert torch.equal(mask, quest_reference(query, keys, [100] * 3, 32, 16))
    # The chosen page is the best by each head's own bound.
    kmax, kmin = page_min_max(keys, 16)
    bound = page_upper_bound(query, kmax[:, :, :6], kmin[:, :, :6], "none")
    chosen = mask[..., :96].view(3, hq, 6, 16).all(-1)
    assert torch.equal(chosen, torch.zeros_like(chosen).scatter_(-1, bound.argmax(-1, keepdim=True), True))
    if hq > h:  # heads of one group disagree somewhere: per-head selection is not the grouped one
        assert not torch.equal(
            mask, mask.view(3, h, hq // h, 100)[:, :, :1].expand(3, h, hq // h, 100).reshape(mask.shape)
        )
    # Everything fits (at most 2 pages held): attend to all; the first two layers are dense.
    assert policy.select(selection_inputs(query, keys[:, :, :32], layer_idx=2)) is None
    assert policy.select(selection_inputs(query, keys, layer_idx=0)) is None
    assert policy.select(selection_inputs(query, keys, layer_idx=1)) is None


@pytest.mark.parametrize("group_reduce", ["none", "max", "sum"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_quest_matches_the_reference_at_every_budget_and_length(layout, group_reduce):
    h, hq = LAYOUTS[layout]
    g = torch.Generator().manual_seed(7)
    keys = torch.randn(3, h, 90, DIM, generator=g)
    for budget in (16, 32, 48, 64):
        policy = load_policy("quest", budget=budget, dense_layers=0, group_reduce=group_reduce)
        for lengths in ([90, 90, 90], [90, 47, 17], [33, 64, 65]):
            query = torch.randn(3, hq, 1, DIM, generator=g)
            length = max(lengths)
            got = policy.select(selection_inputs(query, keys[:, :, :length], lengths=lengths, capacity=96))
            want = quest_reference(query, keys, lengths, budget, 16, group_reduce)[..., :length]
            if got is None:
                assert all((n - 1) // 16 + 1 <= budget // 16 for n in lengths)
            else:
                for i, n in enumerate(lengths):
                    assert torch.equal(got[i, :, :n], want[i, :, :n]), (budget, lengths, i)
                assert got.shape[1] == (hq if group_reduce == "none" else h)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_quest_rows_of_different_lengths_equal_each_row_alone(layout):
    """Continuous batching: rows holding different lengths get, each, the mask it gets alone."""
    h, hq = LAYOUTS[layout]
    policy = load_policy("quest", budget=32, dense_layers=0)
    g = torch.Generator().manual_seed(2)
    keys = torch.randn(3, h, 100, DIM, generator=g)
    query = torch.randn(3, hq, 1, DIM, generator=g)
    lengths = [100, 71, 40]
    mask = policy.select(selection_inputs(query, keys, lengths=lengths, capacity=128))
    assert mask.shape == (3, hq, 100)
    for i, length in enumerate(lengths):
        alone = policy.select(selection_inputs(query[i : i + 1], keys[i : i + 1, :, :length], capacity=128))
        want = torch.ones(1, hq, length, dtype=torch.bool) if alone is None else alone
        assert torch.equal(mask[i : i + 1, :, :length], want), i


def test_quest_incremental_state_matches_fresh():
    policy = load_policy("quest", budget=32, dense_layers=0)
    g = torch.Generator().manual_seed(1)
    keys = torch.randn(2, 2, 130, DIM, generator=g)
    state: dict = {}
    for length in range(20, 131):  # one call per decode step, as the engine does
        query = torch.randn(2, 8, 1, DIM, generator=g)
        got = policy.select(selection_inputs(query, keys[:, :, :length], state, capacity=130))
        want = policy.select(selection_inputs(query, keys[:, :, :length], capacity=130))
        assert (got is None and want is None) or torch.equal(got, want), length
        if got is not None:
            kmax, kmin = page_min_max(keys[:, :, :length], 16)
            pages = kmax.shape[2]
            assert torch.equal(state["kmax"][:, :, :pages], kmax) and torch.equal(state["kmin"][:, :, :pages], kmin)
            assert state["kmax"].shape[:3] == (2, 2, 9)  # row-first, allocated once for the capacity's pages


# ---- VaSE-AttnV -----------------------------------------------------------------------------------------------------


def test_vase_attnv_defaults():
    p = load_policy("vase_attnv", budget=512, window=64)
    assert (p.sinks, p.protect_count, p.sample, p.value_stat, p.smooth_kernel) == (4, 128, True, "range", 5)
    assert p.needs_queries and VaSEAttnV(budget=512, window=64).describe() == p.describe()


def test_vase_attnv_always_keeps_protected():
    policy = load_policy("vase_attnv", n_protect=20)
    for seed in range(20):
        inputs = make_inputs(2, 2, 8, seeds=[seed, seed + 1000], data_seed=seed)
        kept = torch.zeros(2, 2, N_CAND, dtype=torch.bool).scatter_(-1, policy.keep(inputs), True)
        assert not (expected_protected(policy, inputs) & ~kept).any()


def test_vase_attnv_keep_frequency_rises_with_score():
    """Over many seeded draws, candidates with a higher attention score are kept more often."""
    rows, n, d = 400, 40, 4
    a = torch.linspace(-2.0, 2.0, n)
    keys = torch.zeros(rows, 1, n, d)
    keys[..., 0] = a  # logit of candidate i = a_i (one query (1, 0, 0, 0), scaling 1): score ∝ exp(a_i)
    values = torch.ones(rows, 1, n, d)
    values[..., 0] = 2.0  # every range equal: protection is just the sinks
    inputs = EvictionInputs(
        keys=keys,
        values=values,
        positions=torch.arange(n).expand(rows, 1, n).clone(),
        n_keep=24,
        layer_idx=0,
        scaling=1.0,
        generators=[torch.Generator().manual_seed(s) for s in range(rows)],
        queries=torch.tensor([1.0, 0, 0, 0]).expand(rows, 1, 1, d).clone(),
    )
    policy = VaSEAttnV(budget=32, window=8, n_protect=4, smooth_kernel=1)
    idx = policy.keep(inputs)
    freq = torch.zeros(rows, n).scatter_(-1, idx[:, 0], 1.0).mean(0)
    assert freq[:4].eq(1).all()  # sinks
    f = freq[4:]
    ranks = lambda x: x.argsort().argsort().double()  # noqa: E731
    spearman = torch.corrcoef(torch.stack([ranks(f), ranks(a[4:])]))[0, 1]
    assert spearman > 0.9
    top, middle, bottom = f[-9:].mean(), f[9:18].mean(), f[:9].mean()  # ≈ .94, .39, .18 with these seeds
    assert top > middle + 0.3 and middle > bottom + 0.1
    assert 0 < f.min() and f.max() < 1  # stochastic: nothing is certain


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_vase_attnv_without_sampling_is_topk_after_protection(layout):
    h, hq = LAYOUTS[layout]
    policy = load_policy("vase_attnv", sample=False)
    inputs = make_inputs(3, h, hq)
    kept = torch.zeros(3, h, N_CAND, dtype=torch.bool).scatter_(-1, policy.keep(inputs), True)
    protected = expected_protected(policy, inputs)
    score = windowed_attention_score(inputs.queries, inputs.keys, inputs.scaling)
    for b in range(3):
        for hi in range(h):
            rest = sorted((i for i in range(N_CAND) if not protected[b, hi, i]), key=lambda i: -float(score[b, hi, i]))
            want = set(torch.nonzero(protected[b, hi]).flatten().tolist()) | set(rest[: N_KEEP - policy.protect_count])
            assert set(torch.nonzero(kept[b, hi]).flatten().tolist()) == want


def test_snapkv_and_rkv_are_topk_of_their_scores():
    inputs = make_inputs(2, 2, 8)
    attn = windowed_attention_score(inputs.queries, inputs.keys, inputs.scaling)
    for policy, score in [
        (SnapKV(budget=BUDGET, window=WINDOW), attn),
        (RKV(budget=BUDGET, window=WINDOW), 0.5 * attn - 0.5 * redundancy_score(inputs.keys)),
        (RKV(budget=BUDGET, window=WINDOW, rkv_lambda=0.1), 0.1 * attn - 0.9 * redundancy_score(inputs.keys)),
    ]:
        got = policy.keep(inputs)
        assert torch.equal(got.sort(-1).values, score.topk(N_KEEP, dim=-1).indices.sort(-1).values), policy


def test_attention_policies_return_the_authors_storage_order():
    """Protected first (sinks, then by decreasing value), then by decreasing score: the authors' cache layout."""
    policy = VaSEAttnV(budget=BUDGET, window=WINDOW, sample=False, n_protect=10)
    inputs = make_inputs(1, 2, 8)
    idx = policy.keep(inputs)
    stat = value_statistic(inputs.values, "range")
    score = windowed_attention_score(inputs.queries, inputs.keys, inputs.scaling)
    for hi in range(2):
        head = idx[0, hi]
        assert (inputs.positions[0, hi, head[:4]] < 4).all()
        assert (stat[0, hi, head[4:10]].diff() <= 0).all()
        assert (score[0, hi, head[10:]].diff() <= 0).all()


# ---- CurDKV / VaSE-DKV ----------------------------------------------------------------------------------------------


def test_vase_dkv_redraws_the_sketch_and_curdkv_reuses_it():
    for name, resample in [("curdkv", False), ("vase_dkv", True)]:
        policy = load_policy(name)
        assert policy.resample_sketch is resample and policy.rank == 20 and policy.sinks == 4
        state: dict = {}
        inputs = make_inputs(3, 2, 8, state=state)  # one generation: the same generators and state throughout
        first_keep = policy.keep(inputs)
        first = state["sketch"].clone()
        assert first.shape == (3, DIM, 20)
        second_keep = policy.keep(inputs)  # the next eviction of the same layer
        if resample:
            assert not torch.equal(state["sketch"], first)
            assert not torch.equal(second_keep, first_keep)
        else:
            assert torch.equal(state["sketch"], first)
            assert torch.equal(second_keep, first_keep)


def test_dkv_sketch_is_gaussian_with_variance_one_over_rank():
    policy = VaSEDKV(budget=BUDGET, window=WINDOW, rank=20)
    inputs = make_inputs(64, 1, 1, seeds=list(range(64)))
    g = policy.sketch(inputs)
    assert g.mean().abs() < 0.02 and g.var().item() == pytest.approx(1 / 20, rel=0.05)


# ---- evict_large_value ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("stat", ["range", "l2", "absmax", "variance"])
def test_evict_large_value_keeps_exactly_the_smallest(stat):
    policy = load_policy("evict_large_value", value_stat=stat)
    assert isinstance(policy, EvictLargeValue) and policy.sinks == 0
    inputs = make_inputs(2, 2, 8)
    idx = policy.keep(inputs)
    v = value_statistic(inputs.values, stat)
    for b in range(2):
        for hi in range(2):
            smallest = sorted(range(N_CAND), key=lambda i: float(v[b, hi, i]))[:N_KEEP]
            assert set(idx[b, hi].tolist()) == set(smallest)


# ---- validation -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name,overrides,message",
    [
        ("vase_attnv", {"n_protect": 600}, "policy.n_protect: must be <= budget - window = 448, got 600"),
        ("vase_attnv", {"n_protect": 1.5}, "policy.n_protect: a float is a fraction of the budget"),
        ("vase_attnv", {"n_protect": -1}, "policy.n_protect: must be >= 0"),
        ("vase_attnv", {"value_stat": "median"}, "policy.value_stat: must be one of range, l2, absmax, variance"),
        ("vase_attnv", {"smooth_kernel": 4}, "policy.smooth_kernel: must be an odd integer"),
        ("vase_attnv", {"attn_temperature": 0.0}, "policy.attn_temperature: must be a finite number >= 1e-6"),
        ("vase_attnv", {"attn_temperature": 1e-300}, "policy.attn_temperature: must be a finite number >= 1e-6"),
        ("vase_attnv", {"smooth_along": "text"}, "policy.smooth_along"),
        ("snapkv", {"sinks": 449}, "policy.sinks: must be <= budget - window = 448"),
        ("rkv", {"sample": True}, "policy.sample: must be false for R-KV"),
        ("rkv", {"rkv_lambda": 1.5}, "policy.rkv_lambda: must be in [0, 1]"),
        ("curdkv", {"rank": 0}, "policy.rank: must be an integer >= 1"),
        ("evict_large_value", {"value_stat": "l1"}, "policy.value_stat"),
        ("quest", {"page_size": 0}, "policy.page_size: must be an integer >= 1"),
        ("quest", {"group_reduce": "mean"}, "policy.group_reduce"),
        ("rkv_original", {"pool_kernel": 4}, "policy.pool_kernel: must be an odd integer >= 1"),
        ("rkv_original", {"rkv_lambda": -0.1}, "policy.rkv_lambda: must be in [0, 1]"),
        ("rkv_original", {"similarity_threshold": 2}, "policy.similarity_threshold"),
        ("rkv_original", {"evict_every": 0}, "policy.evict_every: must be an integer >= 1 or null"),
        ("curdkv_original", {"local_window": -1}, "policy.local_window: must be an integer >= 0"),
        ("curdkv_original", {"leverage": "kv"}, "policy.leverage: must be one of key, value, kv_avg, kv_product"),
        ("random_keep_prompt", {"keep_prompt": "yes"}, "policy.keep_prompt: must be true or false"),
        ("quest", {"dense_layers": -1}, "policy.dense_layers: must be an integer >= 0"),
        ("seer_attention_r", {"block_size": 1024}, "policy.budget: must be >= block_size = 1024"),
        ("seer_attention_r", {"decode_block_position": "middle"}, "policy.decode_block_position: must be one of"),
    ],
)
def test_validation_names_the_field(name, overrides, message):
    cfg = OmegaConf.load(CONF / f"{name}.yaml")
    cfg.budget, cfg.window = 512, 64
    kwargs = {**OmegaConf.to_container(cfg, resolve=True), **overrides}
    cls = get_class(kwargs.pop("_target_"))
    with pytest.raises(ValueError, match=re.escape(message)):  # hydra wraps it in an InstantiationException
        cls(**kwargs)


def test_n_protect_forms():
    assert load_policy("vase_attnv", budget=512, window=64).protect_count == 128  # null -> budget // 4
    assert load_policy("vase_attnv", budget=512, window=64, n_protect=0.5).protect_count == 256
    assert load_policy("vase_attnv", budget=512, window=64, n_protect=64).protect_count == 64
    assert load_policy("snapkv_protect", budget=4096, window=64).protect_count == 1024
    assert load_policy("snapkv", budget=512, window=64).protect_count == 0
    assert load_policy("snapkv", budget=512, window=64, sinks=4).protect_count == 4  # sinks always kept


# ---- the authors' rules (tests/authors_rules.py) ---------------------------------------------------------------------
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("name", sorted(AUTHORS_RULES))
def test_kept_set_equals_the_authors_rule(name, layout):
    """Each config with a port of its authors' rule keeps the rule's set on random inputs of an eviction event: three
    layers of two sequences at once (TriAttention's per-head mode shares one set across the layers of a sequence)."""
    h, hq = LAYOUTS[layout]
    assert name in kinds("eviction")
    policy = calibrate(load_policy(name), layers=3, q_heads=hq, head_dim=DIM)
    check_rule_on_geometry(policy, name, h, hq, DIM, [0, 1, 2])


def test_an_inverted_rule_fails_the_authors_rule_check(monkeypatch):
    """The check can fail: H2O keeping its lowest scores (its rule inverted) and TriAttention's per-(layer, head) mode
    (the harness's former default) both keep other sets than their authors' rules."""
    import baselines.h2o as h2o

    h, hq = LAYOUTS["gqa"]
    inverted = h2o.topk_with_protection
    monkeypatch.setattr(h2o, "topk_with_protection", lambda score, k, protected: inverted(-score, k, protected))
    with pytest.raises(AssertionError, match="keeps another set than its authors' rule"):
        check_rule_on_geometry(load_policy("h2o"), "h2o", h, hq, DIM, [0, 1, 2])
    monkeypatch.undo()
    old = calibrate(load_policy("triattention", selection="per_layer_head"), layers=3, q_heads=hq, head_dim=DIM)
    with pytest.raises(AssertionError, match="keeps another set than its authors' rule"):
        check_rule_on_geometry(old, "triattention", h, hq, DIM, [0, 1, 2])


def test_a_wrong_vase_rule_fails_the_authors_rule_check(monkeypatch):
    """The VaSE ports (tests/authors_rules_vase.py) can fail: SnapKV pooling along the text (``smooth_along=position``,
    a setting) instead of the storage slots, and SnapKV with its softmax over the candidates and the recent window
    (their softmax takes the candidates only) keep other sets than the authors' ``attn`` mode."""
    h, hq = LAYOUTS["gqa"]
    with pytest.raises(AssertionError, match="keeps another set than its authors' rule"):
        check_rule_on_geometry(load_policy("snapkv", smooth_along="position"), "snapkv", h, hq, DIM, [0, 1, 2])

    def over_candidates_and_window(self, inputs):
        n = inputs.keys.shape[2]
        keys = torch.cat([inputs.keys, inputs.window_keys], dim=2)
        wide = windowed_attention_score(inputs.queries, keys, inputs.scaling, smooth_kernel=1)
        return avg_pool(wide[..., :n].double()).float()

    monkeypatch.setattr(SnapKV, "score", over_candidates_and_window)
    with pytest.raises(AssertionError, match="keeps another set than its authors' rule"):
        check_rule_on_geometry(load_policy("snapkv"), "snapkv", h, hq, DIM, [0, 1, 2])


@pytest.mark.parametrize("name", sorted(VASE_RULES))
def test_vase_configs_keep_in_the_authors_storage_order(name):
    """The kept candidates come back in the order of the authors' ``ids_to_keep`` (``range_attn``'s protected block by
    decreasing value range, then by decreasing score): the slot order their next eviction's smoothing pools along."""
    h, hq = LAYOUTS["gqa"]
    policy = load_policy(name)
    make = lambda: rule_inputs(policy, h, hq, DIM, 2, [0, 1, 2])  # noqa: E731
    inputs, twin = make(), make()
    key = authors_storage_key(name, policy, twin).gather(-1, policy.keep(inputs))
    assert (key.diff(dim=-1) <= 1e-6).all(), f"{name}: kept candidates out of the authors' order"
