"""Random uses of NeighborAllreduce (Hop) against what each result says it holds:
python neighbor_fuzz_checks.py [CASES]

(CASES: the first number among the arguments, so that the module runs in one job with
neighbor_checks.py and its arguments.)

Each case is drawn on rank 0 (seeded: the same cases every run; PC_FUZZ_SEED=N draws
another stream) and broadcast: a random directed graph over the ranks (asymmetric edges,
ranks without in- or out-neighbours), count (0 to 70000: MPI's eager and rendezvous
paths), dtype, op, weights, backup, max_staleness, max_gap and the number of iterations.
Every rank then runs its own random program: up to depth posts outstanding, waited for
in order or not, test() polls, results into the update (out=x), an array of the
caller's or the request's own, skip() when an in-neighbour is ahead, sleeps; some posts
are never waited for (close() drops them). Checks, for every result at every rank:

- it is exactly the combination (op, mean or staleness weights) of this rank's update
  of iteration k and the updates it reports, each the value its sender posted for that
  iteration (a skipped iteration carries the sender's last post);
- the updates come from in-neighbours, at least n_in - backup of them, of iterations in
  [k - s, k] (exactly k without staleness), sorted, each sender once; nap and active;
- Theorem 2 (max_gap = g: Iter(i) - Iter(j) <= g x len(path i -> j)) at every entry,
  and Theorem 1 ((s + 1) x len(path j -> i)) where every rank waits for each iteration
  before the next and nobody skips or has backup workers; no update dropped in the
  standard mode where this rank skipped nothing; close() returns on every rank.
"""
from __future__ import annotations

import os
import random
import time

import numpy as np
from mpi4py import MPI

import partialcoll as pc
from _util import ARGS, run_module
from neighbor_checks import check_gaps

CASES = next((int(a) for a in ARGS if a.isdigit()), 30)
SEED = int(os.environ.get("PC_FUZZ_SEED", "0"))
COUNTS = [0, 1, 3, 257, 70000]
DTYPES = ["float64", "float32", "float16", "complex64", "int32", "int64"]


def draw(rng: random.Random, p: int) -> dict:
    """One case: the graph as {rank: (sources, destinations)} and the collective's arguments."""
    density = rng.choice([0.0, 0.3, 0.6, 1.0])
    edges = {(i, j) for i in range(p) for j in range(p) if i != j and rng.random() < density}
    adjacency = {r: (sorted(i for i, j in edges if j == r), sorted(j for i, j in edges if i == r))
                 for r in range(p)}
    dtype = rng.choice(DTYPES)
    integral = dtype.startswith("int")
    weights = None if integral else rng.choice(["mean", "mean", "staleness", None])
    op = "SUM" if weights is not None or dtype.startswith("complex") else rng.choice(["SUM", "MAX", "MIN"])
    n_in = [len(adjacency[r][0]) for r in range(p)]
    most = min([n for n in n_in if n], default=0)        # backup < every n_in, and 0 without in-neighbours
    backup = rng.randrange(most) if most and min(n_in) > 0 and rng.random() < 0.5 else 0
    return {"adjacency": adjacency, "count": rng.choice(COUNTS), "dtype": dtype, "op": op, "weights": weights,
            "backup": backup, "max_staleness": rng.choice([None, None, 0, 1, 3]),
            "max_gap": rng.choice([None, None, 1, 2, 4]), "iterations": rng.randint(1, 25),
            "lockstep": rng.random() < 0.3, "program": rng.randrange(1 << 30)}


def value(rank: int, k: int, count: int, dtype: np.dtype) -> np.ndarray:
    """Rank r's update of iteration k: small integers (every sum of them exact, bfloat16
    and float16 included), differing per rank, iteration and element."""
    base = (rank * 7 + k * 3) % 17 + 1
    return (base + np.arange(count) % 5).astype(dtype)


def expected(case: dict, rank: int, k: int, updates, posted: list, dtype: np.dtype) -> np.ndarray:
    """The combination of rank's update of k with the updates (sender, iteration) it reports;
    posted[r]: the iterations rank r posted (a skipped one carries the last before it)."""
    count = case["count"]

    def update(r, m):
        return value(r, max(q for q in posted[r] if q <= m), count, dtype)

    acc = update(rank, k)
    if case["weights"] == "staleness":
        acc = acc.astype(np.float64 if dtype.kind != "c" else np.complex128)
        wsum = 1.0
        for r, m in updates:
            w = 1.0 / (1 + k - m)
            acc = acc + w * update(r, m)
            wsum += w
        return (acc / wsum).astype(dtype) if updates else acc.astype(dtype)
    fold = {"SUM": np.add, "MAX": np.maximum, "MIN": np.minimum}[case["op"]]
    for r, m in updates:
        acc = fold(acc, update(r, m))
    return acc / dtype.type(1 + len(updates)) if case["weights"] == "mean" and updates else acc


def run_case(comm, case: dict) -> None:
    rank, p = comm.rank, comm.size
    sources, destinations = case["adjacency"][rank]
    g = comm.Create_dist_graph_adjacent(sources, destinations, reorder=False)
    dtype = np.dtype(case["dtype"])
    coll = pc.NeighborAllreduce(case["count"], dtype, getattr(MPI, case["op"]), comm=g, backup=case["backup"],
                                max_staleness=case["max_staleness"], max_gap=case["max_gap"],
                                weights=case["weights"])
    coll.trace = []
    rng = random.Random(case["program"] * 7919 + rank)
    n, lockstep = case["iterations"], case["lockstep"]
    depth = coll.depth
    slow = rng.random() < 0.3
    pending, posted, results, skipped = {}, [], [], 0
    while coll.iteration + 1 < n or pending:
        k = coll.iteration + 1
        can_post = k < n and k - depth not in pending and (not pending or not lockstep)
        if can_post and (not pending or rng.random() < 0.6):
            x = value(rank, k, case["count"], dtype)
            how = rng.choice(["own", "out", "x"])
            out = np.empty_like(x) if how == "out" else x if how == "x" else None
            pending[k] = coll.post(x, out=out)
            posted.append(k)
            continue
        if not pending:                       # at the end with nothing to wait for: skip or stop
            if k < n and coll.lag and posted and not lockstep:
                skipped += coll.skip(min(coll.lag, n - k))
                continue
            break
        if slow and rng.random() < 0.3:
            time.sleep(rng.random() * 0.003)
        if not lockstep and len(pending) > 1 and rng.random() < 0.15 and coll.iteration + 1 >= n:
            pending.pop(max(pending))         # never waited for: close() drops it
            continue
        m = min(pending) if rng.random() < 0.7 else rng.choice(sorted(pending))
        req = pending.pop(m)
        if rng.random() < 0.3:
            for _ in range(rng.randint(1, 5)):
                if req.test():
                    break
        res = req.wait(timeout=60)
        assert res.iteration == m, (res.iteration, m)
        results.append((m, res.updates, res.nap, res.active, np.array(res.data, copy=True)))
        if (not pending and not lockstep and rng.random() < 0.3 and coll.iteration + 1 < n and coll.lag
                and posted):
            skipped += coll.skip(min(coll.lag, n - 1 - coll.iteration))
    stats, trace, last = coll.stats, list(coll.trace), coll.iteration
    coll.close(timeout=60)
    g.Free()

    posted_all = comm.allgather(posted)
    lasts = comm.allgather(last)
    assert lasts == [n - 1] * p, (lasts, n)
    s = case["max_staleness"] or 0
    n_in = len(sources)
    for k, updates, nap, active, data in results:
        where = f"rank {rank} iteration {k} of case {case}"
        senders = [r for r, _ in updates]
        assert senders == sorted(set(senders)) and set(senders) <= set(sources), (where, updates)
        assert len(updates) >= n_in - case["backup"], (where, updates)
        assert all(k - s <= m <= k for _, m in updates), (where, updates)
        assert nap == 1 + len(updates) and active == tuple(sorted([rank, *senders])), (where, nap, active)
        want = expected(case, rank, k, updates, posted_all, dtype)
        if case["weights"] is None:
            np.testing.assert_array_equal(data, want, err_msg=where)
        else:
            tol = {"float16": 2e-3}.get(dtype.name, 1e-6)
            np.testing.assert_allclose(data, want, rtol=tol, err_msg=where)
    if not case["backup"] and not s and not skipped:     # a skipped iteration drops what it would have used
        assert stats["dropped"] == 0, stats
    any_skips = comm.allreduce(skipped)
    check_gaps(comm, "random graph", trace, case, case["adjacency"], theorem1=case["lockstep"] and not any_skips)


def test_random_neighbor_allreduces(comm):
    rng = random.Random(SEED * 1000003 + comm.size)
    for number in range(CASES):
        case = comm.bcast(draw(rng, comm.size) if comm.rank == 0 else None)
        try:
            run_case(comm, case)
        except BaseException:
            print(f"case {number} (PC_FUZZ_SEED={SEED}) failed at rank {comm.rank}: {case}", flush=True)
            raise


if __name__ == "__main__":
    run_module(__file__)
