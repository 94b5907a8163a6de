"""The cost of the who-is-slow telemetry: post(x, out=y).wait() with it on and off.

Run: mpiexec -n 2 python bench/telemetry_cost.py [--count N] [--pairs K] [--calls C]

Two collectives of the same mode, one created with pc.rc.telemetry on and one with it
off, timed in pairs of blocks of C calls each, the order swapped from pair to pair, all in
one process: the ratio of each pair (on / off; the slowest rank's block time) cancels the
machine's slow drift, which on a shared machine is larger than the cost. Rank 0 prints
the median and the quartiles of the pairs' ratios, per mode.
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np
from mpi4py import MPI

import partialcoll as pc


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--count", type=int, default=2, help="float32 elements (default 2: 8 B)")
    ap.add_argument("--pairs", type=int, default=200)
    ap.add_argument("--calls", type=int, default=100, help="calls per block")
    ap.add_argument("--modes", default="full,solo")
    ap.add_argument("--json")
    args = ap.parse_args()
    comm = MPI.COMM_WORLD
    x = np.arange(args.count, dtype=np.float32) + comm.rank
    y = np.empty_like(x)
    rows = []
    for mode in args.modes.split(","):
        colls = {}
        for on in (True, False):
            pc.rc.telemetry = on
            colls[on] = pc.PartialAllreduce(args.count, np.float32, comm=comm, mode=mode)
        pc.rc.telemetry = True

        def block(coll):
            comm.Barrier()
            t0 = time.perf_counter()
            for _ in range(args.calls):
                coll.post(x, out=y).wait()
            return comm.allreduce(time.perf_counter() - t0, op=MPI.MAX) / args.calls

        for coll in colls.values():      # warm-up
            block(coll)
        ratios, ons, offs = [], [], []
        for k in range(args.pairs):
            order = (True, False) if k % 2 == 0 else (False, True)
            t = {on: block(colls[on]) for on in order}
            ratios.append(t[True] / t[False])
            ons.append(t[True])
            offs.append(t[False])
        for coll in colls.values():
            coll.close()
        q = np.percentile(ratios, [25, 50, 75])
        row = {"mode": mode, "bytes": 4 * args.count, "P": comm.size, "pairs": args.pairs, "calls": args.calls,
               "on_us": float(np.median(ons) * 1e6), "off_us": float(np.median(offs) * 1e6),
               "ratio_q25": q[0], "ratio_median": q[1], "ratio_q75": q[2]}
        rows.append(row)
        if comm.rank == 0:
            print(f"{mode:>6} {4 * args.count:>9} B P={comm.size}: on {row['on_us']:.2f} us, off {row['off_us']:.2f} us "
                  f"per call; on/off per pair: median {q[1]:.4f} (quartiles {q[0]:.4f} - {q[2]:.4f})", flush=True)
    if comm.rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
