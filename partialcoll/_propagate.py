"""A rank that fails tells its peers (docs/faults.md): the collectives open on this rank,
and the hooks that report a failure on them before the process goes away.

A report goes through the engine (pc_coll_abort: one message to every peer on each
open collective's own communicator); the peers' pending and later calls on that
collective raise PeerError naming this rank, its exception type and message. The hooks
are installed when the first collective is made, each chained to what was there:

- sys.excepthook: an exception nobody caught (KeyboardInterrupt from SIGINT included)
  is reported on every open collective, then the previous hook prints it;
- threading.excepthook: an exception that ends another thread is reported on the
  collectives that thread made;
- SIGTERM, only where its handler is the default one and the first collective is made
  on the main thread (only it may set handlers): report, restore the default, and raise
  the signal again (the process ends as it would have);
- atexit: collectives still open when the interpreter exits (sys.exit(), no close())
  are reported ("exit").

An exception the application catches is not reported: it may carry on (a bad buffer on
one rank is an error there, and the collective still works after). A `with` block left
by an exception, and a close() that times out, report it, since this rank then drops
the collective. A killed process (SIGKILL) cannot report: peers rely on the MPI's
failure query and on their timeouts.

Threads: register/forget/report run on application threads; the set of open
collectives is a WeakSet (a collective dropped without close() leaves it).
"""
from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
import time
import weakref
from typing import Any, Dict, Optional, TypeVar, cast

REPORT_SECONDS = 1.0        # how long a report waits, in all, for its messages to leave
_Self = TypeVar("_Self", bound="Reporting")

_open: "weakref.WeakSet" = weakref.WeakSet()
_installed = False
_previous: Dict[str, Any] = {}


def register(coll) -> None:
    """A collective was made: report on it if this rank fails (hooks installed once)."""
    _open.add(coll)
    if not _installed:
        _install()


def forget(coll) -> None:
    """The collective was closed: nothing to report on it any more."""
    _open.discard(coll)


def report(exc_type: str, message: str, thread: Optional[int] = None) -> int:
    """Tell the peers of every open collective (of `thread` only, where given) that this
    rank failed with exc_type: message; returns on how many collectives it was said."""
    deadline = time.monotonic() + REPORT_SECONDS
    told = 0
    for coll in list(_open):
        if thread is not None and coll._thread != thread:
            continue
        try:
            told += coll._report(exc_type, message, max(deadline - time.monotonic(), 0.0))
        except Exception:       # noqa: BLE001 - a failing rank reports what it can
            pass
    return told


class Reporting:
    """What PartialAllreduce and NeighborAllreduce share: a ``with`` block closes the
    collective, or, left by an exception, reports it and drops the collective on this rank
    (close() is collective: running it while other ranks may not reach it would hang them;
    the exception propagates, and the peers hear of it: PeerError); dropped without
    close(), it reports "dropped" (its __del__, on any thread: no MPI call there, the
    engine's next pass sends the report). Subclasses give _abort (the engine's pc_*_abort),
    _abandon and close."""

    _closed: bool

    def _abort(self, exc_type: bytes, message: bytes, seconds: float) -> None:
        raise NotImplementedError

    def _abandon(self) -> None:
        raise NotImplementedError

    def _report(self, exc_type: str, message: str, seconds: float) -> int:
        """Tell every peer that this rank failed with exc_type: message (their calls on this
        collective then raise PeerError); the collective cannot be used here after. 0 where
        it is closed, else 1 (the engine sends nothing where a peer's report came first, or
        after the final round). seconds: how long to wait for the messages to leave;
        negative: no MPI call here, the engine's next pass sends them."""
        if self._closed:
            return 0
        self._abort(exc_type.encode(errors="replace")[:59], message.encode(errors="replace")[:431], seconds)
        return 1

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            try:
                self._report("dropped", "the collective was dropped without close() (garbage-collected, "
                             "or left behind by an exception or sys.exit())", -1.0)
            except Exception:       # noqa: BLE001 - __del__ must not raise
                pass
            self._abandon()

    def __enter__(self: _Self) -> _Self:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if self._closed:
            return
        if exc_type is None:
            cast(Any, self).close()
            return
        try:
            self._report(exc_type.__name__, describe(exc[0]), REPORT_SECONDS)
        finally:
            self._abandon()


_LET_GO = threading.Lock()       # let_go: one release per hold


def hold_for_waiters(obj: Any, handle: Any, hold: Any) -> None:
    """Before obj drops its native handle: where another thread is inside wait() or test()
    (obj._waiting), hold the handle for those threads (the engine's pc_*_hold); the last
    of them lets go (let_go). obj._held is the handle so held."""
    if getattr(obj, "_waiting", None):
        hold(handle)
        obj._held = handle


def let_go(obj: Any, release: Any) -> None:
    """The last thread out of obj's wait()/test() releases what hold_for_waiters held."""
    with _LET_GO:
        held = obj._held
        if held is None or obj._waiting:
            return
        obj._held = None
    release(held)


def describe(exc: BaseException) -> str:
    """The message a report carries for exc."""
    return str(exc) or repr(exc)


def _excepthook(exc_type, exc, tb) -> None:
    try:
        report(exc_type.__name__, describe(exc))
    finally:
        _previous["excepthook"](exc_type, exc, tb)


def _threading_excepthook(args) -> None:
    try:
        if args.exc_type is not SystemExit and args.thread is not None:
            report(args.exc_type.__name__, f"{describe(args.exc_value)} (in thread {args.thread.name})",
                   thread=args.thread.ident)
    finally:
        _previous["threading"](args)


def _on_sigterm(signum, frame) -> None:
    try:
        report("SIGTERM", f"the process received signal {signum} (SIGTERM)")
    finally:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


def _at_exit() -> None:
    report("exit", "the process exited with the collective open (no close())")


def _install() -> None:
    global _installed
    _installed = True
    _previous["excepthook"] = sys.excepthook
    sys.excepthook = _excepthook
    _previous["threading"] = threading.excepthook
    threading.excepthook = _threading_excepthook
    try:        # only where nobody handles SIGTERM, and only the main thread may set handlers
        if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            signal.signal(signal.SIGTERM, _on_sigterm)
    except ValueError:
        pass
    atexit.register(_at_exit)   # after the engine's finalize: runs before it
