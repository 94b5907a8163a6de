"""close() with uneven post counts (issue 11, finding 2): python close_checks.py MODE LATE COUNT

Ranks post different numbers of times (3 + 2*rank, then the reverse pattern), some
waiting on every request and some never waiting, then all close(). close() must return
on every rank, and nothing posted may be lost: with late="fold" and SUM, at every rank,
the sum of every result it received plus close()'s result equals the sum of every value
posted by every rank (integers, so exactly). With late="latest" every rank still
returns from close(), and results of the same round agree across ranks.
"""
from __future__ import annotations

import sys

import numpy as np
from mpi4py import MPI

import partialcoll as pc
from _util import main

MODE, LATE, COUNT = sys.argv[1], sys.argv[2], int(sys.argv[3])


def options(size):
    if MODE == "quorum":
        return {"quorum": max(1, (size + 1) // 2)}
    return {}


def value(rank, i):
    return np.full(COUNT, 1000 * (rank + 1) + i, dtype=np.int64)


def run(comm, posts_of, waits):
    coll = pc.PartialAllreduce(COUNT, np.int64, MPI.SUM, comm, mode=MODE, late=LATE, **options(comm.size))
    mine = posts_of(comm.rank)
    received = np.zeros(COUNT, np.int64)
    seen = {}
    for i in range(mine):
        req = coll.post(value(comm.rank, i))
        if waits(comm.rank):
            res = req.wait(timeout=60)
            received += res.data
            if res.rounds == 1:
                seen[res.round] = int(res.data[0])
    final = coll.close(timeout=60)
    received += final.data
    total = sum(int(value(r, i)[0]) for r in range(comm.size) for i in range(posts_of(r)))
    if LATE == "fold":
        assert np.all(received == total), (comm.rank, received[:2], total, MODE)
    everyone = comm.allgather(seen)
    for other in everyone:
        for n, v in other.items():
            if n in seen:
                assert seen[n] == v, (n, seen[n], v)


def body(comm):
    p = comm.size
    run(comm, lambda r: 3 + 2 * r, lambda r: True)               # the pattern, all wait
    run(comm, lambda r: 3 + 2 * (p - 1 - r), lambda r: r % 2 == 0)  # reversed; odd ranks never wait
    run(comm, lambda r: 0 if r == 0 else 4, lambda r: True)      # one rank never posts


main(body)
