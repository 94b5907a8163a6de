"""A small round whose data carries the activation: python carried_checks.py

A small solo round (recursive doubling, up to 8 KiB) sends no empty activation message
on a flood edge whose data carries it (partialcoll/activation/flood.py): at P = 2 none at
all, so a rank that has not posted joins the round only through its peer's data. The
script makes that happen on purpose, from every initiator, with late="latest" and "fold":

- round 0 and round 1: only the initiator i posts (e_i: element r of a result counts rank
  r's posts inside it, and one more element 1000**r checks it); each other rank joins
  with nothing (the identity) while it sleeps, not calling the library;
- then each other rank r posts e_r, late for both rounds: "latest" returns round 1's
  result, "fold" the two rounds folded (2 e_i, two posts of one rank, nap 2); e_r stays
  for the next round;
- round 2: i posts again; every other rank joins with its leftover e_r: all ranks inside;
- close() (once round 2 is done at i): with "fold", at every rank, its results and
  close()'s hold every post exactly once (round 2, never waited for at the other ranks,
  comes with their close()).

Each result is checked against that script's values (a reference written here, not the
library's), its counts exactly; the schedules' empty messages against the flood's edges.
"""
from __future__ import annotations

import time

import numpy as np
import pytest
from mpi4py import MPI

import partialcoll as pc
from partialcoll import _engine
from partialcoll.activation import flood
from _reference import contribution as unit
from _util import quiet_barrier, run_module

def expect(res, counts, p, what, **fields):
    """res holds counts[r] posts of each rank r (data, posts, active exactly), and fields
    (round=, rounds=, contributed=, nap=) as given."""
    data = sum((k * unit(r, p) for r, k in enumerate(counts)), np.zeros(p + 1, np.int64))
    active = tuple(r for r, k in enumerate(counts) if k)
    got = (res.data.tolist(), res.posts, res.active, *(getattr(res, f) for f in fields))
    want = (data.tolist(), sum(counts), active, *fields.values())
    assert got == want, f"{what}: got (data, posts, active, {', '.join(fields)}) {got}, expected {want}: {res}"


def rounds_done_here(coll, n, limit=30.0):
    """Sleep (not posting) until this rank's engine has completed n rounds of coll: its
    armed round is n (the engine arms round n once n - 1 completed here)."""
    ffi, lib = _engine.ffi, _engine.lib
    ranks, armed, count = ffi.new("int[]", 64), ffi.new("int64_t *"), ffi.new("int *")
    deadline = time.monotonic() + limit
    while True:
        lib.pc_coll_silent(coll._coll, ranks, 64, armed, count)
        if armed[0] >= n:
            return
        assert time.monotonic() < deadline, f"round {n - 1} never completed here (armed: {armed[0]})"
        time.sleep(0.001)


def empty_messages(sched):
    """(peers this rank sends empty messages to, peers it receives them from): the flood's."""
    sends = sorted(op.peer for op in sched.ops if op.kind == 0 and op.bufs[0].nbytes == 0)
    recvs = sorted(op.peer for op in sched.ops if op.kind == 1 and op.bufs[0].nbytes == 0)
    return sends, recvs


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("late", ["latest", "fold"])
def test_data_carries_the_activation(comm, late):
    p, me = comm.size, comm.rank
    side = comm.Dup()
    for i in range(p):
        coll = pc.PartialAllreduce(p + 1, np.int64, MPI.SUM, comm, mode="solo", late=late)
        # the schedule: empty messages only on the flood's edges that no data message carries
        nb = flood.neighbours(me, p)
        if p == 2:
            assert empty_messages(coll._schedules[0][0]) == ([], []), coll._schedules[0][0].dump()
        if p == 3:                 # 0 folds into 1 at once: 0 -> 1 carried; 1 -> 0 and 0 <-> 2 not
            want = {0: ([2], [1, 2]), 1: ([0], []), 2: ([0], [0])}[me]
            assert empty_messages(coll._schedules[0][0]) == want, coll._schedules[0][0].dump()
        sends, recvs = empty_messages(coll._schedules[0][0])
        assert set(sends) <= set(nb) and set(recvs) <= set(nb), (sends, recvs, nb)
        what = f"P={p} initiator {i} late={late} rank {me}"
        got = np.zeros(p + 1, np.int64)               # the sum of this rank's results
        if me == i:
            for n in (0, 1):
                res = coll.post(unit(me, p)).wait(timeout=30)
                expect(res, [int(r == i) for r in range(p)], p, f"{what}: round {n}",
                       round=n, rounds=1, nap=1, contributed=True)
                got += res.data
            quiet_barrier(side)                       # the others have posted, late
            res = coll.post(unit(me, p)).wait(timeout=30)
            expect(res, [1] * p, p, f"{what}: round 2", round=2, rounds=1, nap=p, contributed=True)
            got += res.data
            quiet_barrier(side)                       # round 2 done here: the others may close
        else:
            rounds_done_here(coll, 2)                 # rounds 0 and 1 ran here without a post
            res = coll.post(unit(me, p)).wait(timeout=30)
            if late == "latest":
                expect(res, [int(r == i) for r in range(p)], p, f"{what}: late post, latest",
                       round=1, rounds=1, nap=1, contributed=False)
            else:
                expect(res, [2 * (r == i) for r in range(p)], p, f"{what}: late post, fold",
                       round=1, rounds=2, nap=2, contributed=False)
            got += res.data
            quiet_barrier(side)
            quiet_barrier(side)
        final = coll.close(timeout=30)
        if late == "fold":       # nothing lost: this rank's results and close() hold every post once
            if me == i:
                expect(final, [0] * p, p, f"{what}: close", nap=0)
            everything = sum((k * unit(r, p) for r, k in enumerate([3 if r == i else 1 for r in range(p)])))
            assert (got + final.data).tolist() == everything.tolist(), (what, got, final, everything)
    side.Free()


if __name__ == "__main__":
    run_module(__file__)
