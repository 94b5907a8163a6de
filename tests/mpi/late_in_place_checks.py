"""Late in-place posts (issue 12): python late_in_place_checks.py MODES SIZES
(comma-separated lists of modes and of vector sizes in bytes: every combination is a check)

A post(x, out=x) whose round has already read this rank's accumulator (a late post,
the balanced solo pattern: the first rank to post starts the round, the others' posts
arrive a moment later): its data must go to a later round while x receives this round's
result. Checked here, with ranks other than 0 made late on purpose (rank 0 posts at once,
the others 20-40 ms later), float64 vectors of each of SIZES bytes, late="fold":

- each in-place result lands in its own buffer, and the engine holds no waited-for buffer
  (pc_coll_user_buffers);
- nothing is lost: at every rank the results plus close() sum to what every rank posted,
  whether the late request is waited for at once, after the next round has started (the
  request waited for late), or after a second post has folded into the accumulator.
"""
from __future__ import annotations

import time

import numpy as np
import pytest
from mpi4py import MPI

import partialcoll as pc
from partialcoll import _engine
from _util import ARGS, run_module

MODES = ARGS[0].split(",") if ARGS else ["solo"]
SIZES = [int(b) for b in ARGS[1].split(",")] if len(ARGS) > 1 else [1 << 20]
STEPS = 12


def options(mode):
    if mode == "quorum":
        return {"quorum": 1}
    if mode == "probe":
        return {"candidates": 1}
    return {}


def held(coll):
    """Addresses of the user buffers the engine holds (acc, work, result)."""
    bufs = _engine.ffi.new("void *[3]")
    _engine.lib.pc_coll_user_buffers(coll._coll, bufs)
    return {int(_engine.ffi.cast("uintptr_t", b)) for b in bufs} - {0}


@pytest.mark.parametrize("nbytes", SIZES)
@pytest.mark.parametrize("mode", MODES)
def test_late_in_place_posts_nothing_lost(comm, mode, nbytes):
    n = nbytes // 8
    coll = pc.PartialAllreduce(n, np.float64, MPI.SUM, comm, mode=mode, late="fold", seed=5, **options(mode))
    rng = np.random.default_rng(300 + comm.rank)
    posted = np.zeros(n)
    received = np.zeros(n)
    late = 0
    for i in range(STEPS):
        if comm.rank != 0 and mode != "full":
            time.sleep(rng.uniform(0.02, 0.04))        # let rank 0 start the round without us
        how = i % 3                                    # 0: wait at once; 1: wait after the next
        bufs = [np.arange(n, dtype=np.float64) * (1 + i % 4) + comm.rank + i]   # round took x;
        if how == 2:                                   # 2: a second post before the wait
            bufs.append(np.full(n, float(comm.rank + 1)))
        reqs = []
        for b in bufs:
            posted += b
            req = coll.post(b, out=b)
            late += req.late
            reqs.append(req)
        if how == 1 and comm.rank != 0 and mode != "full":
            time.sleep(0.05)                           # rank 0's next post starts a round meanwhile
        for b, req in zip(bufs, reqs):
            res = req.wait(timeout=60)
            assert np.shares_memory(res.data, b) and res.data is b
            assert b.ctypes.data not in held(coll), "a waited-for buffer is the caller's again"
            received += res.data
    final = coll.close()
    received += final.data
    total = comm.allreduce(posted)
    assert np.array_equal(received, total), float(np.abs(received - total).max())
    if mode == "solo" and comm.size > 1:      # ranks > 0 are late in most rounds
        assert comm.allreduce(late) > 0, "no late post happened: the check tested nothing"


if __name__ == "__main__":
    run_module(__file__)
