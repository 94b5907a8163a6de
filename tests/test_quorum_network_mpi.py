"""Quorum through the comparator network under mpiexec (tests/mpi/quorum_network_checks.py):
one job of 8 ranks checking P = 2, 3, 4, 5, 8 in turn: the k-th post starts the round and
not the (k - 1)-th, results equal the posters' values summed here, and with late="fold"
MPI_Allreduce of everything posted."""
import pytest


@pytest.mark.mpiexec
def test_quorum_network(mpirun):
    """P = 2, 3, 4, 5, 8 in one launch of 8 ranks (sub-communicators in turn)."""
    mpirun("quorum_network_checks.py", 8, "--sizes=2,3,4,5,8", timeout=300)
