"""close() with uneven post counts (issue 11, finding 2): python close_checks.py MODES LATES COUNTS
(comma-separated lists, e.g. solo,full fold,latest 1,131072: every combination is a check)

Ranks post different numbers of times (3 + 2*rank, then the reverse pattern), some
waiting on every request and some never waiting, then all close(). close() must return
on every rank, and nothing posted may be lost: with late="fold" and SUM, at every rank,
the sum of every result it received plus close()'s result equals the sum of every value
posted by every rank (integers, so exactly). With late="latest" every rank still
returns from close(), and results of the same round agree across ranks.
"""
from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

import partialcoll as pc
from _util import ARGS, run_module

MODES, LATES, COUNTS = ARGS[0].split(","), ARGS[1].split(","), [int(c) for c in ARGS[2].split(",")]

# how many times rank r of p posts, and whether it waits for its requests
PATTERNS = {
    "increasing": (lambda r, p: 3 + 2 * r, lambda r: True),                  # the issue's, all wait
    "reversed": (lambda r, p: 3 + 2 * (p - 1 - r), lambda r: r % 2 == 0),    # odd ranks never wait
    "one_never_posts": (lambda r, p: 0 if r == 0 else 4, lambda r: True),
}


def options(mode, size):
    if mode == "quorum":
        return {"quorum": max(1, (size + 1) // 2)}
    return {}


def value(rank, i, count):
    return np.full(count, 1000 * (rank + 1) + i, dtype=np.int64)


@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("late", LATES)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("count", COUNTS)
def test_uneven_posts(comm, count, mode, late, pattern):
    posts, waits = PATTERNS[pattern]
    p = comm.size
    coll = pc.PartialAllreduce(count, np.int64, MPI.SUM, comm, mode=mode, late=late, **options(mode, p))
    mine = posts(comm.rank, p)
    received = np.zeros(count, np.int64)
    seen = {}
    for i in range(mine):
        req = coll.post(value(comm.rank, i, count))
        if waits(comm.rank):
            res = req.wait(timeout=60)
            received += res.data
            if res.rounds == 1:
                seen[res.round] = int(res.data[0])
    final = coll.close(timeout=60)
    received += final.data
    total = sum(int(value(r, i, 1)[0]) for r in range(p) for i in range(posts(r, p)))
    if late == "fold":
        assert np.all(received == total), (comm.rank, received[:2], total, mode)
    everyone = comm.allgather(seen)
    for other in everyone:
        for n, v in other.items():
            if n in seen:
                assert seen[n] == v, (n, seen[n], v)


if __name__ == "__main__":
    run_module(__file__)
