"""Partial allreduce semantics (issue 4) under mpiexec: each mode at P = 1, 2, 3, 4, 5, 8,
40 rounds with random 0-20 ms skew: nothing lost, agreement, membership,
liveness, staleness, several collectives at once, bad input.

One job per process count runs every mode (and late policy, size...): each in-rank check
runs once per case and its id names the case (test_staleness[probe]), so a failure names
its check, case and ranks; starting the ranks (Python, NumPy, mpi4py, the engine) is
most of a small check's time."""
import pytest

from conftest import run_shared

MODES = ["solo", "majority", "probe", "quorum", "full"]


@pytest.mark.mpiexec
@pytest.mark.parametrize("nprocs", [1, 2, 3, 4, 5, 8])
def test_partial_allreduce(mpirun, nprocs):
    """Every mode (tests/mpi/partial_checks.py, one check per mode), 40 rounds (each round
    the same checks over a fresh random skew; the long runs are test_soak.py's 1000 rounds
    per mode)."""
    mpirun("partial_checks.py", nprocs, ",".join(MODES), "40", timeout=600)


@pytest.mark.mpiexec
@pytest.mark.parametrize("nprocs,idle", [(3, "auto"), (5, "auto"), (8, "auto"), (8, "spin")])
def test_counts_exact(mpirun, nprocs, idle):
    """Rank r posts e_r (and 1000**r): every result's posts, active and nap say exactly
    whose posts its data holds, leftovers of late posts included; solo, majority, probe,
    quorum x fold, latest (one in-rank check each); at P = 8 with the polling policy too."""
    mpirun("counts_checks.py", nprocs, "solo,majority,probe,quorum", "fold,latest", "40", timeout=300,
           env={"PARTIALCOLL_IDLE": idle})


@pytest.mark.mpiexec
@pytest.mark.parametrize("nprocs", [3, 4])
def test_partial_inline_progress(mpirun, nprocs):
    """The same semantics when test/wait drive progress (no progress thread)."""
    mpirun("partial_checks.py", nprocs, "majority", "40", env={"PARTIALCOLL_PROGRESS": "inline"}, timeout=240)


@pytest.mark.mpiexec
@pytest.mark.parametrize("nprocs", [2, 3, 5])      # powers of two: 2 here, 4 and 8 in the semantics jobs
def test_close_uneven_posts(mpirun, nprocs):
    """close() finishes on every rank and flushes everything when ranks posted different
    numbers of times (some never waiting, one never posting), every mode x late policy
    (one in-rank check each, tests/mpi/close_checks.py); 8 B, and 1 MiB vectors at P = 3."""
    counts = "1,131072" if nprocs == 3 else "1"
    mpirun("close_checks.py", nprocs, ",".join(MODES), "fold,latest", counts, timeout=300)


@pytest.mark.mpiexec
@pytest.mark.parametrize("nprocs", [2, 3, 5])
def test_late_in_place_post(mpirun, nprocs):
    """Late in-place posts, post(x, out=x) after the round started without this rank (the
    balanced solo pattern, issue 12): the result lands in x, nothing is lost whether the
    request is waited for at once, after the next round started, or after a second post;
    every mode (one in-rank check each), 1 MiB vectors, and 16 MiB at P = 3."""
    sizes = [1 << 20, 16 << 20] if nprocs == 3 else [1 << 20]
    mpirun("late_in_place_checks.py", nprocs, ",".join(MODES), ",".join(map(str, sizes)), timeout=300)


@pytest.mark.mpiexec
@pytest.mark.shared_job("carried_checks.py")
@pytest.mark.parametrize("nprocs", [2, 3, 5])
def test_data_carries_the_activation(mpirun, request, nprocs):
    """A small solo round whose flood leaves out the empty messages its data carries: from
    every initiator, ranks that never posted join through the data alone (P = 2: no empty
    message at all) and contribute nothing, late posts get round 1 (latest) or rounds 0
    and 1 folded (fold), and their leftovers go into round 2; exact data and counts."""
    run_shared(mpirun, request, nprocs)
