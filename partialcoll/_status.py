"""Engine return codes as exceptions (check), and waits that return to Python in slices
(wait_in_slices), asking the MPI about failed peers on the way (Peers); timed waits for
mpi4py requests (wait_request). The binding's side of partialcoll._errors: this module
imports the native module, _errors does not."""
from __future__ import annotations

import logging
import os
import time
from typing import Any, Callable, Optional, Tuple

from mpi4py import MPI

from ._errors import (ArgumentError, EngineError, MPIError, OpError, OutOfMemory,
                      PartialcollError, PeerError, StateError, Timeout, as_timeout)
from ._lib import ffi, lib

_BY_CODE = {lib.PC_ERR_ARG: ArgumentError, lib.PC_ERR_MPI: MPIError, lib.PC_ERR_NOMEM: OutOfMemory,
            lib.PC_ERR_STATE: StateError, lib.PC_ERR_TIMEOUT: Timeout, lib.PC_ERR_THREAD: EngineError,
            lib.PC_ERR_DTYPE_OP: OpError, lib.PC_ERR_TRUNCATE: MPIError, lib.PC_ERR_PEER: PeerError}


def check(rc: int) -> None:
    """Raise the exception for a non-zero engine return code, with the engine's message."""
    if rc == 0:
        return
    msg = ffi.string(lib.pc_last_error()).decode(errors="replace") or \
        ffi.string(lib.pc_strerror(rc)).decode()
    peer = lib.pc_last_error_peer()
    if _BY_CODE.get(rc) is MPIError and peer >= 0:      # a send or receive failed: name its peer
        raise MPIError(msg, (peer,))
    if rc == lib.PC_ERR_PEER:                          # the collective's peer_error() says more
        raise PeerError(msg, peer)
    raise _BY_CODE.get(rc, PartialcollError)(msg)


TIMEOUT_CODE = lib.PC_ERR_TIMEOUT
PEER_CODE = lib.PC_ERR_PEER
_SLICE = 0.25     # seconds; waits return to Python this often, so Ctrl-C works
_stuck: list = []  # (request, buffers) of timed-out mpi4py requests: MPI may still write them


def wait_until(done: Callable[[], bool], timeout: Optional[float], longest: float = 2e-3,
               check: Optional[Callable[[], None]] = None, busy: float = 0.0) -> bool:
    """Poll done() between sleeps that double from 10 us to `longest` seconds, so a wait
    spins no shared core: True once done() is, False after `timeout` seconds (None: it
    waits for ever). For the first `busy` seconds it polls between yields of the core
    instead (MPI's nonblocking collectives move on only while they are tested: a large
    one waited for with sleeps took 10 times as long at P = 4 on two cores). check()
    runs every _SLICE seconds of the wait; it raises to end it."""
    now = time.monotonic()
    deadline = None if timeout is None else now + timeout
    ask_at, yield_until = now + _SLICE, now + busy
    pause = 1e-5
    while not done():
        now = time.monotonic()
        if deadline is not None and now > deadline:
            return False
        if check is not None and now >= ask_at:
            check()
            ask_at = now + _SLICE
        if now < yield_until:
            os.sched_yield()
            continue
        time.sleep(pause)
        pause = min(2 * pause, longest)
    return True


def busy_seconds(nbytes: int, least: float = 0.0) -> float:
    """How long a wait for a transfer of nbytes polls between yields (wait_until's busy):
    four times the time the bytes take at 1 GB/s, and at least `least` seconds."""
    return max(least, 4 * nbytes / 1e9)


def wait_request(req: Any, timeout: Optional[float], keep: Any = (), status: Any = None,
                 check: Optional[Callable[[], None]] = None, busy: float = 0.0) -> bool:
    """Wait for an mpi4py request under the engine's idle policy (MPICH's waits spin a
    core; a Python loop of tests and sleeps answers a peer a few us late only after a
    sleep of 60 - 100 us in a VM): pc_mpi_request_wait tests it in C without the GIL,
    polling, then yielding the core (for `busy` seconds at least: MPI's nonblocking
    collectives move on only while they are tested; a large one waited for with sleeps
    took 10 times as long at P = 4 on two cores), then between sleeps. Returns True once
    it completed; False after `timeout` seconds (None: it waits for ever). check() runs
    every _SLICE seconds of the wait; it raises to end it. After a timeout, or an
    exception from check(), the request and `keep` (its buffers) are kept for good: MPI
    may still write them, and a collective's request cannot be cancelled."""
    from . import _engine               # (_engine imports this module) the policy's values
    _engine.ensure_started()
    handle = ffi.cast("void *", MPI._addressof(req))
    st = ffi.NULL if status is None else ffi.cast("void *", MPI._addressof(status))
    done = ffi.new("int *")
    start = time.monotonic()
    try:
        while True:                       # tested at least once, also with timeout 0
            waited = time.monotonic() - start
            left = _SLICE if timeout is None else max(timeout - waited, 0.0)
            rc = lib.pc_mpi_request_wait(handle, st, min(left, _SLICE), busy * 1e6, waited * 1e6, done)
            if rc != 0:                   # the request failed (ULFM: a dead peer): as the engine's
                if check is not None:
                    check()               # MPIError naming the failed ranks, where the MPI knows
                raise MPIError(f"the MPI failed the request: "
                               f"{ffi.string(lib.pc_last_error()).decode(errors='replace')}")
            if done[0]:
                return True
            if left <= _SLICE and timeout is not None:
                break                     # that call waited out the timeout
            if check is not None:
                check()
    except BaseException:
        _stuck.append((req, keep))
        raise
    _stuck.append((req, keep))
    return False


def failed_peers_check(comm_handle, rank: int, where: str) -> Callable[[], None]:
    """A check for wait_request on the communicator comm_handle (_engine.comm_handle):
    MPIError naming its ranks that the MPI reports as failed (MPIX_Comm_get_failed), as
    the engine's waits raise it."""
    peers = Peers(comm_handle, rank, lambda: ("", ()))
    return lambda: peers.check_failed(where)


def peer_error_of(query, handle) -> Callable[[], Tuple[int, str, str]]:
    """For a wait that the engine failed with a peer's report: () -> (rank, exception type,
    message), from query (lib.pc_coll_peer_error, lib.pc_hop_peer_error) on handle."""
    def peer_error() -> Tuple[int, str, str]:
        rank, kind, msg = ffi.new("int *"), ffi.new("char[64]"), ffi.new("char[512]")
        check(query(handle, rank, kind, 64, msg, 512))
        return rank[0], ffi.string(kind).decode(errors="replace"), ffi.string(msg).decode(errors="replace")
    return peer_error


class Peers:
    """What a wait asks when it is slow: which peers failed, which were not heard from."""

    def __init__(self, comm_handle, rank: int, silent: Callable[[], Tuple[str, Tuple[int, ...]]],
                 peer_error: Optional[Callable[[], Tuple[int, str, str]]] = None) -> None:
        self.comm_handle, self.rank, self.silent = comm_handle, rank, silent
        self.peer_error = peer_error     # () -> (rank, exception type, message) of a peer's report

    def raise_peer_error(self, where: str) -> None:
        """Raise the PeerError of the report a peer sent (the engine returned PC_ERR_PEER)."""
        if self.peer_error is None:
            return
        try:
            rank, exc_type, message = self.peer_error()
        except PartialcollError:
            return
        raise PeerError(f"rank {rank} failed with {exc_type}: {message}; {where} cannot complete "
                        f"(this is rank {self.rank})", rank, exc_type, message)

    def failed(self) -> Tuple[int, ...]:
        """The ranks the MPI reports as failed (MPIX_Comm_get_failed; () where it cannot tell)."""
        ranks, n = ffi.new("int[]", _MAX_NAMED), ffi.new("int *")
        check(lib.pc_comm_failed(self.comm_handle, ranks, _MAX_NAMED, n))
        return tuple(ranks[0:n[0]]) if n[0] > 0 else ()

    def check_failed(self, where: str) -> None:
        dead = self.failed()
        if dead:
            raise MPIError(f"{_ranks(dead)} failed (the MPI reports {'it' if len(dead) == 1 else 'them'} "
                           f"through MPIX_Comm_get_failed); {where} cannot complete (this is rank {self.rank})",
                           dead)

    def timeout(self, message: str, timeout: float) -> Timeout:
        what, silent = self.silent()
        if silent:
            return Timeout(f"{message} (timeout={timeout} s): no message from {_ranks(silent)} in {what} "
                           f"(this is rank {self.rank})", silent)
        return Timeout(f"{message} (timeout={timeout} s)")


_MAX_NAMED = 64         # ranks named in one error, at most


def _ranks(ranks: Tuple[int, ...]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def wait_in_slices(call, timeout, *args, peers: Optional[Peers] = None, what: str = "the wait",
                   shown=None) -> None:
    """Run call(*args, seconds) -> engine code until it stops timing out or `timeout`
    (None: forever) has passed; then raise as check() does (Timeout after the deadline,
    naming `shown` as the timeout when given: the caller waited part of it already).

    peers: after every slice that timed out, a peer the MPI reports as failed raises
    MPIError naming it; the Timeout names the peers not heard from. A wait still running
    after rc.stall_warning seconds logs the peers not heard from, once (stall inspector)."""
    shown = timeout if shown is None else shown
    if timeout is None:                      # the hot path: usually done at the first call
        rc = call(*args, _SLICE)
        if rc == TIMEOUT_CODE:
            stall = _Stall(peers, what)
            while rc == TIMEOUT_CODE:
                if peers is not None:
                    peers.check_failed(what)
                stall.check()
                rc = call(*args, _SLICE)
        check_round(rc, peers, what)
        return
    timeout = as_timeout(timeout)
    shown = timeout if shown is None else shown
    deadline = time.monotonic() + max(float(timeout), 0.0)
    rc = call(*args, min(_SLICE, max(float(timeout), 0.0)))
    stall = _Stall(peers, what)
    while rc == TIMEOUT_CODE:
        if peers is not None:
            peers.check_failed(what)
        left = deadline - time.monotonic()
        if left <= 0:
            try:
                check(rc)
            except Timeout as exc:
                if peers is not None:
                    # the silent peers first, then a report that came as the deadline
                    # passed: a report heard in between withdraws the armed round (no peer
                    # is then missing in it) and is what the wait raises
                    timeout_error = peers.timeout(str(exc), shown)
                    peers.raise_peer_error(what)
                    raise timeout_error from None
                raise Timeout(f"{exc} (timeout={shown} s)") from None
        stall.check()
        rc = call(*args, min(_SLICE, left))
    check_round(rc, peers, what)


class _Stall:
    """The stall inspector of one wait (as Horovod's): once the wait has run for
    rc.stall_warning seconds, log which peers this rank has not heard from in the round."""

    __slots__ = ("peers", "what", "start", "done")

    def __init__(self, peers: Optional[Peers], what: str) -> None:
        self.peers, self.what, self.start, self.done = peers, what, time.monotonic(), False

    def check(self) -> None:
        if self.done:
            return
        from ._rc import rc
        limit = rc.stall_warning
        waited = time.monotonic() - self.start
        if limit is None or waited < limit:
            return
        self.done = True
        where, silent = self.peers.silent() if self.peers is not None else ("", ())
        rank = f" at rank {self.peers.rank}" if self.peers is not None else ""
        heard = f": no message from {_ranks(silent)} in {where}" if silent else ""
        if silent:                       # the words of coll.stats()'s table (docs/who-is-slow.md)
            heard += f"; who is slow: {_ranks(silent)}, late in this round (coll.stats() has the table)"
        logging.getLogger("partialcoll").warning(
            "partialcoll: %s has waited %.1f s%s%s (stall warning after %g s: partialcoll.rc.stall_warning)",
            self.what, waited, rank, heard, limit)


def check_round(rc: int, peers: Optional[Peers], what: str) -> None:
    """check(rc), but an MPI error while the MPI reports failed peers names them: under
    Open MPI's ULFM a receive from a dead rank fails at once (MPIX_ERR_PROC_FAILED), where
    MPICH leaves it pending and the slices above find the dead rank."""
    if rc == PEER_CODE and peers is not None:
        peers.raise_peer_error(what)
    if rc and peers is not None and _BY_CODE.get(rc) is MPIError:
        peers.check_failed(what)
        try:
            check(rc)
        except MPIError as exc:         # say what cannot complete, as the other waits' errors do
            raise MPIError(f"{exc}; {what} cannot complete (this is rank {peers.rank})", exc.ranks) from None
    check(rc)
