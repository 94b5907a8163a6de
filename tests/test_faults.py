"""A peer that dies (issue 14, faults; tests/mpi/peer_dies.py): the last rank exits at
iteration 5 under an mpiexec that outlives it (MPICH -disable-auto-cleanup, Open MPI
--with-ft ulfm; conftest.launch); every survivor raises within its
timeout: MPIError naming the dead rank where the MPI can tell (MPICH reports it through
MPIX_Comm_get_failed), else Timeout naming the ranks not heard from in the round; close()
then raises too. With pytest --hosts N the ranks die and survive on emulated hosts."""
import re

import pytest

from conftest import mpi_flavour

pytestmark = pytest.mark.mpiexec

# Liveness bounds: the README promises a dead peer named within a quarter second, and
# docs/faults.md measured PeerError within 16 ms; on two shared cores the suite allows
# LIVENESS_S (bench/fault_table.py measures the real figures).
LIVENESS_S = 1.0
# The waits' deadline where the survivors must time out (or ask the MPI at it): they
# raise within [DEADLINE_S - 0.1, DEADLINE_S + LIVENESS_S); each such job waits it twice
# (the wait, then close()), so it is short
DEADLINE_S = 2.0


def named_death() -> str:
    """How the victim dies so that the MPI can tell the survivors: MPICH reports a rank
    that exits without MPI_Finalize (SIGKILL makes Hydra end the job); Open MPI's ULFM
    reports a killed rank, not one that exits (its survivors time out: docs/faults.md)."""
    return "kill" if mpi_flavour() == "openmpi" else "exit"


def faults(out):
    """{rank: (exception, seconds, ranks named)} of the survivors' FAULT lines (waits)."""
    got = {}
    for m in re.finditer(r"FAULT rank=(\d+) mode=\w+ raised=(\w+) at_round=\d+ after=([\d.]+)s ranks=\(([\d, ]*)\)", out):
        got[int(m.group(1))] = (m.group(2), float(m.group(3)),
                                tuple(int(r) for r in m.group(4).replace(" ", "").split(",") if r))
    return got


@pytest.mark.parametrize("nprocs", [3, 4])
@pytest.mark.parametrize("mode", ["solo", "full"])
def test_dead_peer_is_named(mpirun, mode, nprocs):
    """The MPI can tell: every survivor raises MPIError naming the dead rank, within
    LIVENESS_S (the failure query runs every slice of the wait, 0.25 s)."""
    out = mpirun("peer_dies.py", nprocs, mode, "MPIError", "10", named_death(), keep_going=True,
                 expect_passed=nprocs - 1, timeout=60)
    got = faults(out)
    assert sorted(got) == list(range(nprocs - 1)), out[-3000:]
    for rank, (exc, took, ranks) in got.items():
        assert exc == "MPIError" and ranks == (nprocs - 1,) and took < LIVENESS_S, (rank, exc, took, ranks)


@pytest.mark.parametrize("mode,nprocs", [("solo", 3), ("full", 4)], ids=["solo-3", "full-4"])
def test_dead_peer_times_out(mpirun, mode, nprocs):
    """The MPI cannot tell (MPIX_Comm_get_failed hidden): each mode at one P (the timeout
    does not depend on P; the named failure runs both at 3 and 4): every survivor raises Timeout after
    its DEADLINE_S, naming the ranks it has not heard from in the round; the dead rank is among
    them at the survivors it talks to directly. Open MPI across emulated hosts notices the
    dead rank's closed TCP connection even so: a survivor whose receive from it fails
    raises MPIError naming it, at once."""
    out = mpirun("peer_dies.py", nprocs, mode, "Timeout", str(DEADLINE_S), keep_going=True,
                 env={"PARTIALCOLL_NO_FAILED_QUERY": "1"}, expect_passed=nprocs - 1, timeout=60)
    got = faults(out)
    assert sorted(got) == list(range(nprocs - 1)), out[-3000:]
    for rank, (exc, took, ranks) in got.items():
        if exc == "MPIError" and mpi_flavour() == "openmpi":
            assert ranks == (nprocs - 1,) and took < LIVENESS_S, (rank, exc, took, ranks)
            continue
        assert exc == "Timeout" and DEADLINE_S - 0.1 <= took < DEADLINE_S + LIVENESS_S and ranks and rank not in ranks, \
            (rank, exc, took, ranks)
    assert any(nprocs - 1 in ranks for _, _, ranks in got.values()), got


def test_dead_neighbor_is_named(mpirun):
    """NeighborAllreduce (ring, P = 4): the survivors' waits ask the MPI at their deadline
    and raise MPIError naming the dead rank, also at rank 1, whose own neighbours live (it
    stalls an iteration later, when they do). Under Open MPI's ULFM the receive from the
    dead rank fails at once, and the MPI is asked then."""
    out = mpirun("peer_dies.py", 4, "neighbor", "MPIError", str(DEADLINE_S), named_death(), keep_going=True,
                 expect_passed=3, timeout=60)
    got = faults(out)
    assert sorted(got) == [0, 1, 2], out[-3000:]
    ulfm = mpi_flavour() == "openmpi"
    for rank, (exc, took, ranks) in got.items():
        if ulfm:    # a receive from the dead rank fails at once; survivors that already
            # finished (and left without MPI_Finalize) may be reported as failed too
            assert exc == "MPIError" and 3 in ranks and rank not in ranks and took < LIVENESS_S, \
                (rank, exc, took, ranks)
        else:
            assert exc == "MPIError" and ranks == (3,) and DEADLINE_S - 0.1 <= took < DEADLINE_S + LIVENESS_S, \
                (rank, exc, took, ranks)


@pytest.mark.parametrize("nprocs", [2, 3])
def test_failed_receive_names_its_peer(mpirun, nprocs):
    """The MPIError names the peer of the request that failed, not the first request
    listed (MODE schedule: a receive from a live rank that never sends is listed first).
    Only where the MPI fails the receive itself (ULFM, a killed rank); the failure query is
    hidden, so the name comes from the failed operation. Open MPI across emulated hosts
    once blamed a send to a live rank this way (mpi_test took req_op[0])."""
    if mpi_flavour() != "openmpi":
        pytest.skip("needs the second MPI's environment: MPICH leaves a receive from a dead rank pending "
                    "(the failure query names it); Open MPI's ULFM fails the request (tests/test_openmpi.py)")
    out = mpirun("peer_dies.py", nprocs, "schedule", "MPIError", "10", "kill", keep_going=True,
                 env={"PARTIALCOLL_NO_FAILED_QUERY": "1"}, expect_passed=nprocs - 1, timeout=60)
    got = faults(out)
    assert sorted(got) == list(range(nprocs - 1)), out[-3000:]
    for rank, (exc, took, ranks) in got.items():
        assert exc == "MPIError" and ranks == (nprocs - 1,) and took < LIVENESS_S, (rank, exc, took, ranks)


@pytest.mark.parametrize("mode", ["hierarchy", "torch"])
def test_dead_peer_in_mpi_collectives_is_named(mpirun, mode):
    """Waits in MPI's own nonblocking collectives (RNA's regrouping allgather; the torch
    process group's broadcast, sync_parameters) ask the MPI every slice, as the engine's
    waits do: MPIError naming the dead rank at once, where they waited for their timeout
    (the process group's: torch's 30 minutes)."""
    if mode == "torch":
        pytest.importorskip("torch", reason="torch is not installed (pip install -e '.[test]' installs its CPU build)")
    out = mpirun("peer_dies.py", 3, mode, "MPIError", "10", named_death(), keep_going=True,
                 expect_passed=2, timeout=90)
    calls = ["regrouping"] if mode == "hierarchy" else ["process_group", "sync_parameters"]
    got = sorted((int(m.group(1)), m.group(2), m.group(3), float(m.group(4)), m.group(5)) for m in re.finditer(
        r"FAULT rank=(\d+) mode=(\w+) raised=(\w+) at_round=\d+ after=([\d.]+)s ranks=\(([\d, ]*)\)", out))
    assert [(r, c) for r, c, *_ in got] == [(r, c) for r in (0, 1) for c in sorted(calls)], out[-3000:]
    for rank, call, exc, took, ranks in got:
        assert exc == "MPIError" and ranks.strip(", ") == "2" and took < LIVENESS_S, (rank, call, exc, took, ranks)


# -- a rank that fails tells its peers (tests/mpi/peer_fails.py) ---------------------------
PEER_FAULT = re.compile(r"FAULT rank=(\d+) case=(\w+) mode=(\w+) raised=(\w+) named=([\d,-]+) exc_type=(\S+) "
                        r"at=([\d.]+) close=(\S+) close_s=([\d.]+)")
FAILING = re.compile(r"FAILING case=(\w+) at=([\d.]+)")
MODES = ("solo", "majority", "probe", "quorum", "full", "neighbor")    # neighbor: a NeighborAllreduce
EXPECTED_TYPE = {"badbuf": "InvalidBufferError", "raise": "RuntimeError", "sigint": "KeyboardInterrupt",
                 "sigterm": "SIGTERM", "exit": "exit", "with": "RuntimeError", "thread": "RuntimeError", "drop": "dropped", "close": "Timeout",
}


def peer_faults(out):
    """{(case, rank, mode): (raised, named, exc_type, at, close, close_s)}, {case: failing at}"""
    got = {(m[1], int(m[0]), m[2]): (m[3], m[4], m[5], float(m[6]), m[7], float(m[8]))
           for m in PEER_FAULT.findall(out)}
    return got, {m[0]: float(m[1]) for m in FAILING.findall(out)}


def check_peer_error(out, case, nprocs):
    """Every survivor raised PeerError naming rank 0 and its exception type on every
    collective within LIVENESS_S of the failure, and close() then raised at once."""
    got, failing = peer_faults(out)
    for rank in range(1, nprocs):
        for mode in MODES:
            raised, named, exc_type, at, close, close_s = got.get((case, rank, mode), (None,) * 6)
            assert raised == "PeerError" and named == "0" and exc_type == EXPECTED_TYPE[case], \
                (case, rank, mode, raised, named, exc_type, out[-3000:])
            assert at - failing[case] < LIVENESS_S, (case, rank, mode, at - failing[case])
            assert close == "PeerError" and close_s < 1.0, (case, rank, mode, close, close_s)


def check_first_report_wins(out, nprocs):
    """Two failures (peer_fails.py's `second`): rank 1 failed after hearing rank 0's report
    and sent none of its own; every survivor, rank 1 included, named rank 0 on every
    collective (rank 1 then dropped its collectives; the others' close() raised at once)."""
    got, _ = peer_faults(out)
    for rank in range(1, nprocs):
        for mode in MODES:
            raised, named, exc_type, _, close, close_s = got.get(("second", rank, mode), (None,) * 6)
            assert (raised, named, exc_type) == ("PeerError", "0", "RuntimeError"), \
                (rank, mode, raised, named, out[-3000:])
            assert close == ("dropped" if rank == 1 else "PeerError") and close_s < 1.0, (rank, mode, close, close_s)
    sent = {int(r): int(n) for r, n in re.findall(r"REPORTS rank=(\d+) case=second sent=(\d+)", out)}
    assert sent == {r: len(MODES) if r == 0 else 0 for r in range(nprocs)}, sent


# each way of ending rank 0's process at one or two P (2, 3, 5 each at least twice): how the
# report travels does not depend on how rank 0 ended
@pytest.mark.parametrize("case,nprocs", [("badbuf", 3), ("raise", 2), ("raise", 5), ("sigint", 3),
                                         ("sigterm", 2), ("sigterm", 5), ("exit", 3)])
def test_failure_reaches_every_peer(mpirun, case, nprocs):
    """Rank 0 fails with its six collectives (one per mode, and a NeighborAllreduce) open,
    in a way that ends its process: an uncaught InvalidBufferError or user exception,
    SIGINT, SIGTERM, sys.exit() without close(). Every survivor raises PeerError naming
    rank 0 and what it raised, on every collective, within LIVENESS_S; close() then raises at
    once; and the job ends by itself under a plain mpiexec (sigterm: the rank dies of the
    signal, and MPICH's mpiexec kills a node's ranks once it reaps such a rank, so every
    rank runs behind a thin parent and the job keeps going: peer_fails.behind_a_parent)."""
    out = mpirun("peer_fails.py", nprocs, case, keep_going=case == "sigterm", expect_passed=nprocs - 1,
                 timeout=90)
    check_peer_error(out, case, nprocs)


@pytest.mark.parametrize("nprocs", [2, 3, 5])
def test_failure_in_process(mpirun, nprocs):
    """The failures that leave rank 0 running, each in every mode: an exception leaves
    `with` blocks (PeerError at every survivor); a thread of rank 0 that made and used
    collectives dies of an exception (PeerError); rank 0 drops its collectives without
    close() (PeerError, "dropped"); rank 0 closes early and its close(),
    without timeout=, times out after pc.rc.close_timeout (1.5 s; PeerError, exc_type
    Timeout); rank 0 never posts: solo, probe and quorum go
    on without it, majority and full time out (2 s) naming the ranks not heard from (0
    among them), after the stall inspector (0.5 s) logged them, and rank 0 hears of it;
    two failures, rank 1 after rank 0's report: the first report wins."""
    out = mpirun("peer_fails.py", nprocs, "inproc", timeout=120,
                 env={"PARTIALCOLL_TIMEOUT": "2", "PARTIALCOLL_STALL_WARNING": "0.5"})
    for case in ("with", "thread", "drop", "close"):
        check_peer_error(out, case, nprocs)
    check_first_report_wins(out, nprocs)
    got, _ = peer_faults(out)
    named = set()
    for rank in range(1, nprocs):
        for mode in ("solo", "probe", "quorum"):
            assert got[("never", rank, mode)][0] == "nothing", (rank, mode)
        for mode in ("majority", "full"):
            raised, who, exc_type = got[("never", rank, mode)][:3]
            assert raised == "Timeout" or (raised == "PeerError" and exc_type == "Timeout"), (rank, mode, raised)
            if raised == "Timeout":
                named |= {int(r) for r in who.split(",")}
        assert re.search(rf"partialcoll: round \d+ has waited [\d.]+ s at rank {rank}: no message from rank", out), \
            (rank, out[-3000:])
    assert 0 in named, named
    for mode in ("majority", "full"):    # rank 0, back, hears that its peers gave up
        raised, who, exc_type = got[("never", 0, mode)][:3]
        assert raised == "PeerError" and who != "0" and exc_type == "Timeout", (mode, raised, who, exc_type)


@pytest.mark.parametrize("nprocs", [2, 3])
def test_failure_in_process_inline(mpirun, nprocs):
    """The same failures with progress inline (no progress thread), but `never`, whose
    rounds go on without rank 0 only where a progress thread serves it. In `drop` rank 0
    then waits in an MPI barrier, outside the engine: a reporter thread sends the reports
    its garbage collector made (before, no pass came to send them and every survivor
    timed out instead of raising PeerError)."""
    out = mpirun("peer_fails.py", nprocs, "inproc", "with,thread,drop,close,second", timeout=120,
                 env={"PARTIALCOLL_TIMEOUT": "2", "PARTIALCOLL_STALL_WARNING": "0.5",
                      "PARTIALCOLL_PROGRESS": "inline"})
    for case in ("with", "thread", "drop", "close"):
        check_peer_error(out, case, nprocs)
    check_first_report_wins(out, nprocs)


@pytest.mark.parametrize("nprocs", [2, 3, 5])
def test_stale_report_is_ignored(mpirun, nprocs):
    """Reports sent on communicators freed since (a dropped collective's peers send them)
    stay in MPI's queue and may match the receive of the next collective, whose
    communicator can get the freed one's context id: a report names its collective, and
    the collectives made next run their rounds as if nothing had been sent."""
    mpirun("stale_report_checks.py", nprocs, timeout=120)


def test_report_spares_completed_rounds(mpirun):
    """A rank still in a round that the failing rank completed (here: it progresses
    inline) completes that round with the right data; its next round raises PeerError."""
    mpirun("report_round_checks.py", 2, timeout=120)
