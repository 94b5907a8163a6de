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
- atexit: at a normal exit (the end of the script, sys.exit() with 0 or None), the
  PartialAllreduces still open are closed cooperatively, together, as close_all() would
  (their peers' rounds go on with this rank standing in; nothing is reported), then the
  NeighborAllreduces still open, one by one in the order they were made (the order of
  their collective creation, the same on every rank of a graph; each close() drains its
  channels with its peers, as their own close or exit does); a failure of a close is
  reported. After an uncaught exception or sys.exit() with another code, collectives
  still open are reported ("exit"), and so is what a normal exit could not close.
- abort: after an uncaught exception is reported and printed, MPI.COMM_WORLD.Abort()
  ends the job, as ``python -m mpi4py`` does (not after sys.exit(n): a program may end
  every rank with the same code on purpose), so ranks waiting in MPI calls partialcoll does not own
  (mpi4py's, a torch process group's) do not wait for their timeout; rc.abort_on_exception
  = False turns it off (environment PARTIALCOLL_ABORT_ON_EXCEPTION=0).

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
import itertools
import os
import signal
import sys
import threading
import time
import weakref
from typing import Any, Dict, NoReturn, Optional, TypeVar, cast

REPORT_SECONDS = 1.0        # how long a report waits, in all, for its messages to leave
_Self = TypeVar("_Self", bound="Reporting")

_open: "weakref.WeakSet" = weakref.WeakSet()
_made: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()     # collective -> the order it was made in
_counter = itertools.count()
_installed = False
_previous: Dict[str, Any] = {}
_failed = False             # an uncaught exception or SIGTERM was reported: exit is no close
_exit_code: Any = None      # what sys.exit() was last called with
_abort_code = 0             # an uncaught exception: abort the job at exit with this code
_no_abort = False          # on_failure="shrink" in use: a failing rank leaves, the job goes on
ABORT_FALLBACK_SECONDS = 3.0


def register(coll) -> None:
    """A collective was made: report on it if this rank fails (hooks installed once)."""
    _open.add(coll)
    _made[coll] = next(_counter)
    install()


def install() -> None:
    """Install the hooks (once): the first collective does, and so does the torch
    integration's process group (an uncaught exception then ends the job even where no
    collective of partialcoll's is open)."""
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
    global _failed
    _failed = True
    try:
        report(exc_type.__name__, describe(exc))
    finally:
        _previous["excepthook"](exc_type, exc, tb)
        # abort once the hooks chained around this one have printed (torch's prints what
        # this one wrote into its buffer only after it returns): at exit, or from a timer
        # where the exit does not come (a thread that does not end)
        _abort_later(1)


def _abort_later(code: int) -> None:
    global _abort_code
    _abort_code = code
    timer = threading.Timer(ABORT_FALLBACK_SECONDS, _abort, (code,))
    timer.daemon = True
    timer.start()


def leave_without_abort() -> None:
    """A collective with on_failure="shrink" exists: this rank, failing, reports and leaves
    without ending the job, so that the others go on without it."""
    global _no_abort
    _no_abort = True


def _leave(code: Any) -> None:
    """on_failure="shrink": the failing rank reported; it leaves now, without MPI_Finalize
    (which would wait for the peers that go on without it)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:       # noqa: BLE001 - a closed stream must not stop the exit
            pass
    os._exit(code if isinstance(code, int) and code else 1)


def _abort(code: int) -> None:
    """End the whole job as ``python -m mpi4py`` does (MPI.COMM_WORLD.Abort), unless
    rc.abort_on_exception is off, a collective shrinks on failure, or MPI is not running."""
    from ._rc import rc
    if not rc.abort_on_exception or _no_abort:
        return
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None or not mpi.Is_initialized() or mpi.Is_finalized():
        return
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:       # noqa: BLE001 - a closed stream must not stop the abort
            pass
    mpi.COMM_WORLD.Abort(code if isinstance(code, int) and code else 1)


def _exit(code: Any = None) -> NoReturn:
    global _exit_code
    _exit_code = code
    _previous["exit"](code)
    raise SystemExit(code)      # not reached: sys.exit raised


def _threading_excepthook(args) -> None:
    try:
        if args.exc_type is not SystemExit and args.thread is not None:
            report(args.exc_type.__name__, f"{describe(args.exc_value)} (in thread {args.thread.name})",
                   thread=args.thread.ident)
    finally:
        _previous["threading"](args)


def _on_sigterm(signum, frame) -> None:
    global _failed
    _failed = True
    try:
        report("SIGTERM", f"the process received signal {signum} (SIGTERM)")
    finally:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


def _at_exit() -> None:
    if _failed or _exit_code not in (None, 0):
        report("exit", "the process exited with the collective open (no close())")
        if _abort_code:
            _abort(_abort_code)
        if _no_abort:
            _leave(_abort_code or _exit_code)
        return
    _close_at_exit()
    report("exit", "the process exited with the collective open (no close())")   # what close could not


def _close_at_exit() -> None:
    """A normal exit closes the PartialAllreduces still open, together and cooperatively,
    as close_all() would: the peers' rounds go on with this rank standing in, and their own
    close (or exit) completes the final round. Then the NeighborAllreduces, in the order
    they were made (each close() is collective over its graph, so every rank must close
    them in the same order). One that another thread still waits on cannot be closed: it
    is reported instead. A close that fails reports itself."""
    from ._partial import PartialAllreduce, close_all
    from .neighbor import NeighborAllreduce
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None or mpi.Is_finalized():      # the application finalized MPI itself
        return
    open_now = [c for c in list(_open) if not getattr(c, "_closed", True) and not getattr(c, "_waiting", None)]
    colls = [c for c in open_now if isinstance(c, PartialAllreduce)]
    # close_all begins closing every one before waiting for any: their order may differ by rank
    try:
        close_all(colls)
    except Exception as exc:    # noqa: BLE001 - reported by close_all; the exit goes on
        print(f"partialcoll: closing the collectives at exit failed: {type(exc).__name__}: {exc}", file=sys.stderr)
    for coll in sorted((c for c in open_now if isinstance(c, NeighborAllreduce)), key=lambda c: _made.get(c, 0)):
        try:
            coll.close()
        except Exception as exc:    # noqa: BLE001 - close() reported it (or a peer's report came); go on
            print(f"partialcoll: closing a NeighborAllreduce at exit failed: {type(exc).__name__}: {exc}",
                  file=sys.stderr)


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
    _previous["exit"] = sys.exit
    sys.exit = _exit            # what the exit code was, for atexit (a normal exit closes)
    atexit.register(_at_exit)   # after the engine's finalize: runs before it
