"""Exceptions (a small hierarchy whose base is never raised itself). No import of the
native binding: partialcoll._status turns engine return codes into these."""
from __future__ import annotations

from typing import Optional, Tuple


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
    """MPI reported an error inside the engine; ``ranks``: the failed peers where the MPI
    names them (MPIX_Comm_get_failed), else the peer of the send or receive that failed."""

    def __init__(self, message: str = "", ranks: Tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.ranks = tuple(ranks)


class Timeout(PartialcollError, TimeoutError):
    """wait(timeout=...) or close(timeout=...) expired; ``ranks``: those not heard from in the round."""

    def __init__(self, message: str = "", ranks: Tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.ranks = tuple(ranks)


class PeerError(PartialcollError, RuntimeError):
    """A peer failed while this collective was open: ``rank`` names it, ``exc_type`` and
    ``message`` say what it raised (or the signal it received); ``ranks`` is ``(rank,)``."""

    def __init__(self, text: str = "", rank: int = -1, exc_type: str = "", message: str = "") -> None:
        super().__init__(text)
        self.rank, self.exc_type, self.message = rank, exc_type, message
        self.ranks = (rank,) if rank >= 0 else ()


class EngineError(PartialcollError, RuntimeError):
    """The engine cannot run (for example MPI lacks MPI_THREAD_MULTIPLE)."""


class OutOfMemory(PartialcollError, MemoryError):
    """The engine could not allocate memory (buffers of a collective, a schedule's tables)."""


def as_timeout(timeout, what: str = "timeout") -> Optional[float]:
    """timeout as seconds (float, negative: 0) or None: anything else is an ArgumentError."""
    import numbers
    if timeout is None:
        return None
    if isinstance(timeout, numbers.Real) and not isinstance(timeout, bool) and timeout == timeout:
        return max(float(timeout), 0.0)
    raise ArgumentError(f"{what} must be a number of seconds or None, not {timeout!r}")
