"""partialcoll-bench calibrate: measure the alpha-beta model's parameters on this machine
and cache them, for algorithm="auto" (partialcoll/algorithms/model.py).

    mpiexec -n 2 partialcoll-bench calibrate                  # one node: its links
    mpiexec -n 4 -ppn 2 partialcoll-bench calibrate           # two nodes: the network's too

alpha, beta: half a ping-pong (mpi4py, 8 B - 4 MiB), least squares with relative errors;
between rank 0 and the next rank on its node (alpha_node, beta_node) and, if there is
one, the first rank on another node (alpha, beta; else the defaults stay). gamma: the
slope of the engine's float32 SUM (1 - 16 MiB, one rank's schedule); o: the engine's cost
of an op (a chain of 64 NOPs). Each node's first rank writes the result to its cache
(model.cache_path(), --output); a collective then chooses with rank 0's.
"""
from __future__ import annotations

import time
from typing import Dict, List, Optional, Tuple

import numpy as np
from mpi4py import MPI

SIZES = (8, 512, 4096, 32768, 262144, 1 << 20, 4 << 20)


def add_calibrate_args(p) -> None:
    p.add_argument("--output", metavar="FILE", default=None,
                   help="where to cache the parameters (default: model.cache_path(), per host)")
    p.add_argument("--no-save", action="store_true", help="measure and print only")
    p.add_argument("-i", "--iterations", type=int, default=100, help="ping-pong round trips per size (default 100)")


def median_time(fn, iters: int, reps: int = 3) -> float:
    """Median over reps of the mean time of iters calls (seconds)."""
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        out.append((time.perf_counter() - t0) / iters)
    return sorted(out)[len(out) // 2]


def pingpong(comm, a: int, b: int, iterations: int) -> Optional[Tuple[float, float]]:
    """(alpha, beta) from half the round trips between ranks a and b (collective; the
    others wait); None if a == b."""
    if a == b:
        return None
    rank, sizes, times = comm.rank, [], []
    for nbytes in SIZES:
        buf = np.zeros(nbytes, np.uint8)
        iters = max(5, iterations * 16384 // max(nbytes, 16384))

        def once():
            if rank == a:
                comm.Send(buf, b)
                comm.Recv(buf, b)
            elif rank == b:
                comm.Recv(buf, a)
                comm.Send(buf, a)
        comm.Barrier()
        once()
        t = median_time(once, iters) / 2          # a's counts; b answers, the others pass
        sizes.append(nbytes)
        times.append(comm.bcast(t, root=a))
    n, secs = np.array(sizes, float), np.array(times, float)
    (alpha, beta), *_ = np.linalg.lstsq(np.stack([1 / secs, n / secs], 1), np.ones_like(secs), rcond=None)
    return max(float(alpha), 0.0), max(float(beta), 0.0)


def engine_costs() -> Tuple[float, float]:
    """(gamma, o) of this rank's engine: float32 SUM per byte, and one op."""
    import partialcoll as pc
    with pc.Schedule(MPI.COMM_SELF) as s:
        s.nop()
        s.commit()
        empty = median_time(lambda: s.start().wait(), 500)
    with pc.Schedule(MPI.COMM_SELF) as s:
        last = None
        for _ in range(64):
            last = s.nop(after=last)
        s.commit()
        o = max(0.0, (median_time(lambda: s.start().wait(), 500) - empty) / 63)
    xs, ts = [], []
    for nbytes in (1 << 20, 4 << 20, 16 << 20):
        a, b = np.ones(nbytes // 4, np.float32), np.ones(nbytes // 4, np.float32)
        with pc.Schedule(MPI.COMM_SELF) as s:
            s.compute(MPI.SUM, a, b, out=b)
            s.commit()
            xs.append(nbytes)
            ts.append(median_time(lambda: s.start().wait(), max(5, 64 * (1 << 20) // nbytes)))
    return max(float(np.polyfit(xs, ts, 1)[0]), 0.0), o


def calibrate(comm, args) -> dict:
    from ..algorithms import model
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        leaders = comm.allgather(node.allreduce(comm.rank, op=MPI.MIN))
        local_rank = node.rank
    finally:
        node.Free()
    same = next((r for r in range(1, comm.size) if leaders[r] == leaders[0]), 0)
    other = next((r for r in range(1, comm.size) if leaders[r] != leaders[0]), 0)
    q = model.DEFAULTS
    rows: List[Dict[str, object]] = []
    inside = pingpong(comm, 0, same, args.iterations)
    if inside:
        q = q._replace(alpha_node=inside[0], beta_node=inside[1])
        rows.append({"link": f"node (0 <-> {same})", "alpha_us": inside[0] * 1e6, "beta_ns_per_B": inside[1] * 1e9})
    across = pingpong(comm, 0, other, args.iterations)
    if across:
        q = q._replace(alpha=across[0], beta=across[1])
        rows.append({"link": f"network (0 <-> {other})", "alpha_us": across[0] * 1e6,
                     "beta_ns_per_B": across[1] * 1e9})
    gamma, o = engine_costs() if comm.rank == 0 else (0.0, 0.0)
    gamma, o = comm.bcast((gamma, o), root=0)
    q = q._replace(gamma=gamma, o=o, source="partialcoll-bench calibrate")
    path = None
    if not args.no_save and local_rank == 0:
        path = model.save(q, args.output)
    paths = comm.gather(path, root=0)
    if comm.rank == 0:
        for row in rows:
            print(f"# {row['link']}: alpha {row['alpha_us']:.3g} us, beta {row['beta_ns_per_B']:.3g} ns/B")
        print(f"# engine: gamma {gamma * 1e9:.3g} ns/B (float32 SUM), o {o * 1e6:.3g} us per op")
        print(f"# model: {q.describe()}")
        saved = sorted({p for p in paths or () if p})
        print(f"# cached in {', '.join(saved)}" if saved else "# not cached (--no-save)")
    return {"rows": rows, "params": q._asdict(), "cached": paths}
