"""A normal exit closes the collectives still open, NeighborAllreduce included
(tests/mpi/neighbor_exit.py): the ranks that end their script without close() close
cooperatively at exit, in the order the collectives were made, so the rank still working
closes them itself and nobody is reported as failed. (PartialAllreduce's exit close:
tests/test_horovod.py, through the torch integration.)"""
import re

import pytest


@pytest.mark.mpiexec
@pytest.mark.parametrize("nprocs", [2, 3, 5])
def test_normal_exit_closes_neighbor_allreduce(mpirun, nprocs):
    out = mpirun("neighbor_exit.py", nprocs, timeout=90)
    assert len(set(re.findall(r"DONE rank=(\d+)", out))) == nprocs, out[-3000:]
    assert out.count("CLOSED") == 1, out[-3000:]
    for bad in ("PeerError", "failed with", "at exit failed", "Traceback"):
        assert bad not in out, out[-3000:]
