"""Lifetimes of NeighborAllreduce, AsyncAverager and HierarchicalAllreduce
(tests/mpi/lifetimes_checks.py): a NeighborAllreduce dropped under another thread's wait,
an AsyncAverager collected without close() (no MPI call from __del__), a pipelined
HierarchicalAllreduce across regroupings."""
from __future__ import annotations

import pytest

from conftest import run_shared


def test_lifetimes_spin(mpirun):
    """P = 2 under the polling policy."""
    mpirun("lifetimes_checks.py", 2, timeout=120, env={"PARTIALCOLL_IDLE": "spin"})


@pytest.mark.mpiexec
@pytest.mark.shared_job("lifetimes_checks.py")
@pytest.mark.parametrize("nprocs", [3])
def test_lifetimes(mpirun, request, nprocs):
    """P = 3 under the default policy, in the shared job."""
    run_shared(mpirun, request, nprocs)


def test_balancer_rounds_not_leaked(mpirun, request):
    """Round schedules the balancer thread built and did not hand over (it had to stop)
    are freed: LeakSanitizer reports nothing (tests/mpi/balancer_lifetime_checks.py)."""
    import sanitize
    engine = sanitize.engine("address", request.config.cache.mkdir("engine-address"))
    out = mpirun("balancer_lifetime_checks.py", 2, timeout=120, env=sanitize.env("address", engine))
    sanitize.check_clean("address", out)
