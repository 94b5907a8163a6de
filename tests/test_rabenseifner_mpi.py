"""Rabenseifner's allreduce and "auto" against MPI_Allreduce under mpiexec, every mode
(tests/mpi/rabenseifner_checks.py): one job per P in 1 - 9, and one test running
P = 12, 13, 16, 24 (--quick: fewer op x dtype pairs, on few cores)."""
import pytest


@pytest.mark.mpiexec
@pytest.mark.parametrize("nprocs", list(range(1, 10)))
def test_rabenseifner(mpirun, nprocs):
    mpirun("rabenseifner_checks.py", nprocs, timeout=300)


@pytest.mark.mpiexec
def test_rabenseifner_large_p(mpirun):
    for nprocs in (12, 13, 16, 24):
        mpirun("rabenseifner_checks.py", nprocs, "--quick", timeout=300)
