"""AsyncAverager (RNA's asynchronous averaging through a server): the pure builders, and
under mpiexec at P = 2-5 (tests/mpi/averager_checks.py): the exact mean of every key's
latest push for every dtype, a fast pusher not delayed by a slow key, a server that only
serves, bad input on every rank."""
import numpy as np
import pytest

from conftest import run_shared

from partialcoll.averager import HEADER, client_schedule, server_schedule


def test_builders():
    s = server_schedule(server=0, size=3, client=2, nbytes=40)
    text = s.dump()
    assert "recv work[0:56] (56 B) <- rank 2" in text and "deliver" in text
    assert "send mask[0:56] (56 B) -> rank 2" in text
    push, reply = np.zeros(HEADER + 8, np.uint8), np.zeros(HEADER + 8, np.uint8)
    c = client_schedule(rank=1, size=3, server=0, push=push, reply=reply)
    assert [op.kind for op in c.ops] == [0, 1] and all(op.peer == 0 for op in c.ops)
    assert all(not op.deps for op in c.ops)        # both posted at once: a push is one round trip


@pytest.mark.mpiexec
@pytest.mark.shared_job("averager_checks.py")
@pytest.mark.parametrize("nprocs", [2, 3, 4, 5, 8])
def test_averager(mpirun, request, nprocs):
    run_shared(mpirun, request, nprocs)
