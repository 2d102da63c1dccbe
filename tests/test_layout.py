"""The layout rules, checked on the source: import direction, long modules, Hydra targets, entry scripts.

* Imports run one way, engine <- run <- analysis (read from the source with ``ast``, imports inside functions
  included): the engine imports neither the runner, the analysis nor the benchmarks; the runner neither the analysis
  nor the benchmarks; the policies and the baselines only the engine (and the policies they build on; a baseline
  that loads a checkpoint, also ``vase.hub``).
* No import cycles between the project's modules (``vase``, ``baselines``, ``tasks``), imports inside functions
  included; an import under ``if TYPE_CHECKING:`` (annotations only, never run) does not count.
* A module of ``vase/``, ``baselines/``, ``tasks/`` or ``scripts/`` over :data:`MAX_LINES` lines says why at its top: a
  line of its docstring starting with :data:`LONG_MARKER`.
* Every ``_target_`` in ``conf/`` imports, and the keys next to it are parameters of what it names.
* Every entry script opens with a docstring holding the command that runs it, and answers ``--help``.
"""

from __future__ import annotations

import ast
import inspect
import runpy
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 500
LONG_MARKER = "Long module:"
# Modules over the limit that another change is editing right now: each entry must still be long and unmarked (the
# test fails once the marker is added or the module shrinks, so the entry cannot go stale).
PENDING_LONG: dict[str, str] = {}

# (files, rule): "forbid" lists the packages the files must not import; "allow" lists the only project packages
# (vase.*, baselines, tasks) they may import.
LAYERS = [
    ("vase/engine", "forbid", ("vase.run", "vase.analysis", "vase.bench", "vase.policies", "baselines", "tasks")),
    ("vase/models.py", "forbid", ("vase.run", "vase.analysis", "vase.bench", "vase.policies", "baselines", "tasks")),
    # a model's reasoning format (the text its tokens are graded as): read by the runner and the benchmarks alike
    ("vase/reasoning.py", "forbid", ("vase.run", "vase.analysis", "vase.bench", "vase.policies", "baselines", "tasks")),
    ("vase/run", "forbid", ("vase.analysis", "vase.bench")),
    ("vase/bench", "forbid", ("vase.run", "vase.analysis")),
    ("vase/analysis", "forbid", ("vase.bench",)),
    ("vase/policies", "allow", ("vase.engine", "vase.policies")),
    # vase.hub (standard library only) gives a baseline that loads a checkpoint the harness's hub errors and pins.
    ("baselines", "allow", ("vase.engine", "vase.policies", "vase.hub", "baselines")),
]
PROJECT_PACKAGES = ("vase", "baselines", "tasks")


def python_files(rel: str) -> list[Path]:
    path = ROOT / rel
    return [path] if path.suffix == ".py" else sorted(path.rglob("*.py"))


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(source: str, module: str, is_package: bool = False) -> list[tuple[int, str]]:
    """``(line, dotted name)`` of every import in ``source`` (at any depth: functions, ``if TYPE_CHECKING`` blocks),
    relative imports resolved against ``module``; ``from a import b`` yields ``a.b`` (``b`` may be a submodule)."""
    package = module if is_package else module.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            out += [(node.lineno, f"{base}.{alias.name}" if alias.name != "*" else base) for alias in node.names]
    return out


def _is_type_checking(node: ast.AST) -> bool:
    test = node.test if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def runtime_imports(source: str, module: str, is_package: bool = False) -> list[str]:
    """The dotted names :func:`imported_modules` finds, less those under ``if TYPE_CHECKING:`` (never executed)."""
    tree = ast.parse(source)
    skipped = set()
    for node in ast.walk(tree):
        if _is_type_checking(node):
            for inner in node.body:
                skipped.update(id(n) for n in ast.walk(inner))
    kept = ast.Module(body=[], type_ignores=[])
    kept.body = [n for n in ast.walk(tree) if isinstance(n, ast.Import | ast.ImportFrom) and id(n) not in skipped]
    return [name for _, name in imported_modules(ast.unparse(kept), module, is_package)]


def import_graph(tops: tuple[str, ...] = PROJECT_PACKAGES) -> dict[str, set[str]]:
    """Module -> the project modules it imports at run time (``from a import b``: ``a.b`` if a module, else ``a``)."""
    files = {module_name(p): p for top in tops for p in sorted((ROOT / top).rglob("*.py"))}
    graph = {}
    for mod, path in files.items():
        edges = set()
        for name in runtime_imports(path.read_text(), mod, path.name == "__init__.py"):
            while name and name not in files:
                name = name.rpartition(".")[0]
            if name and name != mod:
                edges.add(name)
        graph[mod] = edges
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (each a cycle of imports), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []

    def visit(v: str) -> None:  # Tarjan; the graphs here are a few hundred modules deep at most
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(cycles)


def _within(name: str, packages: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


def violations(rel: str, rule: str, packages: tuple[str, ...]) -> list[str]:
    found = []
    for path in python_files(rel):
        mod = module_name(path)
        for line, name in imported_modules(path.read_text(), mod, path.name == "__init__.py"):
            if not _within(name, PROJECT_PACKAGES):
                continue
            bad = _within(name, packages) if rule == "forbid" else not _within(name, packages)
            if bad:
                found.append(f"{path.relative_to(ROOT)}:{line} imports {name}")
    return found


@pytest.mark.parametrize(("rel", "rule", "packages"), LAYERS, ids=[f"{r}-{k}" for r, k, _ in LAYERS])
def test_imports_run_one_way(rel: str, rule: str, packages: tuple[str, ...]):
    assert python_files(rel), f"{rel}: no Python files (was the package moved? update LAYERS)"
    assert not violations(rel, rule, packages), "\n".join(violations(rel, rule, packages))


def test_import_checker_sees_imports_inside_functions_and_relative_ones():
    source = (
        "import torch\n"
        "from vase.engine.policy import Policy\n"
        "def f():\n"
        "    from vase.run import runner\n"
        "    from ..analysis.report import build_report\n"
        "    import vase.bench.jobs\n"
    )
    names = [n for _, n in imported_modules(source, "vase.engine.decode")]
    assert names == ["torch", "vase.engine.policy.Policy", "vase.run.runner", "vase.analysis.report.build_report",
                     "vase.bench.jobs"]  # fmt: skip
    assert [n for _, n in imported_modules("from . import cache\n", "vase.engine", is_package=True)] == [
        "vase.engine.cache"
    ]
    assert not _within("vase.engine2", ("vase.engine",)) and _within("vase.engine.cache", ("vase.engine",))


def test_no_import_cycles():
    graph = import_graph()
    assert {"vase.bench.worker", "vase.bench.jobs", "vase.engine.cache"} <= set(graph)  # the walk found the modules
    cycles = import_cycles(graph)
    assert not cycles, (
        "import cycles (break them, e.g. with a dispatch table of 'module:function' names):\n"
        + "\n".join(" <-> ".join(c) for c in cycles)
    )


def test_cycle_checker_finds_cycles_and_ignores_type_checking_imports():
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert import_cycles({"a": {"b"}, "b": set()}) == []
    source = (
        "from typing import TYPE_CHECKING\n"
        "import vase.engine.policy\n"
        "if TYPE_CHECKING:\n"
        "    from vase.engine.cache import VaseCache\n"
        "def f():\n"
        "    from vase.bench import jobs\n"
    )
    assert runtime_imports(source, "vase.engine.layer") == [
        "typing.TYPE_CHECKING",
        "vase.engine.policy",
        "vase.bench.jobs",
    ]
    # the bench cycle this test was written against (worker -> jobs -> worker) is found on the real sources' shape
    worker = "def run(kind):\n    from vase.bench.jobs import run_config\n"
    jobs = "def run_isolated(spec):\n    from vase.bench.worker import run_isolated\n"
    graph = {
        "vase.bench.worker": {n.rpartition(".")[0] for n in runtime_imports(worker, "vase.bench.worker")},
        "vase.bench.jobs": {n.rpartition(".")[0] for n in runtime_imports(jobs, "vase.bench.jobs")},
    }
    assert import_cycles(graph) == [["vase.bench.jobs", "vase.bench.worker"]]


def _docstring_lines(path: Path) -> list[str]:
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    return [line.strip() for line in doc.splitlines()]


def long_modules() -> dict[str, bool]:
    """Every module over :data:`MAX_LINES` lines -> whether its docstring states why."""
    out = {}
    for top in ("vase", "baselines", "tasks", "scripts"):
        for path in sorted((ROOT / top).rglob("*.py")):
            if len(path.read_text().splitlines()) > MAX_LINES:
                out[str(path.relative_to(ROOT))] = any(s.startswith(LONG_MARKER) for s in _docstring_lines(path))
    return out


def test_long_modules_say_why_at_their_top():
    modules = long_modules()
    unmarked = [m for m, marked in modules.items() if not marked and m not in PENDING_LONG]
    assert not unmarked, f"over {MAX_LINES} lines without a '{LONG_MARKER} <reason>' docstring line: {unmarked}"
    stale = [m for m in PENDING_LONG if modules.get(m, True)]
    assert not stale, f"PENDING_LONG entries now marked or short (remove them): {stale}"


def _targets(node, where: str):
    if isinstance(node, dict):
        if "_target_" in node:
            yield where, node
        for key, value in node.items():
            yield from _targets(value, f"{where}.{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _targets(value, f"{where}[{i}]")


CONF_TARGETS = [
    (f"{path.relative_to(ROOT)}{where}", node)
    for path in sorted((ROOT / "conf").rglob("*.yaml"))
    for where, node in _targets(yaml.safe_load(path.read_text()) or {}, "")
]


def test_conf_has_targets():
    files = {name.split(".yaml")[0] for name, _ in CONF_TARGETS}
    assert len(files) >= 30, files  # every policy, task, model and logger file names one


@pytest.mark.parametrize(("name", "node"), CONF_TARGETS, ids=[n for n, _ in CONF_TARGETS])
def test_every_hydra_target_imports_and_takes_its_keys(name: str, node: dict):
    from hydra.utils import get_object

    obj = get_object(node["_target_"])
    assert callable(obj), f"{name}: {node['_target_']} is not callable"
    params = inspect.signature(obj).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    unknown = [k for k in node if not k.startswith("_") and k not in params]
    assert not unknown, f"{name}: {node['_target_']} takes no {unknown}"


SCRIPTS = sorted((ROOT / "scripts").glob("*.py"))


@pytest.mark.parametrize("path", SCRIPTS, ids=[p.name for p in SCRIPTS])
def test_entry_scripts_document_their_command_and_answer_help(path: Path, monkeypatch, capsys):
    doc = ast.get_docstring(ast.parse(path.read_text()))
    assert doc, f"{path.name}: no docstring at the top"
    assert f"scripts/{path.name}" in doc, f"{path.name}: its docstring does not show the command that runs it"
    monkeypatch.setattr(sys, "argv", [str(path), "--help"])
    monkeypatch.setattr(sys, "path", list(sys.path))  # the scripts put the repository root on sys.path
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(str(path), run_name="__main__")
    assert exit_info.value.code in (0, None)
    assert "usage:" in capsys.readouterr().out
