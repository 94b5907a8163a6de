"""Idle CPU of a rank whose collective is armed. Run: mpiexec -n 2 python bench/idle.py

For each vector size x mode x progress ("thread", "inline") two scenarios, each
`--seconds` long, reporting the CPU (user + system, all threads) of the busiest rank
as a percentage of one core:

armed    one round done, then every rank sleeps: the next round is armed (its first
         receives are posted) but nothing moves on the wire.
waiting  rank 0 posts and waits for round n while rank 1 sleeps, posting only after
         the window (full mode waits for it; solo's round needs rank 1's engine,
         which in inline mode runs only inside rank 1's calls): a waiting rank must
         not spin.
work     the peer of `waiting`, measured in the same run: the CPU of one round in which
         every rank posts at once (the copy of the post and the data movement, which
         the waiting window contains too), in ms of the busiest rank. `waiting` minus
         `work` over the window is what waiting itself costs (`overhead`): at 25 MiB the
         round's own work is about 1 % of a 2 s window.

With --answer MS,...: how soon a waiting rank answers a late peer that needs it, what
the sleep tiers trade for those wake-ups. Rank 0 posts to a full round and waits, rank 1
posts MS ms later and times its own post+wait (5 times each, median and worst): at 8 B
(P = 2) rank 0's message is already there; at 1 MiB rank 1 waits for rank 0 to send.

Rank 0 prints one row per case and, with --json, writes them all.
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np
from mpi4py import MPI

import partialcoll as pc
from partialcoll.bench import _apply_rc

SIZES = {"8B": 2, "1MiB": 1 << 18, "25MiB": 25 << 18}     # float32 elements


def cpu_over(comm, seconds, body):
    """Run body() on every rank, then sleep out the rest of `seconds`; return each
    rank's CPU % of one core over that window."""
    comm.Barrier()
    c0, t0 = time.process_time(), time.perf_counter()
    body()
    time.sleep(max(0.0, t0 + seconds - time.perf_counter()))
    cpu = (time.process_time() - c0) / (time.perf_counter() - t0) * 100
    return comm.gather(cpu, root=0)


def measure(comm, count, mode, seconds):
    x = np.ones(count, np.float32)
    coll = pc.PartialAllreduce(count, np.float32, comm=comm, mode=mode, late="fold")
    coll.post(x).wait()
    armed = cpu_over(comm, seconds, lambda: time.sleep(seconds))

    def wait_for_late_peer():
        if comm.rank == 0:
            coll.post(x).wait()
        else:
            time.sleep(seconds)
    waiting = cpu_over(comm, seconds, wait_for_late_peer)
    if comm.rank == 1:
        coll.post(x).wait()             # the late post (solo: its round is long done)
    work = []
    for _ in range(3):                  # one round, every rank posting at once: its CPU
        comm.Barrier()
        c0 = time.process_time()
        coll.post(x).wait()
        work.append(time.process_time() - c0)
    coll.close()
    return armed, waiting, comm.gather(sorted(work)[1] * 1e3, root=0)


def answer(comm, count, late_ms, repeat=5):
    """Rank 1's post+wait (ms) when it posts late_ms after rank 0 began waiting."""
    x = np.ones(count, np.float32)
    coll = pc.PartialAllreduce(count, np.float32, comm=comm, mode="full")
    coll.post(x).wait()
    times = []
    for _ in range(repeat):
        comm.Barrier()
        if comm.rank == 1:
            time.sleep(late_ms / 1e3)
            t0 = time.perf_counter()
            coll.post(x).wait()
            times.append((time.perf_counter() - t0) * 1e3)
        else:
            coll.post(x).wait()
    coll.close()
    return comm.bcast(times, root=1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--sizes", default=",".join(SIZES))
    ap.add_argument("--modes", default="solo,full")
    ap.add_argument("--progress", default="thread,inline")
    ap.add_argument("--idle", default=None, help="partialcoll.rc.idle: auto, spin or sleep (default: rc's)")
    ap.add_argument("--rc", default="", help="partialcoll.rc options KEY=VALUE,... (e.g. deep_sleep_us=10000)")
    ap.add_argument("--answer", default="", help="late peers, ms,... (e.g. 50,150,300,1000): see above")
    ap.add_argument("--json")
    args = ap.parse_args()
    _apply_rc(args.rc)
    if args.idle:
        pc.rc.idle = args.idle
    comm = MPI.COMM_WORLD
    rows = []
    if comm.rank == 0:
        print(f"# idle CPU, % of one core, busiest of {comm.size} ranks ({args.seconds:g} s each), "
              f"idle={pc.rc.idle}")
        print(f"# {'progress':<8} {'mode':<6} {'size':>6} {'armed':>8} {'waiting':>8} {'work ms':>8} "
              f"{'overhead':>8}  active policy (rank 0's polling and large-message yield bounds, ms)")
    for progress in args.progress.split(","):
        pc.finalize()
        pc.rc.progress = progress
        for mode in args.modes.split(","):
            for name in args.sizes.split(","):
                armed, waiting, work = measure(comm, SIZES[name], mode, args.seconds)
                if comm.rank == 0:
                    busiest = max(range(comm.size), key=lambda r: waiting[r])
                    overhead = waiting[busiest] - work[busiest] / 10 / args.seconds     # ms -> % of the window
                    info = pc.info()
                    row = {"progress": progress, "mode": mode, "size": name, "idle": info["idle"],
                           "spin_bound_us": info["spin_bound_us"], "busy_bound_us": info["busy_bound_us"],
                           "armed": max(armed), "waiting": max(waiting), "waiting_rank0": waiting[0],
                           "work_ms": work[busiest], "overhead": overhead, "waiting_all": waiting, "work_all": work}
                    rows.append(row)
                    print(f"  {progress:<8} {mode:<6} {name:>6} {row['armed']:8.1f} {row['waiting']:8.1f} "
                          f"{row['work_ms']:8.1f} {overhead:8.1f}  {row['idle']} ({info['spin_bound_us'] / 1e3:.1f}, "
                          f"{info['busy_bound_us'] / 1e3:.1f})", flush=True)
    lates = [float(v) for v in filter(None, args.answer.split(","))]
    if lates and comm.size >= 2:
        pc.finalize()
        pc.rc.progress = args.progress.split(",")[0]
        if comm.rank == 0:
            print(f"# a peer posting late: its post+wait, ms (median / worst of 5), deep_sleep_us="
                  f"{pc.rc.deep_sleep_us:g}")
        for name in args.sizes.split(","):
            for late in lates:
                times = answer(comm, SIZES[name], late)
                if comm.rank == 0:
                    rows.append({"answer_size": name, "late_ms": late, "post_wait_ms": times})
                    print(f"  {name:>6} late {late:6g} ms: {np.median(times):7.2f} / {max(times):7.2f}", flush=True)
    if comm.rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
