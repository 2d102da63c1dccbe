"""The ranks of a data-parallel launch agree on what they run, and a rank's one-line error reaches torchrun.

Every rank compares (:func:`agree_on`) its command line (``run.py``, before Hydra starts), its resolved settings (at
the start of :func:`vase.run.runner.run`, before anything is written) and, once planned, its run: the run directory,
the protocol, the data and the weights it resolved. A rank that differs ends every rank with the same one line naming
the first setting that differs (``seed is '0' on rank 0 but '1' on rank 1``): ranks launched by hand or by ``srun``
with different settings would otherwise each write half a run.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

#: the fix of a disagreement between ranks (:func:`agree_on`)
SAME_COMMAND = (
    "start every rank with the same command line, environment, data and weights (torchrun and srun give each rank "
    "the same command); nothing was written"
)


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """``{"a.b": leaf}`` of nested mappings (lists are leaves), in insertion order."""
    if isinstance(value, Mapping) and value:
        out: dict[str, Any] = {}
        for k, v in value.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: value}


def _shown(value: Any) -> str:
    text = "<unset>" if value is _UNSET else repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


_UNSET = object()


def first_difference(values: Sequence[Mapping]) -> tuple[str, Any, int, Any] | None:
    """``(setting, rank 0's value, rank, that rank's value)`` of the first setting (in rank 0's order, then the
    others') on which a rank differs from rank 0, or ``None`` when every rank holds the same."""
    first = _flatten(values[0])
    for rank, other in enumerate(values[1:], 1):
        flat = _flatten(other)
        for key in [*first, *(k for k in flat if k not in first)]:
            a, b = first.get(key, _UNSET), flat.get(key, _UNSET)
            if a is _UNSET or b is _UNSET or a != b:
                return key, a, rank, b
    return None


def agree_on(world: Any, what: str, values: Mapping, fix: str) -> None:
    """Every rank holds the same ``values`` (``{setting: value}``, nested mappings flattened to dotted names), or
    every rank raises the same one-line ``ValueError`` naming the first setting that differs. One process: nothing
    to compare."""
    if world.size == 1:
        return
    gathered = world.step(f"comparing {what}", lambda: dict(values))
    found = first_difference(gathered)
    if found is not None:
        key, a, rank, b = found
        raise ValueError(
            f"the ranks disagree on {what}: {key} is {_shown(a)} on rank 0 but {_shown(b)} on rank {rank}; {fix}"
        )


def command_settings(argv: Sequence[str]) -> dict[str, str]:
    """``{setting: value}`` of a command line (``key=value``; anything else by its position), for :func:`agree_on`."""
    out: dict[str, str] = {}
    for i, arg in enumerate(argv):
        key, eq, value = arg.partition("=")
        out[key if eq else f"argument {i + 1}"] = value if eq else arg
    return out


def record_for_torchrun(line: str) -> None:
    """Hand this rank's one-line error to torchrun (its ``TORCHELASTIC_ERROR_FILE``, the file
    ``torch.distributed.elastic``'s ``@record`` writes): torchrun's failure summary then shows that line as the
    rank's ``traceback`` instead of a pointer to its docs. torchrun still prints its own ``ChildFailedError``
    traceback around it (the README says so); without torchrun, nothing happens."""
    import json
    import time

    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps({"message": line, "timestamp": int(time.time())}))
    except OSError:  # torchrun then says "<N/A>": the line is on the terminal already
        pass
