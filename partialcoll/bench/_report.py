"""Printing and writing benchmark results (rank 0 only)."""
from __future__ import annotations

import csv
import json
import sys

from mpi4py import MPI


def header(title: str, comm) -> str:
    import partialcoll as pc
    info = pc.info()
    idle = "".join(f"; {key.replace('_', ' ')}: {info[key]}" for key in ("idle_policy", "idle") if key in info)
    return (f"# partialcoll {pc.__version__} {title}\n"
            f"# MPI: {info['mpi_library']}; P = {comm.size}; progress: {info['progress']}{idle}")


def progress(message: str) -> None:
    if MPI.COMM_WORLD.rank == 0:
        sys.stderr.write(f"# {message}\n")
        sys.stderr.flush()


def write_outputs(args, result: dict) -> None:
    plot = result.pop("plot", None)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if args.csv:
        rows = result["rows"]
        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0].keys()) if rows else ["empty"])
            w.writeheader()
            w.writerows(rows)
    if args.plot:
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            sys.stderr.write("partialcoll-bench: --plot needs matplotlib (pip install partialcoll[plot])\n")
            sys.exit(2)
        plot(plt, args.plot)
