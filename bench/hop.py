"""Hop's heterogeneity experiments on NeighborAllreduce, one short run.

    flock /tmp/pc-bench.lock mpiexec -n 8 python bench/hop.py [--json hop.json]

Graph: the ring-based graph (pc.ring_based_graph). Every iteration a worker "computes"
for --base-ms (a sleep: on an oversubscribed machine real compute would measure the
cores, not the protocol), then posts a --count float32 vector and waits for its result.

1. Random slowdown (Hop §6): each worker is slowed 6x with probability 1/P per iteration
   (seeded; the same draws for every mode). Iterations/s per worker (mean over workers),
   for NeighborAllreduce standard, backup=1, max_staleness=5, and the same workload
   through PartialAllreduce full (a global allreduce) and solo (eager-SGD's), and through
   MPI_Allreduce (mpi4py), the peer measured in the same run.
2. Deterministic slowdown (Hop §5): worker 0 is 4x slower every iteration. Time per
   iteration until every worker has reached --iterations, relative to the balanced run
   (nobody slowed), without and with skipping (worker 0 calls skip(lag) after each
   iteration; the others do not skip). Both use backup=1 and tokens (max_gap=--gap), as skipping needs a
   neighbour that does not wait for the slow worker.

Every result is checked: data equals the mean of exactly the updates it reports (values
differ per worker, per element and per iteration). Only rank 0 prints.
"""
import argparse
import json
import random
import sys
import time

import numpy as np
from mpi4py import MPI

import partialcoll as pc


def slow_draws(seed, rank, size, n, factor):
    rng = random.Random(seed * 100003 + rank)
    return [factor if rng.random() < 1.0 / size else 1 for _ in range(n)]


def check(res, base, rank, skipper=None):
    """res.data == mean over res.active of (base * (r + 1) + iteration of r's data). The
    skipping worker's update of a skipped iteration m carries its last computed data (an
    iteration <= m, recovered from element 0, where base is 0)."""
    its = {r: float(m) for r, m in res.updates}
    its[rank] = float(res.iteration)
    if skipper in its and skipper != rank:
        others = sum(v for r, v in its.items() if r != skipper)
        real = round(float(res.data[0]) * res.nap - others)
        if not 0 <= real <= its[skipper]:
            raise AssertionError(f"rank {rank}: iteration {res.iteration}: worker {skipper}'s update of "
                                 f"{its[skipper]} carries data of iteration {real}")
        its[skipper] = float(real)
    expected = (base * float(sum(r + 1 for r in res.active)) + sum(its.values())) / res.nap
    if not np.allclose(res.data, expected, rtol=1e-5, atol=1e-3):
        raise AssertionError(f"rank {rank}: iteration {res.iteration} data differs from its updates {res.updates}")


def run_neighbor(comm, g, args, slow, skip=False, **options):
    """Per-rank (iterations/s, finish time since the common start)."""
    rank = comm.rank
    base = (np.arange(args.count, dtype=np.float32) % 13)
    coll = pc.NeighborAllreduce(args.count, np.float32, comm=g, **options)
    x = np.empty(args.count, np.float32)
    for _ in range(args.warmup):
        x[:] = base * (rank + 1) + (coll.iteration + 1)
        coll.post(x).wait()
    comm.Barrier()
    t0 = time.monotonic()
    target = args.warmup + args.iterations
    while coll.iteration + 1 < target:
        k = coll.iteration + 1
        time.sleep(args.base_ms * 1e-3 * slow[k - args.warmup])
        x[:] = base * (rank + 1) + k
        res = coll.post(x).wait()
        check(res, base, rank, skipper=0 if skip else None)
        if skip and rank == 0 and coll.iteration + 1 < target:
            lag = coll.lag
            if lag:
                coll.skip(min(lag, target - 1 - coll.iteration))
    elapsed = time.monotonic() - t0
    skipped = coll.stats["skipped"]
    coll.close()
    return args.iterations / elapsed, elapsed, skipped


def run_partial(comm, args, slow, mode):
    rank = comm.rank
    base = (np.arange(args.count, dtype=np.float32) % 13)
    coll = pc.PartialAllreduce(args.count, np.float32, comm=comm, mode=mode)
    x = np.empty(args.count, np.float32)
    for _ in range(args.warmup):
        x[:] = base
        coll.post(x).wait()
    comm.Barrier()
    t0 = time.monotonic()
    for k in range(args.iterations):
        time.sleep(args.base_ms * 1e-3 * slow[k])
        x[:] = base
        res = coll.post(x).wait()
        c = float(res.data[1])           # base[1] == 1: how many posts the round summed
        if not (np.allclose(res.data, base * c, rtol=1e-5) and c >= res.nap and (mode != "full" or c == comm.size)):
            raise AssertionError(f"rank {rank}: round {res.round} data is not a sum of posts ({c}, nap {res.nap})")
    elapsed = time.monotonic() - t0
    coll.close()
    return args.iterations / elapsed, elapsed, 0


def run_mpi(comm, args, slow):
    """The same workload through MPI_Allreduce (mpi4py): the peer every ratio can be read against."""
    x, y = np.ones(args.count, np.float32), np.empty(args.count, np.float32)
    for _ in range(args.warmup):
        comm.Allreduce(x, y)
    comm.Barrier()
    t0 = time.monotonic()
    for k in range(args.iterations):
        time.sleep(args.base_ms * 1e-3 * slow[k])
        comm.Allreduce(x, y)
        if y[0] != comm.size:
            raise AssertionError(f"rank {comm.rank}: MPI_Allreduce gave {y[0]}, not {comm.size}")
    elapsed = time.monotonic() - t0
    return args.iterations / elapsed, elapsed, 0


def main():
    try:
        run_all()
    except BaseException:  # noqa: BLE001 - reported, then the job is aborted
        import traceback
        traceback.print_exc()
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(1)


def run_all():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-i", "--iterations", type=int, default=80)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--base-ms", type=float, default=5.0)
    ap.add_argument("--count", type=int, default=16384, help="float32 elements per update (64 KiB)")
    ap.add_argument("--gap", type=int, default=2, help="max_gap of the skipping runs")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json")
    args = ap.parse_args()
    comm = MPI.COMM_WORLD
    size, rank = comm.size, comm.rank
    g = pc.ring_based_graph(comm)
    n = args.iterations + args.warmup + 1
    rows = {}

    def record(name, result):
        rate, elapsed, skipped = result
        every = comm.gather((rate, elapsed, skipped), root=0)
        if rank == 0:
            rows[name] = {"its_per_s": float(np.mean([e[0] for e in every])),
                          "s_per_it_all": max(e[1] for e in every) / args.iterations,
                          "skipped": sum(e[2] for e in every)}

    random6 = slow_draws(args.seed, rank, size, n, 6)
    record("standard", run_neighbor(comm, g, args, random6))
    record("backup=1", run_neighbor(comm, g, args, random6, backup=1))
    record("max_staleness=5", run_neighbor(comm, g, args, random6, max_staleness=5))
    record("PartialAllreduce full", run_partial(comm, args, random6, "full"))
    record("PartialAllreduce solo", run_partial(comm, args, random6, "solo"))
    record("MPI_Allreduce (mpi4py)", run_mpi(comm, args, random6))

    flat = [1] * n
    slow4 = [4] * n if rank == 0 else flat
    hop = dict(backup=1, max_gap=args.gap)
    record("balanced", run_neighbor(comm, g, args, flat, **hop))
    record("one 4x slower", run_neighbor(comm, g, args, slow4, **hop))
    record("one 4x slower, skipping", run_neighbor(comm, g, args, slow4, skip=True, **hop))

    if rank == 0:
        std = rows["standard"]["its_per_s"]
        print(f"# Hop on NeighborAllreduce: P = {size}, ring-based graph, {args.count * 4} B updates, "
              f"{args.base_ms} ms compute, {args.iterations} iterations")
        print("# 1. each worker 6x slower with probability 1/P per iteration (seeded)")
        print(f"# {'mode':<26} {'iterations/s':>13} {'vs standard':>12}")
        for name in ("standard", "backup=1", "max_staleness=5", "PartialAllreduce full", "PartialAllreduce solo",
                     "MPI_Allreduce (mpi4py)"):
            r = rows[name]["its_per_s"]
            print(f"  {name:<26} {r:>13.1f} {r / std:>12.2f}")
        bal = rows["balanced"]["s_per_it_all"]
        print(f"# 2. worker 0 4x slower every iteration; backup=1, max_gap={args.gap}")
        print(f"# {'run':<26} {'ms/iteration':>13} {'vs balanced':>12} {'skipped':>8}")
        for name in ("balanced", "one 4x slower", "one 4x slower, skipping"):
            t = rows[name]["s_per_it_all"]
            print(f"  {name:<26} {t * 1e3:>13.2f} {t / bal:>12.2f} {rows[name]['skipped']:>8}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"P": size, "args": vars(args), "rows": rows}, f, indent=1)
        sys.stdout.flush()
    g.Free()


if __name__ == "__main__":
    main()
