"""HierarchicalAllreduce (RNA's hierarchical synchronization) under mpiexec
(tests/mpi/hierarchical_checks.py): equal to a NumPy model of the algorithm, nothing lost
across a regrouping, hysteresis, regrouping on measured delays, random step times in
every mode (nothing lost across the regroupings they cause), bad input everywhere."""
import pytest

from conftest import run_shared

from partialcoll.hierarchical import _partition


def test_partition_ignores_numbers():
    assert _partition([0, 1, 0]) == ((0, 2), (1,))
    assert _partition([1, 0, 1]) == ((1,), (0, 2))       # group 0 first: ranks {1}, then {0, 2}
    assert _partition([5, 5]) == _partition([0, 0])


@pytest.mark.mpiexec
@pytest.mark.shared_job("hierarchical_checks.py")
@pytest.mark.parametrize("nprocs", [1, 2, 3, 4, 5, 8])
def test_hierarchical(mpirun, request, nprocs):
    run_shared(mpirun, request, nprocs)
