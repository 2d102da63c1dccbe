"""Write docs/reliability.md from the registry of tests/test_reliability.py (every bad input and fault, what the user
sees, the test that shows it).

    python scripts/reliability_table.py            # rewrite docs/reliability.md
    python scripts/reliability_table.py --check    # exit 1 when docs/reliability.md is stale (as the test does)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="only check that the file is up to date")
    args = parser.parse_args()
    from tests.test_reliability import DOC, render

    text = render()
    if args.check:
        if DOC.read_text() != text:
            print(f"{DOC.relative_to(ROOT)} is stale: run python scripts/reliability_table.py", file=sys.stderr)
            sys.exit(1)
        return
    DOC.write_text(text)
    print(f"wrote {DOC.relative_to(ROOT)}")


if __name__ == "__main__":
    from vase.run.oneline import script_main

    script_main(main)
