"""Partial allreduce semantics (issue 4) under mpiexec: each mode at P = 1, 2, 3, 4, 5, 8,
200 rounds with random 0-20 ms skew: nothing lost, agreement, membership, liveness,
staleness, several collectives at once, bad input."""
import pytest

MODES = ["solo", "majority", "probe", "quorum", "full"]


@pytest.mark.mpiexec
@pytest.mark.parametrize("nprocs", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("mode", MODES)
def test_partial_allreduce(mpirun, mode, nprocs):
    mpirun("partial_checks.py", nprocs, mode, timeout=240)


@pytest.mark.mpiexec
@pytest.mark.parametrize("nprocs", [3, 4, 5])
@pytest.mark.parametrize("late", ["fold", "latest"])
@pytest.mark.parametrize("mode", ["solo", "majority", "probe", "quorum"])
def test_counts_exact(mpirun, mode, late, nprocs):
    """Rank r posts 1000**r: every result's posts, active and nap say exactly whose posts
    its data holds, leftovers of late posts included."""
    mpirun("counts_checks.py", nprocs, mode, late, "40", timeout=120)


@pytest.mark.mpiexec
@pytest.mark.parametrize("nprocs", [3, 4])
def test_partial_inline_progress(mpirun, nprocs):
    """The same semantics when test/wait drive progress (no progress thread)."""
    mpirun("partial_checks.py", nprocs, "majority", "60", env={"PARTIALCOLL_PROGRESS": "inline"}, timeout=240)


@pytest.mark.mpiexec
@pytest.mark.parametrize("nprocs", [2, 3, 4, 5])
def test_close_uneven_posts(mpirun, nprocs):
    """close() finishes on every rank and flushes everything when ranks posted different
    numbers of times (some never waiting, one never posting), every mode x late policy
    (one in-rank check each, tests/mpi/close_checks.py); 8 B, and 1 MiB vectors at P = 3."""
    counts = "1,131072" if nprocs == 3 else "1"
    mpirun("close_checks.py", nprocs, ",".join(MODES), "fold,latest", counts, timeout=300)


@pytest.mark.mpiexec
@pytest.mark.parametrize("nprocs", [2, 3, 5])
@pytest.mark.parametrize("mode", MODES)
def test_late_in_place_post(mpirun, mode, nprocs):
    """Late in-place posts, post(x, out=x) after the round started without this rank (the
    balanced solo pattern, issue 12): the result lands in x, nothing is lost whether the
    request is waited for at once, after the next round started, or after a second post;
    1 MiB and 16 MiB vectors."""
    mpirun("late_in_place_checks.py", nprocs, mode, str(1 << 20), timeout=120)
    if nprocs == 3:
        mpirun("late_in_place_checks.py", nprocs, mode, str(16 << 20), timeout=120)
