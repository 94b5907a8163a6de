"""Short versions of bench/soak.py and bench/stall.py (issue 14): the full runs are
benchmarks (docs/faults.md, "Soak" and "A stalled rank")."""
import pytest


@pytest.mark.mpiexec
@pytest.mark.parametrize("nprocs", [3, 4])
def test_soak_short(mpirun, nprocs):
    """1000 rounds x 5 modes with random skew: nothing lost, agreement, full rounds exact;
    under MPI_TAG_UB 255 (PARTIALCOLL_TAG_UB), so the rounds' versions wrap many times."""
    mpirun("soak_checks.py", nprocs, "1000", timeout=120, env={"PARTIALCOLL_TAG_UB": "255"})


@pytest.mark.mpiexec
def test_stalled_rank_solo(mpirun):
    """P = 3, solo: the last rank's application thread sleeps 3 s; the others' rounds go on,
    the victim's next post folds every round it missed, nothing is lost."""
    mpirun("stall_checks.py", 3, "sleep", "3", timeout=120)


@pytest.mark.mpiexec
def test_stopped_rank_solo(mpirun):
    """P = 3, solo: the last rank is SIGSTOPped for 2 s (nothing of it runs, so rounds wait
    for it); after SIGCONT everyone goes on, close() flushes, nothing is lost."""
    mpirun("stall_checks.py", 3, "sigstop", "2", timeout=120)
