"""Exceptions, and the one helper that turns engine return codes into them."""
from __future__ import annotations


class PartialcollError(Exception):
    """Base of every partialcoll error (never raised itself)."""


class ArgumentError(PartialcollError, ValueError):
    """An argument is invalid, or differs between the ranks of a collective call."""


class InvalidBufferError(PartialcollError, TypeError):
    """A buffer has the wrong type, dtype, shape, layout or is read-only."""


class OpError(PartialcollError, TypeError):
    """A reduction op is not defined for the dtype."""


class StateError(PartialcollError, RuntimeError):
    """An object is used in a state that does not allow it (after close, while running...)."""


class MPIError(PartialcollError, RuntimeError):
    """MPI reported an error inside the engine."""


class Timeout(PartialcollError, TimeoutError):
    """wait(timeout=...) expired."""


class EngineError(PartialcollError, RuntimeError):
    """The engine cannot run (for example MPI lacks MPI_THREAD_MULTIPLE)."""


class OutOfMemory(PartialcollError, MemoryError):
    """The engine could not allocate memory (buffers of a collective, a schedule's tables)."""


_BY_CODE = {1: ArgumentError, 2: MPIError, 3: OutOfMemory, 4: StateError, 5: Timeout,
            6: EngineError, 7: OpError, 8: MPIError}


def check(rc: int) -> None:
    """Raise the exception for a non-zero engine return code, with the engine's message."""
    if rc == 0:
        return
    from ._engine import ffi, lib
    msg = ffi.string(lib.pc_last_error()).decode(errors="replace") or \
        ffi.string(lib.pc_strerror(rc)).decode()
    raise _BY_CODE.get(rc, PartialcollError)(msg)


TIMEOUT_CODE = 5
_SLICE = 0.25     # seconds; waits return to Python this often, so Ctrl-C works


def wait_in_slices(call, timeout, *args, shown=None) -> None:
    """Run call(*args, seconds) -> engine code until it stops timing out or `timeout`
    (None: forever) has passed; then raise as check() does (Timeout after the deadline,
    naming `shown` as the timeout when given: the caller waited part of it already)."""
    if timeout is None:                      # the hot path: usually done at the first call
        rc = call(*args, _SLICE)
        while rc == TIMEOUT_CODE:
            rc = call(*args, _SLICE)
        check(rc)
        return
    import time
    shown = timeout if shown is None else shown
    deadline = time.monotonic() + max(float(timeout), 0.0)
    rc = call(*args, min(_SLICE, max(float(timeout), 0.0)))
    while rc == TIMEOUT_CODE:
        left = deadline - time.monotonic()
        if left <= 0:
            try:
                check(rc)
            except Timeout as exc:
                raise Timeout(f"{exc} (timeout={shown} s)") from None
        rc = call(*args, min(_SLICE, left))
    check(rc)
