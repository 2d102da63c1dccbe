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

#: the authors' repository at the commit the harness reproduces
AUTHORS_REPO = "terarachang/VaSE@bfa2692"

#: the authors' data files: the harness's file name -> (their file at ``bfa2692``, its sha256). Computed from their
#: repository (``git show bfa2692:<path> | sha256sum``); the copies in ``../shared/data`` are these files byte for byte.
AUTHORS_DATA: dict[str, tuple[str, str]] = {
    "aime24.jsonl": (
        "eval/reasoning_tasks/data/aime24/test.jsonl",
        "a0f7eb9915f60f70fdaa9375414869d101eab639a67acf652cde98166efcd1cc",
    ),
    "aime25.jsonl": (
        "eval/reasoning_tasks/data/aime25/test.jsonl",
        "12467eb9bb7423968809cd205c6ed281a6230e4e0fd6de948ff1d6cded259369",
    ),
    "aime26.jsonl": (
        "eval/reasoning_tasks/data/aime26/test.jsonl",
        "0f06796196f75df28d8034c77a535436a412950557d37aecbd2b2494d5e53193",
    ),
    "amc.jsonl": (
        "eval/reasoning_tasks/data/amc/test.jsonl",
        "43707e1ca784602d8479de24ee8ce36609dbebc46dd152b0b12a46611aa898a4",
    ),
    "gpqa_diamond.jsonl": (
        "eval/reasoning_tasks/data/gpqa/test.jsonl",
        "1eed4e8b60f983b0106a3ae26db2ffa9eff4fb816611f05a172fafee50a81c7f",
    ),
    "hmmt25.jsonl": (
        "eval/reasoning_tasks/data/hmmt/test.jsonl",
        "045ad97877139ae221dcb951e6d11a5096b7b65ebabcc00179b72df3dd8abcff",
    ),
    "livecodebench_v6_medium.jsonl": (
        "eval/reasoning_tasks/data/livecodebench/test.jsonl",
        "9758c5ac9213e89c1ca77ab3923413e32a15e36247f9b0546c4eed5c894f3816",
    ),
    "math500.jsonl": (
        "eval/reasoning_tasks/data/math/test.jsonl",
        "a239272930e5202bf1d5275f7fa475a56687c775a61f1354a6d3371bf9dd7a94",
    ),
    "minerva.jsonl": (
        "eval/reasoning_tasks/data/minerva/test.jsonl",
        "e04ec2bc1d8f80a0091b4b1989f1ffb366f3583f5bae381546a066d4ccc26e3d",
    ),
    "olympiadbench.jsonl": (
        "eval/reasoning_tasks/data/olympiadbench/test.jsonl",
        "8016961fd178845f84b0b6c03afb2c9c8638f7e0b692142608970e5c9faaad2f",
    ),
}

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
        "equivalence": getattr(task, "equivalence", None),
        "code_extraction": getattr(task, "code_extraction", None),
    }


#: settings added to ``protocol.json`` after runs were made, by (section, key): the values under which a stored run
#: that lacks the key was made (the harness's behaviour before the setting existed); see :func:`comparable`
LATER_KEYS: dict[tuple[str, str], tuple[Any, ...]] = {
    ("model", "reasoning_format"): ("think_tags",),
    ("task", "equivalence"): ("math_verify",),
    ("task", "code_extraction"): ("harness",),
    ("protocol", "equivalence"): (None, "math_verify"),
    ("protocol", "code_extraction"): (None, "harness"),
}


def _without_later_keys(protocol: dict, old: Mapping) -> dict:
    """``protocol`` without the :data:`LATER_KEYS` that ``old`` (a stored protocol) lacks and whose value here is the
    behaviour the stored run had: such a run resumes; one that would now be graded otherwise is still refused."""
    out = dict(protocol)
    for (section, key), before in LATER_KEYS.items():
        mine, theirs = out.get(section), old.get(section)
        if isinstance(mine, Mapping) and isinstance(theirs, Mapping) and key in mine and key not in theirs:
            if mine[key] in before:
                out[section] = {k: v for k, v in mine.items() if k != key}
    return out


def data_copy(task: Any) -> dict:
    """Which copy of its data a run read (``resolved.json`` and ``manifest.json`` ``data_copy``), after ``task.load()``.

    ``{"copy": "hub" | "builtin" | "authors" | "local", "files": {name: {"sha256", "authors"}}}``: ``hub`` without
    ``task.data_dir`` (``builtin`` for a task whose problems come from a package or a generator, e.g. HumanEval,
    ``gsm_symbolic``); ``authors`` when every file read that :data:`AUTHORS_DATA` names is the authors' (``authors``:
    its path in their repository); ``local`` otherwise (a file the authors do not ship, e.g. GSM8K, which their code
    loads from the hub, or a copy that is not theirs: ``authors: null``).
    """
    if task.data_dir is None:
        return {"copy": "hub" if task.hub_sources() else "builtin", "files": {}}
    files = {}
    for src in task.resolved_sources():
        if "file" in src:
            path, sha = AUTHORS_DATA.get(src["file"], (None, None))
            files[src["file"]] = {"sha256": src["sha256"], "authors": path if sha == src["sha256"] else None}
    listed = [f for f in files if f in AUTHORS_DATA]
    ok = bool(listed) and all(files[f]["authors"] for f in listed)
    return {"copy": "authors" if ok else "local", "files": files}


def authors_files(task: Any) -> list[str]:
    """The file names of :data:`AUTHORS_DATA` that ``task`` reads from ``task.data_dir`` (each year's for AIME);
    known before anything loads."""
    parts = [task.year_task(y) for y in task.years] if hasattr(task, "year_task") else [task]
    return [p.local_file for p in parts if getattr(p, "local_file", None) in AUTHORS_DATA]


def check_authors_source(task: Any, node: Mapping | None) -> None:
    """Under a protocol that requires the authors' data (``protocol.require_authors_data``: ``protocol=paper``), a
    task whose data the authors ship reads their files from ``task.data_dir``: without it the run would read the
    hub's copies (other files), so it is refused in one line before anything loads."""
    if not (node or {}).get("require_authors_data") or task.data_dir is not None:
        return
    names = authors_files(task)
    if names:
        raise ValueError(
            f"task.data_dir: protocol {settings(node)['name']!r} reads the authors' data files ({', '.join(names)} of "
            f"{AUTHORS_REPO}), not the hub's copies: set task.data_dir=../shared/data (their files, checked against "
            "their sha256), or read the hub with protocol.require_authors_data=false"
        )


def check_authors_data(task: Any, node: Mapping | None) -> None:
    """Under a protocol that requires the authors' data (``protocol.require_authors_data``: ``protocol=paper``), a local
    file of one of the names of :data:`AUTHORS_DATA` must be theirs (its sha256), checked once the task has loaded
    (:func:`check_authors_source` refused a run without ``task.data_dir`` before): one line naming it and the fix."""
    if task.data_dir is None or not (node or {}).get("require_authors_data"):
        return
    for name, entry in data_copy(task)["files"].items():
        if name in AUTHORS_DATA and entry["authors"] is None:
            path, sha = AUTHORS_DATA[name]
            raise ValueError(
                f"task.data_dir: {Path(task.data_dir) / name} is not the authors' copy (sha256 {entry['sha256'][:12]}"
                f"..., theirs {sha[:12]}...: {AUTHORS_REPO} {path}); protocol {settings(node)['name']!r} reads their "
                "files: point task.data_dir at them (../shared/data), or run this copy with "
                "protocol.require_authors_data=false"
            )


def comparable(run_dir: Path, protocol: dict) -> dict:
    """``protocol`` as it is compared with a stored ``protocol.json``: without its ``protocol`` section when the stored
    run predates the section and this is the default preset (the protocol that run used)."""
    stored = run_dir / "protocol.json"
    section = protocol.get("protocol")
    if not stored.exists() or section is None:
        return protocol
    old = read_json(stored)  # a damaged file: one line naming it and the fix
    protocol = _without_later_keys(protocol, old)
    if "protocol" not in old and settings(section) == DEFAULT:
        return {k: v for k, v in protocol.items() if k != "protocol"}
    return protocol
