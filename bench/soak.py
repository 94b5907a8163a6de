"""Soak: many rounds of every mode with random skew: nothing lost, agreement, memory flat.

Run: flock /tmp/pc-bench.lock nice -n 10 mpiexec -n 4 python bench/soak.py          (10^5 rounds x 5 modes)
     flock /tmp/pc-bench.lock nice -n 10 mpiexec -n 3 python bench/soak.py --ops 10000
         (the ownership stress instead, bench/stress.py: --ops operations per rank for each
          mode and late, four threads per rank; stress.py's other options follow --ops)

Each rank posts `--rounds` times (post, then wait) on a persistent PartialAllreduce
(float64 SUM, late="fold", --count elements) of each mode; before a post it is skewed with
probability --skew-p by a random sleep of up to --skew-us microseconds (seeded per rank).
Values are small integers that differ per rank, per post and per element, so every sum is
exact and the checks are equalities:

- nothing lost: at every rank the sum of every result it received plus close()'s result
  equals the sum of everything posted by every rank (MPI_Allreduce of the posted sums);
- agreement: every round that some rank got as a result of its own (rounds == 1) has the
  same data (its first element, kept per round) at every rank that got it;
- full mode: each round's data equals the sum of every rank's post #n, computed locally.

MPICH's MPI_TAG_UB (2^29 - 1) leaves 13 bits of round version, so the version wraps every
8192 rounds. Reported per mode by rank 0: run time, rounds/s, the rounds completed, the
wraps crossed, and every rank's RSS (VmRSS) after creation, after the run, and its peak
(VmHWM), in MiB; sampled every --sample rounds, the largest RSS growth after the first
sample. Exits 1 if a check failed.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np
from mpi4py import MPI

import partialcoll as pc

VERSION_PERIOD = 8192          # 2^13 versions with MPICH's MPI_TAG_UB


def rss_mib(field: str = "VmRSS") -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024.0
    return float("nan")


def value(rank: int, i: int, count: int) -> np.ndarray:
    """Post #i of rank: small integers, different per rank, post and element."""
    return ((np.arange(count) * 3 + 7 * rank + i) % 11 + 1).astype(np.float64)


def mode_options(mode: str, size: int) -> dict:
    if mode == "probe":
        return {"candidates": 2}
    if mode == "quorum":
        return {"quorum": max(1, (size + 1) // 2)}
    return {}


def soak(comm, mode: str, args) -> dict:
    rank, size, count, rounds = comm.rank, comm.size, args.count, args.rounds
    rng = np.random.default_rng([args.seed, rank])
    skew = rng.random(rounds) < args.skew_p
    sleeps = rng.uniform(0, args.skew_us * 1e-6, rounds)
    # values: post i of rank r is base + (i % 11): the periodic part is computed once
    base = value(rank, 0, count) - 1
    period = [base + i for i in range(11)]
    per_round = np.full(rounds + 64, np.nan)     # first element of each round received alone
    received = np.zeros(count)
    posted = np.zeros(count)
    ok = True
    coll = pc.PartialAllreduce(count, np.float64, MPI.SUM, comm, mode=mode, late="fold", seed=args.seed,
                               **mode_options(mode, size))
    out = np.empty(count)
    comm.Barrier()
    rss0 = rss_mib()
    samples = [rss0]
    full_ref = np.zeros(count)
    if mode == "full":
        # round n sums every rank's post #n: base_r + n % 11 over ranks
        full_base = sum(value(r, 0, count) - 1 for r in range(size))
    t0 = time.perf_counter()
    last_round = -1
    for i in range(rounds):
        if skew[i]:
            time.sleep(sleeps[i])
        x = period[i % 11]
        posted += x
        res = coll.post(x, out=out).wait(timeout=args.timeout)
        received += out
        n = res.round
        last_round = max(last_round, n)
        if res.rounds == 1 and n < per_round.size:
            per_round[n] = out[0]
        if mode == "full":
            np.add(full_base, size * (i % 11), out=full_ref)
            if n != i or not np.array_equal(out, full_ref):
                print(f"rank {rank} full round {i}: round {n}, data {out[:3]} != {full_ref[:3]}", flush=True)
                ok = False
        if args.sample and (i + 1) % args.sample == 0:
            samples.append(rss_mib())
    t_loop = time.perf_counter() - t0
    final = coll.close(timeout=args.timeout)
    t_all = time.perf_counter() - t0
    received += final.data
    last_round = max(last_round, final.round)
    everything = np.empty(count)
    comm.Allreduce(posted, everything, op=MPI.SUM)
    if not np.array_equal(received, everything):
        print(f"rank {rank} {mode}: LOST: received {received[:3]} != posted {everything[:3]}", flush=True)
        ok = False
    rss1, hwm = rss_mib(), rss_mib("VmHWM")      # before the checks' own gathers
    # agreement: gather the per-round first elements at rank 0
    rows = comm.gather(per_round, root=0)
    disagree = 0
    checked = 0
    if rank == 0:
        m = np.vstack(rows)
        seen = ~np.isnan(m)
        both = seen.sum(axis=0) >= 2
        checked = int(both.sum())
        lo = np.where(seen, m, np.inf).min(axis=0)
        hi = np.where(seen, m, -np.inf).max(axis=0)
        disagree = int(np.count_nonzero(both & (lo != hi)))
        if disagree:
            print(f"{mode}: {disagree} rounds disagree across ranks", flush=True)
    stats = {"rank": rank, "rss0": rss0, "rss1": rss1, "hwm": hwm,
             "growth_after_first_sample": max(samples[1:] or [rss0]) - (samples[1] if len(samples) > 1 else rss0),
             "t_loop": t_loop, "t_all": t_all, "ok": ok, "last_round": int(last_round)}
    everyone = comm.gather(stats, root=0)
    ok_all = comm.allreduce(ok and disagree == 0, op=MPI.LAND)
    row = None
    if rank == 0:
        t = max(s["t_loop"] for s in everyone)
        row = {"mode": mode, "P": size, "rounds": rounds, "count": count, "skew_p": args.skew_p,
               "skew_us": args.skew_us, "seconds": round(t, 2),
               "seconds_with_close": round(max(s["t_all"] for s in everyone), 2),
               "posts_per_s_per_rank": round(rounds / t, 1),
               "rounds_completed": max(s["last_round"] for s in everyone) + 1,
               "rounds_checked_for_agreement": checked, "disagreements": disagree,
               "nothing_lost": all(s["ok"] for s in everyone),
               "rss_before_mib": [round(s["rss0"], 1) for s in everyone],
               "rss_after_mib": [round(s["rss1"], 1) for s in everyone],
               "rss_peak_mib": [round(s["hwm"], 1) for s in everyone],
               "rss_growth_after_first_sample_mib": [round(s["growth_after_first_sample"], 2) for s in everyone],
               "ok": bool(ok_all)}
        row["rounds_per_s"] = round(row["rounds_completed"] / t, 1)
        row["version_wraps"] = row["rounds_completed"] // VERSION_PERIOD
        print(json.dumps(row), flush=True)
    return {"ok": ok_all, "row": row}


def finish(comm, name: str, rows: list, ok: bool, path) -> None:
    """Rank 0 writes the rows to path (if given) and says OK or FAILED (also bench/stress.py)."""
    if comm.rank == 0:
        if path:
            with open(path, "w") as f:
                json.dump(rows, f, indent=1)
        print(f"# {name}", "OK" if ok else "FAILED", flush=True)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=100000, help="posts per rank per mode")
    ap.add_argument("--modes", default="solo,majority,probe,quorum,full")
    ap.add_argument("--count", type=int, default=4, help="float64 elements")
    ap.add_argument("--skew-p", type=float, default=0.1, help="probability of a skew sleep before a post")
    ap.add_argument("--skew-us", type=float, default=500.0, help="longest skew sleep, microseconds")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--sample", type=int, default=10000, help="sample RSS every this many posts")
    ap.add_argument("--timeout", type=float, default=120.0, help="wait()/close() timeout, seconds")
    ap.add_argument("--json", help="rank 0 writes the rows here")
    ap.add_argument("--ops", type=int, help="run bench/stress.py instead: operations per rank per mode and late")
    return ap


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--ops" in argv:                  # the threaded ownership stress (bench/stress.py)
        import stress
        return stress.main(argv)
    args = parser().parse_args(argv)
    comm = MPI.COMM_WORLD
    if comm.rank == 0:
        print(f"# soak: P={comm.size} rounds={args.rounds} count={args.count} skew p={args.skew_p} "
              f"up to {args.skew_us} us, seed {args.seed}; {pc.info().get('mpi_library', '?')[:40]!r}", flush=True)
    rows, ok = [], True
    for mode in args.modes.split(","):
        r = soak(comm, mode, args)
        ok = ok and r["ok"]
        rows.append(r["row"])
    finish(comm, "soak", rows, ok, args.json)
    pc.finalize()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
