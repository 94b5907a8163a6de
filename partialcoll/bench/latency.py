"""partialcoll-bench latency: an allreduce latency sweep over message sizes, as OSU's
osu_allreduce measures it (each rank times its calls back to back; avg, min and max over
ranks), with nccl-tests' columns (count, type, algbw, busbw, #wrong)."""
from __future__ import annotations

import time
from typing import List, Optional

import numpy as np
from mpi4py import MPI

from . import _validate
from ._common import (COLUMNS_HELP, EVERYONE_MODES, TAIL, Collective, add_common_args, as_buffers, bandwidths,
                      check_common, data, element_type, fill, modes, percentile, runnable_modes, sizes, to_numpy,
                      type_name)
from ._report import Table, header, progress

# OSU's large-message schedule: fewer timed iterations past LARGE, a shorter warm-up past HUGE
LARGE = 8 << 10
HUGE = 1 << 20
MIN_ITERATIONS = 20
HUGE_WARMUP = 3

COLUMNS = COLUMNS_HELP + """\
  avg us        latency of one call in microseconds: each rank's mean over the timed
                iterations, averaged over ranks (OSU's Avg Latency)
  min/max us    the smallest and largest of the ranks' means (OSU's Min/Max Latency)
  mode/MPI      avg latency / MPI_Allreduce's avg latency at the same size (mpi: 1.00)

Iterations: -i up to 8 KiB; larger messages run -i x 8 KiB / size of them, at least 20
(the iters column says how many). Warm-up: -x calls, at most 3 from 1 MiB. Both
schedules are printed in the header and written to --json, row by row.
"""


def add_latency_args(p) -> None:
    add_common_args(p, sizes="8:1M", iterations=1000, warmup=100, mode_list="mpi,full")
    p.add_argument("--buffers", default="host", choices=("host", "cupy"),
                   help="host (NumPy) or cupy (GPU; mpi/impi then stage through pinned host memory)")
    p.epilog = "columns:\n" + COLUMNS


def iterations(nbytes: int, base: int) -> int:
    """Timed iterations at nbytes: base up to LARGE, then base * LARGE / nbytes (at least 20)."""
    return base if nbytes <= LARGE else max(min(base, MIN_ITERATIONS), base * LARGE // nbytes)


def warmup(nbytes: int, base: int) -> int:
    return base if nbytes < HUGE else min(base, HUGE_WARMUP)


def latency_table(args, with_mpi: bool) -> Table:
    """OSU's Avg, Min, Max Latency and Iterations in its order, then nccl-tests' columns."""
    return Table(args, middle=[("avg us", "avg_us", 10, ".2f"), ("min us", "min_us", 10, ".2f"),
                               ("max us", "max_us", 10, ".2f"), ("iters", "iterations", 7, "d")],
                 extra=[("mode/MPI", "ratio_to_mpi", 8, ".2f")] if with_mpi else [])


def _measure(comm, args, mode: str, count: int, dtype, iters: int, warm: int, quorum: int, late: str) -> dict:
    """One mode at one size on this rank: warm-up, then iters timed calls back to back
    (with -c each call's input is set before and its result checked after, untimed)."""
    rank, size = comm.rank, comm.size
    coll = Collective(mode, count, dtype, comm, args.algorithm, quorum, args.candidates, buffers=args.buffers,
                      late=late)
    checker: Optional[_validate.Checker] = None
    values = None
    if args.validate:
        values = _validate.Values(size, count, dtype)
        if values.counted or mode in EVERYONE_MODES:
            checker = _validate.Checker(values, rank, [warm + iters] * size)
    x = as_buffers(data(count, dtype, rank), args.buffers)
    y = x.copy()
    times, naps = np.zeros(iters), np.zeros(iters)

    def step(n: int):
        """Call #n: (seconds inside the call, NAP)."""
        if checker is None:
            t0 = time.perf_counter()
            nap = coll.call(x, y)
            return time.perf_counter() - t0, nap
        assert values is not None         # made with the checker
        fill(x, values.post(rank, n))
        t0 = time.perf_counter()
        res, _ = coll.call_result(x, y)
        seconds = time.perf_counter() - t0
        checker.add(res.round, res.rounds, res.active, to_numpy(res.data), posts=getattr(res, "posts", None))
        return seconds, res.nap

    for n in range(warm):
        step(n)
    comm.Barrier()
    for i in range(iters):
        times[i], naps[i] = step(warm + i)
    comm.Barrier()                          # nobody closes while others still iterate
    final = coll.close()
    if checker is not None and final is not None:
        checker.add(final.round, final.rounds, final.active, to_numpy(final.data), closing=True,
                    posts=getattr(final, "posts", None))
    return {"times": times, "nap": float(naps.mean()), "checker": checker}


def latency(comm, args) -> dict:
    dtype = element_type(args.dtype)
    mode_list = modes(args.modes)
    size = comm.size
    quorum, late = check_common(args, size)
    counts, size_note = sizes(args.sizes, args.factor, dtype.itemsize, 8, 1 << 20)
    notes: List[str] = [size_note] if size_note else []
    mode_list, skipped, note = runnable_modes(mode_list, dtype, "mode/MPI")
    notes += [note] if note else []
    if args.validate:
        small = [m for m in mode_list if m not in EVERYONE_MODES]
        if small and min(counts) < _validate.min_count(size):
            notes.append(f"-c: partial modes ({', '.join(small)}) are checked from {_validate.min_count(size)} "
                         f"elements on (one per rank counts its posts): '-' in #wrong below")
    tname = type_name(dtype)
    largest = counts[-1] * dtype.itemsize
    sched = f"iterations: {args.iterations}"
    if largest > LARGE and iterations(largest, args.iterations) < args.iterations:
        sched += (f" up to {LARGE} B, then {args.iterations} x {LARGE} B / size, at least "
                  f"{min(args.iterations, MIN_ITERATIONS)} (the iters column)")
    sched += f"; warm-up: {args.warmup}"
    if largest >= HUGE and warmup(largest, args.warmup) < args.warmup:
        sched += f", {warmup(largest, args.warmup)} from {HUGE} B (capped)"
    table = latency_table(args, "mpi" in mode_list)
    if comm.rank == 0:
        print(header(f"latency: allreduce (MPI_SUM) of {tname}, {args.buffers} buffers", comm))
        print(f"# sizes: {counts[0] * dtype.itemsize} B to {counts[-1] * dtype.itemsize} B, x{args.factor} "
              f"(-m {args.sizes} -f {args.factor}); {sched}")
        print(table.head(notes))
    rows: List[dict] = []
    for count in counts:
        nbytes = count * dtype.itemsize
        iters, warm = iterations(nbytes, args.iterations), warmup(nbytes, args.warmup)
        base: Optional[float] = None
        for mode in mode_list:
            mine = _measure(comm, args, mode, count, dtype, iters, warm, quorum, late)
            row = _summary(comm, mine, mode, count, nbytes, tname, iters, warm, args, table.failures)
            if mode == "mpi":
                base = row["avg_us"]
            if base is not None:
                row["ratio_to_mpi"] = row["avg_us"] / base
            rows.append(row)
            if comm.rank == 0:
                print(table.line(row), flush=True)
        progress(f"{nbytes} B done")
    if comm.rank == 0:
        print(table.tail(rows), flush=True)
    table.fail_if_wrong(comm, rows)
    if comm.rank != 0:
        return {"rows": []}

    def plot(plt, path):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for m in mode_list:
            mine = [r for r in rows if r["mode"] == m]
            ax.loglog([r["bytes"] for r in mine], [r["avg_us"] for r in mine], marker="o", label=m)
        ax.set_xlabel("message size (bytes)")
        ax.set_ylabel("latency (us)")
        ax.set_title(f"allreduce latency, {tname}, P = {size}")
        ax.legend()
        fig.savefig(path, dpi=120, bbox_inches="tight")

    return {"command": "latency", "P": size, "modes": mode_list, "skipped_modes": skipped, "notes": notes,
            "algorithm": args.algorithm, "dtype": tname, "buffers": args.buffers, "late": late,
            "sizes": args.sizes, "factor": args.factor, "iterations": args.iterations, "warmup": args.warmup,
            "validated": bool(args.validate), "rows": rows, "plot": plot}


def _summary(comm, mine: dict, mode: str, count: int, nbytes: int, tname: str, iters: int, warm: int,
             args, failures: List[str]) -> dict:
    """Every rank: one table row from every rank's measurements (rank 0's is complete)."""
    size = comm.size
    mean = float(mine["times"].mean())
    avg = comm.allreduce(mean) / size
    per_iter = np.zeros(iters) if comm.rank == 0 else None
    comm.Reduce(mine["times"], per_iter, MPI.SUM, 0)
    algbw, busbw = bandwidths(nbytes, avg, size)
    row = {"bytes": nbytes, "count": count, "type": tname, "mode": mode, "iterations": iters, "warmup": warm,
           "avg_us": avg * 1e6, "min_us": comm.allreduce(mean, op=MPI.MIN) * 1e6,
           "max_us": comm.allreduce(mean, op=MPI.MAX) * 1e6, "algbw_gbs": algbw, "busbw_gbs": busbw,
           "nap": comm.allreduce(mine["nap"]) / size}
    if comm.rank == 0:
        samples = per_iter / size * 1e6
        row.update({f"p{q}_us": percentile(samples, q) for q in TAIL})
    if args.validate:
        row.update(_checked(comm, mine["checker"], mode, nbytes, failures))
    return row


def _checked(comm, checker: Optional[_validate.Checker], mode: str, nbytes: int, failures: List[str]) -> dict:
    """-c: the row's #wrong (None: not checked at this size), with every rank's errors and a
    check that all ranks saw the same counts after the same round."""
    checked = comm.allreduce(checker is not None and checker.unchecked == 0, op=MPI.LAND)
    wrong = comm.allreduce(checker.wrong if checker is not None else 0)
    mine = (checker.errors, checker.seen) if checker is not None else ([], {})
    every = comm.gather(mine, root=0)
    if comm.rank == 0 and checker is not None:
        split = _validate.disagreement([seen for _, seen in every])
        if split:
            wrong += 1
            failures.append(f"{mode} at {nbytes} B: {split}")
        failures.extend(f"{mode} at {nbytes} B: {e}" for errors, _ in every for e in errors[:2])
    return {"wrong": wrong if checked or wrong else None}
