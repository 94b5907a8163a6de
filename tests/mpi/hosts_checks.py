"""Where the ranks run under pytest --hosts (tests/hosts.py):
python hosts_checks.py PPN HOSTS [MIN_US [MAX_MBIT]]

Ranks r and s share a network namespace (an emulated host) exactly when r // PPN and
s // PPN name the same host (modulo the number of hosts); every mode's rounds agree
across hosts; an 8 B MPI_Allreduce takes at least MIN_US microseconds (the link delay
is in effect); 4 MiB from rank 0 to the last rank move at no more than MAX_MBIT
Mbit/s (plus 25 %: the link rate is in effect).
"""
from __future__ import annotations

import os

import numpy as np
from mpi4py import MPI

import partialcoll as pc
from _util import ARGS, run_module

PPN = int(ARGS[0])
HOSTS = int(ARGS[1])
MIN_US = float(ARGS[2]) if len(ARGS) > 2 else 0.0
MAX_MBIT = float(ARGS[3]) if len(ARGS) > 3 else 0.0


def test_placement_modes_and_links(comm):
    here = os.readlink("/proc/self/ns/net")
    where = comm.allgather(here)
    host = [(r // PPN) % HOSTS for r in range(comm.size)]
    for r in range(comm.size):
        for s in range(comm.size):
            assert (where[r] == where[s]) == (host[r] == host[s]), (r, s, where, host)
    assert here != os.environ.get("PCH_ROOT_NETNS"), "rank runs in pytest's own namespace"
    for mode in ("solo", "majority", "probe", "quorum", "full"):
        kw = {"quorum": (comm.size + 1) // 2} if mode == "quorum" else {}
        coll = pc.PartialAllreduce(3, np.float64, MPI.SUM, comm, mode=mode, **kw)
        for i in range(20):
            x = np.arange(3, dtype=np.float64) + 10 * comm.rank + i
            res = coll.post(x).wait(timeout=60)
            got = comm.allgather((res.round, res.data.tolist(), res.active))
            assert all(g == got[0] for g in got if g[0] == res.round), got
        comm.Barrier()
        final = coll.close(timeout=60)
        assert final.data.shape == (3,)
    x, y = np.full(1, comm.rank, np.float64), np.empty(1)
    comm.Allreduce(x, y)
    comm.Barrier()
    t = MPI.Wtime()
    for _ in range(20):
        comm.Allreduce(x, y)
    us = (MPI.Wtime() - t) / 20 * 1e6
    assert y[0] == comm.size * (comm.size - 1) / 2, y
    if HOSTS > 1 and comm.size > PPN:
        assert us >= MIN_US, f"8 B MPI_Allreduce took {us:.0f} us, less than {MIN_US} us"
    if comm.rank == 0:
        print(f"8 B MPI_Allreduce across hosts: {us:.0f} us", flush=True)
    if MAX_MBIT and comm.size > 1:
        big, last = np.ones(1 << 19), comm.size - 1        # 4 MiB
        comm.Barrier()
        t = MPI.Wtime()
        if comm.rank == 0:
            comm.Send(big, last)
            comm.Recv(big[:1], last)
        elif comm.rank == last:
            comm.Recv(big, 0)
            comm.Send(big[:1], 0)
        mbit = big.nbytes * 8 / (MPI.Wtime() - t) / 1e6
        if comm.rank == 0:
            print(f"4 MiB from rank 0 to rank {last}: {mbit:.0f} Mbit/s", flush=True)
            assert mbit <= 1.25 * MAX_MBIT, f"{mbit:.0f} Mbit/s through a {MAX_MBIT:g} Mbit/s link"


if __name__ == "__main__":
    run_module(__file__)
