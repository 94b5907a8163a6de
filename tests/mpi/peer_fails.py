"""A rank that fails tells its peers: python peer_fails.py CASE (rank 0 fails; P >= 2)

Every rank makes one collective per mode (solo, majority, probe, quorum, full) and a
NeighborAllreduce over a ring (mode "neighbor"), and posts and waits on each in turn. Rank 0 fails at iteration 3, after its posts to solo and
majority, by CASE:

  badbuf   posts an int64 buffer to the float64 full collective: InvalidBufferError, uncaught
  raise    raises RuntimeError in its own code between posts, uncaught
  sigint   sends itself SIGINT: KeyboardInterrupt, uncaught
  sigterm  sends itself SIGTERM (no handler of its own: partialcoll's reports, then dies of it)
  exit     calls sys.exit(3) with the collectives open (no close()) and still referenced

These end the process: sys.excepthook (and atexit, SIGTERM) report the failure on every
open collective. Rank 0 prints ``FAILING case=... at=T`` (time.time()) just before.
Every survivor must raise PeerError naming rank 0 and its exception type on every
collective (a pending wait, or the next post or wait), then the failed request's wait()
and test() raise it again and close() raises it at once. A survivor prints, per mode,
``FAULT rank=R case=C mode=M raised=PeerError named=0 exc_type=... at=T close=... close_s=S``
(tests/test_faults.py checks at - the FAILING at < 2 s) and ``PASSED R``, then exits
normally (MPI_Finalize), except after sigterm: a rank killed by a signal never reaches
MPI_Finalize, which MPICH's survivors would wait for, so they leave with os._exit(0)
(and each rank runs behind a thin parent: see behind_a_parent).

CASE ``inproc`` [PHASES]: the failures that leave rank 0 running, one phase each, with
fresh collectives (mpiexec's PARTIALCOLL_TIMEOUT: the wait timeout, 2 s in the tests);
PHASES (default all) names some of them, comma-separated:

  with     rank 0 raises RuntimeError inside ``with`` blocks of all six collectives (it
           catches it outside): each __exit__ reports it; survivors raise PeerError
  thread   rank 0's collectives are made and used on a thread that dies of an exception:
           threading.excepthook reports on them: PeerError, RuntimeError
  drop     rank 0 drops all six collectives without close() (the garbage collector
           abandons them; the engine's next pass sends the report, made by the progress
           thread, or inline by a reporter thread: rank 0 then waits in an MPI barrier,
           not in the engine): PeerError, "dropped"
  close    rank 0 closes every collective early (close(timeout=1.5) on six threads) while
           the survivors go on posting: their rounds complete (rank 0 is passive, closing),
           then rank 0's close() times out and reports Timeout: survivors raise PeerError
           (exc_type Timeout)
  second   two failures: rank 0 fails as in ``with``; rank 1 hears it (PeerError naming 0 on
           every collective), then fails too, inside ``with`` blocks of all six: the first
           report wins, rank 1 sends none of its own (pc.info()["reports"]["sent"] counts
           what each rank sent in the phase: rank 0 six, every other rank none), and the
           other survivors, who look only once rank 1 has failed, name rank 0.
  never    rank 0 stops posting (sleeps): solo, probe and quorum (k = P - 1) rounds go on
           without it (it is not active in the last of them); majority and full rounds
           that need it stall: each survivor's wait raises Timeout (or PeerError with type
           Timeout, from a survivor that timed out first and left its ``with`` block), and
           the stall inspector (PARTIALCOLL_STALL_WARNING, 0.5 s in the tests) logs the ranks
           not heard from before that. When rank 0 comes back, its post or wait on
           majority and full raises PeerError naming a survivor; every rank then closes
           solo, probe and quorum normally.
"""
from __future__ import annotations

import gc
import os
import signal
import sys
import threading
import time


def behind_a_parent():
    """CASE sigterm: run the rank as the child of a thin parent that turns a death by a
    signal into exit status 128 + signal, as a shell does. MPICH's mpiexec (its hydra
    proxy) SIGKILLs every rank on the node as soon as it reaps one that died of a signal,
    -disable-auto-cleanup or not, which would end the survivors before they are checked.
    The parent starts no MPI; it ignores the SIGUSR1 the proxy sends when a rank leaves."""
    pid = os.fork()
    if pid == 0:
        return
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    os._exit(128 - code if code < 0 else code)


if sys.argv[1] == "sigterm":
    behind_a_parent()

import numpy as np  # noqa: E402 - after the fork: the parent imports no MPI
from mpi4py import MPI  # noqa: E402

# the survivors must outlive rank 0's failure to report it: turn off the abort that ends
# the whole job after an uncaught exception (pc.rc.abort_on_exception, as python -m mpi4py)
os.environ.setdefault("PARTIALCOLL_ABORT_ON_EXCEPTION", "0")

import partialcoll as pc  # noqa: E402
from _util import nap_until_told  # noqa: E402

CASE = sys.argv[1]
PHASES = sys.argv[2].split(",") if len(sys.argv) > 2 else ["with", "thread", "drop", "close", "never", "second"]
MODES = ("solo", "majority", "probe", "quorum", "full", "neighbor")   # neighbor: a NeighborAllreduce
FAIL_AT = 3
KEPT: list = []
GIVE_UP = 20.0          # seconds: a survivor that has not seen every failure by then fails
EXC_TYPE = {"badbuf": "InvalidBufferError", "raise": "RuntimeError", "sigint": "KeyboardInterrupt",
            "sigterm": "SIGTERM", "exit": "exit"}


def make(comm, mode):
    if mode == "neighbor":      # each rank's two ring neighbours (one at P = 2)
        return pc.NeighborAllreduce(4, np.float64, MPI.SUM, pc.ring_graph(comm))
    kw = {"candidates": 2} if mode == "probe" else {"quorum": max(1, comm.size - 1)} if mode == "quorum" else {}
    return pc.PartialAllreduce(4, np.float64, MPI.SUM, comm, mode=mode, seed=7, **kw)


def opened(comm, modes=MODES):
    """One collective per mode, each after one round on every rank (and a barrier: rank
    0's rounds may complete before a peer has waited for its own, and a wait after a
    peer's report raises PeerError even where its round had completed)."""
    colls = {mode: make(comm, mode) for mode in modes}
    for coll in colls.values():
        coll.post(np.full(4, float(comm.rank))).wait()
    comm.Barrier()
    return colls


def say(line):
    print(line, flush=True)


def fail(comm, colls):
    """Rank 0, CASE: fail at iteration FAIL_AT, after posting to solo and majority."""
    for i in range(FAIL_AT + 1):
        for mode in MODES:
            if i == FAIL_AT and mode == "probe":
                say(f"FAILING case={CASE} at={time.time():.4f}")
                if CASE == "badbuf":
                    colls["full"].post(np.zeros(4, np.int64))
                elif CASE == "raise":
                    raise RuntimeError("the user's code failed between posts")
                elif CASE == "sigint":
                    os.kill(os.getpid(), signal.SIGINT)
                    time.sleep(5)            # KeyboardInterrupt arrives here
                elif CASE == "sigterm":
                    os.kill(os.getpid(), signal.SIGTERM)
                    time.sleep(5)            # partialcoll's handler reports, then the signal ends it
                elif CASE == "exit":
                    KEPT.append(colls)       # still referenced at exit: atexit reports them
                    sys.exit(3)
                raise AssertionError(f"case {CASE} did not fail")
            colls[mode].post(np.full(4, 1.0)).wait()


def survive(comm, colls, expect_type, failing=0):
    """Post and wait on every collective until each raised PeerError naming `failing`;
    returns {mode: (exception, time.time() when raised)}."""
    failed, give_up = {}, time.monotonic() + GIVE_UP
    x = np.full(4, float(comm.rank))
    while len(failed) < len(colls):
        assert time.monotonic() < give_up, f"rank {comm.rank}: no PeerError on {set(colls) - set(failed)}"
        for mode, coll in colls.items():
            if mode in failed:
                continue
            req = None
            try:
                req = coll.post(x)
                req.wait()
            except pc.PeerError as exc:
                failed[mode] = (exc, time.time())
                assert exc.rank == failing and exc.ranks == (failing,), (mode, exc.rank, str(exc))
                assert expect_type in (None, exc.exc_type), (mode, exc.exc_type, str(exc))
                assert f"rank {failing} failed with {exc.exc_type}" in str(exc) and \
                    f"this is rank {comm.rank}" in str(exc), str(exc)
                if req is not None:          # the same request raises again, at once
                    for again in (req.wait, req.test):
                        try:
                            again()
                            raise AssertionError(f"{again.__name__}() after a PeerError returned")
                        except pc.PeerError:
                            pass
    return failed


def close_at_once(comm, colls, failed, case):
    for mode, coll in colls.items():
        t0 = time.monotonic()
        try:
            coll.close()
            closed = "returned"
        except pc.PeerError:
            closed = "PeerError"
        took = time.monotonic() - t0
        assert took < 1.0, f"close() took {took:.2f} s after a PeerError"
        exc, at = failed[mode]
        say(f"FAULT rank={comm.rank} case={case} mode={mode} raised={type(exc).__name__} named={exc.rank} "
            f"exc_type={exc.exc_type} at={at:.4f} close={closed} close_s={took:.3f}")


def exits(comm):
    colls = {mode: make(comm, mode) for mode in MODES}
    if comm.rank == 0:
        fail(comm, colls)
    failed = survive(comm, colls, EXC_TYPE[CASE])
    close_at_once(comm, colls, failed, CASE)
    say(f"PASSED {comm.rank}")
    if CASE == "sigterm":
        os._exit(0)


def phase_with(comm):
    colls = opened(comm)
    if comm.rank == 0:
        say(f"FAILING case=with at={time.time():.4f}")
        fail_inside_with(colls, "failed inside the with blocks")
        for coll in colls.values():      # it dropped them: using them is a StateError here
            try:
                coll.post(np.ones(4))
                raise AssertionError("post after leaving the with block")
            except pc.StateError:
                pass
        return
    close_at_once(comm, colls, survive(comm, colls, "RuntimeError"), "with")


def phase_thread(comm):
    """Rank 0 makes and uses the collectives on a thread, which then dies of an exception:
    threading.excepthook reports on the collectives that thread made."""
    if comm.rank != 0:
        colls = opened(comm)
        close_at_once(comm, colls, survive(comm, colls, "RuntimeError"), "thread")
        return
    kept = []

    def worker():
        kept.append(opened(comm))
        say(f"FAILING case=thread at={time.time():.4f}")
        raise RuntimeError("the worker thread failed")
    t = threading.Thread(target=worker, name="worker")
    t.start()
    t.join()


def phase_drop(comm):
    colls = opened(comm)
    if comm.rank == 0:
        say(f"FAILING case=drop at={time.time():.4f}")
        del colls
        gc.collect()
        return
    close_at_once(comm, colls, survive(comm, colls, "dropped"), "drop")


def phase_close(comm):
    colls = opened(comm)
    if comm.rank == 0:
        errors = {}

        # close() without timeout= waits pc.rc.close_timeout, not pc.rc.timeout (made long)
        old = pc.rc.close_timeout, pc.rc.timeout
        pc.rc.close_timeout, pc.rc.timeout = 1.5, 60.0

        def close(mode):
            t0 = time.monotonic()
            try:
                colls[mode].close()
            except pc.Timeout as exc:
                took = time.monotonic() - t0
                assert 1.5 <= took < 2.5, f"{mode}: close() timed out after {took:.2f} s, not 1.5 s"
                errors[mode] = exc
        say(f"FAILING case=close at={time.time() + 1.5:.4f}")     # when its close() times out
        threads = [threading.Thread(target=close, args=(m,)) for m in MODES]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        pc.rc.close_timeout, pc.rc.timeout = old
        assert sorted(errors) == sorted(MODES), errors
        return
    close_at_once(comm, colls, survive(comm, colls, "Timeout"), "close")


def fail_inside_with(colls, why):
    """Raise RuntimeError(why) inside ``with`` blocks of every collective, and catch it:
    each __exit__ reports it (where this rank is the first to) and drops the collective."""
    try:
        with colls["solo"], colls["majority"], colls["probe"], colls["quorum"], colls["full"], colls["neighbor"]:
            raise RuntimeError(why)
    except RuntimeError:
        pass


def phase_second(comm):
    colls = opened(comm)
    side = comm.Dup()                        # MPI's own: rank 1 tells the others it failed
    sent = pc.info()["reports"]["sent"]
    if comm.rank == 0:
        say(f"FAILING case=second at={time.time():.4f}")
        fail_inside_with(colls, "the first failure")
    elif comm.rank == 1:
        failed = survive(comm, colls, "RuntimeError")
        fail_inside_with(colls, "a second failure, after rank 0's report")
        for mode, (exc, at) in failed.items():
            say(f"FAULT rank=1 case=second mode={mode} raised={type(exc).__name__} named={exc.rank} "
                f"exc_type={exc.exc_type} at={at:.4f} close=dropped close_s=0")
        for peer in range(2, comm.size):
            side.send(1, dest=peer)
    else:
        assert nap_until_told(side, [1], limit=GIVE_UP) == {1}, "rank 1 did not fail"
        close_at_once(comm, colls, survive(comm, colls, "RuntimeError"), "second")
    say(f"REPORTS rank={comm.rank} case=second sent={pc.info()['reports']['sent'] - sent}")
    side.Free()


def phase_never(comm):
    colls = opened(comm, MODES[:5])     # the partial modes: what goes on without a rank
    stalls = ("majority", "full")
    x = np.full(4, float(comm.rank))
    timeout = pc.rc.timeout
    side = comm.Dup()                        # MPI's own: the survivors tell rank 0 they are done
    if comm.rank == 0:
        say(f"FAILING case=never at={time.time():.4f}")
        # never posts (asleep in Python) while the survivors time out, until each has
        heard = nap_until_told(side, range(1, comm.size), limit=3 * timeout + 1.0)
        assert heard == set(range(1, comm.size)), f"survivors {sorted(heard)} of {comm.size - 1} were done"
        for mode in stalls:
            try:
                colls[mode].post(x).wait()
                raise AssertionError(f"{mode}: rank 0's post after its peers timed out completed")
            except pc.PeerError as exc:
                assert exc.exc_type == "Timeout" and exc.rank != 0, (exc.rank, exc.exc_type)
                say(f"FAULT rank=0 case=never mode={mode} raised=PeerError named={exc.rank} "
                    f"exc_type={exc.exc_type} at={time.time():.4f} close=- close_s=0")
    else:
        for mode in ("solo", "probe", "quorum"):      # go on without rank 0
            for _ in range(20):
                res = colls[mode].post(x).wait()
            assert 0 not in res.active, (mode, res.active)
            say(f"FAULT rank={comm.rank} case=never mode={mode} raised=nothing named=- exc_type=- "
                f"at={time.time():.4f} close=- close_s=0")
        for mode in stalls:
            t0 = time.monotonic()
            try:
                with colls[mode]:                     # a Timeout leaves it: rank 0 hears of it
                    for _ in range(200):
                        colls[mode].post(x).wait()
                raise AssertionError(f"{mode}: 200 rounds completed without rank 0")
            except (pc.Timeout, pc.PeerError) as exc:
                took = time.monotonic() - t0
                if isinstance(exc, pc.Timeout):
                    assert exc.ranks and comm.rank not in exc.ranks, exc.ranks
                    named = ",".join(map(str, exc.ranks))
                else:
                    assert exc.exc_type == "Timeout" and exc.rank not in (0, comm.rank), (exc.rank, exc.exc_type)
                    named = str(exc.rank)
                assert took < timeout + 2.0 + 20 * 0.5, took
                say(f"FAULT rank={comm.rank} case=never mode={mode} raised={type(exc).__name__} named={named} "
                    f"exc_type={getattr(exc, 'exc_type', '-')} at={time.time():.4f} close=- close_s=0")
        side.send(comm.rank, dest=0)
    for mode in ("solo", "probe", "quorum"):
        colls[mode].close()
    side.Free()


def body():
    comm = MPI.COMM_WORLD
    assert comm.size >= 2, "a rank fails: P >= 2"
    if CASE != "inproc":
        exits(comm)
        return
    for name in PHASES:
        globals()["phase_" + name](comm)
        comm.Barrier()
    say(f"PASSED {comm.rank}")


body()
