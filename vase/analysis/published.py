"""The published tables (docs/pilot.md's generated blocks, the README's summary blocks), generated from the committed
compact results, never copied by hand.

Each pilot (:data:`PUBLISHED`) is committed as a slim results archive (:mod:`vase.analysis.slim`) under
``docs/data/``: ``pilot.tar.xz`` (``make pilot``) and ``pilot_reasoning.tar.xz`` with its full-cache control and
selection runs (``make pilot-reasoning``). :func:`write_tables` (``make tables``, ``scripts/make_tables.py``) unpacks
them and rewrites, with the generators of :mod:`vase.analysis.pilot`:

- docs/pilot.md's blocks (:data:`vase.analysis.pilot.BLOCKS`: ``pilot`` and ``reasoning``), in full;
- the README's blocks (:data:`README_BLOCKS`: ``<!-- tables:pilot:begin -->`` ... ``<!-- tables:pilot:end -->`` and
  the same with ``reasoning``), a summary (:func:`vase.analysis.pilot.summary_markdown`), where the README has them.

:func:`stale_tables` says which of those blocks differ from what the generators write (``tests/test_tables.py``).
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from pathlib import Path

from vase.analysis.load import _read_json
from vase.analysis.pilot import (
    BLOCKS,
    pilot_comparisons,
    pilot_markdown,
    pilot_regime,
    pilot_table,
    reasoning_markdown,
    regime_markdown,
    summary_markdown,
)
from vase.analysis.slim import SUFFIX, open_slim, slim_info

logger = logging.getLogger(__name__)

DATA = Path("docs") / "data"
PILOT_DOC = Path("docs") / "pilot.md"
README = Path("README.md")
#: the README's generated blocks: name -> (begin marker, end marker)
README_BLOCKS = {name: (f"<!-- tables:{name}:begin -->", f"<!-- tables:{name}:end -->") for name in BLOCKS}


@dataclass(frozen=True)
class Published:
    """One pilot's published tables.

    Attributes:
        block: its generated block (:data:`BLOCKS`, :data:`README_BLOCKS`).
        name: its results tree ``results/<name>`` and its archive ``docs/data/<name>.tar.xz``.
        make: the command that runs it.
        control, selection: the names of its full-cache control and selection trees (the reasoning pilot).
    """

    block: str
    name: str
    make: str
    control: str | None = None
    selection: str | None = None

    def names(self) -> tuple[str, ...]:
        """Every tree it reads: its own, then the control and selection ones."""
        return tuple(n for n in (self.name, self.control, self.selection) if n)


PUBLISHED = (
    Published("pilot", "pilot", "make pilot"),
    Published(
        "reasoning",
        "pilot_reasoning",
        "make pilot-reasoning",
        control="pilot_reasoning_control",
        selection="pilot_reasoning_select",
    ),
)


def archive(data: Path, name: str) -> Path:
    """The compact results of ``results/<name>``: ``<data>/<name>.tar.xz``."""
    return Path(data) / f"{name}{SUFFIX}"


def slim_command(name: str) -> str:
    """The command that slims ``results/<name>`` into the committed archive."""
    return f"python scripts/slim_results.py results/{name} {(DATA / name).as_posix()}{SUFFIX}"


def missing(pub: Published, data: Path, repo: Path | None = None) -> str:
    """One line: the pilot's compact results are absent, and which commands produce them."""
    path = archive(data, pub.name)
    if repo is not None and path.is_relative_to(repo):
        path = path.relative_to(repo)
    return (
        f"{path}: no compact results for the {pub.block!r} tables; `{pub.make}` produces them (it ends with the "
        f"slim step and make tables), or from an existing results/{pub.name}: `make slim` ({slim_command(pub.name)})"
    )


def render(pub: Published, data: Path) -> tuple[str, str]:
    """``(docs/pilot.md block, README block)`` of ``pub`` from its archives under ``data`` (the control and
    selection ones are optional)."""
    with contextlib.ExitStack() as stack:
        roots = {n: stack.enter_context(open_slim(archive(data, n))) for n in pub.names() if archive(data, n).is_file()}
        root = roots[pub.name]
        info = slim_info(root)
        table = pilot_table(root)
        if pub.block == "reasoning":
            text = reasoning_markdown(
                root,
                control=roots.get(pub.control),
                selection=roots.get(pub.selection),
                wall_seconds=info.get("wall_seconds"),
                command="make tables",
            )
        else:
            text = "\n".join([*regime_markdown(pilot_regime(root)), ""]) + pilot_markdown(
                table, info.get("wall_seconds"), command="make tables", comparisons=pilot_comparisons(root)
            )
        text += machine_line(root, info.get("machine"))
        used = ", ".join(f"`{archive(DATA, n).as_posix()}`" for n in pub.names() if n in roots)
        text += (
            f"From the compact results {used} ({info['runs']} runs, {info['samples']} samples of "
            f"`{info['source']}`; `{pub.make}`, then `make slim`).\n"
        )
        return text, summary_markdown(table, f"[docs/pilot.md](docs/pilot.md) ({pub.block!r} block)")


def _distinct(values) -> str:
    """The distinct values in first-seen order, joined by " / " (``?`` for none)."""
    seen = list(dict.fromkeys(str(v) for v in values if v is not None))
    return " / ".join(seen) if seen else "?"


def machine_line(root: Path, machine: str | None = None) -> str:
    """Where the runs under ``root`` ran, from their manifests: the CPU (``device.cpu`` and the kernels torch picked;
    else ``machine``, the slim step's words), the dtype, torch's threads and the rows in flight per process, and the
    library versions. One line ending in a newline."""
    manifests = [m for p in sorted(Path(root).rglob("manifest.json")) if (m := _read_json(p)) is not None]
    if not manifests:
        return ""
    dev = [m.get("device", {}) for m in manifests]
    ranks = [r for m in manifests for r in m.get("ranks", [])]
    libs = [m.get("libraries", {}) for m in manifests]
    gpus = _distinct(d.get("cuda_device") for d in dev)
    if gpus != "?":
        where = gpus
    elif any(d.get("cpu") for d in dev):
        isa = _distinct(d.get("cpu_capability") for d in dev)
        bf16 = {d.get("cpu_bf16") for d in dev} - {None}
        native = {frozenset({True}): ", native bf16", frozenset({False}): ", no native bf16"}.get(frozenset(bf16), "")
        where = f"{_distinct(d.get('cpus') for d in dev)}-core {_distinct(d.get('cpu') for d in dev)} ({isa}{native})"
    else:
        where = machine or f"a {_distinct(d.get('cpus') for d in dev)}-core CPU (its model not recorded)"
    dtype = _distinct(str(r.get("dtype")).removeprefix("torch.") for r in ranks if r.get("dtype"))
    threads = _distinct(d.get("torch_threads") for d in dev)
    rows = _distinct(r.get("rows_in_flight") for r in ranks)
    versions = ", ".join(f"{k} {_distinct(v.get(k) for v in libs)}" for k in ("torch", "transformers"))
    return (
        f"Ran on: {where}; {dtype}; {threads} torch thread(s) and {rows} rows in flight per process; {versions} "
        f"({len(manifests)} manifests).\n"
    )


def _block(content: str, begin: str, end: str) -> tuple[str, str, str] | None:
    """``(head, body, tail)`` of the block between ``begin`` and ``end`` (body without the newline after ``begin``),
    or ``None`` when ``content`` lacks either marker."""
    if begin not in content or end not in content.split(begin, 1)[1]:
        return None
    head, rest = content.split(begin, 1)
    body, tail = rest.split(end, 1)
    return head, body.removeprefix("\n"), tail


def _targets(repo: Path, pub: Published) -> list[tuple[Path, tuple[str, str], bool]]:
    """``(file, markers, required)`` the tables of ``pub`` go to: docs/pilot.md's block (required) and the README's
    (when it has the markers)."""
    return [(repo / PILOT_DOC, BLOCKS[pub.block], True), (repo / README, README_BLOCKS[pub.block], False)]


def generated(repo: str | Path, data: str | Path | None = None) -> tuple[dict[tuple[Path, str], str], list[str]]:
    """What ``make tables`` writes: ``{(file, begin marker): block text}`` for every pilot whose archive is under
    ``data`` (default ``<repo>/docs/data``), and one line per pilot whose archive is not (:func:`missing`)."""
    repo = Path(repo)
    data = repo / DATA if data is None else Path(data)
    out: dict[tuple[Path, str], str] = {}
    absent = []
    for pub in PUBLISHED:
        if not archive(data, pub.name).is_file():
            absent.append(missing(pub, data, repo))
            continue
        doc_text, readme_text = render(pub, data)
        for (path, (begin, _), _required), text in zip(_targets(repo, pub), (doc_text, readme_text)):
            out[(path, begin)] = text
    return out, absent


def _ends(begin: str) -> str:
    for markers in (*BLOCKS.values(), *README_BLOCKS.values()):
        if markers[0] == begin:
            return markers[1]
    raise KeyError(begin)


def write_tables(repo: str | Path, data: str | Path | None = None) -> tuple[list[str], list[str]]:
    """Rewrite every generated block (see the module docstring); return ``(blocks written, pilots absent)``.

    Raises:
        ValueError: docs/pilot.md lacks a block's markers (one line naming them); nothing is written then.
    """
    blocks, absent = generated(repo, data)
    contents: dict[Path, str] = {}
    written = []
    for (path, begin), text in blocks.items():
        end = _ends(begin)
        content = contents.get(path, path.read_text() if path.exists() else "")
        parts = _block(content, begin, end)
        if parts is None:
            if path.name == README.name:
                continue  # the README carries the summary only where its author put the markers
            raise ValueError(f"{path}: no generated block ({begin} ... {end}) to replace; restore the markers")
        head, _, tail = parts
        contents[path] = f"{head}{begin}\n{text}{end}{tail}"
        written.append(f"{path}: {begin}")
    for path, content in contents.items():
        if not path.exists() or path.read_text() != content:
            path.write_text(content)
    return written, absent


def stale_tables(repo: str | Path, data: str | Path | None = None) -> tuple[list[str], list[str]]:
    """The generated blocks that differ from what :func:`write_tables` would write, one line each (``file: marker``),
    and the pilots whose archives are absent (their blocks are not checked)."""
    blocks, absent = generated(repo, data)
    stale = []
    for (path, begin), text in blocks.items():
        parts = _block(path.read_text() if path.exists() else "", begin, _ends(begin))
        if parts is None:
            if path.name != README.name:
                stale.append(f"{path}: no generated block {begin}")
            continue
        if parts[1] != text:
            stale.append(f"{path}: {begin} differs from `make tables`")
    return stale, absent
