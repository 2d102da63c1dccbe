"""The entry scripts' (``scripts/*.py``) errors in one line: a script's ``main`` wrapped by :func:`script_main`.

Bad input (a ``ValueError``: a results tree that is not one, a damaged sample line) is ``error: <line>``, exit 2; a
file that cannot be read or written (an ``OSError``: a read-only results directory, a full disk, a missing path) is
``error: <file>: <reason>; <fix>``, exit 1; Ctrl-C exits 130. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import NoReturn


def one_line(err: BaseException) -> str:
    """``err``'s message on one line."""
    return " ".join(str(err).split()) or type(err).__name__


def os_error_line(err: OSError) -> str:
    """One line for a file that could not be read or written, naming it."""
    where = f"{err.filename}: " if err.filename else ""
    return f"{where}{err.strerror or one_line(err)}; check the path, its permissions and the disk, then rerun"


def script_main(main: Callable[[], int | None]) -> NoReturn:
    """``sys.exit(main())``, with the one-line errors of the module docstring."""
    try:
        code = main() or 0
    except ValueError as err:
        print(f"error: {one_line(err)}", file=sys.stderr)
        code = 2
    except OSError as err:
        print(f"error: {os_error_line(err)}", file=sys.stderr)
        code = 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        code = 130
    sys.exit(code)
