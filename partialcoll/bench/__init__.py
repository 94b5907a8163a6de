"""partialcoll-bench: MPI microbenchmarks of partial collectives (run under mpiexec).

    mpiexec -n 4 partialcoll-bench latency -m 8:16M --modes mpi,full,solo -z -c
    mpiexec -n 8 partialcoll-bench skew --skew linear:1ms -i 64            (the paper's method)
    mpiexec -n 8 partialcoll-bench skew --sync none -z -c                  (free-running, checked)
    mpiexec -n 2 partialcoll-bench calibrate                               (the model "auto" uses)
    mpiexec -n 8 partialcoll-bench skew --report --json skew.json           (who is slow, per mode)
    partialcoll-bench report skew.json --plot who.png

OSU's options (-m [MIN:]MAX, -i, -x, -z, -c) and nccl-tests' (-f factor, the count, type,
algbw, busbw and #wrong columns); sizes step by powers of 2. `partialcoll-bench COMMAND
--help` explains every column.

One registry of commands, each a function of (comm, args) that returns the measured
rows; rank 0 prints them under '#' headers and writes --json/--csv/--plot.
"""
from __future__ import annotations

import argparse
import sys
from typing import Callable, Dict, List, Optional

from mpi4py import MPI

from ._report import ValidationFailed, run_info, write_outputs
from .calibrate import add_calibrate_args, calibrate
from .latency import add_latency_args, latency
from .report import add_report_args, report
from .skew import add_skew_args, skew

COMMANDS: Dict[str, tuple] = {
    "latency": (latency, add_latency_args, "allreduce latency over message sizes (OSU's osu_allreduce, "
                                           "nccl-tests' columns)"),
    "skew": (skew, add_skew_args, "eager-SGD Fig. 9: latency and NAP under a skew pattern"),
    "calibrate": (calibrate, add_calibrate_args, "measure alpha, beta, gamma, o for algorithm='auto' and cache "
                                                 "them for this machine"),
    "report": (report, add_report_args, "who is slow: re-read the per-rank tables of a saved skew --report "
                                        "--json (or a Stats.to_dict()) and draw one (--plot)"),
}


class _Parser(argparse.ArgumentParser):
    def error(self, message):           # usage on rank 0 only, exit 2 on every rank
        if MPI.COMM_WORLD.rank == 0:
            self.print_usage(sys.stderr)
            sys.stderr.write(f"{self.prog}: error: {message}\n")
        sys.exit(2)

    def exit(self, status=0, message=None):
        if message and MPI.COMM_WORLD.rank == 0:
            sys.stderr.write(message)
        sys.exit(status)

    def print_help(self, file=None):
        if MPI.COMM_WORLD.rank == 0:
            super().print_help(file)


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog="partialcoll-bench", description=__doc__,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    for name, (_, add_args, helptext) in COMMANDS.items():
        sp = sub.add_parser(name, help=helptext, description=helptext,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
        add_args(sp)
        sp.add_argument("--json", metavar="FILE", help="write every measured figure as JSON")
        sp.add_argument("--csv", metavar="FILE", help="write the table as CSV")
        sp.add_argument("--plot", metavar="FILE.png", help="draw the results (needs matplotlib)")
        sp.add_argument("--rc", metavar="KEY=VALUE,...", default="",
                        help="partialcoll.rc options set before the engine starts (e.g. progress=inline)")
    return p


def _apply_rc(spec: str) -> None:
    """--rc a=1,b=x: numbers as numbers, 'none' as None; unknown keys raise ValueError."""
    import partialcoll as pc
    for item in filter(None, (part.strip() for part in spec.split(","))):
        key, eq, text = item.partition("=")
        if not eq:
            raise ValueError(f"--rc wants KEY=VALUE, not {item!r}")
        value: object = None if text.lower() == "none" else text
        for kind in (int, float):
            try:
                value = kind(text)
                break
            except ValueError:
                pass
        try:
            setattr(pc.rc, key.strip(), value)
        except AttributeError as exc:
            raise ValueError(str(exc)) from None


def main(argv: Optional[List[str]] = None) -> None:
    args = parser().parse_args(argv)
    comm = MPI.COMM_WORLD
    run: Callable = COMMANDS[args.command][0]
    try:
        _apply_rc(args.rc)
        result = run(comm, args)
    except (ValueError, TypeError) as exc:     # bad option values found while running
        if comm.rank == 0:
            sys.stderr.write(f"partialcoll-bench {args.command}: error: {exc}\n")
        sys.exit(2)
    except ValidationFailed as exc:            # -c: every rank knows, every rank exits 1
        if comm.rank == 0:
            sys.stderr.write(f"partialcoll-bench {args.command}: {exc}\n")
        sys.exit(1)
    if comm.rank == 0:
        result.update(run_info(comm, argv))
        write_outputs(args, result)
