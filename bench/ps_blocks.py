"""The parameter-server allreduce by block size, against MPI_Allreduce and the ring.

    mpiexec -n 4 python bench/ps_blocks.py --mib 25 --block-kib 64,256,1024,4096

A full allreduce (`allreduce_init`) of --mib MiB of float32 with algorithm "ps" in
blocks of each --block-kib size, next to mpi4py's Allreduce and algorithm "ring" in the
same run: each takes --rounds rounds after a barrier (the first dropped), the median,
the slowest rank's. Small blocks cost per message (every block is a message to its
owner from every rank and one back): this shows from which size on they do.
"""
import argparse

import numpy as np
from mpi4py import MPI

import partialcoll as pc
from _timing import median_ms


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=float, default=25.0)
    ap.add_argument("--block-kib", default="64,256,1024,4096")
    ap.add_argument("--rounds", type=int, default=9)
    args = ap.parse_args()
    comm = MPI.COMM_WORLD
    n = int(args.mib * (1 << 20)) // 4
    x, y = np.ones(n, np.float32), np.empty(n, np.float32)
    mpi = median_ms(comm, lambda: comm.Allreduce(x, y), args.rounds, drop=1)
    rows = [("mpi", mpi)]

    def ours(name, **kw):
        coll = pc.allreduce_init(n, np.float32, comm=comm, **kw)
        if kw.get("algorithm") == "ps":
            name = f"{name} ({len(coll.assignment())} blocks)"
        rows.append((name, median_ms(comm, lambda: coll.post(x, out=y).wait(), args.rounds, drop=1)))
        coll.close()

    ours("ring", algorithm="ring")
    for kib in (int(v) for v in args.block_kib.split(",")):
        ours(f"ps, {kib} KiB blocks", algorithm="ps", block_bytes=kib << 10)
    if comm.rank == 0:
        print(f"# P = {comm.size}, {args.mib:g} MiB float32, full mode, median of {args.rounds - 1} rounds")
        for name, ms in rows:
            print(f"  {name:32s} {ms:8.1f} ms  {ms / mpi:6.2f}x MPI_Allreduce")


if __name__ == "__main__":
    main()
