"""The rows of the reliability registry (tests/test_reliability.py renders them into docs/reliability.md).

A new feature adds its rows where its tests live: :class:`Refusal` entries (a bad setting refused in one line before
anything is written; ``tests/test_reliability.py::test_refusals`` runs each) and :class:`Case` rows naming the test
that shows anything else; tests/test_reliability_hostile.py is the example (its lists are added to the registry).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Case:
    """One row of the table.

    Attributes:
        area: the table's section.
        fault: the class of bad input or fault, with an example.
        sees: what the user sees (the start of the one-line message, or what happens).
        code: ``run.py``'s exit code (``-`` where no command exits: a library call, a script's own code).
        test: ``<file>::<test function>`` that shows it.
    """

    area: str
    fault: str
    sees: str
    code: str
    test: str


@dataclass(frozen=True)
class Refusal:
    """A bad input refused in one line before anything is written: run here by :func:`test_refusals`.

    Attributes:
        id: the test id.
        area, fault: as :class:`Case`.
        overrides: added to the tiny run's settings (``{tmp}`` is the test's directory; ``{data}`` a data directory
            whose ``math500.jsonl`` holds :attr:`data`).
        expected: the start of the message.
        data: the content of ``{data}/math500.jsonl``.
    """

    id: str
    area: str
    fault: str
    overrides: tuple[str, ...]
    expected: str
    data: bytes = b""
