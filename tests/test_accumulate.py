"""accumulate= of PartialAllreduce ("sum", "mean", RNA's "rna" weights) under mpiexec
(tests/mpi/accumulate_checks.py): a deterministic round equal to the NumPy model, constant
posts under random delays, exact counts, bad options on every rank."""
import pytest

from conftest import run_shared


@pytest.mark.mpiexec
@pytest.mark.shared_job("accumulate_checks.py")
@pytest.mark.parametrize("nprocs", [1, 2, 3, 4, 5, 8])
def test_accumulate(mpirun, request, nprocs):
    run_shared(mpirun, request, nprocs)
