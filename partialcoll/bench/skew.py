"""partialcoll-bench skew: the eager-SGD Fig. 9 benchmark.

Before each call every rank is delayed by a skew pattern, then calls the allreduce;
the latency is the time spent inside the call. Patterns (seeded, so every rank
knows every rank's delay):

  linear:Dms       rank r waits r*D ms (the paper's setting)
  random:K:Dms     K random ranks wait D ms each step (the paper's ResNet runs)
  uniform:A:Bms    every rank waits a random time in [A, B] ms (RNA's setting)

Next to each measured latency: the ideal latency, what the mode costs under the same
delays with a zero-cost collective (MPI waits for the last rank; majority for the
designated rank; probe for the first candidate; quorum for the k-th arrival; solo for
the first arrival, i.e. nothing), and ideal/measured.
"""
from __future__ import annotations

import time

import numpy as np
from mpi4py import MPI

import partialcoll as pc

from ._common import Collective, data, modes, parse_bytes
from ._report import header, progress


def add_skew_args(p) -> None:
    p.add_argument("--skew", default="linear:1ms", help="linear:Dms | random:K:Dms | uniform:A:Bms")
    p.add_argument("-i", "--iterations", type=int, default=64)
    p.add_argument("-x", "--warmup", type=int, default=4)
    p.add_argument("-m", "--size", default="8", help="message size in bytes (default 8)")
    p.add_argument("--modes", default="mpi,impi,solo,majority,probe,quorum,full")
    p.add_argument("--algorithm", default="auto")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--quorum", type=int, default=None, help="k for mode quorum (default P/2)")
    p.add_argument("--candidates", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)


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
    except ValueError:
        raise ValueError(f"bad skew pattern {pattern!r}: use linear:1ms, random:K:Dms or uniform:A:Bms") from None
    return d / 1000.0


def ideal(mode: str, d: np.ndarray, seed: int, quorum: int, candidates: int) -> float:
    """Mean wait with a zero-cost collective: max(0, start - own arrival)."""
    waits = []
    p = d.shape[1]
    for n, row in enumerate(d):
        if mode in ("mpi", "impi", "full"):
            start = row.max()
        elif mode == "solo":
            start = row.min()
        elif mode == "majority":
            start = row[pc.candidates(seed, n, p, 1)[0]]
        elif mode == "probe":
            start = row[list(pc.candidates(seed, n, p, min(candidates, p)))].min()
        else:
            start = np.sort(row)[quorum - 1]
        waits.append(np.maximum(0, start - row).mean())
    return float(np.mean(waits))


def skew(comm, args) -> dict:
    dtype = np.dtype(args.dtype)
    mode_list = modes(args.modes)
    count = max(1, parse_bytes(args.size) // dtype.itemsize)
    if args.iterations < 1 or args.warmup < 0:
        raise ValueError("iterations must be >= 1 and warmup >= 0")
    quorum = args.quorum or max(1, comm.size // 2)
    d = delays(args.skew, comm.size, args.iterations, args.seed)
    x = data(count, dtype, comm.rank)
    rows = []
    if comm.rank == 0:
        print(header(f"skew {args.skew}, {count * dtype.itemsize} B, {args.iterations} iterations", comm))
        print(f"# {'mode':>9} {'latency us':>12} {'vs MPI':>8} {'mean NAP':>9} {'ideal us':>10} {'ideal/meas':>10}")
    for mode in mode_list:
        coll = Collective(mode, count, dtype, comm, args.algorithm, quorum, args.candidates, args.seed)
        y = np.empty_like(x)
        for _ in range(args.warmup):
            coll.call(x, y)
        comm.Barrier()
        lat, naps = [], []
        for i in range(args.iterations):
            time.sleep(d[i, comm.rank])
            t = MPI.Wtime()
            naps.append(coll.call(x, y))
            lat.append(MPI.Wtime() - t)
        comm.Barrier()            # nobody closes while others still iterate
        coll.close()
        mean = comm.allreduce(float(np.mean(lat))) / comm.size * 1e6
        nap = comm.allreduce(float(np.mean(naps))) / comm.size
        best = ideal(mode, d, args.seed, quorum, args.candidates) * 1e6
        rows.append({"mode": mode, "latency_us": mean, "nap": nap, "ideal_us": best,
                     "ideal_over_measured": best / mean if mean > 0 else float("nan")})
        progress(f"{mode} done")
    base = next((r["latency_us"] for r in rows if r["mode"] == "mpi"), None)
    for r in rows:
        r["ratio_to_mpi"] = r["latency_us"] / base if base else float("nan")
        if comm.rank == 0:
            print(f"  {r['mode']:>9} {r['latency_us']:>12.1f} {r['ratio_to_mpi']:>8.3f} {r['nap']:>9.2f} "
                  f"{r['ideal_us']:>10.1f} {r['ideal_over_measured']:>10.3f}", flush=True)

    def plot(plt, path):
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
        names = [r["mode"] for r in rows]
        a1.bar(names, [r["latency_us"] for r in rows], label="measured")
        a1.plot(names, [r["ideal_us"] for r in rows], "k_", markersize=20, label="ideal")
        a1.set_ylabel("latency (us)")
        a1.legend()
        a2.bar(names, [r["nap"] for r in rows])
        a2.set_ylabel("mean NAP")
        for ax in (a1, a2):
            ax.tick_params(axis="x", rotation=30)
        fig.suptitle(f"skew {args.skew}, P = {comm.size}")
        fig.savefig(path, dpi=120, bbox_inches="tight")

    return {"command": "skew", "P": comm.size, "skew": args.skew, "bytes": count * dtype.itemsize,
            "iterations": args.iterations, "seed": args.seed, "rows": rows, "plot": plot}
