"""The presets' memory table (docs/scaling.md): weights, KV bytes per token, what fits one H200 / H100, and the
``parallel.tensor`` the full cache needs at the paper's batch, computed from each preset's config.

    python scripts/memory_table.py                          # print the table
    python scripts/memory_table.py --update docs/scaling.md # rewrite the table between its markers

Each preset's config is read with ``AutoConfig`` (the hub cache, or the hub when online); where neither answers, from
the preset's committed copy (``conf/model/configs``, :func:`vase.configs.hub_config`, logged); a preset with neither is
listed as such, never guessed. Numbers: :mod:`vase.run.memory_plan` (weights per rank from the
config on the meta device, the cache of :func:`vase.engine.geometry.config_geometry`, the workspace reserve).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from vase.configs import hub_config  # noqa: E402
from vase.engine.geometry import config_geometry  # noqa: E402
from vase.models import cache_dir  # noqa: E402
from vase.parallel import kv_heads_split, weight_bytes  # noqa: E402
from vase.run.memory_plan import GIB, MemoryPlan, reserve_bytes  # noqa: E402

#: usable memory of one GPU (bytes): H200 141 GB of HBM3e as the driver reports it, H100 80 GB
DEVICES = {"H200": int(140.4 * GIB), "H100": int(79.2 * GIB)}
ROWS, TOKENS, WINDOW = 64, 32768, 64  # the paper's batch: 64 rows of 32K tokens; the recent window
RATIOS = (1, 2, 4, 8)
BEGIN, END = "<!-- memory-table:begin -->", "<!-- memory-table:end -->"


def row_bytes(config, ratio: int, tensor: int) -> int:
    """One row of ``TOKENS`` tokens at ``ratio`` (1: the full cache) on one rank of ``tensor``: full-attention K/V
    of the held tokens (the KV heads split when the plan splits them), sliding rings and the linear state."""
    g = config_geometry(config, 1, TOKENS if ratio == 1 else TOKENS // ratio + WINDOW, torch.bfloat16, "cpu")
    if tensor > 1 and kv_heads_split(config, tensor):
        from dataclasses import replace

        g = replace(g, num_kv_heads=g.num_kv_heads // tensor, num_q_heads=g.num_q_heads // tensor)
    return g.kv_bytes_per_row


def fits(config, device: int, ratio: int, tensor: int = 1) -> int:
    """Rows that fit one rank of ``device`` bytes beside its weights and the reserve."""
    weights, row = weight_bytes(config, torch.bfloat16, tensor), row_bytes(config, ratio, tensor)
    return MemoryPlan(weights, row, 0, reserve_bytes(device), device, tensor).max_rows


def table() -> str:
    from transformers import AutoConfig

    lines = [
        "| preset | weights (bf16) | KV bytes / token | H200: rows at ratio 1 / 2 / 4 / 8 | "
        "H100: rows at ratio 1 / 2 / 4 / 8 | parallel.tensor for 64 rows, full cache (H200 / H100) |",
        "| --- | ---: | ---: | --- | --- | --- |",
    ]
    for path in sorted((ROOT / "conf" / "model").glob("*.yaml")):
        spec = yaml.safe_load(path.read_text())
        name = spec["name"]
        if name.startswith("tiny:"):
            continue
        local = cache_dir() / name  # a wheel model converted once (vase.models.convert_offline_model)
        try:
            config = AutoConfig.from_pretrained(local) if (local / "config.json").exists() else hub_config(name)
        except Exception as err:  # offline, not in the cache and no committed copy
            lines.append(f"| {path.stem} | config not readable here ({type(err).__name__}) | | | | |")
            continue
        g = config_geometry(config, 1, 1, torch.bfloat16, "cpu")
        cells = []
        for dev in DEVICES.values():
            cells.append(" / ".join(str(min(fits(config, dev, r), 999)) for r in RATIOS))
        need = []
        for dev in DEVICES.values():
            t = next((t for t in (1, 2, 4, 8) if _divides(config, t) and fits(config, dev, 1, t) >= ROWS), None)
            need.append(str(t) if t else "> 8")
        weights = weight_bytes(config, torch.bfloat16) / 1e9
        lines.append(
            f"| {path.stem} | {weights:.1f} GB | {g.bytes_per_token:,} | {cells[0]} | {cells[1]} | {' / '.join(need)} |"
        )
    return "\n".join(lines)


def _divides(config, tensor: int) -> bool:
    try:
        kv_heads_split(config, tensor)
        return True
    except ValueError:
        return False


def main() -> int:
    logging.basicConfig(level=logging.WARNING)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--update", type=Path, help="rewrite the table between its markers in this file")
    args = parser.parse_args()
    text = table()
    if args.update is None:
        print(text)
        return 0
    doc = args.update.read_text()
    if BEGIN not in doc or END not in doc:
        raise ValueError(f"--update: {args.update} has no {BEGIN} ... {END} markers to rewrite; add them")
    head, rest = doc.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    args.update.write_text(f"{head}{BEGIN}\n{text}\n{END}{tail}")
    return 0


if __name__ == "__main__":
    from vase.run.oneline import script_main

    script_main(main)
