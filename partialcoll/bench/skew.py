"""partialcoll-bench skew: the eager-SGD Fig. 9 benchmark (latency under a skewed arrival).

Every iteration each rank sleeps its skew delay, then calls the allreduce (post + wait);
the latency is the time inside the call. Two ways to run the loop (--sync):

  iteration  the paper's method (fflib2 evaluation/rsgd.c and ssgd.c, the default): after
             every call MPI_Reduce of the latency to rank 0 and MPI_Barrier, so every
             iteration starts aligned. Measures the cost of one call under one skewed
             arrival, what the ideal column models.
  none       free-running, as training is: each rank goes on to its next sleep as soon as
             its call returns. Ranks drift apart; fast ranks run ahead where the mode lets
             them (solo), and a persistent skew paces everyone where it does not (majority's
             rounds designated to slow ranks). Measures what a training loop sees.

Patterns (seeded, so every rank knows every rank's delay):

  linear:Dms       rank r waits r*D ms (the paper's setting)
  random:K:Dms     K random ranks wait D ms each step (the paper's ResNet runs)
  uniform:A:Bms    every rank waits a random time in [A, B] ms (RNA's setting)

Per mode: latency (mean over ranks and iterations, the paper's "average runtime"), its
ratio to MPI_Allreduce in the same run, mean NAP, the ideal latency (a zero-cost
collective under the same delays and the same --sync), the fraction of late posts (the
round had completed when the rank posted), the throughput (iterations/s of the slowest
rank's whole loop), and the initiator round latency: from the post that made round n
start (the first eligible post; quorum's k-th; MPI's and full's last) to the round's
completion at that rank. -z adds P50/P99 over iterations of the per-iteration mean over
ranks (as OSU's -z); -c checks every result (see _validate.py) with late="fold".
"""
from __future__ import annotations

import time
from typing import Callable, Dict, List, Sequence

import numpy as np
from mpi4py import MPI

import partialcoll as pc

from . import _validate
from ._common import Collective, data, modes, parse_bytes
from ._report import header, progress

SYNCS = ("iteration", "none")


def add_skew_args(p) -> None:
    p.add_argument("--skew", default="linear:1ms",
                   help="linear:Dms | random:K:Dms | uniform:A:Bms (default linear:1ms)")
    p.add_argument("--sync", default="iteration", choices=SYNCS,
                   help="iteration (default, the paper's method: MPI_Reduce of the latency and MPI_Barrier "
                        "after every call, so every iteration starts aligned) or none (free-running, as "
                        "training is: ranks drift apart and fast ones run ahead where the mode lets them)")
    p.add_argument("-i", "--iterations", type=int, default=64, help="timed iterations (default 64)")
    p.add_argument("-x", "--warmup", type=int, default=4, help="untimed calls without skew first (default 4)")
    p.add_argument("-r", "--repetitions", type=int, default=2,
                   help="repetitions; the order of the modes is reversed every other one, so no mode "
                        "always runs first (default 2)")
    p.add_argument("-m", "--size", default="8", help="message size in bytes (default 8)")
    p.add_argument("--modes", default="mpi,impi,solo,majority,probe,quorum,full",
                   help="comma list of mpi,impi,full,solo,majority,probe,quorum")
    p.add_argument("--algorithm", default="auto", help="auto, recursive_doubling or ring")
    p.add_argument("--dtype", default="float32", help="element type (default float32)")
    p.add_argument("--quorum", type=int, default=None, help="k for mode quorum (default P/2)")
    p.add_argument("--candidates", type=int, default=2, help="q for mode probe (default 2)")
    p.add_argument("--seed", type=int, default=0, help="seed of the skew pattern and of the candidates")
    p.add_argument("--late", choices=("latest", "fold"), default=None,
                   help="what a late post returns (default latest; fold with -c)")
    p.add_argument("-z", "--tail", action="store_true", help="also print P50 and P99 latency (as OSU's -z)")
    p.add_argument("-c", "--validate", action="store_true",
                   help="check every result of every mode (late='fold'; the message grows to P+1 "
                        "elements if smaller); exit 1 on every rank if one is wrong")


def _ms(text: str) -> float:
    t = text.strip().lower()
    if t.endswith("us"):
        return float(t[:-2]) / 1000
    return float(t[:-2] if t.endswith("ms") else t)


def delays(pattern: str, size: int, iterations: int, seed: int) -> np.ndarray:
    """[iteration, rank] -> delay in seconds."""
    kind, _, rest = pattern.partition(":")
    rng = np.random.default_rng(seed)
    parts = rest.split(":")
    try:
        if kind == "linear" and len(parts) == 1:
            d = np.tile(np.arange(size) * _ms(parts[0]), (iterations, 1))
        elif kind == "random" and len(parts) == 2:
            k, dur = int(parts[0]), _ms(parts[1])
            if not 0 <= k <= size:
                raise ValueError
            d = np.zeros((iterations, size))
            for i in range(iterations):
                d[i, rng.choice(size, k, replace=False)] = dur
        elif kind == "uniform" and len(parts) == 2:
            d = rng.uniform(_ms(parts[0]), _ms(parts[1]), (iterations, size))
        else:
            raise ValueError
        if np.any(d < 0):
            raise ValueError
    except ValueError:
        raise ValueError(f"bad skew pattern {pattern!r}: use linear:1ms, random:K:Dms or uniform:A:Bms") from None
    return d / 1000.0


def start_rule(mode: str, size: int, seed: int, quorum: int, candidates: int) -> Callable[[int], tuple]:
    """round -> (eligible ranks, k): round n starts with the k-th post among the eligible."""
    everyone = tuple(range(size))
    if mode in ("mpi", "impi", "full"):
        return lambda n: (everyone, size)
    if mode == "solo":
        return lambda n: (everyone, 1)
    if mode == "quorum":
        return lambda n: (everyone, quorum)
    q = 1 if mode == "majority" else min(candidates, size)
    return lambda n: (pc.candidates(seed, n, size, q), 1)


def simulate(d: np.ndarray, sync: str, rule: Callable[[int], tuple], first_round: int = 0) -> dict:
    """A zero-cost collective under delays d[i, r]: every rank's wait, late posts, loop time.

    sync "iteration": every iteration starts at the same time (after a barrier); "none":
    rank r's iteration i starts when its call i-1 returned. Round n starts at the k-th
    eligible arrival, not before round n-1 (rounds run in order); a rank arriving after
    the start returns at once (late).
    """
    n, p = d.shape
    done = np.zeros(p)
    started = -np.inf
    waits, late = np.zeros((n, p)), np.zeros((n, p), bool)
    for i in range(n):
        arrive = (done.max() if sync == "iteration" else done) + d[i]
        eligible, k = rule(first_round + i)
        started = max(started, float(np.sort(arrive[list(eligible)])[k - 1]))
        done = np.maximum(arrive, started)
        waits[i], late[i] = done - arrive, arrive > started
    return {"waits": waits, "late": late, "time": float(done.max())}


def ideal(mode: str, d: np.ndarray, seed: int, quorum: int, candidates: int, sync: str = "iteration",
          first_round: int = 0) -> float:
    """Mean wait with a zero-cost collective (see simulate)."""
    rule = start_rule(mode, d.shape[1], seed, quorum, candidates)
    return float(simulate(d, sync, rule, first_round)["waits"].mean())


def initiator_latency(post: np.ndarray, done: np.ndarray, rule: Callable[[int], tuple],
                      first_round: int) -> np.ndarray:
    """Per iteration: done - post at the rank whose post started the round (k-th eligible).

    post, done: [rank, iteration] times on one clock."""
    out = np.empty(post.shape[1])
    for i in range(post.shape[1]):
        eligible, k = rule(first_round + i)
        eligible = np.asarray(eligible)
        who = eligible[np.argsort(post[eligible, i], kind="stable")[k - 1]]
        out[i] = done[who, i] - post[who, i]
    return out


def _clock(comm) -> Callable[[], float]:
    """time.perf_counter (CLOCK_MONOTONIC, one clock for the node) where every rank shares a
    node; otherwise the same clock less this rank's reading just after a barrier."""
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    same = node.Get_size() == comm.Get_size()
    node.Free()
    if same:
        return time.perf_counter
    comm.Barrier()
    zero = time.perf_counter()
    return lambda: time.perf_counter() - zero


def _run(comm, args, mode: str, count: int, dtype, quorum: int, d: np.ndarray, clock, late: str) -> dict:
    """One mode once: warm-up, then the timed loop; returns this rank's raw records."""
    rank, size = comm.rank, comm.size
    iters, validate = args.iterations, args.validate
    coll = Collective(mode, count, dtype, comm, args.algorithm, quorum, args.candidates, args.seed, late=late)
    x = data(count, dtype, rank)
    y = np.empty_like(x)
    outcomes: List[_validate.Outcome] = []
    lat, post, done = np.zeros(iters), np.zeros(iters), np.zeros(iters)
    is_late, naps = np.zeros(iters, bool), np.zeros(iters)
    sync = args.sync == "iteration"
    mine, total = np.zeros(1), np.zeros(1)

    def prepare(n: int) -> None:          # outside the timed call
        if validate:
            x[:] = _validate.post_values(rank, size, count, n, dtype)

    def record(res) -> None:
        if validate:
            outcomes.append(_validate.Outcome(res.round, res.rounds, res.active, res.data, posts=res.posts))

    for n in range(args.warmup):
        prepare(n)
        record(coll.call_result(x, y)[0])
    comm.Barrier()
    start = time.perf_counter()
    for i in range(iters):
        prepare(args.warmup + i)
        time.sleep(d[i, rank])
        t0 = clock()
        res, was_late = coll.call_result(x, y)
        t1 = clock()
        record(res)
        lat[i], post[i], done[i], is_late[i], naps[i] = t1 - t0, t0, t1, was_late, res.nap
        if sync:                          # the paper's method: reduce the time, then a barrier
            mine[0] = lat[i]
            comm.Reduce(mine, total, MPI.SUM, 0)
            comm.Barrier()
    loop = time.perf_counter() - start
    comm.Barrier()                        # nobody closes while others still iterate
    final = coll.close()
    if validate and final is not None:
        outcomes.append(_validate.Outcome(final.round, final.rounds, final.active, final.data, closing=True,
                                            posts=final.posts))
    errors: List[str] = []
    seen: Dict[int, tuple] = {}
    if validate:
        errors, seen = check_results(outcomes, size, [args.warmup + iters] * size, rank)
    return {"lat": lat, "post": post, "done": done, "late": is_late, "nap": naps, "loop": loop,
            "errors": errors, "seen": seen}


check_results = _validate.check       # the reference -c compares with (tests replace it)


def _summary(mode: str, recs: Sequence[dict], d: np.ndarray, args, quorum: int) -> dict:
    """Rank 0: one repetition's figures for one mode from every rank's records."""
    size = len(recs)
    lat = np.array([r["lat"] for r in recs])                 # [rank, iteration]
    per_iter = lat.mean(axis=0)
    rule = start_rule(mode, size, args.seed, quorum, args.candidates)
    init = initiator_latency(np.array([r["post"] for r in recs]), np.array([r["done"] for r in recs]),
                             rule, args.warmup)
    sim = simulate(d, args.sync, rule, args.warmup)
    return {"mode": mode, "latency_us": float(lat.mean() * 1e6), "nap": float(np.mean([r["nap"] for r in recs])),
            "ideal_us": float(sim["waits"].mean() * 1e6),
            "late_fraction": float(np.mean([r["late"] for r in recs])),
            "ideal_late_fraction": float(sim["late"].mean()),
            "throughput_its": args.iterations / max(r["loop"] for r in recs),
            "initiator_us": float(init.mean() * 1e6),
            "per_iteration_us": (per_iter * 1e6).tolist(), "initiator_per_round_us": (init * 1e6).tolist(),
            "errors": [e for r in recs for e in r["errors"]]}


def _percentile(values: Sequence[float], pct: float) -> float:
    """OSU's tail latency: the value at round(n * pct / 100) - 1 of the sorted samples."""
    v = np.sort(np.asarray(values))
    return float(v[max(0, min(len(v) - 1, int(round(len(v) * pct / 100)) - 1))])


def skew(comm, args) -> dict:
    dtype = np.dtype(args.dtype)
    mode_list = modes(args.modes)
    if args.iterations < 1 or args.warmup < 0 or args.repetitions < 1:
        raise ValueError("iterations and repetitions must be >= 1 and warmup >= 0")
    if args.validate and args.late == "latest":
        raise ValueError("-c needs late='fold' (with 'latest' a late rank skips rounds' data, so nothing "
                         "can be checked to add up); leave --late out or pass --late fold")
    late = args.late or ("fold" if args.validate else "latest")
    size = comm.size
    count = max(1, parse_bytes(args.size) // dtype.itemsize)
    grown = ""
    if args.validate and count < _validate.min_count(size):
        count = _validate.min_count(size)
        grown = f" (grown from {args.size} B for -c)"
    quorum = args.quorum or max(1, size // 2)
    if not 1 <= quorum <= size:
        raise ValueError(f"--quorum must be in 1..{size}, not {quorum}")
    if args.candidates < 1:
        raise ValueError("--candidates must be >= 1")
    d = delays(args.skew, size, args.iterations, args.seed)
    clock = _clock(comm)
    nbytes = count * dtype.itemsize
    if comm.rank == 0:
        print(header(f"skew {args.skew}, {nbytes} B{grown}, {args.iterations} iterations x "
                     f"{args.repetitions} repetitions, late={late!r}", comm))
        print("# sync iteration: the paper's method (every iteration: sleep, time post+wait, MPI_Reduce "
              "of the time, MPI_Barrier)" if args.sync == "iteration" else
              "# sync none: free-running (no barrier between iterations; ranks drift apart as in training)")
        print(f"# mode order alternates per repetition: {','.join(mode_list)} then reversed")
    per_rep: List[Dict[str, dict]] = []
    for rep in range(args.repetitions):
        order = mode_list if rep % 2 == 0 else mode_list[::-1]
        rows: Dict[str, dict] = {}
        for mode in order:
            mine = _run(comm, args, mode, count, dtype, quorum, d, clock, late)
            recs = comm.gather(mine, root=0)
            if comm.rank == 0:
                rows[mode] = _summary(mode, recs, d, args, quorum)
                if args.validate:
                    seen_bad = _validate.disagreement([r["seen"] for r in recs])
                    if seen_bad:
                        rows[mode]["errors"].append(seen_bad)
            progress(f"repetition {rep + 1}/{args.repetitions}: {mode} done")
        per_rep.append(rows)
    failed = 0
    rows_out: List[dict] = []
    if comm.rank == 0:
        rows_out = _aggregate(per_rep, mode_list, args)
        failed = sum(len(r["errors"]) > 0 for r in rows_out)
        _print(rows_out, args)
    failed = comm.bcast(failed, root=0)
    if failed:
        if comm.rank == 0:
            for r in rows_out:
                for e in r["errors"][:3]:
                    print(f"# FAIL {r['mode']}: {e}")
        raise ValidationFailed(f"-c: {failed} mode(s) returned wrong results")
    if comm.rank != 0:
        return {"rows": []}

    def plot(plt, path):
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
        names = [r["mode"] for r in rows_out]
        a1.bar(names, [r["latency_us"] for r in rows_out], label="measured")
        a1.plot(names, [r["ideal_us"] for r in rows_out], "k_", markersize=20, label="ideal")
        a1.set_ylabel("latency (us)")
        a1.legend()
        a2.bar(names, [r["nap"] for r in rows_out])
        a2.set_ylabel("mean NAP")
        for ax in (a1, a2):
            ax.tick_params(axis="x", rotation=30)
        fig.suptitle(f"skew {args.skew}, sync {args.sync}, P = {size}")
        fig.savefig(path, dpi=120, bbox_inches="tight")

    return {"command": "skew", "P": size, "skew": args.skew, "sync": args.sync, "bytes": nbytes,
            "iterations": args.iterations, "warmup": args.warmup, "repetitions": args.repetitions,
            "seed": args.seed, "late": late, "quorum": quorum, "candidates": args.candidates,
            "validated": bool(args.validate), "rows": rows_out, "plot": plot}


class ValidationFailed(RuntimeError):
    """-c found a wrong result (exit status 1 on every rank)."""


def _aggregate(per_rep: List[Dict[str, dict]], mode_list: List[str], args) -> List[dict]:
    """One row per mode: means over repetitions; ratios to MPI per repetition and overall."""
    rows = []
    for mode in mode_list:
        reps = [rep[mode] for rep in per_rep]
        row = {"mode": mode}
        for key in ("latency_us", "nap", "ideal_us", "late_fraction", "ideal_late_fraction", "throughput_its",
                    "initiator_us"):
            row[key] = float(np.mean([r[key] for r in reps]))
        samples = [v for r in reps for v in r["per_iteration_us"]]
        row["p50_us"], row["p99_us"] = _percentile(samples, 50), _percentile(samples, 99)
        init = [v for r in reps for v in r["initiator_per_round_us"]]
        row["initiator_p50_us"], row["initiator_p99_us"] = _percentile(init, 50), _percentile(init, 99)
        row["ideal_over_measured"] = row["ideal_us"] / row["latency_us"] if row["latency_us"] > 0 else float("nan")
        row["latency_us_per_repetition"] = [r["latency_us"] for r in reps]
        if "mpi" in mode_list:
            ratios = [per_rep[k]["mpi"]["latency_us"] / r["latency_us"] for k, r in enumerate(reps)]
            row["mpi_over_per_repetition"] = ratios
        row["errors"] = [e for r in reps for e in r["errors"]]
        row["valid"] = (not row["errors"]) if args.validate else None
        rows.append(row)
    base = next((r["latency_us"] for r in rows if r["mode"] == "mpi"), None)
    for r in rows:
        r["ratio_to_mpi"] = r["latency_us"] / base if base else float("nan")
        r["mpi_over"] = base / r["latency_us"] if base and r["latency_us"] > 0 else float("nan")
    return rows


def _print(rows: List[dict], args) -> None:
    cols = (f"# {'mode':>9} {'latency us':>11} {'MPI/mode':>9} {'NAP':>6} {'ideal us':>9} {'ideal/meas':>10} "
            f"{'late %':>7} {'it/s slowest':>12} {'initiator us':>12}")
    if args.tail:
        cols += f" {'P50 us':>9} {'P99 us':>9}"
    if args.validate:
        cols += f" {'valid':>6}"
    print(cols)
    for r in rows:
        line = (f"  {r['mode']:>9} {r['latency_us']:>11.1f} {r['mpi_over']:>9.2f} {r['nap']:>6.2f} "
                f"{r['ideal_us']:>9.1f} {r['ideal_over_measured']:>10.3f} {100 * r['late_fraction']:>7.1f} "
                f"{r['throughput_its']:>12.1f} {r['initiator_us']:>12.1f}")
        if args.tail:
            line += f" {r['p50_us']:>9.1f} {r['p99_us']:>9.1f}"
        if args.validate:
            line += f" {'Pass' if r['valid'] else 'Fail':>6}"
        print(line, flush=True)
