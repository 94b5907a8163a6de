"""PyTorch integration (issue 6) under mpiexec; skipped where torch is not installed."""
import pytest

pytest.importorskip("torch")


@pytest.mark.mpi
@pytest.mark.parametrize("nprocs", [3, 4])
def test_torch_integration(mpirun, nprocs):
    mpirun("torch_checks.py", nprocs, timeout=300)
