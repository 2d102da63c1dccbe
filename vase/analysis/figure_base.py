"""What every figure shares: the result holder, the single-column style, colours, making and saving figures.

Figures are drawn for a paper's single column (:data:`COLUMN_WIDTH`, 3.3 in) with fonts of at least 7 pt
(:data:`PAPER_RC`) and horizontal tick labels where names are long (no rotated text), so they stay legible printed at
that width; a figure with many panels grows in height, never past two columns' width.
"""

from __future__ import annotations

import functools
import logging
import textwrap
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from matplotlib import rc_context
from matplotlib.figure import Figure

from vase.analysis.labels import POLICY_ORDER

logger = logging.getLogger(__name__)

COLUMN_WIDTH = 3.3  # inches: one column of a two-column paper
MIN_FONT = 7.0  # points
PAPER_RC = {
    "font.size": MIN_FONT,
    "axes.titlesize": 8.0,
    "axes.labelsize": MIN_FONT,
    "xtick.labelsize": MIN_FONT,
    "ytick.labelsize": MIN_FONT,
    "legend.fontsize": MIN_FONT,
    "legend.title_fontsize": MIN_FONT,
    "figure.titlesize": 8.0,
    "axes.linewidth": 0.6,
    "lines.linewidth": 1.0,
    "lines.markersize": 3.5,
}


F = TypeVar("F", bound=Callable)


def paper_style(fn: F) -> F:
    """Run a figure-making function under :data:`PAPER_RC`: titles, labels, legends and texts take their sizes when
    they are made (ticks when drawn: :func:`save_figure`), so the whole figure is set at the paper's sizes, not
    matplotlib's 10-12 pt defaults that overflow a 3.3 in column."""

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with rc_context(PAPER_RC):
            return fn(*args, **kwargs)

    return wrapped  # type: ignore[return-value]


@dataclass
class FigureResult:
    """Figures made, and the ones skipped with the reason."""

    figures: dict[str, Figure] = field(default_factory=dict)
    skipped: list[tuple[str, str]] = field(default_factory=list)

    def skip(self, name: str, reason: str) -> None:
        logger.info("figure %s skipped: %s", name, reason)
        self.skipped.append((name, reason))


_PALETTE = [
    "#7f7f7f",
    "#1f77b4",
    "#ff7f0e",
    "#2ca02c",
    "#d62728",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#bcbd22",
    "#17becf",
    "#aec7e8",
    "#ffbb78",
    "#98df8a",
    "#ff9896",
    "#c5b0d5",
    "#c49c94",
]


def _wrap(labels: Iterable[str], width: int = 26) -> list[str]:
    """Tick labels wrapped at ``width`` characters (long ablation names)."""
    return [textwrap.fill(str(t), width) for t in labels]


def wrap_to(text: str, width_in: float, size: float = PAPER_RC["figure.titlesize"]) -> str:
    """``text`` with each line broken at spaces so that it is at most ``width_in`` inches wide at ``size`` points
    (measured with matplotlib's own font metrics; a single word wider than that stays whole)."""
    from matplotlib.font_manager import FontProperties
    from matplotlib.textpath import text_to_path

    prop = FontProperties(size=size)

    def inches(s: str) -> float:
        return text_to_path.get_text_width_height_descent(s, prop, ismath=False)[0] / 72

    out = []
    for line in text.split("\n"):
        cur = ""
        for word in line.split(" "):
            trial = f"{cur} {word}" if cur else word
            if cur and inches(trial) > width_in:
                out.append(cur)
                cur = word
            else:
                cur = trial
        out.append(cur)
    return "\n".join(out)


def policy_color(policy: str, index: int = 0) -> str:
    """A stable colour per policy name (the variants of one policy get shades via ``index``)."""
    base = policy.split("[", 1)[0]
    i = POLICY_ORDER.index(base) if base in POLICY_ORDER else len(POLICY_ORDER) + abs(hash(base)) % 4
    return _PALETTE[(i + 5 * index) % len(_PALETTE)]


def new_figure(width: float = COLUMN_WIDTH, height: float = 2.6) -> Figure:
    """A pyplot-free figure (renders headless with Agg; no global state), single-column wide by default."""
    with rc_context(PAPER_RC):
        return Figure(figsize=(width, height), layout="constrained")


def save_figure(
    fig: Figure, out_dir: str | Path, name: str, formats: Sequence[str] = ("png", "pdf"), dpi: int = 300
) -> list[Path]:
    """Save ``fig`` as ``<out_dir>/<name>.<fmt>`` for each format; return the paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    with rc_context(PAPER_RC):  # ticks are made when the figure is drawn: their font sizes are read here
        for fmt in formats:
            path = out_dir / f"{name}.{fmt}"
            fig.savefig(path, dpi=dpi, format=fmt)
            paths.append(path)
    return paths


def legend_below(fig: Figure, handles: list | None = None, labels: list | None = None, ncols: int = 2) -> None:
    """A compact legend under the axes (inside the figure's width: at most ``ncols`` entries a row)."""
    if handles is None:
        handles, labels = fig.axes[0].get_legend_handles_labels()
    if not handles:
        return
    fig.legend(
        handles,
        labels,
        loc="outside lower center",
        ncols=max(1, min(ncols, len(handles))),
        frameon=False,
        handlelength=1.2,
        columnspacing=0.8,
        handletextpad=0.4,
    )
