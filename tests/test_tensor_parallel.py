"""Tensor parallelism (issue 37): ``parallel.tensor=N`` splits the KV heads over N ranks (transformers' tp plan) and
writes the directory one process writes, sample for sample; the head-keyed noise; the memory plan's refusals."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.test_distributed import ENV, ROOT, SMALL, TORCHRUN, _metrics, _samples, needs_torchrun
from vase.engine.policy import EvictionInputs
from vase.engine.rng import RowRNG
from vase.run.distributed import World
from vase.run.memory_plan import GIB, plan_memory, reserve_bytes

# a tiny qwen3 of 4 KV heads (8 query heads): 2 ranks hold 2 KV heads each; three generated gsm_symbolic problems,
# two samples each, sampled at temperature 1, float32
TP = ["model=tiny", "+model.tiny.num_key_value_heads=4", "+model.tiny.num_attention_heads=8", *SMALL[1:]]
TIMING = {"decode_seconds", "prefill_seconds", "wall_seconds", "decode_tokens_per_second", "eviction_seconds"}
#: per rank, not per run: a rank's own storage and memory
PER_RANK = {"kv_allocated_bytes", "kv_allocated_bytes_per_row", "peak_memory_bytes", "run_dir"}


def _run(args: list[str], ranks: int, timeout: int = 900) -> subprocess.CompletedProcess:
    import sys

    if ranks == 1:
        cmd = [sys.executable, "run.py", *args]
    else:
        cmd = [str(TORCHRUN), "--nproc-per-node", str(ranks), "--standalone", "run.py", *args]
    r = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def _dirs(root: Path) -> dict[str, Path]:
    return {d.name.split("-")[0]: d for d in root.glob("*/*/*") if (d / "metrics.json").exists()}


def _assert_equal_runs(tp: Path, single: Path, tensor: int = 2, split: str = "half") -> None:
    """Samples equal (tokens' text, kept counts, evictions, every number but timings); metrics equal but timings and
    each rank's own storage: ``1 / tensor`` of the single process's when the heads split (``half``), less when some
    state stays whole on each rank (``less``: a hybrid's linear state), the same when no head splits (``same``)."""
    assert _samples(tp) == _samples(single)
    a, b = _metrics(tp), _metrics(single)
    assert {k: v for k, v in a.items() if k not in TIMING | PER_RANK} == {
        k: v for k, v in b.items() if k not in TIMING | PER_RANK
    }
    mine, whole = (json.loads((d / "metrics.json").read_text())["kv_allocated_bytes_per_row"] for d in (tp, single))
    if split == "half":
        assert mine * tensor == whole  # each rank's own cache: 1 / tensor of the single process's
    else:
        assert (mine < whole) if split == "less" else (mine == whole)


def _compare(
    tmp_path: Path, policies: list[str], extra: list[str], ranks: int = 2, tensor: int = 2, model: str = "tiny", **kw
) -> None:
    args = ["-m", f"policy={','.join(policies)}", f"model={model}", *TP[1:], *extra]
    _run([*args, f"results_dir={tmp_path / 'one'}"], 1)
    r = _run([*args, f"parallel.tensor={tensor}", f"results_dir={tmp_path / 'tp'}"], ranks)
    one, tp = _dirs(tmp_path / "one"), _dirs(tmp_path / "tp")
    assert sorted(one) == sorted(tp) == sorted(policies), r.stderr[-2000:]
    for name in one:
        _assert_equal_runs(tp[name], one[name], tensor, **kw)


# ---------------------------------------------------------------------------------------------------------------------
# end to end: torchrun on the CPU (gloo)


@needs_torchrun
def test_two_tensor_ranks_equal_one_process_for_vase_dkv_and_quest(tmp_path):
    """The default suite's one torchrun: 2 ranks, each holding 2 of the 4 KV heads, ``-m policy=vase_dkv,quest``."""
    _compare(tmp_path, ["vase_dkv", "quest"], [])


@needs_torchrun
@pytest.mark.slow
def test_two_tensor_ranks_equal_one_process_for_the_core_policies(tmp_path):
    """full, vase_attnv, snapkv, h2o and random (its noise keyed by the model's head index), kept sets recorded
    (gathered over the heads at each eviction) and compared file for file."""
    _compare(tmp_path, ["full", "vase_attnv", "snapkv", "h2o", "random"], ["record_kept=true"])
    for name, d in _dirs(tmp_path / "one").items():
        for f in sorted((d / "kept_sets").glob("*.npz")):
            a, b = np.load(f), np.load(tmp_path / "tp" / d.relative_to(tmp_path / "one") / "kept_sets" / f.name)
            assert a.files == b.files and all(np.array_equal(a[k], b[k]) for k in a.files), (name, f.name)


@needs_torchrun
@pytest.mark.slow
def test_four_ranks_as_two_data_by_two_tensor_equal_one_process(tmp_path):
    _compare(tmp_path, ["vase_dkv"], [], ranks=4)


@needs_torchrun
@pytest.mark.slow
@pytest.mark.parametrize(
    "model, split",
    [
        ("tiny_qwen3_5", "less"),  # hybrid: the full-attention heads split, the linear state whole on each rank
        ("tiny_qwen3_next", "less"),  # hybrid and MoE: the experts split too (expert parallelism, all-reduced)
        ("tiny_olmo3", "same"),  # sliding: its plan keeps every KV head on every rank
    ],
)
def test_a_hybrid_a_moe_and_a_sliding_family_under_tensor_parallelism(tmp_path, model, split):
    _compare(tmp_path, ["vase_dkv"], [], split=split, model=model)


@needs_torchrun
@pytest.mark.slow
@pytest.mark.parametrize("extra", [["generation.sync_every=4"], ["generation.compile=on"]], ids=["no_sync", "compiled"])
def test_the_no_sync_and_the_compiled_step_under_tensor_parallelism(tmp_path, extra):
    _compare(tmp_path, ["vase_attnv"], extra)


# ---------------------------------------------------------------------------------------------------------------------
# engine checks on a split model: two spawned ranks (gloo), each holding 2 of the 4 KV heads


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, port: int, check: str, tmp: str, queue) -> None:
    import os
    import traceback

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from vase.models import tiny_model
    from vase.parallel import shard_tensor_parallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        model = tiny_model("qwen3", num_attention_heads=8, num_key_value_heads=4, num_hidden_layers=3)
        model = shard_tensor_parallel(model, init_device_mesh("cpu", (2,)))
        if check == "masking":
            from tests.test_engine import check_eviction_equals_masking

            check_eviction_equals_masking(model, "vase_dkv", Path(tmp) / f"r{rank}")
        else:
            from tests.test_gpu_path import load_policy, run_detected

            with pytest.MonkeyPatch.context() as mp:
                detector, steps, dec = run_detected(model, load_policy("vase_attnv", model), mp)
            assert dec.geometry.num_kv_heads == 2 and dec.geometry.heads.offset == 2 * rank
            assert detector.step_syncs() == {}, detector.step_syncs()
            assert any(s["evicted"] for s in steps.values())
        queue.put((rank, None))
    except BaseException:
        queue.put((rank, traceback.format_exc()[-3000:]))
    finally:
        dist.destroy_process_group()


def _on_two_ranks(check: str, tmp_path: Path) -> None:
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    queue, port = ctx.Queue(), _free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, port, check, str(tmp_path), queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=600) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    assert results == {0: None, 1: None}, results


@pytest.mark.slow
def test_eviction_equals_masking_on_each_ranks_heads(tmp_path):
    """tests/test_engine.py's proof on a split model: each rank's logits (gathered over the ranks) equal the
    unmodified split model's on the whole sequence with each rank's heads masked as its cache evicted them."""
    _on_two_ranks("masking", tmp_path)


@pytest.mark.slow
def test_no_host_sync_in_a_decode_step_on_a_split_model(tmp_path):
    """tests/test_gpu_path.py's detector on a split model: the engine adds no host sync to a decode step (the
    model's own all-reduces are collectives, not host reads)."""
    _on_two_ranks("no_sync", tmp_path)


# ---------------------------------------------------------------------------------------------------------------------
# the noise: keyed by the model's head index


def test_a_slice_of_heads_draws_its_part_of_the_whole_draw():
    key = RowRNG.from_seeds([3, 11], counter=40, stream=1)
    whole_u, whole_n = RowRNG.from_seeds([3, 11], 40, 1), RowRNG.from_seeds([3, 11], 40, 1)
    u, n = whole_u.uniform(4, 5), whole_n.normal(4, 5)
    for offset in (0, 2):
        a, b = RowRNG.from_seeds([3, 11], 40, 1), RowRNG.from_seeds([3, 11], 40, 1)
        assert torch.equal(a.uniform(2, 5, heads=(offset, 4)), u[:, offset : offset + 2])
        assert torch.equal(b.normal(2, 5, heads=(offset, 4)), n[:, offset : offset + 2])
    assert key.uniform(3).shape == (2, 3)


def test_eviction_inputs_draw_a_head_axis_by_the_models_head_index():
    torch.manual_seed(0)
    k = torch.randn(2, 4, 6, 8)

    def inputs(heads: slice, span):
        return EvictionInputs(
            keys=k[:, heads],
            values=k[:, heads],
            positions=torch.arange(6).expand(2, k[:, heads].shape[1], 6),
            n_keep=2,
            layer_idx=1,
            scaling=1.0,
            head_span=span,
        )

    whole = inputs(slice(0, 4), None).rand(4, 6)
    assert torch.equal(inputs(slice(2, 4), (2, 4)).rand(2, 6), whole[:, 2:])
    assert torch.equal(inputs(slice(0, 2), (0, 4)).rand(2, 6), whole[:, :2])
    assert torch.equal(inputs(slice(2, 4), (2, 4)).rand(7), inputs(slice(0, 4), None).rand(7))  # no head axis


# ---------------------------------------------------------------------------------------------------------------------
# the world and the memory plan


def test_parallel_tensor_must_divide_the_ranks_of_a_node():
    with pytest.raises(ValueError, match=r"parallel.tensor=2 does not divide the 3 ranks") as err:
        World(rank=0, size=3, local_size=3).with_tensor(2)
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="ranks on this node"):
        World(rank=0, size=4, local_size=2).with_tensor(4)
    w = World(rank=3, size=4, local_size=4).with_tensor(2)
    assert (w.data_rank, w.data_size, w.writes) == (1, 2, False)
    assert w.share(list(range(6))) == [1, 3, 5]
    assert World(rank=0, size=1).with_tensor(1).share([1, 2]) == [1, 2]


def test_the_memory_plan_refuses_weights_bigger_than_the_device_in_one_line():
    device = 80 * GIB  # a fake device
    with pytest.raises(ValueError, match=r"the weights alone are 150.0 GiB per rank") as err:
        plan_memory(150 * GIB, GIB, 1, device, reserve_bytes(device))
    assert "\n" not in str(err.value) and "parallel.tensor" in str(err.value) and "quantised" in str(err.value)
    assert plan_memory(75 * GIB // 2, GIB, 8, device, reserve_bytes(device), tensor=2).total < device


def test_an_explicit_max_rows_that_fits_only_without_the_weights_is_refused():
    device = 140 * GIB
    rows, row = 64, 2 * GIB  # 128 GiB of cache: fits the device alone, not beside 54 GiB of weights
    assert rows * row < device
    with pytest.raises(ValueError, match=r"use at most generation.max_rows=37") as err:
        plan_memory(54 * GIB, row, rows, device, reserve_bytes(device), rows_setting="generation.max_rows")
    assert "\n" not in str(err.value) and "54.0 GiB of weights" in str(err.value)


def test_the_preflight_counts_the_weights_per_rank_before_anything_loads():
    from vase.engine.policy import Policy
    from vase.models import tiny_config
    from vase.parallel import weight_bytes
    from vase.run.preflight import check_memory

    config = tiny_config("qwen3", num_key_value_heads=4, num_attention_heads=8)
    whole, half = weight_bytes(config, torch.float32), weight_bytes(config, torch.float32, tensor=2)
    assert whole / 2 < half < whole  # the norms stay whole on each rank
    kw = dict(
        dtype="float32",
        device=torch.device("cpu"),
        capacity=64,
        rows=4,
        rows_reason="generation.max_rows",
        kv_memory=None,
        length_setting="generation.max_length",
        machine=True,
    )
    check_memory(config, Policy(), free=whole + 10**6, **kw)
    with pytest.raises(ValueError, match="memory plan: the weights alone"):
        check_memory(config, Policy(), free=whole - 1, **kw)
    check_memory(config, Policy(), free=half + 10**6, tensor=2, **kw)


def test_a_policy_with_per_head_parameters_is_refused_before_anything_loads():
    from baselines.triattention import TriAttention
    from vase.engine.policy import Policy
    from vase.models import tiny_config
    from vase.run.preflight import check_tensor

    config = tiny_config("qwen3", num_key_value_heads=4, num_attention_heads=8)
    with pytest.raises(ValueError, match=r"policy triattention: not supported under parallel.tensor=2") as err:
        check_tensor(TriAttention(budget=64, window=16), config, 2)
    assert "\n" not in str(err.value) and "parallel.tensor=1" in str(err.value)
    check_tensor(TriAttention(budget=64, window=16), config, 1)
    check_tensor(Policy(), config, 2)
    with pytest.raises(ValueError, match="KV heads do not split evenly"):
        check_tensor(Policy(), config, 8)
    with pytest.raises(ValueError, match="experts do not split evenly"):
        check_tensor(Policy(), tiny_config("qwen3_moe", num_key_value_heads=4, num_attention_heads=8), 8)
