"""Printing and writing benchmark results (rank 0 prints; every rank agrees on failures)."""
from __future__ import annotations

import csv
import datetime
import json
import shlex
import sys
from typing import List, Optional, Sequence, Tuple

from mpi4py import MPI

from ._common import TAIL


class ValidationFailed(RuntimeError):
    """-c found a wrong result (exit status 1 on every rank)."""


def header(title: str, comm) -> str:
    import partialcoll as pc
    info = pc.info()
    idle = "".join(f"; {key.replace('_', ' ')}: {info[key]}" for key in ("idle_policy", "idle") if key in info)
    return (f"# partialcoll {pc.__version__} {title}\n"
            f"# MPI: {info['mpi_library']} (MPI {info['mpi_version']}); P = {comm.size}; "
            f"progress: {info['progress']}{idle}")


def idle_at_end() -> str:
    """The idle policy as the run ends: auto decides once the engine has run a while (the
    header shows it before), and the numbers of a node with cores to spare depend on it."""
    import partialcoll as pc
    info = pc.info()
    return f"# idle at the end (rank 0's node): {info['idle']} ({info['idle_reason']})"


def progress(message: str) -> None:
    if MPI.COMM_WORLD.rank == 0:
        sys.stderr.write(f"# {message}\n")
        sys.stderr.flush()


Column = Tuple[str, str, int, str]      # (title, row key, width, format)


class Table:
    """One row per (size, mode), nccl-tests' way: size, count, type, mode, the command's own
    columns, then -z's percentiles, algbw, busbw, NAP, extra, and -c's #wrong."""

    def __init__(self, args, middle: Sequence[Column], extra: Sequence[Column] = ()) -> None:
        self.validate = bool(args.validate)
        cols: List[Column] = [("size", "bytes", 10, "d"), ("count", "count", 10, "d"), ("type", "type", 9, "s"),
                              ("mode", "mode", 9, "s"), *middle]
        if args.tail:
            cols += [(f"P{q} us", f"p{q}_us", 9, ".2f") for q in TAIL]
        cols += [("algbw GB/s", "algbw_gbs", 10, ".3f"), ("busbw GB/s", "busbw_gbs", 10, ".3f"),
                 ("NAP", "nap", 6, ".2f"), *extra]
        if self.validate:
            cols.append(("#wrong", "wrong", 7, "d"))
        # at least two spaces between titles, so that a reader (or a script) can split them
        self.cols = [(title, key, max(width, len(title) + 1), fmt) for title, key, width, fmt in cols]
        self.failures: List[str] = []       # -c: what was wrong, in words (rank 0's list)

    def head(self, notes: Sequence[str] = ()) -> str:
        """The notes, one '# ' line each, then the column titles."""
        text = " ".join(f"{title:>{width}}" for title, _, width, _ in self.cols)
        return "".join(f"# {note}\n" for note in notes) + ("#" + text[1:] if text.startswith(" ") else "# " + text)

    def line(self, row: dict) -> str:
        cells = []
        for _, key, width, fmt in self.cols:
            value = row.get(key)
            cells.append(f"{'-':>{width}}" if value is None else f"{value:>{width}{fmt}}")
        return " ".join(cells)

    def tail(self, rows: Sequence[dict]) -> str:
        """nccl-tests' closing lines: the average bus bandwidth, and -c's verdict."""
        busbw = [r["busbw_gbs"] for r in rows if r.get("busbw_gbs") == r.get("busbw_gbs")]
        lines = [f"# Avg bus bandwidth: {sum(busbw) / len(busbw) if busbw else 0:.3f} GB/s (over every row)",
                 idle_at_end()]
        if self.validate:
            wrong = sum(r.get("wrong") or 0 for r in rows)
            unchecked = sum(r.get("wrong") is None for r in rows)
            lines.append(f"# -c: {wrong} wrong elements {'FAILED' if wrong else 'OK'}"
                         + (f" ({unchecked} rows not checked: '-')" if unchecked else ""))
        return "\n".join(lines)

    def fail_if_wrong(self, comm, rows: Sequence[dict]) -> None:
        """-c: every rank raises ValidationFailed if any row had a wrong element (rank 0
        prints the first failures)."""
        if not self.validate:
            return
        bad = comm.bcast(sum(bool(r.get("wrong")) for r in rows) if comm.rank == 0 else None, root=0)
        if bad:
            if comm.rank == 0:
                for failure in self.failures[:10]:
                    print(f"# FAIL {failure}")
                sys.stdout.flush()
            raise ValidationFailed(f"-c: {bad} row(s) with wrong results")


def run_info(comm, argv: Optional[Sequence[str]]) -> dict:
    """What --json records about the run: when, how, and on what MPI."""
    import mpi4py

    import partialcoll as pc
    info = pc.info()
    vendor, version = MPI.get_vendor()
    command = ["partialcoll-bench", *argv] if argv is not None else sys.argv
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command_line": shlex.join(command), "P": comm.size,
            "mpi_library": info["mpi_library"], "mpi_version": info["mpi_version"],
            "mpi_vendor": f"{vendor} {'.'.join(map(str, version))}", "mpi4py": mpi4py.__version__,
            "partialcoll": pc.__version__, "host": MPI.Get_processor_name(), "info": info}


def write_outputs(args, result: dict) -> None:
    plot = result.pop("plot", None)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1, default=str)
    if args.csv:
        rows = result["rows"]
        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0].keys()) if rows else ["empty"], extrasaction="ignore")
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
