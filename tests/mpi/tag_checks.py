"""A smaller MPI_TAG_UB (issue 11): python tag_checks.py, under PARTIALCOLL_TAG_UB=32767 or 8388607.

Tags are (version mod 2^vbits) << seqbits | seq. With the forced view both leave 4 bits
of version, so executions wrap every 16: a persistent schedule and partial allreduces
run past the wrap point twice, results checked every time; and more messages between one
pair of ranks than seqbits allow is a clear error at commit.
"""
from __future__ import annotations

import os

import numpy as np
import pytest
from mpi4py import MPI

import partialcoll as pc
from _util import expect_raises, run_module

UB = int(os.environ["PARTIALCOLL_TAG_UB"])
SEQBITS = (UB.bit_length()) - 4          # as the engine computes it (fewer than 24 tag bits)
RUNS = 2 * 16 + 10


def test_persistent_schedule(comm):
    r, p = comm.rank, comm.size
    buf, got = np.zeros(3, np.int64), np.zeros(3, np.int64)
    s = pc.Schedule(comm)
    s.send(buf, (r + 1) % p)
    s.recv(got, (r - 1) % p)
    with s.commit():
        for i in range(RUNS):
            buf[:] = 1000 * r + i
            s.start().wait(timeout=30)
            assert np.all(got == 1000 * ((r - 1) % p) + i), (i, got)


def test_partial_rounds(comm):
    p = comm.size
    for mode in ("full", "solo"):
        coll = pc.PartialAllreduce(4, np.int64, MPI.SUM, comm, mode=mode, late="fold")
        total = np.zeros(4, np.int64)
        for i in range(RUNS):
            res = coll.post(np.full(4, comm.rank + 10 * i, np.int64)).wait(timeout=30)
            if mode == "full":
                assert np.all(res.data == p * 10 * i + p * (p - 1) // 2), (i, res)
            total += res.data
        total += coll.close(timeout=30).data
        assert np.all(total == sum(r + 10 * i for r in range(p) for i in range(RUNS))), total


@pytest.mark.mpi(min_size=2)
def test_pair_limit(comm):
    s = pc.Schedule(comm)
    buf = np.zeros(1)
    peer = (comm.rank + 1) % comm.size
    for _ in range((1 << SEQBITS) + 1):
        s.send(buf, peer)
    expect_raises(pc.ArgumentError, s.commit, match="messages between ranks")


if __name__ == "__main__":
    run_module(__file__)
