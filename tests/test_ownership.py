"""Ownership (tests/mpi/ownership_checks.py): a collective dropped while another thread
waits on it, two threads on one request, one out= buffer for two posts, polling with
wait(timeout=0), a round completed before a peer's report; at P = 2 and 3, idle "spin"
and the default, and with inline progress."""
import pytest


@pytest.mark.mpiexec
@pytest.mark.parametrize("nprocs,idle", [(2, "spin"), (3, "auto")])     # one idle policy per P
def test_ownership(mpirun, nprocs, idle):
    mpirun("ownership_checks.py", nprocs, timeout=150, env={"PARTIALCOLL_IDLE": idle})


@pytest.mark.mpiexec
def test_ownership_inline(mpirun):
    """The same with inline progress (the waits drive the engine)."""
    mpirun("ownership_checks.py", 2, timeout=150, env={"PARTIALCOLL_PROGRESS": "inline"})
