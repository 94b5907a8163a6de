"""accumulate= of PartialAllreduce: python accumulate_checks.py (any P).

What a rank contributes when several of its posts wait in its accumulator: their sum,
their mean, or RNA's weighted mean (the j-th post since the last read weighs j). A
deterministic round 0 (majority: every rank but round 0's initiator posts 1-3 times, then
tells the initiator to start) must equal the NumPy model exactly, in-place posts
included; under random delays a constant per rank must come out exactly whatever the
number of posts folded; counts stay exact; bad options raise on every rank."""
from __future__ import annotations

import time

import numpy as np
import pytest
from mpi4py import MPI

import partialcoll as pc
from _util import expect_raises, run_module

COUNT = 7


def quiet(req):
    while not req.Test():
        time.sleep(0.0005)


def contribution(vs, how):
    """The model: what a rank's accumulator gives the round after posts vs (oldest first)."""
    k = len(vs)
    if how == "sum":
        return sum(vs)
    if how == "mean":
        return sum(vs) / k
    return sum((j + 1) * v for j, v in enumerate(vs)) / (k * (k + 1) / 2)


@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.float16])
@pytest.mark.parametrize("how", ["sum", "mean", "rna"])
def test_round0_model(comm, how, dtype):
    p, r = comm.size, comm.rank
    # majority with a seed whose rounds 0-2 have the same initiator d: the others' extra
    # posts cannot start rounds 1 and 2, so every rank's first wait gets round 0
    seed = next(s for s in range(10000) if len({pc.candidates(s, n, p, 1)[0] for n in range(3)}) == 1)
    d = pc.candidates(seed, 0, p, 1)[0]
    coll = pc.PartialAllreduce(COUNT, dtype, MPI.SUM, comm, mode="majority", seed=seed, accumulate=how)
    e = np.arange(COUNT)
    posted = {q: [6.0 * ((q + 1) * (j + 1) + e) for j in range(1 + q % 3)] for q in range(p) if q != d}
    if r != d:
        reqs = []
        for j, v in enumerate(posted[r]):
            x = v.astype(dtype)
            last = j == len(posted[r]) - 1
            reqs.append(coll.post(x, out=x) if last and r % 2 else coll.post(x))   # in place: x is lent
        assert not any(q.late for q in reqs)
        comm.isend(None, dest=d, tag=5).wait()       # my posts are in: start round 0
        res = reqs[0].wait()
    else:
        for q in range(p):
            if q != d:
                quiet(comm.irecv(source=q, tag=5))
        xd = (6.0 * (d + 1) + e).astype(dtype)
        res = coll.post(xd).wait()
    want = 6.0 * (d + 1) + e + sum(contribution(vs, how) for vs in posted.values())
    assert res.round == 0 and res.rounds == 1
    assert res.nap == p and res.active == tuple(range(p))
    assert res.posts == 1 + sum(len(vs) for vs in posted.values())      # exact counts, whatever accumulate
    assert np.array_equal(res.data, want.astype(dtype)), (how, res.data, want)
    quiet(comm.Ibarrier())
    coll.close()


@pytest.mark.parametrize("how", ["mean", "rna"])
def test_constant_posts_under_delays(comm, how):
    """Rank r always posts 2**r: a mean of any number of its posts is 2**r, so every
    one-round result is exactly the sum of 2**r over its active ranks (a sum would give
    k 2**r). Posts are sometimes doubled before the wait, so accumulators hold several."""
    p, r = comm.size, comm.rank
    coll = pc.PartialAllreduce(3, np.float64, MPI.SUM, comm, mode="solo", late="fold", accumulate=how)
    rng = np.random.default_rng(5 + r)
    x = np.full(3, 2.0 ** r)
    several = 0
    for _ in range(40):
        time.sleep(rng.uniform(0, 0.004))
        if rng.random() < 0.3:
            coll.post(x)                          # never waited for: its data folds later
        res = coll.post(x).wait()
        if res.rounds == 1:
            assert np.all(res.data == sum(2.0 ** q for q in res.active)), res
            several += res.posts > res.nap
        assert res.nap <= res.posts
    final = coll.close()
    assert final.nap <= final.posts
    assert comm.allreduce(several) > 0 or p == 1, "no round took several posts of one rank"


def test_bad_accumulate_everywhere(comm):
    p, r = comm.size, comm.rank
    expect_raises(pc.ArgumentError, pc.PartialAllreduce, 4, np.float32, MPI.SUM, comm, accumulate="median",
                  match="accumulate")
    # an integer dtype on the last rank: OpError there, ArgumentError naming it elsewhere
    expect_raises(pc.PartialcollError, pc.PartialAllreduce, 4, np.int32 if r == p - 1 else np.float32, MPI.SUM,
                  comm, accumulate="mean", match="accumulate" if r == p - 1 else f"rank {p - 1}")
    expect_raises(pc.OpError, pc.PartialAllreduce, 4, np.float32, MPI.MAX, comm, accumulate="rna",
                  match="MPI.SUM")
    if p > 1:
        expect_raises(pc.ArgumentError, pc.PartialAllreduce, 4, np.float32, MPI.SUM, comm,
                      accumulate="mean" if r == 0 else "sum", match="accumulate differs")


if __name__ == "__main__":
    run_module(__file__)
