"""A normal exit closes the NeighborAllreduces still open: python neighbor_exit.py (P >= 2)

Every rank runs the same iterations of two NeighborAllreduces on a two-way ring (made in
the same order everywhere), each result checked against the mean of its own and its
in-neighbours' updates (NumPy, from the ranks' formula). Rank 0 then sleeps 1 s and
closes both itself; every other rank just ends its script, no close(). Their exit must
close both cooperatively, in the order they were made, so rank 0's close() completes
(before, the exit reported "exit" and rank 0's close() raised PeerError naming a rank
that did not fail). Every rank prints DONE rank=R and PASSED R; rank 0 CLOSED after its
close(). The collectives stay referenced to the end (module globals), as a script's do,
and MPI is left to finalize at exit (no partialcoll.finalize()).
"""
from __future__ import annotations

import sys
import time
import traceback

import numpy as np

import partialcoll as pc
from mpi4py import MPI

ITERATIONS = 6


comm = MPI.COMM_WORLD
rank = comm.rank
g = pc.ring_graph(comm)
sources = g.Get_dist_neighbors()[0]
colls = [pc.NeighborAllreduce(4, np.float64, comm=g) for _ in range(2)]


def run() -> None:
    for k in range(ITERATIONS):
        for c, coll in enumerate(colls):
            value = lambda r: r + 10.0 * k + 100.0 * c            # noqa: E731 - the ranks' formula
            res = coll.post(np.full(4, value(rank))).wait(timeout=60)
            expect = np.mean([value(r) for r in [rank, *sources]])
            assert np.allclose(res.data, expect), (rank, k, c, res.data, expect)
    if rank == 0:
        time.sleep(1.0)          # the others are at their exit by now
        for coll in colls:
            coll.close(timeout=60)
        print("CLOSED", flush=True)
    print(f"DONE rank={rank}", flush=True)


try:
    run()
except BaseException:  # noqa: BLE001 - any failure is printed, then the job is aborted
    traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    comm.Abort(1)
print(f"PASSED {rank}", flush=True)
