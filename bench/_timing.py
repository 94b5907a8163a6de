"""Timing the bench scripts share: one call's median time, the slowest rank's."""
import statistics
import time

from mpi4py import MPI


def median_ms(comm, fn, repeat: int, drop: int = 0) -> float:
    """fn() `repeat` times, each after a barrier of comm; the median of the times after
    the first `drop`, in ms, the slowest rank's (the same on every rank)."""
    ts = []
    for _ in range(repeat):
        comm.Barrier()
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return comm.allreduce(statistics.median(ts[drop:]), op=MPI.MAX) * 1e3
