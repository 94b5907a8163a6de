"""A peer that dies (issue 14, faults; tests/mpi/fault_checks.py): the last rank exits at
iteration 5 under mpiexec -disable-auto-cleanup; every survivor raises within its
timeout: MPIError naming the dead rank where the MPI can tell (MPICH reports it through
MPIX_Comm_get_failed), else Timeout naming the ranks not heard from in the round; close()
then raises too. With pytest --hosts N the ranks die and survive on emulated hosts."""
import re

import pytest

pytestmark = pytest.mark.mpi


def faults(out):
    """{rank: (exception, seconds, ranks named)} of the survivors' FAULT lines (waits)."""
    got = {}
    for m in re.finditer(r"FAULT rank=(\d+) mode=\w+ raised=(\w+) at_round=\d+ after=([\d.]+)s ranks=\(([\d, ]*)\)", out):
        got[int(m.group(1))] = (m.group(2), float(m.group(3)),
                                tuple(int(r) for r in m.group(4).replace(" ", "").split(",") if r))
    return got


@pytest.mark.parametrize("nprocs", [3, 4])
@pytest.mark.parametrize("mode", ["solo", "full"])
def test_dead_peer_is_named(mpirun, mode, nprocs):
    """MPICH can tell: every survivor raises MPIError naming the dead rank, within a few slices of the wait (0.25 s each)."""
    out = mpirun("fault_checks.py", nprocs, mode, "MPIError", "10", mpiexec_args=["-disable-auto-cleanup"],
                 expect_passed=nprocs - 1, timeout=60)
    got = faults(out)
    assert sorted(got) == list(range(nprocs - 1)), out[-3000:]
    for rank, (exc, took, ranks) in got.items():
        assert exc == "MPIError" and ranks == (nprocs - 1,) and took < 8, (rank, exc, took, ranks)


@pytest.mark.parametrize("nprocs", [3, 4])
@pytest.mark.parametrize("mode", ["solo", "full"])
def test_dead_peer_times_out(mpirun, mode, nprocs):
    """The MPI cannot tell (MPIX_Comm_get_failed hidden): every survivor raises Timeout after
    its 3 s, naming the ranks it has not heard from in the round; the dead rank is among
    them at the survivors it talks to directly."""
    out = mpirun("fault_checks.py", nprocs, mode, "Timeout", "3", mpiexec_args=["-disable-auto-cleanup"],
                 env={"PARTIALCOLL_NO_FAILED_QUERY": "1"}, expect_passed=nprocs - 1, timeout=60)
    got = faults(out)
    assert sorted(got) == list(range(nprocs - 1)), out[-3000:]
    for rank, (exc, took, ranks) in got.items():
        assert exc == "Timeout" and 2.9 <= took < 8 and ranks and rank not in ranks, (rank, exc, took, ranks)
    assert any(nprocs - 1 in ranks for _, _, ranks in got.values()), got


def test_dead_neighbor_is_named(mpirun):
    """NeighborAllreduce (ring, P = 4): the survivors' waits ask the MPI at their deadline
    and raise MPIError naming the dead rank, also at rank 1, whose own neighbours live (it
    stalls an iteration later, when they do)."""
    out = mpirun("fault_checks.py", 4, "neighbor", "MPIError", "3", mpiexec_args=["-disable-auto-cleanup"],
                 expect_passed=3, timeout=60)
    got = faults(out)
    assert sorted(got) == [0, 1, 2], out[-3000:]
    for rank, (exc, took, ranks) in got.items():
        assert exc == "MPIError" and ranks == (3,) and 2.9 <= took < 8, (rank, exc, took, ranks)
