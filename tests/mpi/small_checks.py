"""The small-message path (issue 13) against MPI_Allreduce: python small_checks.py

post(x, out=y).wait() and post(x).wait() on allreduce_init (mode full) give
MPI_Allreduce's result (exactly for integers; floats to rounding, since the MPI's
summation order is its own: Open MPI across hosts at P = 5 differed in the last bit),
the same bits on every rank, call after call, with the request's fields right; a solo
PartialAllreduce (late="fold") loses nothing; wait(timeout=) still times out when a peer
never posts; test() before wait(). Run under each idle policy (PARTIALCOLL_IDLE) and
progress mode by tests/test_small.py; the script checks that info() reports the policy.
"""
from __future__ import annotations

import os

import numpy as np
import pytest
from mpi4py import MPI

import partialcoll as pc
from _data import assert_matches, values
from _util import expect_raises, run_module

CASES = [(np.float32, 2), (np.int64, 1), (np.float64, 3), (np.int32, 0)]   # 8 B, 8 B, 24 B, 0 B


@pytest.mark.parametrize("dtype,count", CASES, ids=[f"{np.dtype(d)}x{c}" for d, c in CASES])
def test_full_mode(comm, dtype, count, iterations=200):
    coll = pc.allreduce_init(count, dtype, MPI.SUM, comm)
    y = np.empty(count, dtype)
    ref = np.empty(count, dtype)
    for it in range(iterations):
        x = values(dtype, MPI.SUM, count, comm.rank, salt=it)
        comm.Allreduce(x, ref, op=MPI.SUM)
        how = it % 4
        if how == 0:                       # the idiom
            req = coll.post(x, out=y)
            res = req.wait()
            assert res.data is y
        elif how == 1:                     # no out=: a fresh array
            req = coll.post(x)
            res = req.wait()
        elif how == 2:                     # in place
            x = x.copy()
            req = coll.post(x, out=x)
            res = req.wait()
            assert res.data is x
        else:                              # test() until done, then wait()
            req = coll.post(x, out=y)
            while not req.test():
                pass
            res = req.wait()
        what = f"full {np.dtype(dtype)} count={count} P={comm.size} call {it} (way {how})"
        assert_matches(res.data, ref, MPI.SUM, f"{what}: against MPI_Allreduce's")
        mine = res.data.tobytes()
        assert all(b == mine for b in comm.allgather(mine)), f"{what}: the ranks' results differ"
        assert req.index == it and not req.late, (what, req.index, req.late)
        assert res.round == it and res.rounds == 1 and res.contributed, (what, res)
        assert res.active == tuple(range(comm.size)) and res.nap == comm.size and res.closing == (), (what, res)
        assert req.wait() is res, what                      # a second wait gives the same result
    final = coll.close()
    assert final.nap == 0 and not final.data.any(), final     # nothing left to flush


@pytest.mark.parametrize("dtype,count", [(np.int64, 1), (np.int32, 2)], ids=["int64x1", "int32x2"])
def test_solo_mode(comm, dtype, count, iterations=100):     # integers: sums are exact
    """Nothing lost: sum of results + close() == the sum of every post (integers: exact)."""
    coll = pc.solo_allreduce(count, dtype, MPI.SUM, comm, late="fold")
    y = np.empty(count, dtype)
    got = np.zeros(count, dtype)
    posted = np.zeros(count, dtype)
    rounds = posts = 0
    for it in range(iterations):
        x = values(dtype, MPI.SUM, count, comm.rank, salt=it)
        posted += x
        res = coll.post(x, out=y).wait()
        assert res.round >= it and len(res.active) <= res.nap <= res.posts, res
        rounds, posts = rounds + res.rounds, posts + res.posts
        got += res.data
    final = coll.close()
    got += final.data
    # fold: this rank's results cover every round once, and hold every rank's posts once
    assert rounds + final.rounds == final.round + 1, (rounds, final.rounds, final.round)
    assert posts + final.posts == comm.size * iterations, (posts, final.posts)
    everything = np.empty_like(posted)
    comm.Allreduce(posted, everything, op=MPI.SUM)
    assert np.array_equal(got, everything), f"solo P={comm.size}: {got} != {everything}"


def test_timeout_still_works(comm):
    """wait(timeout=) raises when a peer has not posted (full mode, rank 0 posts late)."""
    coll = pc.allreduce_init(2, np.float32, MPI.SUM, comm)
    x = np.ones(2, np.float32)
    y = np.empty_like(x)
    if comm.size > 1 and comm.rank == 1:
        req = coll.post(x, out=y)
        exc = expect_raises(pc.Timeout, req.wait, timeout=0.3, match="did not complete")
        assert "timeout=0.3" in str(exc), exc
        comm.Barrier()
        assert np.array_equal(req.wait().data, np.full(2, comm.size, np.float32))
    else:
        if comm.size > 1:
            comm.Barrier()
        assert np.array_equal(coll.post(x, out=y).wait().data, np.full(2, comm.size, np.float32))
    coll.close()


def test_info_reports_the_idle_policy(comm):
    expect = os.environ.get("PARTIALCOLL_IDLE", "auto")
    info = pc.info()
    assert info["idle_setting"] == expect, info
    assert info["idle"] in ("spin", "sleep") and (expect == "auto" or info["idle"] == expect), info
    assert info["cpu_budget"] >= 1 and info["idle_reason"].startswith(info["idle"] + ":"), info
    if expect == "auto":
        assert info["ranks_on_node"] == comm.Split_type(MPI.COMM_TYPE_SHARED).Get_size(), info
        assert info["node_from"] == "communicator", info


if __name__ == "__main__":
    run_module(__file__)
