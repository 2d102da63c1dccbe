"""Committed copies of the hub presets' ``config.json``, for counting weights and cache where the hub is not reachable.

Each hub preset in ``conf/model/*.yaml`` (``name: <org>/<model>``) has a copy of its model's config, architecture
fields only, in ``conf/model/configs/<org>--<model>/config.json`` (where each file's values came from:
``conf/model/configs/README.md``). :func:`hub_config` reads the hub (or its local cache) first and falls back to the
copy only when that fails, with a log line saying so: the copy sizes memory (``scripts/memory_table.py``), it never
replaces the hub config a run loads its weights with.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

#: the committed configs: one folder per hub id, ``/`` written ``--`` (``Qwen/Qwen3-4B`` -> ``Qwen--Qwen3-4B``)
COMMITTED = Path(__file__).resolve().parents[1] / "conf" / "model" / "configs"


def committed_config_dir(name: str, root: Path = COMMITTED) -> Path | None:
    """The folder holding the committed ``config.json`` of hub model ``name`` (``None`` when none is committed)."""
    path = root / name.replace("/", "--")
    return path if (path / "config.json").is_file() else None


def hub_config(name: str, revision: str | None = None, root: Path = COMMITTED) -> Any:
    """The config of hub model ``name`` at ``revision``: from the hub or its cache; when neither can be read here
    (offline, not downloaded), from its committed copy under ``root``, logged as such. Raises the hub's ``OSError``
    when there is no committed copy either."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(name, revision=revision)
    except OSError as err:
        local = committed_config_dir(name, root)
        if local is None:
            raise
        logger.warning(
            "%s: config not readable from the hub here (%s); using the committed copy %s (architecture fields only, "
            "sources in %s)",
            name,
            type(err).__name__,
            local / "config.json",
            root / "README.md",
        )
        return AutoConfig.from_pretrained(local)
