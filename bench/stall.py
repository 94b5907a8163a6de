"""One rank stalled for a long time: do the others' rounds continue, is memory bounded?

Run: flock /tmp/pc-bench.lock nice -n 10 mpiexec -n 4 python bench/stall.py --stall 60 --how sleep

Every rank posts and waits in a loop (float64 SUM, late="fold", --mode, default solo) for
--before seconds; then the last rank (the victim) stalls for --stall seconds, while the
others go on posting; then everyone posts for --after seconds more, and closes.

  --how sleep:    the victim's application thread sleeps (a rank stuck in computation or
                  I/O): its progress thread still takes part in rounds passively.
  --how sigstop:  rank 0 stops the whole victim process (SIGSTOP, then SIGCONT): nothing of
                  it runs, its progress thread included (a descheduled or swapped-out host).

Rank 0 samples every rank's RSS (/proc/PID/status VmRSS) once a second. Reported (rank 0,
one JSON line, then a summary): the survivors' posts/s and rounds/s before, during and
after the stall; every rank's RSS before the stall, its largest during it, and at the end;
for the victim after the stall: its first result (how many rounds it folds, its latency)
and how long its late posts took until it was back in step; and the check that at every
rank the sum of its results plus close() equals everything posted by every rank (values
are small integers, so exactly).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time

import numpy as np
from mpi4py import MPI

import partialcoll as pc


def rss_of(pid: int) -> float:
    """VmRSS of a process on this node, MiB (a stopped process can still be read)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return float("nan")


def mode_options(mode: str, size: int) -> dict:
    if mode == "probe":
        return {"candidates": 2}
    if mode == "quorum":
        return {"quorum": max(1, (size + 1) // 2)}
    return {}


def run(comm, args) -> dict:
    rank, size = comm.rank, comm.size
    victim = size - 1 if args.victim is None else args.victim
    pids = comm.allgather(os.getpid())
    count = args.count
    coll = pc.PartialAllreduce(count, np.float64, MPI.SUM, comm, mode=args.mode, late="fold",
                               **mode_options(args.mode, size))
    x = np.full(count, float(rank + 1))          # every post of rank r adds r + 1
    out = np.empty(count)
    received = np.zeros(count)
    posts = 0
    timeout = args.stall + 120.0
    comm.Barrier()
    t0 = comm.bcast(time.monotonic(), root=0)    # one node: CLOCK_MONOTONIC is shared
    t_stall, t_resume = t0 + args.before, t0 + args.before + args.stall
    t_end = t_resume + args.after
    # per phase: posts, (unused), first and last round of this rank's results
    phases = {"before": [0, 0, -1, -1], "during": [0, 0, -1, -1], "after": [0, 0, -1, -1]}

    samples = []                                 # (t, [rss per rank]) at rank 0
    stop_sampler = threading.Event()

    def sampler():
        stopped = False
        while not stop_sampler.is_set():
            now = time.monotonic()
            if args.how == "sigstop" and not stopped and t_stall <= now < t_resume:
                os.kill(pids[victim], signal.SIGSTOP)
                stopped = True
            if args.how == "sigstop" and stopped and now >= t_resume:
                os.kill(pids[victim], signal.SIGCONT)
                stopped = False
            samples.append((now - t0, [rss_of(p) for p in pids]))
            stop_sampler.wait(min(args.sample, 0.05) if args.how == "sigstop" else args.sample)
        if stopped:
            os.kill(pids[victim], signal.SIGCONT)

    thread = None
    if rank == 0:
        thread = threading.Thread(target=sampler, daemon=True)
        thread.start()

    def phase_of(t):
        return "before" if t < t_stall else "during" if t < t_resume else "after"

    first_after = None                           # the victim's first result after the stall
    back_in_step = None                          # when its posts stopped being late
    while True:
        now = time.monotonic()
        if now >= t_end:
            break
        if rank == victim and args.how == "sleep" and t_stall <= now < t_resume:
            time.sleep(t_resume - now)           # stuck in "computation"
            continue
        t_post = time.monotonic()
        req = coll.post(x, out=out)
        res = req.wait(timeout=timeout)
        t_done = time.monotonic()
        posts += 1
        received += out
        ph = phases[phase_of(t_post)]
        ph[0] += 1
        if ph[2] < 0:
            ph[2] = res.round
        ph[3] = res.round
        if rank == victim and t_post >= t_resume:
            if first_after is None:
                first_after = {"rounds_folded": int(res.rounds), "round": int(res.round), "index": req.index,
                               "late": bool(req.late), "latency_s": round(t_done - t_post, 4),
                               "posted_at_s": round(t_post - t0, 3)}
            if back_in_step is None and not req.late:
                back_in_step = {"after_s": round(t_done - t_resume, 3), "index": req.index,
                                "late_posts": req.index - first_after["index"]}
    final = coll.close(timeout=timeout)
    received += final.data
    t_close = time.monotonic() - t0
    if rank == 0:
        stop_sampler.set()
        thread.join()
    mine = np.full(count, float(posts * (rank + 1)))
    everything = np.empty(count)
    comm.Allreduce(mine, everything, op=MPI.SUM)
    lost = not np.array_equal(received, everything)
    stats = comm.gather({"rank": rank, "phases": phases, "posts": posts, "lost": lost,
                         "first_after": first_after, "back_in_step": back_in_step}, root=0)
    nothing_lost = not comm.allreduce(lost, op=MPI.LOR)
    if rank != 0:
        return {"ok": nothing_lost}

    def window(name):
        return {"before": (0.0, args.before), "during": (args.before, args.before + args.stall),
                "after": (args.before + args.stall, args.before + args.stall + args.after)}[name]

    others = [s for s in stats if s["rank"] != victim]
    row = {"P": size, "mode": args.mode, "how": args.how, "victim": victim, "stall_s": args.stall,
           "before_s": args.before, "after_s": args.after, "count": count, "close_at_s": round(t_close, 2),
           "nothing_lost": nothing_lost, "posts": [s["posts"] for s in stats]}
    for name in ("before", "during", "after"):
        lo, hi = window(name)
        span = hi - lo
        ph = [s["phases"][name] for s in others]
        row[f"{name}_posts_per_s_per_survivor"] = round(sum(p[0] for p in ph) / len(ph) / span, 1)
        first = min((p[2] for p in ph if p[2] >= 0), default=-1)
        last = max((p[3] for p in ph), default=-1)
        row[f"{name}_rounds_per_s"] = round((last - first + 1) / span, 1) if first >= 0 else 0.0
        rss = [r for t, r in samples if lo <= t < hi]
        if rss:
            row[f"{name}_rss_mib_first"] = [round(v, 1) for v in rss[0]]
            row[f"{name}_rss_mib_max"] = [round(max(r[i] for r in rss), 1) for i in range(size)]
            row[f"{name}_rss_mib_last"] = [round(v, 1) for v in rss[-1]]
    row["victim_posts_during"] = stats[victim]["phases"]["during"][0]
    # its late posts return at once, so it gains on the others' rounds at this rate less theirs
    row["victim_posts_per_s_after"] = round(stats[victim]["phases"]["after"][0] / args.after, 1)
    # rounds the others completed that the victim has not posted for: right after the stall
    # and at the end (its late posts return at once, so the lag must shrink)
    vph = stats[victim]["phases"]
    row["victim_lag_after_stall"] = max(p["phases"]["during"][3] for p in others) - \
        (vph["before"][0] + vph["during"][0] - 1)
    row["victim_lag_at_end"] = max(p["phases"]["after"][3] for p in others) - (stats[victim]["posts"] - 1)
    row["victim_first_result_after"] = stats[victim]["first_after"]
    row["victim_back_in_step"] = stats[victim]["back_in_step"]
    row["rss_samples"] = len(samples)
    row["ok"] = nothing_lost
    print(json.dumps(row), flush=True)
    if args.trace:
        with open(args.trace, "w") as f:
            json.dump([(round(t, 2), [round(v, 2) for v in r]) for t, r in samples], f)
    return {"ok": nothing_lost, "row": row}


def parser():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stall", type=float, default=60.0, help="seconds the victim is stalled")
    ap.add_argument("--before", type=float, default=5.0)
    ap.add_argument("--after", type=float, default=10.0)
    ap.add_argument("--how", choices=["sleep", "sigstop"], default="sleep")
    ap.add_argument("--mode", default="solo")
    ap.add_argument("--victim", type=int, default=None, help="the stalled rank (default: the last)")
    ap.add_argument("--count", type=int, default=4, help="float64 elements")
    ap.add_argument("--sample", type=float, default=1.0, help="RSS sampling period, seconds")
    ap.add_argument("--trace", help="rank 0 writes the RSS samples here (JSON)")
    return ap


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    r = run(MPI.COMM_WORLD, args)
    pc.finalize()
    return 0 if r["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
