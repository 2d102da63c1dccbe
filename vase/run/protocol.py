"""The protocol preset (``conf/protocol/``): the knobs of docs/protocol.md, as one run used them.

``protocol=default`` keeps the harness's own choices; ``protocol=paper`` reproduces the authors' code
(terarachang/VaSE at ``bfa2692``) knob for knob, on top of task and model. Some knobs live in the ``protocol`` node
(``grader``, ``score_dtype``, ``n_protect``), the others where they act (``generation.top_k``, ``model.dtype``, the
policy's ``n_protect``, GPQA's ``shuffle_choices``), so the preset sets those. :func:`protocol_knobs` reads every knob
back from what the run will really use (the built task, policy and sampling), and the runner writes it as the
``protocol`` section of ``protocol.json``. Its settings are checked up front by :func:`vase.run.checks.check_settings`.

A run directory written before the preset existed has no ``protocol`` section: it was a ``protocol=default`` run, and
:func:`comparable` lets it resume under the default preset.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from vase.run.results import read_json, stable_hash

#: the ``protocol`` node's own settings under ``protocol=default`` (``conf/protocol/default.yaml``)
DEFAULT = {"name": "default", "grader": "strict", "score_dtype": "float32"}


def settings(node: Mapping | None) -> dict:
    """The preset's own settings that name it (name, grader, score dtype), defaults filled in."""
    node = dict(node or {})
    return {k: node.get(k, v) for k, v in DEFAULT.items()}


def run_tag(node: Mapping | None) -> str:
    """The suffix of a run directory's name: ``""`` under the default settings, else ``-<name>`` (``-paper``), or
    ``-<name>-<hash>`` when the default preset's own settings were changed, so runs of two protocols never share a
    directory (resuming one under the other would be refused)."""
    own = settings(node)
    if own == DEFAULT:
        return ""
    if own["name"] != DEFAULT["name"]:
        return f"-{own['name']}"
    return f"-{own['name']}-{stable_hash(own, 4)}"


def protocol_knobs(prep: Any, grader: str) -> dict:
    """Every knob of docs/protocol.md with the value this run uses (``None``: the knob does not apply).

    Read from the built objects, not the config, so an override anywhere (``generation.top_k=20`` under
    ``protocol=paper``) is what is recorded.
    """
    node = dict(prep.cfg.get("protocol") or {})
    policy, task = prep.policy, prep.task
    protect = getattr(policy, "protect_count", None)
    return {
        "name": settings(node)["name"],
        "grader": grader,
        "grader_rules": list(task.grader_rules),
        "score_dtype": settings(node)["score_dtype"],
        "temperature": prep.sampling.temperature,
        "top_p": prep.sampling.top_p,
        "top_k": prep.sampling.top_k,
        "greedy": prep.sampling.greedy,
        "max_length": prep.max_length,
        "thinking": prep.thinking,
        "prompt_suffix": getattr(task, "prompt_suffix", None),
        "shuffle_choices": getattr(task, "shuffle_choices", None),
        "n_samples": prep.n_samples,
        "model_dtype": prep.model_spec.dtype,
        "attn_backend": prep.cfg.generation.get("attn_backend", "auto"),
        "budget": None if policy.kind == "none" else prep.cfg.budget,
        "window": None if policy.kind == "none" else prep.cfg.window,
        "n_protect": protect if policy.kind != "none" else None,
        "n_protect_setting": getattr(policy, "n_protect", None),
        "sinks": getattr(policy, "sinks", None),
        "smooth_kernel": getattr(policy, "smooth_kernel", None),
        "smooth_along": getattr(policy, "smooth_along", None),
        "attn_temperature": getattr(policy, "attn_temperature", None),
        "value_stat": getattr(policy, "value_stat", None),
    }


def comparable(run_dir: Path, protocol: dict) -> dict:
    """``protocol`` as it is compared with a stored ``protocol.json``: without its ``protocol`` section when the stored
    run predates the section and this is the default preset (the protocol that run used)."""
    stored = run_dir / "protocol.json"
    section = protocol.get("protocol")
    if not stored.exists() or section is None:
        return protocol
    old = read_json(stored)  # a damaged file: one line naming it and the fix
    if "protocol" not in old and settings(section) == DEFAULT:
        return {k: v for k, v in protocol.items() if k != "protocol"}
    return protocol
