"""Tensor parallelism (``parallel.tensor``, docs/scaling.md): a model split over the ranks of a node by transformers'
own plans, and the weights each rank holds (for the memory plan).

* :func:`shard_tensor_parallel` — split a model whose whole weights this process holds (a tiny random model; a data x
  tensor launch) by the model's tensor-parallel plan, and its experts by its expert plan, then
  :func:`local_parameters`;
* :func:`tensor_config` — the ``DistributedConfig`` that ``from_pretrained`` loads the same split with;
* :func:`weight_bytes` / :func:`kv_heads_split` — counted from a config on the meta device, nothing allocated.
"""

from __future__ import annotations

import torch

#: rules vase changes in a model's tensor-parallel plan: the token embedding stays whole on every rank (the plans'
#: ``embedding_rowwise`` splits the vocabulary, and DTensor's masked lookup of the ids outside a rank's slice is an
#: ``index_put_`` with a boolean mask: a host sync in every decode step, tests/test_tensor_parallel.py; the whole
#: embedding costs vocab x hidden per rank, ~1.5 GB for Qwen3-14B in bf16)
TP_PLAN_OVERRIDES = {"model.embed_tokens": "replicated_with_grad_allreduce"}


def shard_tensor_parallel(model, mesh):
    """Split ``model`` (its whole weights in this process, the same on every rank of ``mesh``) over the ranks of the
    1-d device ``mesh`` by the model's own tensor-parallel plan (transformers' ``base_model_tp_plan``, as
    ``tp_plan="auto"`` applies it): each rank keeps its slice of the attention heads and of the MLP, and the forward
    reduces across the ranks. Used where ``from_pretrained(tp_plan=...)`` cannot be (a tiny random model; a data x
    tensor launch, whose tensor groups are sub-groups of the world). One-line ``ValueError`` for a model without a
    plan. Returns the model."""
    from transformers.distributed.expert_parallel import apply_expert_parallelism
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism

    if not model.config.get_text_config().base_model_tp_plan:
        raise ValueError(
            f"parallel.tensor={mesh.size()}: {model.config.model_type} has no tensor-parallel plan in transformers "
            "(base_model_tp_plan); run it with parallel.tensor=1"
        )
    model._mesh_manager = None  # read by apply_tensor_parallelism (expert meshes only), as maybe_distribute_model sets
    tp_plan, ep_plan, _ = model._resolve_parallel_plans(tensor_config(model.config, mesh.size()))
    model._tp_size = mesh.size()
    model = apply_tensor_parallelism(model, mesh, tp_plan)
    if ep_plan:  # the experts over the same ranks, each on the whole batch, outputs all-reduced (AllReduceEP)
        model = apply_expert_parallelism(model, mesh, mesh, ep_plan, ep_implementation="all_reduce")
    return local_parameters(model, mesh)


def local_parameters(model, mesh):
    """Each parameter of a split ``model`` as this rank's plain slice (a view of the ``DTensor``'s local tensor):
    the plans' inference forwards compute on local tensors anyway and reduce through their hooks, and the compiled
    decode step cannot take tensor-subclass parameters beside the cache it writes in place. Inference only: a
    forward with gradients enabled takes the plans' ``DTensor`` path, which needs ``DTensor`` parameters. Records
    ``mesh`` as ``model.vase_tensor_mesh`` (what :func:`vase.engine.geometry.head_shard` reads). Returns the model."""
    from torch.distributed.tensor import DTensor

    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if isinstance(param, DTensor):
                module._parameters[name] = torch.nn.Parameter(param.to_local(), requires_grad=False)
    model.vase_tensor_mesh = mesh
    return model


def tensor_config(config, tensor: int):
    """transformers' ``DistributedConfig`` of ``parallel.tensor=tensor``: the model's tensor-parallel plan with
    :data:`TP_PLAN_OVERRIDES`, and, for a mixture of experts with an expert plan, its experts split over the same
    ranks (``ep_size = tensor``, ``ep_implementation="all_reduce"``: every rank runs its experts on the whole batch
    and the outputs are summed, no token exchange). One-line ``ValueError`` when the experts do not divide."""
    from transformers.distributed.configuration_utils import DistributedConfig

    cfg = config.get_text_config()
    experts = getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None)
    ep = tensor if experts and getattr(cfg, "base_model_ep_plan", None) else None
    if ep and experts % tensor:
        raise ValueError(
            f"parallel.tensor={tensor}: the model's {experts} experts do not split evenly over the ranks; use a "
            "parallel.tensor that divides them"
        )
    return DistributedConfig(
        tp_size=tensor, tp_plan=dict(TP_PLAN_OVERRIDES), ep_size=ep, ep_implementation="all_reduce"
    )


def weight_bytes(config, dtype: torch.dtype, tensor: int = 1) -> int:
    """Bytes of the weights one rank holds, counted from ``config`` on the meta device (nothing is allocated): every
    parameter at ``dtype``; under ``tensor`` ranks (transformers' ``tp_plan``), a parameter of a module the plan
    or its expert plan splits (the experts of a MoE: :func:`tensor_config`) counts ``1 / tensor``, the others (norms,
    routers, the token embedding: :data:`TP_PLAN_OVERRIDES`) in full."""
    import re

    from transformers import AutoModelForCausalLM

    itemsize = torch.empty((), dtype=dtype).element_size()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    plan = {**(model.tp_plan or {}), **TP_PLAN_OVERRIDES, **(model.ep_plan or {})} if tensor > 1 else {}
    split = [re.compile(re.escape(k).replace(r"\*", r"\d+")) for k, v in plan.items() if "replicated" not in v]
    total = 0.0
    for name, p in model.named_parameters():
        module = name.rsplit(".", 1)[0]
        total += p.numel() * itemsize / (tensor if any(rx.fullmatch(module) for rx in split) else 1)
    return int(total)


def kv_heads_split(config, tensor: int) -> bool:
    """Whether transformers' plan for ``config`` splits the KV heads over ``tensor`` ranks (each rank's cache holds
    ``1 / tensor`` of the full-attention K/V); ``False`` when it keeps every head on every rank (gpt-oss, OLMo 3)."""
    from transformers.distributed.tensor_parallel import get_kv_heads_per_rank

    cfg = config.get_text_config()
    heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    if tensor == 1:
        return False
    plan = {f"model.{k}": v for k, v in (cfg.base_model_tp_plan or {}).items()}
    per_rank = get_kv_heads_per_rank(plan, heads, tensor)
    if per_rank is None:
        raise ValueError(
            f"parallel.tensor={tensor}: the model's {heads} KV heads do not split evenly; use a parallel.tensor that "
            "divides them"
        )
    return per_rank != heads


def world_size() -> int:
    """Ranks of the default process group (1 without one)."""
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
