"""Small messages: post(x, out=y).wait() vs MPI_Allreduce, interleaved.

Run: mpiexec -n 2 python bench/small.py      (also -n 1: post+wait with nothing to send)

Each block times `--iterations` calls of MPI_Allreduce (mpi4py, buffer interface), then
the same number of `coll.post(x, out=y).wait()` on a persistent allreduce (mode full,
the allreduce_init path) and on a solo PartialAllreduce; the order of the peers
alternates from block to block, so nobody always runs first. Each rank's time per call
is averaged over the block, the block's value is the slowest rank's, and the median over
`--blocks` blocks is reported, with the ratio to MPI_Allreduce. Results are checked
against MPI_Allreduce (values that differ per rank and per call).

--rounds N then times N single calls of each peer, one after the other, and prints the
distribution of one call's time on rank 0 (median, p90, p99, p99.9) and the share of the
loop's time spent in calls over 15 us: a mean per block hides whether it is a slower
typical call or a few very slow ones.

--floor adds two peers that show what a round is made of: `self`, the same post+wait on
a full-mode collective over COMM_SELF (no message: Python and the engine, with the
world's collectives armed beside it), and `exchange` (even P), the message exchange of
one round as a plain mpi4py loop would do it: Irecv and Isend with rank ^ 1, then
Testall until both completed. At P = 2 a full round is about self + exchange.

Rank 0 prints; --json FILE writes the rows.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
from mpi4py import MPI

import partialcoll as pc


def single_calls(comm, fn, rounds):
    """The time of each of `rounds` single calls of fn's body (us), after a barrier."""
    ts = np.empty(rounds)
    clock = time.perf_counter_ns
    comm.Barrier()
    for i in range(rounds):
        t = clock()
        fn(1)
        ts[i] = (clock() - t) / 1e3
    return ts


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-b", "--blocks", type=int, default=5)
    ap.add_argument("-i", "--iterations", type=int, default=2000)
    ap.add_argument("-n", "--count", type=int, default=2, help="float32 elements (default 2: 8 B)")
    ap.add_argument("--modes", default="full,solo")
    ap.add_argument("--rc", default="", help="partialcoll.rc options KEY=VALUE,...")
    ap.add_argument("--rounds", type=int, default=0, help="then time this many single calls of each peer")
    ap.add_argument("--floor", action="store_true", help="also time `self` and `exchange` (see above)")
    ap.add_argument("--telemetry", action="store_true",
                    help="each mode twice, interleaved: with the who-is-slow telemetry (pc.rc.telemetry) "
                         "and without it ('MODE/off'): its cost")
    ap.add_argument("--json")
    args = ap.parse_args()
    for kv in filter(None, args.rc.split(",")):
        key, value = kv.split("=", 1)
        cur = getattr(pc.rc, key)
        setattr(pc.rc, key, value if isinstance(cur, str) or cur is None else type(cur)(value))
    comm = MPI.COMM_WORLD
    n, iters = args.count, args.iterations
    x = np.arange(n, dtype=np.float32) + comm.rank
    y = np.empty_like(x)
    ref = np.empty_like(x)
    colls = {m: pc.PartialAllreduce(n, np.float32, comm=comm, mode=m) for m in args.modes.split(",")}
    if args.telemetry:                   # the same modes without telemetry (read at creation)
        on, pc.rc.telemetry = pc.rc.telemetry, False
        colls.update({m + "/off": pc.PartialAllreduce(n, np.float32, comm=comm, mode=m)
                      for m in args.modes.split(",")})
        pc.rc.telemetry = on

    def run_mpi(k=iters):
        for _ in range(k):
            comm.Allreduce(x, ref, op=MPI.SUM)

    def run_coll(coll):
        def body(k=iters):
            for _ in range(k):
                coll.post(x, out=y).wait()
        return body

    peers = [("mpi", run_mpi)] + [(m, run_coll(c)) for m, c in colls.items()]
    if args.floor:
        colls["self"] = pc.PartialAllreduce(n, np.float32, comm=MPI.COMM_SELF, mode="full")
        peers.append(("self", run_coll(colls["self"])))
        if comm.size % 2 == 0:
            other, rbuf = comm.rank ^ 1, np.empty_like(x)

            def run_exchange(k=iters):
                for _ in range(k):
                    reqs = [comm.Irecv(rbuf, other, 7), comm.Isend(x, other, 7)]
                    while not MPI.Request.Testall(reqs):
                        pass
            peers.append(("exchange", run_exchange))
    # warm-up, and a check: every peer gives MPI_Allreduce's result (full mode: exactly;
    # solo: a round's data is a sum of whole posts, so with equal posts per rank and a
    # barrier in between it is the same)
    for _name, fn in peers:
        fn()
    comm.Allreduce(x, ref, op=MPI.SUM)
    if "full" in colls:
        colls["full"].post(x, out=y).wait()
        assert np.array_equal(y, ref), (y, ref)
    times = {name: [] for name, _ in peers}
    for b in range(args.blocks):
        order = peers if b % 2 == 0 else peers[::-1]
        for name, fn in order:
            comm.Barrier()
            t0 = time.perf_counter()
            fn()
            t = (time.perf_counter() - t0) / iters * 1e6
            times[name].append(comm.allreduce(t, op=MPI.MAX))
    tails = {name: single_calls(comm, fn, args.rounds) for name, fn in peers} if args.rounds else {}
    for c in colls.values():
        c.close()
    if comm.rank == 0:
        med = {name: statistics.median(ts) for name, ts in times.items()}
        info = pc.info()
        print(f"# small messages: {n * 4} B, P = {comm.size}, {iters} calls x {args.blocks} blocks, "
              f"median of the slowest rank's mean per block; idle={info.get('idle', '?')}")
        print(f"# {'peer':<8} {'us/call':>9} {'x MPI':>7}   blocks")
        rows = []
        for name, _ in peers:
            ratio = med[name] / med["mpi"]
            print(f"  {name:<8} {med[name]:9.2f} {ratio:7.2f}   " + " ".join(f"{t:.2f}" for t in times[name]))
            rows.append({"peer": name, "us": med[name], "ratio": ratio, "blocks": times[name],
                         "P": comm.size, "bytes": n * 4, "idle": info.get("idle")})
        if tails:
            print(f"# one call, {args.rounds} calls (rank 0): us at the median, p90, p99, p99.9; "
                  "share of the time in calls over 15 us")
            for name, ts in tails.items():
                q = np.percentile(ts, [50, 90, 99, 99.9])
                slow = ts[ts > 15].sum() / ts.sum() * 100
                print(f"  {name:<8} " + " ".join(f"{v:8.2f}" for v in q) + f"   {slow:5.1f} %")
                rows.append({"peer": name, "rounds": args.rounds, "percentiles_us": q.tolist(), "slow_share": slow})
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
