"""A peer that dies (issue 14, faults): python peer_dies.py MODE EXPECT [TIMEOUT [HOW]]

Run under ``mpiexec -disable-auto-cleanup`` (else mpiexec ends every rank with the
first). The last rank dies before its post #5 (HOW: ``exit``, os._exit(3), default;
``kill``, SIGKILL); every survivor's wait for round 5
(or the rounds after it) must raise, within TIMEOUT seconds (default 10), EXPECT:

  MPIError  the MPI can tell (MPICH: MPIX_Comm_get_failed): the error's ranks are the dead one
  Timeout   the MPI cannot tell (PARTIALCOLL_NO_FAILED_QUERY=1 hides MPIX_Comm_get_failed):
            the Timeout names the ranks not heard from in the round (never this rank);
            survivors next to the dead rank in the round's schedule name it

Then close() raises the same way, at once (MPIError) or after its timeout (Timeout; or
PeerError, type Timeout, where another survivor's close() timed out first and told this
one). MODE
``neighbor``: a NeighborAllreduce on a ring (Hop), whose waits ask the MPI at their
deadline (backup workers may carry on without a dead neighbour), so MPIError comes after
TIMEOUT; close() is not checked there. MODE ``schedule``: no collective; after a barrier
the victim dies while each survivor waits for one Schedule execution that receives from
a live rank first (never sent) and from the victim second: the MPIError names the victim
(schedule_survive). MODE ``hierarchy`` and ``torch``: the victim dies after a barrier
while the survivors wait in MPI's own nonblocking collectives (RNA's regrouping
allgather; the torch process group's broadcast from the victim, then sync_parameters):
each wait asks the MPI every slice and raises MPIError naming the victim
(collective_survive). A survivor
prints ``FAULT rank=... raised=... after=...s ranks=...`` and PASSED, then leaves with
os._exit(0): MPI_Finalize would wait for the dead rank forever (MPICH).
"""
from __future__ import annotations

import faulthandler
import itertools
import os
import shutil
import signal
import sys
import tempfile
import time

import numpy as np
from mpi4py import MPI

import partialcoll as pc
from partialcoll import topology

MODE, EXPECT = sys.argv[1], sys.argv[2]
TIMEOUT = float(sys.argv[3]) if len(sys.argv) > 3 else 10.0
HOW = sys.argv[4] if len(sys.argv) > 4 else "exit"
DIE_AT = 5


def say(line):
    """Print a report line; also append it to $PC_REPORT_DIR/rank-R where that is set (the
    harness reads those too: a launcher may lose a survivor's output when a rank dies)."""
    print(line, flush=True)
    where = os.environ.get("PC_REPORT_DIR")
    if where:
        with open(os.path.join(where, f"rank-{MPI.COMM_WORLD.rank}"), "a") as f:
            f.write(f"{time.time():.3f} {line}\n")


def survive(comm, coll, victim):
    # Open MPI (ULFM) across hosts notices the dead rank's closed TCP connection even with
    # the query hidden: the receive from it fails, and the MPIError names that peer
    ulfm = "Open MPI" in MPI.Get_library_version()
    expected = {"MPIError": (pc.MPIError,), "Timeout": (pc.Timeout, pc.MPIError) if ulfm else (pc.Timeout,)}[EXPECT]
    # Under solo the victim's progress thread serves the survivors' rounds until the
    # process is really gone, which on a loaded machine can be many rounds after its
    # last post: go on posting until a round fails, for a bounded time, not a bounded count.
    give_up = time.monotonic() + 2 * TIMEOUT
    for i in itertools.count():
        if time.monotonic() > give_up:
            raise AssertionError(f"rank {comm.rank}: {i} rounds in {2 * TIMEOUT:.0f} s completed "
                                 f"although rank {victim} died")
        t0 = time.monotonic()
        try:        # the error may surface at a post: the progress thread met it after the last wait
            coll.post(np.full(4, float(comm.rank + i))).wait(timeout=TIMEOUT)
        except pc.PartialcollError as exc:
            took = time.monotonic() - t0
            assert isinstance(exc, expected), f"rank {comm.rank}: {type(exc).__name__}: {exc}, not {EXPECT}"
            if EXPECT == "Timeout" and isinstance(exc, pc.MPIError):
                assert exc.ranks == (victim,), (exc.ranks, str(exc))
            assert took <= TIMEOUT + 5.0, f"raised after {took:.1f} s, past the timeout {TIMEOUT} s"
            assert i >= DIE_AT, f"round {i} failed before rank {victim} died: {exc}"
            assert exc.ranks and comm.rank not in exc.ranks, exc.ranks
            if EXPECT == "MPIError":
                # Open MPI (ULFM) also reports survivors that already left without MPI_Finalize
                assert (victim in exc.ranks) if ulfm else exc.ranks == (victim,), (exc.ranks, str(exc))
            assert f"this is rank {comm.rank}" in str(exc), str(exc)
            say(f"FAULT rank={comm.rank} mode={MODE} raised={type(exc).__name__} at_round={i} "
                f"after={took:.2f}s ranks={exc.ranks} msg={str(exc)!r}")
            break
    if MODE == "neighbor":
        return
    t0 = time.monotonic()
    try:
        coll.close(timeout=TIMEOUT)
        raise AssertionError("close() returned although a rank died")
    except (*expected, pc.PeerError) as exc:
        took = time.monotonic() - t0
        assert took <= TIMEOUT + 5.0, took
        if isinstance(exc, pc.PeerError):   # a survivor whose close() timed out first told this one
            assert EXPECT == "Timeout" and exc.exc_type == "Timeout" and exc.rank not in (victim, comm.rank), \
                (exc.rank, exc.exc_type, str(exc))
        say(f"FAULT rank={comm.rank} mode={MODE} close_raised={type(exc).__name__} after={took:.2f}s "
            f"ranks={exc.ranks}")
    try:
        coll.post(np.zeros(4))
        raise AssertionError("post after a failed close() was accepted")
    except pc.StateError:
        pass


def schedule_survive(comm, victim):
    """MODE schedule: one execution whose first request stays pending (a receive from a
    live rank that never sends it) and whose second receives from the victim. Under ULFM
    the second fails at once (MPI_ERR_IN_STATUS): the MPIError must name the victim, the
    peer of the request that failed, not the first request's peer."""
    s = pc.Schedule(comm)
    s.recv(np.zeros(1), (comm.rank + 1) % victim)       # a survivor (or this rank): never sent
    s.recv(np.zeros(1), victim)                          # the victim dies instead of sending
    s.commit()                                           # collective (the victim commits one too)
    comm.Barrier()                                       # the victim dies after this
    t0 = time.monotonic()
    try:
        s.start().wait(timeout=TIMEOUT)
        raise AssertionError("the execution completed although the victim died")
    except pc.PartialcollError as exc:
        took = time.monotonic() - t0
        assert isinstance(exc, pc.MPIError), f"{type(exc).__name__}: {exc}"
        assert exc.ranks == (victim,) and f"(recv from rank {victim})" in str(exc), (exc.ranks, str(exc))
        say(f"FAULT rank={comm.rank} mode={MODE} raised={type(exc).__name__} at_round=0 "
            f"after={took:.2f}s ranks={exc.ranks} msg={str(exc)!r}")


def collective_setup(comm, victim):
    """MODE hierarchy, torch: made by every rank (collectively) before the victim dies; the
    survivors' calls, each a wait in an MPI collective that the victim never joins."""
    if MODE == "hierarchy":
        from partialcoll.hierarchical import SpeedGrouping
        g = SpeedGrouping(comm.Dup(), regroup_every=4)
        g.note(0.01)
        return [("regrouping", g.decide)]
    import torch
    import torch.distributed as dist
    import partialcoll.integrations.torch as pct
    pct.init_process_group(comm)
    return [("process_group", lambda: dist.broadcast(torch.ones(8), src=victim)),
            ("sync_parameters", lambda: pct.sync_parameters([torch.ones(8)], comm))]


def collective_survive(comm, victim, calls):
    for what, call in calls:
        t0 = time.monotonic()
        try:
            call()
            raise AssertionError(f"{what} completed although rank {victim} died")
        except pc.PartialcollError as exc:
            took = time.monotonic() - t0
            assert isinstance(exc, pc.MPIError), f"{what}: {type(exc).__name__}: {exc}"
            assert exc.ranks == (victim,) and f"this is rank {comm.rank}" in str(exc), (exc.ranks, str(exc))
            assert took <= TIMEOUT, f"{what} raised after {took:.1f} s"
            say(f"FAULT rank={comm.rank} mode={what} raised={type(exc).__name__} at_round=0 "
                f"after={took:.2f}s ranks={exc.ranks} msg={str(exc)!r}")


def body():
    # a survivor that hangs anyway shows where (every thread's stack) and exits
    faulthandler.dump_traceback_later(3 * TIMEOUT + 20, exit=True)
    if os.environ.get("PC_TEST_GDB"):
        import subprocess
        import threading
        def native_stacks():
            subprocess.run(["gdb", "-p", str(os.getpid()), "-batch", "-ex", "thread apply all bt"],
                           stdin=subprocess.DEVNULL)
        threading.Timer(3 * TIMEOUT + 10, native_stacks).start()
    comm = MPI.COMM_WORLD
    victim = comm.size - 1
    ulfm = "Open MPI" in MPI.Get_library_version()
    rendezvous = comm.bcast(tempfile.mkdtemp(prefix="pc-peer-dies-") if ulfm and comm.rank == 0 else None)
    calls = collective_setup(comm, victim) if MODE in ("hierarchy", "torch") else None
    if calls is not None:
        coll = None
        comm.Barrier()                  # the victim dies after this
    elif MODE == "schedule":
        coll = None
    elif MODE == "neighbor":
        src, dst = topology.neighbors("ring", comm.size)[comm.rank]
        coll = pc.NeighborAllreduce(4, np.float64, comm=comm.Create_dist_graph_adjacent(src, dst))
    else:
        coll = pc.PartialAllreduce(4, np.float64, MPI.SUM, comm, mode=MODE)
    if comm.rank == victim:
        if MODE == "schedule":
            keep = pc.Schedule(comm)
            keep.nop()
            keep.commit()
            comm.Barrier()
        for i in range(DIE_AT if coll is not None else 0):
            coll.post(np.full(4, float(comm.rank + i))).wait(timeout=TIMEOUT)
        # linger as a descheduled process would (CI once saw solo survivors finish all
        # their rounds before the victim was gone): its progress thread still serves rounds
        time.sleep(0.3)
        if HOW == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        os._exit(3)                     # dies: no close, no MPI_Finalize
    try:
        if calls is not None:
            collective_survive(comm, victim, calls)
        elif MODE == "schedule":
            schedule_survive(comm, victim)
        else:
            survive(comm, coll, victim)
    except BaseException:  # noqa: BLE001 - any failure is reported, then the rank exits 1
        import traceback
        traceback.print_exc()
        sys.stdout.flush()
        os._exit(1)
    pc.finalize()
    say(f"PASSED {comm.rank}")
    time.sleep(0.5)                     # let mpiexec's proxy forward the line (once lost under load)
    if ulfm:
        # ULFM reports a rank that leaves as failed: stay until every survivor has raised
        # and closed (Timeout: after its wait's and close()'s timeouts; MPIError: within
        # 0.5 s), so that none of them names this rank instead of the dead one
        stay_until_all_passed(comm, victim, rendezvous, limit=2 * TIMEOUT + 1.0 if EXPECT == "Timeout" else 3.0)
    os._exit(0)


def stay_until_all_passed(comm, victim, where, limit):
    """Wait (for at most limit seconds) until every survivor has passed: each says so with
    a file in where, a directory on the node's file system (MPI cannot tell them: its
    collectives would wait for the dead rank). Rank 0 removes the directory a second after
    it saw them all; a survivor that missed them waits out the limit."""
    open(os.path.join(where, f"passed-{comm.rank}"), "w").close()
    want = {f"passed-{r}" for r in range(comm.size) if r != victim}
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        try:
            if want <= set(os.listdir(where)):
                break
        except FileNotFoundError:
            break                       # rank 0 saw them all and removed it
        time.sleep(0.01)
    if comm.rank == 0:
        time.sleep(1.0)
        shutil.rmtree(where, ignore_errors=True)


body()
