"""The README's excerpt of a run's summary table, generated from the run's saved files (issue 39).

:func:`excerpt_markdown` renders the chosen lines of the summary ``run.py`` prints at the end of a run, from the run's
``metrics.json``, with what a reader needs to compare a number: the command, the machine, the dtype, the thread count
and the run's wall time (``manifest.json``). :func:`update_readme` puts it between the README's markers. Entry point:
``scripts/readme_excerpt.py``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

BEGIN = "<!-- readme-excerpt:start -->"
END = "<!-- readme-excerpt:end -->"
#: the summary lines the README shows (``run.py``'s ``print_summary`` prints more)
KEYS = (
    "task",
    "policy",
    "budget",
    "samples",
    "accuracy",
    "accuracy_stderr",
    "compression_ratio",
    "decode_tokens_per_second",
    "evictions",
)


def summary_lines(metrics: dict, keys: tuple[str, ...] = KEYS) -> list[str]:
    """``run.py``'s summary lines for ``keys`` (same layout: the key padded to the longest, 4 significant digits)."""
    shown = [(k, metrics[k]) for k in keys if metrics.get(k) is not None]
    width = max(len(k) for k, _ in shown)
    return [f"{k:<{width}}  {v:.4g}" if isinstance(v, float) else f"{k:<{width}}  {v}" for k, v in shown]


def cpu_name(cpuinfo: str) -> str:
    """``"AMD EPYC, native bf16"`` from ``/proc/cpuinfo``: the model name and whether the CPU has native bf16
    (AVX-512 bf16 or AMX), which decides ``model.dtype=auto`` there."""
    name = re.search(r"^model name\s*:\s*(.+)$", cpuinfo, re.M)
    flags = re.search(r"^flags\s*:\s*(.+)$", cpuinfo, re.M)
    flag_set = set(flags.group(1).split()) if flags else set()
    if "amx_bf16" in flag_set:
        isa = "AMX (native bf16)"
    elif "avx512_bf16" in flag_set:
        isa = "AVX-512 with native bf16"
    elif "avx512f" in flag_set:
        isa = "AVX-512, no native bf16"
    elif "avx2" in flag_set:
        isa = "AVX2, no native bf16"
    else:
        isa = "no AVX2"
    return f"{name.group(1).strip() if name else 'unknown CPU'}, {isa}"


def _duration(seconds: float) -> str:
    m, s = divmod(round(seconds), 60)
    return f"{m} min {s} s" if m else f"{s} s"


def excerpt_markdown(run_dir: Path, command: str, cpu: str, note: str = "") -> str:
    """The README block for the run in ``run_dir``, made by ``command`` on a CPU described by ``cpu`` (``note``: what
    else the machine was doing, e.g. ``"other jobs running"``).

    Raises:
        ValueError: the run is incomplete or its files are missing.
    """
    try:
        metrics = json.loads((run_dir / "metrics.json").read_text())
        manifest = json.loads((run_dir / "manifest.json").read_text())
    except FileNotFoundError as err:
        raise ValueError(f"{run_dir}: {Path(err.filename).name} missing; point at a finished run directory") from err
    if not metrics.get("complete", True):
        raise ValueError(f"{run_dir}: the run is incomplete; rerun its command to finish it first")
    device = manifest.get("device", {})
    dtype = str(manifest.get("model", {}).get("dtype", "?")).removeprefix("torch.")
    threads = device.get("torch_threads", "?")
    where = f"{device.get('cpus', '?')}-core {cpu}" if manifest.get("attention", {}).get("device") == "cpu" else cpu
    head = (
        f"`{command}` on a {where}{f' ({note})' if note else ''}, in {dtype} with {threads} "
        f"thread{'s' if threads != 1 else ''}; the run took {_duration(metrics['wall_seconds'])}:"
    )
    return "\n".join([head, "", "```text", *summary_lines(metrics), "```", ""])


def update_readme(readme: Path, block: str) -> None:
    """Replace the text between :data:`BEGIN` and :data:`END` in ``readme`` with ``block``."""
    content = readme.read_text(encoding="utf-8")
    if BEGIN not in content or END not in content:
        raise ValueError(f"{readme}: no {BEGIN} ... {END} markers to write between")
    head, rest = content.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    readme.write_text(f"{head}{BEGIN}\n{block}{END}{tail}", encoding="utf-8")
