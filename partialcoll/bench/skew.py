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

One row per message size (-m [MIN:]MAX, -f) and mode; COLUMNS (what --help prints) says
what each column means. -z adds P50/P90/P99; -c checks every result (see _validate.py)
with late="fold".
"""
from __future__ import annotations

import time
from typing import Callable, Dict, List, Sequence

import numpy as np
from mpi4py import MPI

import partialcoll as pc

from . import _validate
from ._common import (COLUMNS_HELP, TAIL, Collective, add_common_args, bandwidths, check_common, data,
                      element_type, modes, percentile, runnable_modes, sizes, to_numpy, type_name)
from ._report import Table, header, progress

SYNCS = ("iteration", "none")

COLUMNS = COLUMNS_HELP + """\
  latency us    time inside the call (post + wait), mean over ranks and iterations: the
                paper's "average runtime"
  MPI/mode      MPI_Allreduce's latency / this mode's, in the same run: the speedup
  ideal us      the latency of a zero-cost collective under the same delays and --sync
                (mode full, mpi: waiting for the last rank; solo: 0)
  ideal/meas    ideal us / latency us: how close the mode comes to its ideal
  late %        posts that found their round already completed (they return at once)
  it/s          iterations per second of the slowest rank's whole loop (sleeps included)
  init us       the initiator's round latency: from the post that started round n (the
                first eligible post; quorum's k-th; mpi's and full's last) to the round's
                completion at that rank

-c grows a message to P + 1 elements if smaller (one element per rank counts its posts).
"""


def add_skew_args(p) -> None:
    p.add_argument("--skew", default="linear:1ms",
                   help="linear:Dms | random:K:Dms | uniform:A:Bms (default linear:1ms)")
    p.add_argument("--sync", default="iteration", choices=SYNCS,
                   help="iteration (default, the paper's method: MPI_Reduce of the latency and MPI_Barrier "
                        "after every call, so every iteration starts aligned) or none (free-running, as "
                        "training is: ranks drift apart and fast ones run ahead where the mode lets them)")
    add_common_args(p, sizes="8", iterations=64, warmup=4, mode_list="mpi,impi,solo,majority,probe,quorum,full")
    p.add_argument("-r", "--repetitions", type=int, default=2,
                   help="repetitions; the order of the modes is reversed every other one, so no mode "
                        "always runs first (default 2)")
    p.add_argument("--seed", type=int, default=0, help="seed of the skew pattern and of the candidates")
    p.add_argument("--report", action="store_true",
                   help="after each mode, print who is slow: the collective's per-rank table (coll.stats(); "
                        "--json keeps every table, partialcoll-bench report re-reads them)")
    p.epilog = "columns:\n" + COLUMNS


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
    iters = args.iterations
    coll = Collective(mode, count, dtype, comm, args.algorithm, quorum, args.candidates, args.seed, late=late)
    values = _validate.Values(size, count, dtype) if args.validate else None
    checker = _validate.Checker(values, rank, [args.warmup + iters] * size) if values is not None else None
    x = data(count, dtype, rank)
    y = np.empty_like(x)
    lat, post, done = np.zeros(iters), np.zeros(iters), np.zeros(iters)
    is_late, naps = np.zeros(iters, bool), np.zeros(iters)
    sync = args.sync == "iteration"
    mine, total = np.zeros(1), np.zeros(1)

    def prepare(n: int) -> None:          # outside the timed call
        if values is not None:
            x[:] = values.post(rank, n)

    def record(res, closing: bool = False) -> None:
        if checker is not None:
            checker.add(res.round, res.rounds, res.active, to_numpy(res.data), closing=closing,
                        posts=getattr(res, "posts", None))

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
    if final is not None:
        record(final, closing=True)
    who = coll.coll.stats().to_dict() if coll.coll is not None and pc.rc.telemetry else None
    return {"stats": who, "lat": lat, "post": post, "done": done, "late": is_late, "nap": naps, "loop": loop,
            "wrong": checker.wrong if checker else 0, "errors": checker.errors if checker else [],
            "seen": checker.seen if checker else {}}


def _summary(mode: str, recs: Sequence[dict], d: np.ndarray, args, quorum: int) -> dict:
    """Rank 0: one repetition's figures for one mode from every rank's records."""
    size = len(recs)
    lat = np.array([r["lat"] for r in recs])                 # [rank, iteration]
    per_iter = lat.mean(axis=0)
    rule = start_rule(mode, size, args.seed, quorum, args.candidates)
    init = initiator_latency(np.array([r["post"] for r in recs]), np.array([r["done"] for r in recs]),
                             rule, args.warmup)
    sim = simulate(d, args.sync, rule, args.warmup)
    errors = [e for r in recs for e in r["errors"]]
    wrong = sum(r["wrong"] for r in recs)
    if args.validate:
        split = _validate.disagreement([r["seen"] for r in recs])
        if split:
            errors.append(split)
            wrong += 1
    return {"mode": mode, "latency_us": float(lat.mean() * 1e6), "nap": float(np.mean([r["nap"] for r in recs])),
            "ideal_us": float(sim["waits"].mean() * 1e6),
            "late_fraction": float(np.mean([r["late"] for r in recs])),
            "ideal_late_fraction": float(sim["late"].mean()),
            "throughput_its": args.iterations / max(r["loop"] for r in recs),
            "initiator_us": float(init.mean() * 1e6),
            "per_iteration_us": (per_iter * 1e6).tolist(), "initiator_per_round_us": (init * 1e6).tolist(),
            "wrong": wrong, "errors": errors}


def skew_table(args) -> Table:
    return Table(args, middle=[("iters", "iterations", 6, "d"), ("latency us", "latency_us", 11, ".1f"),
                               ("MPI/mode", "mpi_over", 9, ".2f"), ("ideal us", "ideal_us", 9, ".1f"),
                               ("ideal/meas", "ideal_over_measured", 10, ".3f"), ("late %", "late_percent", 7, ".1f"),
                               ("it/s", "throughput_its", 9, ".1f"), ("init us", "initiator_us", 9, ".1f")])


def skew(comm, args) -> dict:
    dtype = element_type(args.dtype)
    mode_list = modes(args.modes)
    if args.repetitions < 1:
        raise ValueError("-r/--repetitions must be >= 1")
    size = comm.size
    quorum, late = check_common(args, size)
    counts, size_note = sizes(args.sizes, args.factor, dtype.itemsize, 8, 8)
    notes = [size_note] if size_note else []
    if args.validate and min(counts) < _validate.min_count(size):
        grown = [c * dtype.itemsize for c in counts if c < _validate.min_count(size)]
        counts = list(dict.fromkeys(max(c, _validate.min_count(size)) for c in counts))
        notes.append(f"-c: {', '.join(map(str, grown))} B grown to {_validate.min_count(size)} elements "
                     f"(one per rank counts its posts)")
    mode_list, skipped, note = runnable_modes(mode_list, dtype, "MPI/mode")
    notes += [note] if note else []
    d = delays(args.skew, size, args.iterations, args.seed)
    clock = _clock(comm)
    tname = type_name(dtype)
    table = skew_table(args)
    if comm.rank == 0:
        print(header(f"skew {args.skew}: allreduce (MPI_SUM) of {tname}, {args.iterations} iterations x "
                     f"{args.repetitions} repetitions, late={late!r}", comm))
        print("# sync iteration: the paper's method (every iteration: sleep, time post+wait, MPI_Reduce "
              "of the time, MPI_Barrier)" if args.sync == "iteration" else
              "# sync none: free-running (no barrier between iterations; ranks drift apart as in training)")
        print(f"# sizes: {', '.join(str(c * dtype.itemsize) for c in counts)} B; warm-up: {args.warmup} calls "
              f"without skew; mode order alternates per repetition: {','.join(mode_list)} then reversed")
        print(table.head(notes))
    rows_out: List[dict] = []
    reports: List[dict] = []
    for count in counts:
        nbytes = count * dtype.itemsize
        per_rep: List[Dict[str, dict]] = []
        for rep in range(args.repetitions):
            order = mode_list if rep % 2 == 0 else mode_list[::-1]
            rows: Dict[str, dict] = {}
            for mode in order:
                mine = _run(comm, args, mode, count, dtype, quorum, d, clock, late)
                recs = comm.gather(mine, root=0)
                if comm.rank == 0:
                    rows[mode] = _summary(mode, recs, d, args, quorum)
                    if mine["stats"] is not None:
                        mine["stats"].update({"mode": mode, "bytes": nbytes, "repetition": rep})
                        reports.append(mine["stats"])
                        if args.report:
                            print(_report_lines(mine["stats"], f"{mode}, {nbytes} B, repetition {rep + 1}"),
                                  flush=True)
                progress(f"{nbytes} B, repetition {rep + 1}/{args.repetitions}: {mode} done")
            per_rep.append(rows)
        if comm.rank == 0:
            for row in _aggregate(per_rep, mode_list, args):
                row.update({"bytes": nbytes, "count": count, "type": tname, "iterations": args.iterations})
                row["algbw_gbs"], row["busbw_gbs"] = bandwidths(nbytes, row["latency_us"] * 1e-6, size)
                table.failures.extend(f"{row['mode']} at {nbytes} B: {e}" for e in row["errors"][:3])
                rows_out.append(row)
                print(table.line(row), flush=True)
    if comm.rank == 0:
        print(table.tail(rows_out), flush=True)
    table.fail_if_wrong(comm, rows_out)
    if comm.rank != 0:
        return {"rows": []}

    def plot(plt, path):
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
        shown = [r for r in rows_out if r["bytes"] == rows_out[0]["bytes"]]
        names = [r["mode"] for r in shown]
        a1.bar(names, [r["latency_us"] for r in shown], label="measured")
        a1.plot(names, [r["ideal_us"] for r in shown], "k_", markersize=20, label="ideal")
        a1.set_ylabel("latency (us)")
        a1.legend()
        a2.bar(names, [r["nap"] for r in shown])
        a2.set_ylabel("mean NAP")
        for ax in (a1, a2):
            ax.tick_params(axis="x", rotation=30)
        fig.suptitle(f"skew {args.skew}, sync {args.sync}, {shown[0]['bytes']} B, P = {size}")
        fig.savefig(path, dpi=120, bbox_inches="tight")

    return {"command": "skew", "P": size, "skew": args.skew, "sync": args.sync, "dtype": tname,
            "bytes": rows_out[0]["bytes"], "sizes": args.sizes, "factor": args.factor, "notes": notes,
            "skipped_modes": skipped, "iterations": args.iterations, "warmup": args.warmup,
            "repetitions": args.repetitions, "seed": args.seed, "late": late, "quorum": quorum,
            "candidates": args.candidates, "validated": bool(args.validate), "rows": rows_out, "stats": reports, "plot": plot}


def _report_lines(stats: dict, what: str) -> str:
    """A collective's who-is-slow table under '#' (the skew run's rounds, warm-up included)."""
    table = pc.Stats.from_dict(stats).table()
    return "\n".join(["# " + what + ":"] + ["#   " + line for line in table.splitlines()])


def _aggregate(per_rep: List[Dict[str, dict]], mode_list: List[str], args) -> List[dict]:
    """One row per mode: means over repetitions; ratios to MPI per repetition and overall."""
    rows = []
    for mode in mode_list:
        reps = [rep[mode] for rep in per_rep]
        row: dict = {"mode": mode}
        for key in ("latency_us", "nap", "ideal_us", "late_fraction", "ideal_late_fraction", "throughput_its",
                    "initiator_us"):
            row[key] = float(np.mean([r[key] for r in reps]))
        row["late_percent"] = 100 * row["late_fraction"]
        samples = [v for r in reps for v in r["per_iteration_us"]]
        row.update({f"p{q}_us": percentile(samples, q) for q in TAIL})
        init = [v for r in reps for v in r["initiator_per_round_us"]]
        row.update({f"initiator_p{q}_us": percentile(init, q) for q in TAIL})
        row["ideal_over_measured"] = row["ideal_us"] / row["latency_us"] if row["latency_us"] > 0 else float("nan")
        row["latency_us_per_repetition"] = [r["latency_us"] for r in reps]
        if "mpi" in mode_list:
            ratios = [per_rep[k]["mpi"]["latency_us"] / r["latency_us"] for k, r in enumerate(reps)]
            row["mpi_over_per_repetition"] = ratios
        row["errors"] = [e for r in reps for e in r["errors"]]
        row["wrong"] = sum(r["wrong"] for r in reps) if args.validate else None
        row["valid"] = (not row["wrong"]) if args.validate else None
        rows.append(row)
    base = next((r["latency_us"] for r in rows if r["mode"] == "mpi"), None)
    for r in rows:
        r["ratio_to_mpi"] = r["latency_us"] / base if base else None
        r["mpi_over"] = base / r["latency_us"] if base and r["latency_us"] > 0 else None
    return rows
