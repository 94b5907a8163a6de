"""The in-rank checks' reporting (tests/mpi/conftest.py): under mpiexec every rank runs a
check module with pytest; each check is reported by name and rank, a failure names its
check and ranks and stops every rank there, and a failure that leaves the others waiting
ends the job after the grace period instead of hanging."""
import re
import time

import pytest

from conftest import run_mpi

GRACE_S = 2.0           # PC_CHECKS_GRACE for these runs (default 10 s)

CHECKS = ["test_first", "test_fails_on_last_rank", "test_after"]


def reported(out: str) -> set:
    return set(re.findall(r"CHECK (\S+) (passed|FAILED|skipped) rank=(\d+)", out))


@pytest.mark.mpiexec
@pytest.mark.parametrize("nprocs", [1, 2, 3, 5])
def test_every_check_reported_by_name_and_rank(nprocs):
    out = run_mpi("reporting_checks.py", nprocs, "pass", timeout=60)
    assert reported(out) == {(name, "passed", str(r)) for name in CHECKS for r in range(nprocs)}, out


@pytest.mark.mpiexec
@pytest.mark.parametrize("nprocs", [2, 3])
def test_failure_named_with_its_rank(nprocs):
    with pytest.raises(pytest.fail.Exception) as failed:
        run_mpi("reporting_checks.py", nprocs, "fail", timeout=60)
    msg, last = str(failed.value), nprocs - 1
    assert f"failed checks: test_fails_on_last_rank on ranks [{last}]" in msg, msg
    got = reported(msg)
    assert ("test_fails_on_last_rank", "FAILED", str(last)) in got, msg
    assert "the last rank fails" in msg, msg                         # its traceback, with the rank
    assert not any(name == "test_after" for name, _, _ in got), "a rank went on past the failed check"
    assert "PASSED" not in msg, msg


@pytest.mark.mpiexec
@pytest.mark.parametrize("nprocs", [2, 3])
def test_failure_while_others_wait_ends_the_job(nprocs):
    t0 = time.monotonic()
    with pytest.raises(pytest.fail.Exception) as failed:
        run_mpi("reporting_checks.py", nprocs, "hang", timeout=GRACE_S + 50,
                env={"PC_CHECKS_GRACE": str(GRACE_S)})
    took, msg = time.monotonic() - t0, str(failed.value)
    assert "timed out" not in msg and "aborting the job" in msg, msg
    assert f"failed checks: test_fails_on_last_rank on ranks [{nprocs - 1}]" in msg, msg
    assert "within 2 s" in msg and took < GRACE_S + 30, took
