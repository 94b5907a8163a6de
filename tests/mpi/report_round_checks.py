"""A report spares the rounds its sender completed: mpiexec -n 2 python -m pytest --with-mpi report_round_checks.py

Rank 1 progresses inline (its rounds move only inside its own calls), so it is still in
a round that rank 0 has completed when rank 0 fails and reports. Rank 0's part of that
round is done and its messages are on their way: the round completes at rank 1 as it
did at rank 0 (the same data), and the next round fails with PeerError naming rank 0.
Before, the report withdrew rank 1's round, which every other rank had completed.
"""
from __future__ import annotations

import time

import numpy as np
import pytest

import partialcoll as pc
from _util import expect_raises


def test_report_spares_rounds_the_reporter_completed(comm):
    if comm.size != 2:
        pytest.skip("a check for 2 ranks (one of them inline)")
    if comm.rank == 1:
        pc.finalize()
        pc.rc.progress = "inline"
    for mode in ("full", "solo"):
        coll = pc.PartialAllreduce(4, np.float64, mode=mode, comm=comm)
        x = np.full(4, float(comm.rank + 1))
        for _ in range(2):      # solo's values are checked elsewhere: here, that ranks agree
            res = coll.post(x).wait(timeout=30)
            assert mode == "solo" or (np.all(res.data == 3.0) and res.active == (0, 1)), res
        if comm.rank == 0:
            got = coll.post(x).wait(timeout=30)    # round 2 completes here ...
            assert got.round == 2 and (mode == "solo" or np.all(got.data == 3.0)), got
            coll._report("RuntimeError", "rank 0 fails after round 2", 1.0)   # ... then rank 0 fails
            comm.Barrier()
            comm.bcast((got.active, got.data), root=0)
        else:
            req = coll.post(x)                      # round 2: rank 1's messages leave ...
            comm.Barrier()                          # ... and rank 0's report is here
            time.sleep(0.2)
            got = req.wait(timeout=30)              # round 2 still completes here, as at rank 0
            active, data = comm.bcast(None, root=0)
            assert got.round == 2 and got.active == active and np.array_equal(got.data, data), (got, data)
            exc = expect_raises(pc.PeerError, lambda: coll.post(x).wait(timeout=30))
            assert exc.rank == 0 and exc.exc_type == "RuntimeError", exc
        expect_raises(pc.PartialcollError, coll.close)
        comm.Barrier()
