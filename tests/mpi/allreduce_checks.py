"""Allreduce schedules against MPI_Allreduce (issue 3): python allreduce_checks.py [--large]"""
from __future__ import annotations

import sys
import zlib

import numpy as np
from mpi4py import MPI

import partialcoll as pc
from _data import assert_matches, combos, values
from _util import main

ALGORITHMS = ["recursive_doubling", "ring", "auto"]


def check_one(comm, algorithm, count, dtype, op, salt=0, in_place=False):
    x = values(dtype, op, count, comm.rank, salt)
    ref = np.empty_like(x)
    comm.Allreduce(x, ref, op=op)
    coll = pc.allreduce_init(count, dtype, op, comm, algorithm=algorithm)
    if in_place:
        res = coll.post(x, out=x).wait()
        assert res.data is x
    else:
        res = coll.post(x).wait()
    what = f"{algorithm} count={count} {np.dtype(dtype)} {op} P={comm.size}"
    assert_matches(res.data, ref, op, what)
    assert res.round == 0 and res.active == tuple(range(comm.size)) and res.contributed
    # every rank holds bitwise the same result
    crcs = comm.allgather(zlib.crc32(res.data.tobytes()))
    assert len(set(crcs)) == 1, f"{what}: ranks disagree bitwise"
    coll.close()


def body(comm):
    p = comm.size
    large = "--large" in sys.argv
    if large:                        # count 2^20 + 3, every op x dtype, every algorithm
        n = 2 ** 20 + 3
        for algorithm in ALGORITHMS:
            for dtype, op in combos():
                check_one(comm, algorithm, n, dtype, op)
        return
    counts = sorted({0, 1, 2, max(p - 1, 0), p, p + 1, 1000})
    for algorithm in ALGORITHMS:
        for count in counts:
            for dtype, op in combos():
                check_one(comm, algorithm, count, dtype, op)
        check_one(comm, algorithm, 1000, np.float64, MPI.SUM, in_place=True)
    # one persistent allreduce, 500 executions with fresh data each time
    for algorithm in ("recursive_doubling", "ring"):
        coll = pc.allreduce_init(37, np.int64, MPI.SUM, comm, algorithm=algorithm)
        for it in range(500):
            x = values(np.int64, MPI.SUM, 37, comm.rank, salt=it)
            ref = np.empty_like(x)
            comm.Allreduce(x, ref)
            res = coll.post(x).wait()
            assert np.array_equal(res.data, ref) and res.round == it, (algorithm, it)
        coll.close()


if __name__ == "__main__":
    main(body)
