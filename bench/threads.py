"""Two application threads on two collectives: does one wait behind the other?

Run: mpiexec -n 2 python bench/threads.py lock      (also: latency; --rc idle=spin)

lock     Thread A of rank 0 waits on a full-mode 8 B collective X whose peer (rank 1)
         posts 400 ms later; meanwhile thread B of rank 0 posts 4 MiB to a solo
         collective Y every 20 ms. Printed: B's post times while A waits (worst,
         median) next to B's posts with nobody waiting, in the same run.
latency  An 8 B round on collective Y (full mode, every rank's thread A loops
         post(x, out=y).wait()) while thread B of rank 0 posts 100 MiB to collective X
         (solo, late="fold") and waits for it, then sleeps --gap ms. The 8 B rounds that
         overlap B's post or wait are compared with those that do not, in the same run.

Rank 0 prints; --json FILE writes the rows.
"""
from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

import numpy as np
from mpi4py import MPI

import partialcoll as pc


def set_rc(text: str) -> None:
    for kv in filter(None, text.split(",")):
        key, value = kv.split("=", 1)
        cur = getattr(pc.rc, key)
        setattr(pc.rc, key, value if isinstance(cur, str) or cur is None else type(cur)(value))


def lock(comm, args):
    """Thread B's post times with thread A waiting on another collective, and without."""
    x8 = np.ones(2, np.float32)
    big = np.ones((4 << 20) // 4, np.float32)
    X = pc.allreduce_init(2, np.float32, comm=comm)
    Y = pc.PartialAllreduce(big.size, np.float32, comm=comm, mode="solo", late="fold")
    waiting, alone = [], []

    def posts(into, seconds):
        t_end = time.perf_counter() + seconds
        while time.perf_counter() < t_end:
            t0 = time.perf_counter()
            Y.post(big)
            into.append(time.perf_counter() - t0)
            time.sleep(0.02)

    if comm.rank == 0:
        # Y's first two posts touch its accumulator and scratch (2 - 3 ms each here): no lock
        # wait, and they would fall in the first sample only (B's posts while A waits)
        for _ in range(2):
            Y.post(big).wait(timeout=60)
    for _ in range(args.reps):
        comm.Barrier()
        if comm.rank == 0:
            b = threading.Thread(target=posts, args=(waiting, 0.3))
            a_started = threading.Event()

            def a():
                req = X.post(x8)
                a_started.set()
                req.wait(timeout=60)
            ta = threading.Thread(target=a)
            ta.start()
            a_started.wait()
            time.sleep(0.02)                 # A is inside wait() now
            b.start()
            b.join()
            ta.join()
        else:
            time.sleep(0.4)
            X.post(x8).wait(timeout=60)
        comm.Barrier()
        if comm.rank == 0:
            posts(alone, 0.3)
        comm.Barrier()
    Y.close(timeout=60)
    X.close(timeout=60)
    if comm.rank == 0:
        ms = lambda v: v * 1e3  # noqa: E731
        row = {"what": "lock", "idle": pc.info()["idle"], "P": comm.size,
               "waiting_worst_ms": ms(max(waiting)), "waiting_median_ms": ms(statistics.median(waiting)),
               "alone_worst_ms": ms(max(alone)), "alone_median_ms": ms(statistics.median(alone)),
               "posts": [len(waiting), len(alone)]}
        row["worst_over_alone_median"] = row["waiting_worst_ms"] / row["alone_median_ms"]
        print(f"# lock: B posts 4 MiB to Y while A waits on X (rank 1 posts X 400 ms late), "
              f"P = {comm.size}, idle={row['idle']}, {args.reps} reps")
        print(f"  B's post while A waits: worst {row['waiting_worst_ms']:.2f} ms, median "
              f"{row['waiting_median_ms']:.2f} ms ({len(waiting)} posts)")
        print(f"  B's post alone:         worst {row['alone_worst_ms']:.2f} ms, median "
              f"{row['alone_median_ms']:.2f} ms ({len(alone)} posts)")
        print(f"  worst while waiting / median alone: {row['worst_over_alone_median']:.2f}")
        return row
    return None


def latency(comm, args):
    """8 B round latency on Y, split by whether rank 0's thread B was busy with 100 MiB on X."""
    n_big = (args.big_mib << 20) // 4
    big = np.ones(n_big, np.float32)
    X = pc.PartialAllreduce(n_big, np.float32, comm=comm, mode="solo", late="fold")
    Y = pc.allreduce_init(2, np.float32, comm=comm)
    x8, y8 = np.ones(2, np.float32), np.empty(2, np.float32)
    stop = threading.Event()
    busy = []                                # (start, end) of B's post + wait

    def b():
        while not stop.is_set():
            t0 = time.perf_counter()
            X.post(big).wait(timeout=120)
            busy.append((t0, time.perf_counter()))
            time.sleep(args.gap / 1e3)

    for _ in range(200):
        Y.post(x8, out=y8).wait(timeout=60)
    comm.Barrier()
    tb = threading.Thread(target=b) if comm.rank == 0 else None
    if tb:
        tb.start()
    lat = []
    t_end = time.perf_counter() + args.seconds
    go = 1
    while go:
        t0 = time.perf_counter()
        Y.post(x8, out=y8).wait(timeout=60)
        lat.append((t0, time.perf_counter()))
        if len(lat) % 64 == 0:             # every rank stops after the same round
            go = comm.bcast(int(time.perf_counter() < t_end), root=0)
    stop.set()
    if tb:
        tb.join()
    busy = comm.bcast(busy, root=0)
    Y.close(timeout=60)
    X.close(timeout=120)
    if comm.rank != 0:
        return None
    during, quiet = [], []
    k = 0
    for t0, t1 in lat:
        while k < len(busy) and busy[k][1] < t0:
            k += 1
        hit = k < len(busy) and busy[k][0] <= t1
        (during if hit else quiet).append((t1 - t0) * 1e6)
    row = {"what": "latency", "idle": pc.info()["idle"], "P": comm.size, "big_mib": args.big_mib,
           "during_median_us": statistics.median(during) if during else None,
           "quiet_median_us": statistics.median(quiet) if quiet else None,
           "rounds": [len(during), len(quiet)], "big_posts": len(busy)}
    if during and quiet:
        row["ratio"] = row["during_median_us"] / row["quiet_median_us"]
    print(f"# latency: 8 B full rounds on Y while rank 0's thread B posts {args.big_mib} MiB to X "
          f"(post + wait, then {args.gap} ms asleep), P = {comm.size}, idle={row['idle']}")
    print(f"  8 B rounds overlapping B's work: median {row['during_median_us']} us ({len(during)} rounds)")
    print(f"  8 B rounds with B asleep:        median {row['quiet_median_us']} us ({len(quiet)} rounds)")
    print(f"  ratio: {row.get('ratio')}; {len(busy)} posts of {args.big_mib} MiB")
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["lock", "latency"])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--big-mib", type=int, default=100)
    ap.add_argument("--gap", type=float, default=200.0, help="ms thread B sleeps between its posts")
    ap.add_argument("--rc", default="", help="partialcoll.rc options KEY=VALUE,...")
    ap.add_argument("--json")
    args = ap.parse_args()
    set_rc(args.rc)
    comm = MPI.COMM_WORLD
    row = {"lock": lock, "latency": latency}[args.what](comm, args)
    if row and args.json:
        with open(args.json, "w") as f:
            json.dump(row, f, indent=1)


if __name__ == "__main__":
    main()
