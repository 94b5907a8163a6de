"""The engine under a training loop's pattern, without torch.

    mpiexec -n 2 python bench/bucket_loop.py mpi full solo full solo mpi

Two NumPy "gradient buckets" of the 2.9M MLP's sizes (1,059,850 and 1,853,440 float32,
DDP's buckets after its rebuild) per step: 6 ms of compute, post the last layers'
bucket in place (post(x, out=x)), 6 ms more compute (the rest of backward), post the
first bucket, wait for both. `mpi`: 12 ms of compute, then MPI_Allreduce in place of
each bucket (the plain mpi4py loop). Printed per mode and rank: ms per step (the slowest
rank's), late posts, time in post() and in wait(). The compute is a NumPy loop, so
ranks that share a core compete for it as backward would.
"""
import sys
import time

import numpy as np
from mpi4py import MPI

import partialcoll as pc

SIZES = [1059850, 1853440]
STEPS = 100


def busy(ms):
    t = time.perf_counter()
    a = np.ones(20000)
    while time.perf_counter() - t < ms / 1e3:
        a *= 1.0000001


def run(comm, mode):
    bufs = [np.ones(n, np.float32) for n in SIZES]
    colls = None if mode == "mpi" else [pc.PartialAllreduce(n, np.float32, MPI.SUM, comm, mode=mode) for n in SIZES]
    lates, tpost, twait = 0, 0.0, 0.0
    for it in range(-10, STEPS):
        if it == 0:
            comm.Barrier()
            t0 = time.perf_counter()
        busy(6)
        if colls is None:
            busy(6)
            for b in bufs:
                comm.Allreduce(MPI.IN_PLACE, b)
            continue
        t1 = time.perf_counter()
        r1 = colls[1].post(bufs[1], out=bufs[1])
        t2 = time.perf_counter()
        busy(6)
        t3 = time.perf_counter()
        r0 = colls[0].post(bufs[0], out=bufs[0])
        t4 = time.perf_counter()
        r1.wait()
        r0.wait()
        t5 = time.perf_counter()
        if it >= 0:
            lates += r1.late + r0.late
            tpost += (t2 - t1) + (t4 - t3)
            twait += t5 - t4
    elapsed = comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
    for c in colls or ():
        c.close()
    line = (f"rank {comm.rank} {mode:5s} {elapsed / STEPS * 1e3:6.2f} ms/step  late {lates:3d}  "
            f"post {tpost / STEPS * 1e3:.2f} ms  wait {twait / STEPS * 1e3:.2f} ms")
    lines = comm.gather(line)
    if comm.rank == 0:
        print("\n".join(lines), flush=True)


if __name__ == "__main__":
    for m in sys.argv[1:] or ["mpi", "full", "solo"]:
        run(MPI.COMM_WORLD, m)
