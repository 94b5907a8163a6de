"""Shared by the scripts under tests/mpi (each runs on every rank under mpiexec)."""
from __future__ import annotations

import sys
import traceback

from mpi4py import MPI


def expect_raises(exc_type, fn, *args, match: str = "", **kwargs):
    """fn(*args) must raise exc_type whose message contains match."""
    try:
        fn(*args, **kwargs)
    except exc_type as exc:
        assert match.lower() in str(exc).lower(), f"message {str(exc)!r} lacks {match!r}"
        return exc
    raise AssertionError(f"{getattr(fn, '__name__', fn)} did not raise {exc_type.__name__}")


def main(body) -> None:
    """Run body(comm); print PASSED <rank>, or the traceback and abort every rank."""
    comm = MPI.COMM_WORLD
    try:
        body(comm)
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        comm.Abort(1)
    import partialcoll
    partialcoll.finalize()
    print(f"PASSED {comm.rank}", flush=True)
