"""Partial allreduce semantics (issue 4) under mpiexec: each mode at P = 1, 2, 3, 4, 5, 8,
200 rounds with random 0-20 ms skew: nothing lost, agreement, membership, liveness,
staleness, several collectives at once, bad input."""
import pytest

MODES = ["solo", "majority", "probe", "quorum", "full"]


@pytest.mark.mpi
@pytest.mark.parametrize("nprocs", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("mode", MODES)
def test_partial_allreduce(mpirun, mode, nprocs):
    mpirun("partial_checks.py", nprocs, mode, timeout=240)


@pytest.mark.mpi
@pytest.mark.parametrize("nprocs", [3, 4])
def test_partial_inline_progress(mpirun, nprocs):
    """The same semantics when test/wait drive progress (no progress thread)."""
    mpirun("partial_checks.py", nprocs, "majority", "60", env={"PARTIALCOLL_PROGRESS": "inline"}, timeout=240)
