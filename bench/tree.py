"""Tree allreduce: cross-region bytes and completion times per algorithm.

    mpiexec -n 8 python bench/tree.py traffic [--count N]
    mpiexec -n 8 python bench/tree.py rotation [--count 4096]
    mpiexec -n P python bench/tree.py time --bytes 1048576 [--groups 0,0,1,1] [--late RANK:MS] [--iters 10]
        [--algorithms ring,recursive_doubling,tree,auto]

traffic: 8 ranks in 2 regions of 4 (contiguous, then interleaved), one full round of a
float32 vector, bytes crossing the regions each way as coll.traffic() counts them,
against the formulas (N: the vector's bytes; the mask allreduce adds 16 B a message).
rotation: tree, 2 contiguous regions, a vector of one chunk: bytes each rank sends in
each of R consecutive rounds (the aggregator's row is the large one; it moves).
time: completion time of one blocking allreduce (post + wait) per algorithm, barrier
first; --late r:ms makes rank r post ms later (a late sender); tree and auto get the
groups (auto's row says what it picked). Rank 0 prints.
"""
from __future__ import annotations

import argparse
import time

import numpy as np
from mpi4py import MPI

import partialcoll as pc

ALGS = ("ring", "recursive_doubling", "tree")


def cross(comm, coll, regions):
    """Bytes sent across regions, each way: {(from, to): bytes}, summed over ranks."""
    sent = np.array(comm.allgather(coll.traffic()))
    out = {}
    for a in sorted(set(regions)):
        for b in sorted(set(regions)):
            if a != b:
                rows = [r for r in range(comm.size) if regions[r] == a]
                cols = [r for r in range(comm.size) if regions[r] == b]
                out[a, b] = int(sent[np.ix_(rows, cols)].sum())
    return out


def traffic(comm, args):
    p, n = comm.size, args.count
    nbytes = 4 * n
    layouts = {"contiguous": [r * 2 // p for r in range(p)], "interleaved": [r % 2 for r in range(p)]}
    formula = {("contiguous", "tree"): nbytes, ("contiguous", "ring"): 7 * nbytes // 4,
               ("contiguous", "recursive_doubling"): 4 * nbytes,
               ("interleaved", "tree"): nbytes, ("interleaved", "ring"): 7 * nbytes,
               ("interleaved", "recursive_doubling"): 4 * nbytes}
    if comm.rank == 0:
        print(f"# cross-region bytes, {p} ranks in 2 regions, one allreduce of {nbytes} B (N), float32, mode full")
        print(f"# {'layout':12s} {'algorithm':19s} {'0->1 B':>10s} {'1->0 B':>10s} {'formula':>10s}  {'x N':>5s}")
    for layout, regions in layouts.items():
        for alg in ALGS:
            kw = {"groups": regions} if alg == "tree" else {}
            coll = pc.allreduce_init(n, np.float32, comm=comm, algorithm=alg, **kw)
            coll.post(np.ones(n, np.float32)).wait()
            way = cross(comm, coll, regions)
            coll.close()
            if comm.rank == 0 and p == 8:
                f = formula[layout, alg]
                print(f"  {layout:12s} {alg:19s} {way[0, 1]:10d} {way[1, 0]:10d} {f:10d}  {way[0, 1] / nbytes:5.2f}")
            elif comm.rank == 0:
                print(f"  {layout:12s} {alg:19s} {way[0, 1]:10d} {way[1, 0]:10d}")


def rotation(comm, args):
    p, n = comm.size, args.count
    groups = [r * 2 // p for r in range(p)]
    coll = pc.allreduce_init(n, np.float32, comm=comm, algorithm="tree", groups=groups)
    R, rows, prev = coll._variants, [], coll.traffic()
    for _ in range(R):
        coll.post(np.ones(n, np.float32)).wait()
        now = coll.traffic()
        rows.append(int((now - prev).sum()))
        prev = now
    table = comm.gather(rows, root=0)
    coll.close()
    if comm.rank == 0:
        print(f"# tree, groups={groups}, {4 * n} B of float32, R = {R} variants: bytes sent per rank per round")
        for r, row in enumerate(table):
            print(f"  rank {r}: " + " ".join(f"{b:8d}" for b in row) + f"   total {sum(row)}")


def timing(comm, args):
    n = args.bytes // 4
    groups = [int(g) for g in args.groups.split(",")] if args.groups else [0] * comm.size
    late_rank, late_ms = (int(v) for v in args.late.split(":")) if args.late else (-1, 0)
    x = np.full(n, 1.0 + comm.rank, np.float32)
    expect = sum(1.0 + r for r in range(comm.size))
    rows = []
    for alg in args.algorithms.split(","):
        kw = {"groups": groups} if alg in ("tree", "auto") and args.groups else {}
        coll = pc.allreduce_init(n, np.float32, comm=comm, algorithm=alg, **kw)
        if alg == "auto":
            alg = f"auto ({coll.algorithm})"
        times = []
        for it in range(args.warmup + args.iters):
            comm.Barrier()
            t0 = time.perf_counter()
            if comm.rank == late_rank:
                time.sleep(late_ms / 1000)
            res = coll.post(x).wait()
            dt = time.perf_counter() - t0
            assert res.data[0] == expect and res.data[-1] == expect, (alg, res.data[:3])
            if it >= args.warmup:
                times.append(comm.allreduce(dt, op=MPI.MAX))
        coll.close()
        rows.append((alg, float(np.median(times)), float(np.min(times))))
    if comm.rank == 0:
        base = rows[0][1]
        print(f"# P={comm.size} bytes={args.bytes} groups={groups} late={args.late or '-'} "
              f"iters={args.iters} (median of the slowest rank's post+wait)")
        for alg, med, best in rows:
            print(f"  {alg:19s} median {med * 1e3:9.2f} ms  min {best * 1e3:9.2f} ms  x{med / base:5.2f} of {rows[0][0]}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("command", choices=("traffic", "rotation", "time"))
    ap.add_argument("--count", type=int, default=1 << 18)
    ap.add_argument("--bytes", type=int, default=1 << 20)
    ap.add_argument("--groups", default="")
    ap.add_argument("--late", default="")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--algorithms", default=",".join(ALGS))
    args = ap.parse_args()
    comm = MPI.COMM_WORLD
    {"traffic": traffic, "rotation": rotation, "time": timing}[args.command](comm, args)
    pc.finalize()


if __name__ == "__main__":
    main()
