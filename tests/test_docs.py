"""The README and the guides in docs/ (issue 39): the README's size and order, no commit hashes in it, every relative
link resolves (file and #anchor), and every ``python run.py …`` line composes with Hydra and passes the preflight.

Commands are read from fenced code blocks and inline code spans (``python run.py …``, ``torchrun … run.py …``,
``make run ARGS="…"``); a backslash continues a line, a ``#`` comment ends it. Two levels:

* every command in README.md and docs/*.md: Hydra composes every cell (a ``-m`` sweep's product included), every
  setting passes :func:`vase.run.checks.check_settings` and the task, model and policy are built
  (:func:`vase.run.planning.prepare`: no data, tokenizer or weights loaded);
* every command in README.md and the guides, except a block or paragraph that follows the marker
  ``<!-- docs-test: compose-only -->`` (a line that needs the hub, a GPU or SLURM): the whole preflight ``run.py``
  runs before Hydra starts (:func:`run.check_runs`: the data, the model's config, the tokenizer, the device and the
  memory), with ``results_dir`` in a temporary directory. A ``task.data_dir`` that does not exist from the repository
  root (written for the main checkout, ``../shared/data``) is replaced by the benchmark files found beside this
  checkout, completed by the test fixtures (:func:`local_data`).

A block or paragraph after ``<!-- docs-test: refused -->`` shows a mistake: each of its commands must be refused in
one line before anything runs. A command with a placeholder (``<…>``, ``…``) is a template, not a command: it is left
out.
"""

from __future__ import annotations

import importlib.util
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
#: the guides whose commands get the whole preflight (those present; other docs get the compose level)
GUIDE_NAMES = (
    "getting-started.md",
    "reproducing.md",
    "adding-a-policy.md",
    "adding-a-task.md",
    "adding-a-model-family.md",
    "outputs.md",
    "gpus.md",
    "scaling.md",
)
GUIDES = [README, *[ROOT / "docs" / n for n in GUIDE_NAMES if (ROOT / "docs" / n).exists()]]
MARKERS = {"<!-- docs-test: compose-only": "compose-only", "<!-- docs-test: refused": "refused"}
README_MAX_CHARS = 12_000


def _text(path: Path) -> str:
    return path.read_text(encoding="utf-8")


# --------------------------------------------------------------------------------------------------------------------
# the README's shape


def test_readme_is_at_most_12000_characters():
    n = len(_text(README))
    assert n <= README_MAX_CHARS, f"README.md has {n} characters (limit {README_MAX_CHARS}): move detail to docs/"


def test_readme_names_make_run_and_make_test_in_its_first_60_lines():
    head = "\n".join(_text(README).splitlines()[:60])
    assert "make run" in head and "make test" in head


#: 7-40 hex characters with a digit, standing alone: what a commit hash looks like
_SHA = re.compile(r"(?<![0-9A-Za-z_./-])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}(?![0-9A-Za-z_-])")


def test_sha_pattern_catches_hashes_and_spares_numbers():
    assert _SHA.findall("at commit 89ae75c, then 1595611; full d3881a8c3e474c785e810") == [
        "89ae75c",
        "1595611",
        "d3881a8c3e474c785e810",
    ]
    assert not _SHA.findall("arXiv 2606.03928, 16,320 evictions, 12000 chars, facade, v0.1.0, x/1234567/y")


def test_readme_has_no_commit_hashes():
    found = _SHA.findall(_text(README))
    assert not found, f"README.md quotes what look like commit hashes: {found} (say what changed instead)"


# --------------------------------------------------------------------------------------------------------------------
# links


def _strip_fences(text: str) -> str:
    """``text`` with fenced code blocks blanked (their lines kept, so line numbers stay)."""
    out, fence = [], None
    for line in text.splitlines():
        m = re.match(r"^\s*(```+|~~~+)", line)
        if fence is None and m:
            fence = m.group(1)[0] * 3
            out.append("")
        elif fence is not None:
            if line.strip().startswith(fence):
                fence = None
            out.append("")
        else:
            out.append(line)
    return "\n".join(out)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: links and code marks dropped, lower case, punctuation removed, spaces to ``-``."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip())
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a Markdown file (GitHub numbers repeated ones ``-1``, ``-2``, …)."""
    seen: dict[str, int] = {}
    out = set()
    for line in _strip_fences(_text(path)).splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        s = slug(m.group(1))
        n = seen.get(s, 0)
        out.add(s if n == 0 else f"{s}-{n}")
        seen[s] = n + 1
    return out


def test_slug_follows_github():
    assert slug("The second pilot: the paper's regime (MATH-500)") == "the-second-pilot-the-papers-regime-math-500"
    assert slug("How long it takes, and how it was run") == "how-long-it-takes-and-how-it-was-run"
    assert slug("`policy=` and `task=`") == "policy-and-task"
    assert slug("Data & tensor parallel") == "data--tensor-parallel"


_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def _links(path: Path) -> list[str]:
    text = re.sub(r"`[^`\n]*`", "", _strip_fences(_text(path)))  # code spans hold no links
    return [t for t in _LINK.findall(text) if not re.match(r"^[a-z][a-z0-9+.-]*:", t)]  # http:, mailto:, ...


@pytest.mark.parametrize("path", [README, *DOCS], ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(path):
    broken = []
    for target in _links(path):
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target} (no heading #{anchor} in {dest.name})")
    assert not broken, f"{path.name}: broken links: {broken}"


# --------------------------------------------------------------------------------------------------------------------
# commands


@dataclass(frozen=True)
class Command:
    doc: str  # the file, relative to the repository root
    line: int
    text: str  # as written
    args: tuple[str, ...]  # what run.py gets
    mode: str  # "check" (the whole preflight), "compose-only" or "refused"

    def __str__(self) -> str:
        return f"{self.doc}:{self.line}: {self.text[:90]}"


def _run_args(text: str) -> list[str] | None:
    """run.py's arguments in a shell line (``None``: not a run.py line, or a template)."""
    try:
        words = shlex.split(text, comments=True)
    except ValueError:
        return None
    if re.search(r"<[^>]*>|…|\.\.\.", " ".join(words)):
        return None
    while words and words[-1] in ("&", ";", "&&"):
        words.pop()
    if not words:
        return None
    if words[:2] == ["make", "run"]:
        args = [w.split("=", 1)[1] for w in words[2:] if w.startswith("ARGS=")]
        return shlex.split(args[0]) if args else []
    launcher = words[0] in ("python", "python3", "torchrun") or words[0].endswith("/python")
    if launcher and "run.py" in words:
        return words[words.index("run.py") + 1 :]
    return None


def commands(path: Path, root: Path = ROOT) -> list[Command]:
    """Every run.py command of a Markdown file, in order."""
    out: list[Command] = []
    lines = _text(path).splitlines()
    rel = str(path.relative_to(root))
    fence = None
    marked = ""  # a marker's mode, seen and applying to the next block or paragraph
    mode = "check"  # the mode of the block or paragraph being read
    pending, start = "", 0
    for i, line in enumerate(lines, 1):
        stripped = line.strip()
        seen = [m for k, m in MARKERS.items() if k in line]
        if seen:
            marked, mode = seen[0], "check"
            continue
        m = re.match(r"^\s*(```+|~~~+)", line)
        if fence is None and m:
            fence = m.group(1)[0] * 3
            mode, marked = marked or "check", ""
            continue
        if fence is not None:
            if stripped.startswith(fence):
                fence, mode = None, "check"
                continue
            body = re.sub(r"^\$\s+", "", stripped)
            if pending:
                body = pending + " " + body
            else:
                start = i
            if body.endswith("\\"):
                pending = body[:-1].rstrip()
                continue
            pending = ""
            args = _run_args(body)
            if args is not None:
                out.append(Command(rel, start, body, tuple(args), mode))
            continue
        if not stripped:
            mode = "check"
            continue
        if marked:
            mode, marked = marked, ""
        for span in re.findall(r"`([^`\n]+)`", line):
            args = _run_args(span)
            if args is not None:
                out.append(Command(rel, i, span, tuple(args), mode))
    return out


def test_command_reader_reads_blocks_spans_continuations_and_markers(tmp_path):
    doc = tmp_path / "x.md"
    doc.write_text(
        'Run `python run.py policy=full` or `make run ARGS="limit=1 n_samples=1"`.\n\n'
        "```bash\n"
        "python run.py -m sweep=smoke \\\n"
        "    seed=1   # a comment\n"
        "python run.py model.name=<hub id>\n"
        "```\n\n"
        "<!-- docs-test: compose-only (needs the hub) -->\n"
        "```bash\n"
        "torchrun --nproc-per-node 8 run.py model=qwen3_4b\n"
        "```\n\n"
        "`python run.py seed=2`\n\n"
        "<!-- docs-test: refused -->\n"
        "`python run.py polcy=full`\n",
        encoding="utf-8",
    )
    got = [(c.args, c.mode) for c in commands(doc, root=tmp_path)]
    assert got == [
        (("policy=full",), "check"),
        (("limit=1", "n_samples=1"), "check"),
        (("-m", "sweep=smoke", "seed=1"), "check"),
        (("model=qwen3_4b",), "compose-only"),
        (("seed=2",), "check"),
        (("polcy=full",), "refused"),
    ]


def _first_of_each(found: list[Command]) -> list[Command]:
    """One command per argument list (the same line in two docs is checked once, under its first place)."""
    seen: dict[tuple[str, ...], Command] = {}
    for c in found:
        seen.setdefault(c.args, c)
    return list(seen.values())


ALL_COMMANDS = _first_of_each([c for p in [README, *DOCS] for c in commands(p) if c.mode != "refused"])
GUIDE_COMMANDS = _first_of_each([c for p in GUIDES for c in commands(p) if c.mode == "check"])
REFUSED = [c for p in [README, *DOCS] for c in commands(p) if c.mode == "refused"]


def test_the_readme_and_guides_carry_commands():
    assert any(c.doc == "README.md" for c in ALL_COMMANDS)
    assert len(GUIDE_COMMANDS) >= 5


def _cli():
    spec = importlib.util.spec_from_file_location("vase_run_script_docs", ROOT / "run.py")
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    return cli


@pytest.fixture(scope="module")
def cli():
    return _cli()


FIXTURES = ROOT / "tests" / "fixtures" / "tasks"
_data: list[Path] = []


def local_data() -> Path:
    """A data directory for lines written for another one: the benchmark files beside this checkout or its main
    checkout (``../shared/data``), and the test fixtures under their real names (``gsm8k.jsonl``) for the files it
    lacks (all of them where there is no such directory)."""
    if _data:
        return _data[0]
    import tempfile

    out = Path(tempfile.mkdtemp(prefix="vase-docs-data-"))
    for parent in ROOT.parents:
        shared = parent / "shared" / "data"
        if (shared / "math500.jsonl").exists():
            for f in shared.iterdir():
                (out / f.name).symlink_to(f)
            break
    for f in FIXTURES.iterdir():
        name = f.name.replace(".fixture.jsonl", ".jsonl")
        if not (out / name).exists():
            (out / name).symlink_to(f)
    _data.append(out)
    return out


def _local(args: tuple[str, ...], results: Path) -> list[str]:
    """``args`` for this machine: results in ``results``; a ``task.data_dir`` that is not here (written for the
    main checkout, or made by a ``cp`` line before it) replaced by :func:`local_data`."""
    out = []
    for a in args:
        key, eq, value = a.partition("=")
        if eq and key.lstrip("+") == "task.data_dir" and value and value != "null" and not (ROOT / value).exists():
            a = f"{key}={local_data()}"
        if eq and key.lstrip("+") in ("results_dir", "run_dir"):
            continue
        out.append(a)
    return [*out, f"results_dir={results}"]


@pytest.mark.parametrize("command", ALL_COMMANDS, ids=str)
def test_every_command_composes_and_its_settings_pass(command, cli, tmp_path):
    from vase.run.planning import prepare

    args = _local(command.args, tmp_path / "results")
    error = cli.check_group_choices(args) or cli.check_overrides(args)
    assert error is None, f"{command}\n  -> {error}"
    for _cell, cfg in cli._checked["composed"]:
        try:
            prepare(cfg)
        except ValueError as err:
            pytest.fail(f"{command}\n  -> {err}")


def _wheels_installed(name: str) -> bool:
    """Whether the PyPI wheels of the offline model ``name`` are installed (``make setup-models``)."""
    from vase.models import OFFLINE_MODELS

    return all(importlib.util.find_spec(p) for p in OFFLINE_MODELS[name].packages)


def needs(command: Command, cli) -> str | None:
    """What a command needs that a test machine has not (``None``: nothing): GPUs for a ``torchrun`` line or a CUDA
    device, the hub for a hub model or a hub task without ``task.data_dir``. Read from its composed cells."""
    from vase.models import OFFLINE_MODELS
    from vase.run.planning import prepare

    if command.text.split()[0] == "torchrun":
        return "GPUs (torchrun)"
    args = _local(command.args, Path("/nonexistent-results"))
    if cli.check_group_choices(args) or cli.check_overrides(args):
        return None  # the compose test reports it
    for _cell, cfg in cli._checked["composed"]:
        prep = prepare(cfg)
        name, device = prep.model_spec.name, str(prep.model_spec.device)
        if not (name in OFFLINE_MODELS or name.startswith("tiny:") or (ROOT / name).is_dir()):
            return f"the hub (model {name})"
        if prep.task.data_dir is None and prep.task.hub_sources():
            return f"the hub (task {prep.task.name} without task.data_dir)"
        if name in OFFLINE_MODELS and not _wheels_installed(name):
            return f"the offline model wheels of {name} (make setup-models; `make test` installs none)"
        if device.startswith("cuda"):
            import torch

            if not torch.cuda.is_available():
                return "a GPU (model.device=cuda)"
    return None


@pytest.mark.parametrize("command", GUIDE_COMMANDS, ids=str)
def test_every_guide_command_passes_the_preflight(command, cli, tmp_path):
    """The whole preflight; a line that needs the hub or GPUs is skipped here with the reason (the compose test above
    still composed and built it)."""
    reason = needs(command, cli)
    if reason:
        pytest.skip(f"needs {reason}")
    args = _local(command.args, tmp_path / "results")
    error = cli.check_group_choices(args) or cli.check_overrides(args) or cli.check_runs(args)
    assert error is None, f"{command}\n  -> {error}"
    assert not (tmp_path / "results").exists() or not any((tmp_path / "results").rglob("samples.jsonl"))


@pytest.mark.parametrize("command", REFUSED, ids=str)
def test_every_mistake_shown_is_refused_in_one_line(command, cli, tmp_path):
    args = [*command.args, f"results_dir={tmp_path / 'results'}"]
    error = cli.check_group_choices(args) or cli.check_overrides(args) or cli.check_runs(args)
    assert error is not None and "\n" not in error, f"{command}: not refused"


# --------------------------------------------------------------------------------------------------------------------
# the README's generated excerpt (scripts/readme_excerpt.py)


def test_excerpt_lines_are_the_summary_lines_run_py_prints(cli, capsys):
    from vase.analysis.readme_excerpt import KEYS, summary_lines

    metrics = {"task": "humaneval", "policy": "vase_attnv", "budget": 64, "accuracy": 0.453125, "evictions": 16296}
    metrics |= {"decode_tokens_per_second": 67.71, "loop_rate": 0.0, "samples": 64, "run_dir": "results/x"}
    cli.print_summary(metrics)
    printed = capsys.readouterr().out.splitlines()
    mine = summary_lines(metrics)
    assert [line.split()[0] for line in mine] == [k for k in KEYS if k in metrics]
    assert all(line.split() in [p.split() for p in printed] for line in mine)  # the same key and value text


def test_excerpt_names_command_machine_dtype_threads_and_fills_the_markers(tmp_path):
    from vase.analysis.readme_excerpt import BEGIN, END, cpu_name, excerpt_markdown, update_readme

    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.json").write_text('{"accuracy": 0.5, "samples": 64, "wall_seconds": 312.4, "complete": true}')
    manifest = '{"device": {"cpus": 2, "torch_threads": 1}, "model": {"dtype": "torch.bfloat16"}, '
    (run / "manifest.json").write_text(manifest + '"attention": {"device": "cpu"}}')
    cpu = cpu_name("model name\t: AMD EPYC\nflags\t\t: fpu avx2 avx512f avx512_bf16\n")
    assert cpu == "AMD EPYC, AVX-512 with native bf16"
    block = excerpt_markdown(run, "OMP_NUM_THREADS=1 python run.py", cpu)
    assert block.startswith("`OMP_NUM_THREADS=1 python run.py` on a 2-core AMD EPYC, AVX-512 with native bf16, ")
    assert "in bfloat16 with 1 thread; the run took 5 min 12 s:" in block and "accuracy  0.5" in block
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\n{BEGIN}\nold\n{END}\n\nafter\n")
    update_readme(readme, block)
    assert readme.read_text() == f"# x\n\n{BEGIN}\n{block}{END}\n\nafter\n"
    with pytest.raises(ValueError, match="markers"):
        update_readme(_no_markers(tmp_path), block)
    (run / "metrics.json").write_text('{"complete": false, "wall_seconds": 1}')
    with pytest.raises(ValueError, match="incomplete"):
        excerpt_markdown(run, "make run", cpu)


def _no_markers(tmp_path: Path) -> Path:
    path = tmp_path / "plain.md"
    path.write_text("# no markers\n")
    return path


def test_the_readme_carries_the_excerpt_markers():
    from vase.analysis.readme_excerpt import BEGIN, END

    text = _text(README)
    assert text.count(BEGIN) == 1 and text.count(END) == 1 and text.index(BEGIN) < text.index(END)


def test_needs_names_what_a_line_needs_beyond_this_machine(cli):
    def cmd(text: str) -> Command:
        return Command("x.md", 1, text, tuple(_run_args(text)), "check")

    assert needs(cmd("torchrun --nproc-per-node 8 run.py"), cli) == "GPUs (torchrun)"
    assert needs(cmd("python run.py model=qwen3_4b task=humaneval"), cli) == "the hub (model Qwen/Qwen3-4B)"
    assert needs(cmd("python run.py task=aime"), cli) == "the hub (task aime without task.data_dir)"
    local = None if _wheels_installed("qwen2.5_coder_0.5b") else "the offline model wheels of qwen2.5_coder_0.5b"
    lines = ("python run.py task=math500 task.data_dir=../shared/data limit=1", "python run.py -m policy=full,snapkv")
    for line in lines:
        reason = needs(cmd(line), cli)
        assert reason == local if local is None else reason.startswith(local), (line, reason)
