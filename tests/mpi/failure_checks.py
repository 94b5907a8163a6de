"""Failed executions (issue 11, finding 4): python failure_checks.py (P = 2)

Rank 1 sends 16 bytes where rank 0 receives 8: rank 0's execution fails with MPIError.
The failed execution's version is used up, so the next execution of the same schedule
matches rank 1's next message and fails again the same way (before, rank 0 reused the
failed version, its receive never matched, and it timed out). Then both ranks free the
schedule (rank 0's failed execution drains first) and a new one works.
"""
from __future__ import annotations

import numpy as np
import pytest

import partialcoll as pc
from _util import expect_raises, run_module


def test_size_mismatch_fails_only_its_execution(comm):
    if comm.size != 2:
        pytest.skip("a check for 2 ranks")
    s = pc.Schedule(comm)
    if comm.rank == 0:
        s.recv(np.zeros(1, np.float64), 1)
    else:
        s.send(np.zeros(2, np.float64), 0)
    s.commit()
    for _execution in range(3):
        req = s.start()
        if comm.rank == 0:
            assert expect_raises(pc.MPIError, req.wait, timeout=20).ranks == (1,)
        else:
            req.wait(timeout=20)
        comm.Barrier()
    s.free()
    t = pc.Schedule(comm)
    got = np.zeros(3)
    t.send(np.full(3, float(comm.rank)), 1 - comm.rank)
    t.recv(got, 1 - comm.rank)
    with t.commit():
        t.start().wait(timeout=20)
    assert np.all(got == 1 - comm.rank), got


if __name__ == "__main__":
    run_module(__file__)
