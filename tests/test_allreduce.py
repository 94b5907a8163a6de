"""Allreduce schedules against MPI_Allreduce (issue 3), under mpiexec.

P = 1, 2, 3, 4, 5, 8: P = 6 and 7 took 4-5 minutes of the suite's 20 and add no schedule
shape that 3 and 5 (odd, folded into a power of two) and 8 do not cover; the pure
builder tests (test_builders.py) simulate P = 1-9, 13, 16, 24 without MPI."""
import pytest

from conftest import run_shared


@pytest.mark.mpiexec
@pytest.mark.shared_job("allreduce_checks.py")
@pytest.mark.parametrize("nprocs", [1, 2, 3, 4, 5, 8])
def test_allreduce_every_op_dtype_count(mpirun, request, nprocs):
    """Counts 0, 1, 2, P - 1, P, P + 1, 1000 with every algorithm against MPI_Allreduce:
    every op x dtype pair at P <= 4, each op and each dtype at P = 5 and 8."""
    run_shared(mpirun, request, nprocs)


@pytest.mark.mpiexec
@pytest.mark.parametrize("nprocs", [3, 4])
def test_allreduce_large(mpirun, nprocs):
    """count 2^20 + 3: every dtype and every op (the small counts pair them all), recursive
    doubling and ring, against MPI_Allreduce; at P = 3 (folded into a power of two) and 4:
    the chunking of large counts does not depend on P, the small counts run at every P."""
    mpirun("allreduce_checks.py", nprocs, "--large", timeout=400)
