"""The files of ``conf/`` read before Hydra composes anything: one line naming a file and its line when one is bad.

Hydra reports a YAML syntax error in a group file (a tab, an unclosed bracket) as a 100-line traceback, and a group
file holding a list or nothing as an error about some setting it would have set. :func:`check_conf_dir` reads every
``*.yaml`` under ``conf/`` (about 90 small files, ~50 ms) and refuses the first that is not a non-empty mapping of
``key: value`` settings, before ``run.py`` composes the command line.
"""

from __future__ import annotations

from pathlib import Path

import yaml

_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def _where(path: Path, root: Path) -> str:
    try:
        return str(path.relative_to(root.parent))
    except ValueError:
        return str(path)


def check_conf_file(path: Path, root: Path) -> str | None:
    """One line for ``path`` (a file under the config directory ``root``) when it is not a non-empty mapping of
    settings: its name, the line and the fix; ``None`` when it is fine."""
    name = _where(path, root)
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        return f"{name}: not UTF-8 text (byte {err.start}); save it as UTF-8 YAML"
    except OSError as err:
        return f"{name}: cannot read it ({err.strerror}); make it readable"
    try:
        data = yaml.load(text, Loader=_Loader)
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        where = f", line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        what = " ".join(str(err.problem or err.context or "not YAML").split())
        tab = "\t" in text.splitlines()[mark.line] if mark is not None and mark.line < len(text.splitlines()) else False
        fix = "indent with spaces, not tabs" if tab or "'\\t'" in what else "fix the YAML there"
        return f"{name}{where}: the YAML cannot be read ({what}); {fix}"
    except yaml.YAMLError as err:
        return f"{name}: the YAML cannot be read ({' '.join(str(err).split())[:200]}); fix the file"
    example = "conf/generation/default.yaml"
    if data is None:
        return f"{name}, line 1: the file is empty; a config file holds key: value settings (e.g. {example})"
    if not isinstance(data, dict):
        kind = "a list" if isinstance(data, list) else f"a single value ({type(data).__name__})"
        fix = f"write key: value lines (e.g. {example})"
        return f"{name}, line 1: the file holds {kind}, not key: value settings; {fix}"
    return None


def check_conf_dir(root: Path) -> str | None:
    """The first bad file under the config directory ``root`` (:func:`check_conf_file`), or ``None``."""
    for path in sorted(Path(root).rglob("*.yaml")):
        error = check_conf_file(path, Path(root))
        if error:
            return error
    return None
