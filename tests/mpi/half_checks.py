"""float16 and bfloat16 through every partial mode and the schedule API (issue 12):
python half_checks.py

Values are small integers, exact in both types, so sums are exact and the checks are
equalities: a full round equals MPI_Allreduce of the same values in float64, and with
late="fold" every rank's results plus close() add up to everything posted anywhere."""
from __future__ import annotations

import time

import numpy as np
import pytest
from mpi4py import MPI

import partialcoll as pc
from partialcoll._types import BFLOAT16
from _util import run_module

N = 4099                                  # odd: ring segments of unequal length
MODES = [("solo", {}), ("majority", {}), ("probe", {"candidates": 2}), ("quorum", {"quorum": 2}),
         ("full", {})]
HALF = pytest.mark.parametrize("dtype", [np.float16, BFLOAT16], ids=["float16", "bfloat16"])


def ints(rank, step, n=N):
    """Small integers (|x| <= 8), different per rank, step and element."""
    return ((np.arange(n) * 7 + 3 * rank + 5 * step) % 17 - 8).astype(np.float64)


def to(x, dtype):
    """float64 -> dtype; bfloat16 by its bits where ml_dtypes is absent (exact here)."""
    if np.dtype(dtype).metadata:                     # the raw 16-bit bfloat16 view
        return (x.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16).view(dtype)
    return x.astype(dtype)


def f64(a):
    if a.dtype.metadata:
        return (a.view(np.uint16).astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return a.astype(np.float64)


@HALF
def test_every_mode(comm, dtype):
    for mode, opts in MODES:
        if mode == "quorum" and comm.size < 2:
            continue
        coll = pc.PartialAllreduce(N, dtype, MPI.SUM, comm, mode=mode, late="fold", **opts)
        got = np.zeros(N)
        posted = np.zeros(N)
        for step in range(6):
            if comm.rank == step % comm.size:
                time.sleep(0.01)                                  # a different rank lags each step
            x = ints(comm.rank, step)
            posted += x
            res = coll.post(to(x, dtype)).wait(timeout=60)
            assert res.data.dtype == np.dtype(dtype)
            got += f64(res.data)
        got += f64(coll.close(timeout=60).data)
        everyone = np.empty(N)
        comm.Allreduce(posted, everyone)
        assert np.array_equal(got, everyone), (mode, np.dtype(dtype).name, np.abs(got - everyone).max())


@HALF
def test_full_in_place(comm, dtype):
    """full mode, post(x, out=x): the round runs in the caller's buffer."""
    with pc.allreduce_init(N, dtype, comm=comm) as coll:
        for step in range(3):
            x = to(ints(comm.rank, step), dtype)
            coll.post(x, out=x).wait(timeout=60)
            ref = np.empty(N)
            comm.Allreduce(ints(comm.rank, step), ref)
            assert np.array_equal(f64(x), ref)


@HALF
def test_schedule_api(comm, dtype):
    """A hand-built ring exchange: recv from the left, b = a + b (compute on halves)."""
    left, right = (comm.rank - 1) % comm.size, (comm.rank + 1) % comm.size
    mine = to(ints(comm.rank, 9), dtype)
    theirs = np.empty_like(mine)
    acc = to(ints(comm.rank, 9), dtype)
    s = pc.Schedule(comm)
    s.send(mine, right)
    r = s.recv(theirs, left)
    s.compute(MPI.SUM, theirs, acc, after=r)
    with s.commit():
        s.start().wait(timeout=60)
    expect = ints(comm.rank, 9) + ints(left, 9)
    assert np.array_equal(f64(acc), expect)


if __name__ == "__main__":
    run_module(__file__)
