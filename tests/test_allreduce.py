"""Allreduce schedules against MPI_Allreduce (issue 3), under mpiexec."""
import pytest


@pytest.mark.mpi
@pytest.mark.parametrize("nprocs", [1, 2, 3, 4, 5, 6, 7, 8])
def test_allreduce_every_op_dtype_count(mpirun, nprocs):
    mpirun("allreduce_checks.py", nprocs, timeout=300)


@pytest.mark.mpi
@pytest.mark.parametrize("nprocs", [1, 2, 3, 4, 5, 6, 7, 8])
def test_allreduce_large(mpirun, nprocs):
    """count 2^20 + 3: every op x dtype and algorithm against MPI_Allreduce."""
    mpirun("allreduce_checks.py", nprocs, "--large", timeout=400)
