"""One PartialAllreduce driven from two threads (post on one, wait on another), under
mpiexec: close() refuses while another thread waits, a wait that starts once close()
has begun raises; with the progress thread spinning (PARTIALCOLL_IDLE=spin, as on a node
with cores to spare) and with the default policy."""
import pytest


@pytest.mark.mpiexec
@pytest.mark.parametrize("nprocs,idle", [(1, "spin"), (2, "auto"), (3, "spin")])     # one idle policy per P
def test_one_collective_two_threads(mpirun, nprocs, idle):
    mpirun("thread_owner_checks.py", nprocs, env={"PARTIALCOLL_IDLE": idle}, timeout=120)
