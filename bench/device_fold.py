"""What a post costs when it folds into an accumulator that still holds data (P = 2).

    mpiexec -n 2 python bench/device_fold.py --buffers cupy --size 64M --json fold.json

Full mode, float32 SUM, late="fold" (so every rank's results add up to every post). Rank 1 holds back while rank 0 posts --posts times: rank 0's
first post starts round 0 (its data is taken at once), every later one finds the
accumulator full and folds into it: with device buffers, ``pending = pending + x`` on
the GPU and pending replaces the accumulator (one device op and one device-to-host
copy, docs/gpu.md "The staging path"); with host buffers, the engine's fold on the host.
Each post is timed on its own (device synchronized after it). Then rank 1 posts as many
times and every rank waits for its rounds. Checked: the rounds' results add up, element
by element, to everything both ranks posted (nothing lost or counted twice).

Printed (rank 0, JSON): the first post, the median folded post, and, for device buffers,
a plain device-to-host copy of the same size into pinned memory (what the fold adds to it
is the device op).
"""
import argparse
import json
import time

import numpy as np
from mpi4py import MPI

import partialcoll as pc
from partialcoll.bench._common import parse_bytes


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--buffers", choices=("host", "cupy"), default="cupy")
    ap.add_argument("--size", default="64M")
    ap.add_argument("--posts", type=int, default=8)
    ap.add_argument("--json")
    args = ap.parse_args()
    comm = MPI.COMM_WORLD
    if comm.size != 2:
        raise SystemExit("run on 2 ranks")
    count = parse_bytes(args.size) // 4
    if args.buffers == "cupy":
        import cupy as xp
        import cupyx
    else:
        xp = np
    posts = [xp.asarray(np.full(count, 1 + k + 10 * comm.rank, np.float32)) for k in range(args.posts)]
    sync = posts[0].device.synchronize if xp is not np else (lambda: None)
    sync()
    coll = pc.PartialAllreduce(count, np.float32, MPI.SUM, comm, mode="full", late="fold")
    times, reqs = [], []
    comm.Barrier()
    if comm.rank == 1:
        comm.Recv(np.zeros(1), source=0)           # hold back until rank 0 has posted them all
    for x in posts:
        t0 = time.perf_counter()
        reqs.append(coll.post(x))
        sync()
        times.append(time.perf_counter() - t0)
    if comm.rank == 0:
        comm.Send(np.zeros(1), dest=1)
    total = np.zeros(count, np.float64)
    for r in reqs:
        res = r.wait()
        total += np.asarray(res.data.get() if hasattr(res.data, "get") else res.data, np.float64)
    final = coll.close()
    total += np.asarray(final.data.get() if hasattr(final.data, "get") else final.data, np.float64)
    expect = sum(1 + k + 10 * r for k in range(args.posts) for r in range(comm.size))
    ok = bool(np.all(total == expect))
    oks = comm.allgather(ok)
    copy_s = None
    if args.buffers == "cupy":
        pinned = cupyx.empty_pinned(count, np.float32)
        samples = []
        for _ in range(5):
            t0 = time.perf_counter()
            posts[0].get(out=pinned)
            sync()
            samples.append(time.perf_counter() - t0)
        copy_s = sorted(samples)[2]
    if comm.rank == 0:
        folded = sorted(times[1:])
        row = {"buffers": args.buffers, "bytes": count * 4, "posts": args.posts,
               "first_post_us": times[0] * 1e6, "folded_post_median_us": folded[len(folded) // 2] * 1e6,
               "folded_post_us": [t * 1e6 for t in times[1:]],
               "d2h_copy_us": None if copy_s is None else copy_s * 1e6,
               "nothing_lost": all(oks), "cupy": getattr(xp, "__version__", None) if xp is not np else None}
        print(json.dumps(row), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(row, f, indent=1)
    if not all(oks):
        raise SystemExit(f"the rounds' results do not add up to what was posted (rank results: {oks})")


if __name__ == "__main__":
    main()
