"""partialcoll-bench report FILE.json [--plot PNG]: who is slow, re-read from a saved run.

FILE is a ``--json`` of ``partialcoll-bench skew --report`` (every mode's table), or a
``pc.Stats.to_dict()`` dumped by a program. Rank 0 prints each table; --plot draws one
(--index, default the last): the rank x round heatmap of lateness and the bar per rank
of the time the others waited for it. Reads a file: run it without mpiexec.
"""
from __future__ import annotations

import os

import partialcoll as pc
from partialcoll import _stats


def add_report_args(p) -> None:
    p.add_argument("file", metavar="FILE.json", help="a --json of skew --report, or a saved Stats.to_dict()")
    p.add_argument("--index", type=int, default=-1, help="which table --plot draws (default -1: the last)")


def report(comm, args) -> dict:
    if not os.path.exists(args.file):
        raise ValueError(f"no such file: {args.file}")
    found = _stats.load(args.file)
    if not found:
        raise ValueError(f"{args.file} holds no who-is-slow table (run skew with --report --json FILE)")
    if not -len(found) <= args.index < len(found):
        raise ValueError(f"--index {args.index}: {args.file} holds {len(found)} tables")
    if comm.rank == 0:
        for stats in found:
            print(stats.table(), end="\n\n", flush=True)
    chosen: pc.Stats = found[args.index]

    def plot(plt, path):
        chosen.plot(path)

    return {"command": "report", "file": args.file, "rows": [s.to_dict() for s in found], "plot": plot}
