#!/usr/bin/env python
"""Slim a pilot's results tree into the compact archive committed under docs/data/ (``make slim`` does every pilot).

Logic in :mod:`vase.analysis.slim`: every run's config, protocol, metrics, manifest and throughput, and every sample
without its generated text, in one deterministic ``.tar.xz`` that the generators read as the original tree
(``make tables`` regenerates the published tables from it).

    python scripts/slim_results.py results/pilot docs/data/pilot.tar.xz --wall-seconds 4980
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vase.analysis.slim import slim_tree  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("results", type=Path, help="the pilot's results tree (results/pilot)")
    ap.add_argument("archive", type=Path, help="the compact archive to write (docs/data/pilot.tar.xz)")
    ap.add_argument("--wall-seconds", type=float, default=None, help="wall time of the command that ran the pilot")
    ap.add_argument(
        "--machine",
        default=None,
        help="the machine the runs ran on, in words (for manifests without device.cpu, recorded since issue 38)",
    )
    args = ap.parse_args()
    info = slim_tree(args.results, args.archive, wall_seconds=args.wall_seconds, machine=args.machine)
    size = args.archive.stat().st_size
    print(f"{args.archive}: {info['runs']} runs, {info['samples']} samples of {args.results} ({size / 1024:.0f} KiB)")
    return 0


if __name__ == "__main__":
    from vase.run.oneline import script_main

    script_main(main)
