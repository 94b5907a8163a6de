"""How a Horovod user's script ends under plain mpiexec (tests/mpi/torch_exit.py): an
uncaught exception on one rank ends the job while the others wait in MPI calls
partialcoll does not own (mpi4py's blocking allreduce, the torch process group's), within
the issue's liveness bound; a normal exit without close() closes cooperatively, and no
rank is reported as failed. (Horovod's API itself: tests/mpi/horovod_checks.py, in the
torch job of test_torch.py.) Skipped where torch is not installed."""
import re
import time

import pytest

pytest.importorskip("torch", reason="torch is not installed (pip install -e '.[test]' installs its CPU build)")

GONE_WITHIN_S = 10.0


@pytest.mark.mpiexec
@pytest.mark.parametrize("case,nprocs", [("mpi4py", 3), ("pg", 4)])
def test_uncaught_exception_ends_the_job(mpirun, case, nprocs):
    """The last rank raises while the others sit in an MPI call partialcoll does not own:
    the job is gone within 10 s of the raise (torch's process group would have waited 30
    minutes, mpi4py's allreduce for ever), and no rank got past its collective."""
    out = mpirun("torch_exit.py", nprocs, case, expect_passed=0, timeout=120)
    ended = time.time()
    failing = re.findall(r"FAILING at=([0-9.]+)", out)
    assert len(failing) == 1, out[-3000:]
    assert "UNREACHABLE" not in out, out[-3000:]
    assert "RuntimeError: the user's code failed" in out, out[-3000:]
    print(f"{case} P={nprocs}: every rank gone {ended - float(failing[0]):.2f} s after the raise")
    assert ended - float(failing[0]) < GONE_WITHIN_S, f"the job took {ended - float(failing[0]):.1f} s\n{out[-3000:]}"


@pytest.mark.mpiexec
@pytest.mark.parametrize("nprocs", [3])
def test_normal_exit_is_a_close(mpirun, nprocs):
    """solo with rank 0 slower, no close(): the fast ranks exit first, their exit closes
    the collectives with their peers, rank 0 trains on and every rank ends normally; no
    PeerError, no report. At P = 3 (two fast ranks leave, one after the other; a torch
    job at 2 would show one of them)."""
    out = mpirun("torch_exit.py", nprocs, "close", timeout=180)
    assert len(set(re.findall(r"DONE rank=(\d+)", out))) == nprocs, out[-3000:]
    for bad in ("PeerError", "failed with", "closing the collectives at exit failed", "Traceback"):
        assert bad not in out, out[-3000:]
