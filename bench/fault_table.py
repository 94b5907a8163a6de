"""The fault table of docs/faults.md: run tests/mpi/peer_dies.py for each way a peer
dies, each mode and P, under this environment's mpiexec (MPICH or Open MPI), and print
one Markdown row per run: what each survivor's wait raised, after how long, which ranks
it named, and what close() raised.

    python bench/fault_table.py [--P 3 4] [--modes solo full neighbor] [--how exit kill]
                                [--timeout 3] [--cannot-tell] [--expect Timeout]

--cannot-tell hides MPIX_Comm_get_failed from the engine (PARTIALCOLL_NO_FAILED_QUERY=1).

A rank that fails and can say so (tests/mpi/peer_fails.py: rank 0 raises, gets SIGINT or
SIGTERM, exits, drops or closes its collectives early, or never posts):

    python bench/fault_table.py --failures [--P 2 3 5] [--cases badbuf raise ... inproc]

prints one row per way rank 0 fails and a column per mode: what the survivors raised (and
the exception type the PeerError names), how long after the failure (over survivors and
P), what close() then did, and the jobs' wall times.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
from conftest import launch, launch_env, mpi_flavour   # noqa: E402  (the tests' own launcher)

WAIT = re.compile(r"FAULT rank=(\d+) mode=\w+ raised=(\w+) at_round=(\d+) after=([\d.]+)s ranks=\(([\d, ]*)\)")
CLOSE = re.compile(r"FAULT rank=(\d+) mode=\w+ close_raised=(\w+) after=([\d.]+)s")


def row(mpi: str, how: str, mode: str, p: int, timeout: float, cannot_tell: bool, expect: str) -> str:
    expect = "Timeout" if cannot_tell else expect
    argv = [sys.executable, os.path.join(HERE, "..", "tests", "mpi", "peer_dies.py"), mode, expect,
            str(timeout), how]
    env = dict(os.environ, PYTHONUNBUFFERED="1", **launch_env())
    if cannot_tell:
        env["PARTIALCOLL_NO_FAILED_QUERY"] = "1"
    t0 = time.monotonic()
    try:
        out = subprocess.run(launch(p, argv, keep_going=True), capture_output=True, text=True, env=env,
                             timeout=3 * timeout + 60).stdout
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        out += "\n(mpiexec timed out)"
    took = time.monotonic() - t0
    waits = {int(m[0]): m for m in WAIT.findall(out)}
    closes = {int(m[0]): m for m in CLOSE.findall(out)}
    raised = sorted({f"{m[1]} at round {m[2]}" for m in waits.values()}) or ["nothing"]
    after = sorted(float(m[3]) for m in waits.values())
    span = "-" if not after else (f"{after[0]:.2f} s" if after[-1] - after[0] < 0.01
                                  else f"{after[0]:.2f} - {after[-1]:.2f} s")
    named = ", ".join(f"({waits[r][4]})" if r in waits else "-" for r in range(p - 1))
    closed = sorted({f"{m[1]}, {float(m[2]):.2f} s" for m in closes.values()}) or ["-"]
    died = {"exit": "`os._exit(3)`", "kill": "`SIGKILL`"}[how]
    who = mpi + (", cannot tell" if cannot_tell else "")
    note = "" if waits or "timed out" not in out else " (mpiexec killed by the driver)"
    return (f"| {who} | 1 node | {died} | {mode} | {p} | {'; '.join(raised)}{note} | {span} | {named} | "
            f"{'; '.join(closed)} | {took:.1f} s |")


PEER_FAULT = re.compile(r"FAULT rank=(\d+) case=(\w+) mode=(\w+) raised=(\w+) named=([\d,-]+) exc_type=(\S+) "
                        r"at=([\d.]+) close=(\S+) close_s=([\d.]+)")
FAILING = re.compile(r"FAILING case=(\w+) at=([\d.]+)")
FAILURE_CASES = ("badbuf", "raise", "sigint", "sigterm", "exit", "inproc")
CASE_TEXT = {"badbuf": "bad buffer (uncaught `InvalidBufferError`)", "raise": "user exception between posts",
             "sigint": "SIGINT (`KeyboardInterrupt`)", "sigterm": "SIGTERM", "exit": "`sys.exit()`, no close()",
             "with": "exception leaves `with` blocks", "thread": "exception ends the thread that made them", "drop": "collective dropped without close()",
             "close": "closes early (close() times out, 1.5 s)", "never": "never posts (timeout 2 s)"}


def failure_runs(case: str, p: int) -> tuple:
    """Run peer_fails.py CASE at P ranks: ([(sub-case, rank, mode, raised, named, exc_type,
    seconds after the failure, close, close seconds)], the job's wall time, timed out)."""
    argv = [sys.executable, os.path.join(HERE, "..", "tests", "mpi", "peer_fails.py"), case]
    env = dict(os.environ, PYTHONUNBUFFERED="1", PARTIALCOLL_TIMEOUT="2", PARTIALCOLL_STALL_WARNING="0.5",
               **launch_env())
    t0 = time.monotonic()
    try:
        out = subprocess.run(launch(p, argv, keep_going=case == "sigterm"), capture_output=True, text=True,
                             env=env, timeout=120).stdout
    except subprocess.TimeoutExpired:
        return [], time.monotonic() - t0, True
    failing = {m[0]: float(m[1]) for m in FAILING.findall(out)}
    runs = [(m[1], int(m[0]), m[2], m[3], m[4], m[5], float(m[6]) - failing[m[1]], m[7], float(m[8]))
            for m in PEER_FAULT.findall(out)]
    return runs, time.monotonic() - t0, False


def failure_table(mpi: str, cases, ps) -> None:
    """One row per way rank 0 fails, one column per mode: what the survivors raised (and
    the type they name), the range over survivors and P of the time from the failure."""
    modes = ("solo", "majority", "probe", "quorum", "full", "neighbor")   # neighbor: a NeighborAllreduce
    got: dict = {}
    jobs: dict = {}
    for case in cases:
        for p in ps:
            runs, took, hung = failure_runs(case, p)
            for r in runs:
                got.setdefault(r[0], []).append((p, *r[1:]))
                jobs.setdefault(r[0], []).append(took)
            if hung:
                print(f"<!-- {case} at P = {p}: killed after 120 s -->", flush=True)
    print(f"| rank 0 ({mpi}, P = {', '.join(map(str, ps))}) | " + " | ".join(modes) + " | close() then | job took |")
    print("|---|" + "---|" * len(modes) + "---|---:|")
    for sub in CASE_TEXT:
        rows = [r for r in got.get(sub, []) if r[1] != 0]          # the survivors
        if not rows:
            continue
        cells = []
        for mode in modes:
            rs = [r for r in rows if r[2] == mode]
            raised = sorted({r[3] + (f" ({r[5]})" if r[5] != "-" else "") + (f" naming {r[4]}" if r[3] == "Timeout" else "")
                             for r in rs})
            after = sorted(r[6] for r in rs if r[3] != "nothing")
            span = "" if not after else f", {after[0] * 1e3:.0f} - {after[-1] * 1e3:.0f} ms" if after[-1] < 1 \
                else f", {after[0]:.2f} - {after[-1]:.2f} s"
            cells.append("; ".join(raised) + span if rs else "-")
        closes = sorted({r[7] for r in rows if r[7] != "-"})
        close = f"{'; '.join(closes)}, <= {max(r[8] for r in rows) * 1e3:.0f} ms" if closes else "-"
        took = jobs[sub]
        print(f"| {CASE_TEXT[sub]} | " + " | ".join(cells) + f" | {close} | {min(took):.1f} - {max(took):.1f} s |",
              flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--P", type=int, nargs="+", default=[3, 4])
    ap.add_argument("--modes", nargs="+", default=["solo", "full"])
    ap.add_argument("--how", nargs="+", default=["exit", "kill"])
    ap.add_argument("--timeout", type=float, default=3.0)
    ap.add_argument("--cannot-tell", action="store_true")
    ap.add_argument("--expect", choices=["MPIError", "Timeout"], default="MPIError",
                    help="what the survivors must raise (else they print no row: 'nothing')")
    ap.add_argument("--failures", action="store_true", help="the table of ranks that fail and say so")
    ap.add_argument("--cases", nargs="+", default=list(FAILURE_CASES), choices=FAILURE_CASES)
    a = ap.parse_args()
    import partialcoll as pc
    mpi = pc.info()["mpi_library"].split(",")[0].split("\n")[0].replace("Version:", "").strip()
    if a.failures:
        print(f"# {mpi} ({mpi_flavour()}), rank 0 fails, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
        failure_table(mpi.replace("  ", " "), a.cases, a.P if a.P != [3, 4] else [2, 3, 5])
        return
    print(f"# {mpi} ({mpi_flavour()}), timeout {a.timeout} s, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print("| MPI | where | how the peer died | mode | P | each survivor's wait raised | after | "
          "ranks named (by survivor 0, 1, ...) | close() raised, after | job took |")
    print("|---|---|---|---|---:|---|---:|---|---|---:|")
    for how in a.how:
        for mode in a.modes:
            for p in (a.P if mode != "neighbor" else [4]):
                print(row(mpi, how, mode, p, a.timeout, a.cannot_tell, a.expect), flush=True)


if __name__ == "__main__":
    main()
