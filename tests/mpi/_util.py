"""Shared by the modules under tests/mpi (each runs on every rank under mpiexec)."""
from __future__ import annotations

import contextlib
import sys
import time
import traceback

from mpi4py import MPI

from _launch import checks_args, is_check_module

# the check module's arguments (MODE, ROUNDS...): pytest's --check-args (conftest.py), or
# the command line of ``python X_checks.py ARGS``
ARGS: list = sys.argv[1:] if is_check_module(sys.argv[0]) else []


@contextlib.contextmanager
def progress(mode: str, here: bool = True):
    """On this rank where `here`: restart the engine with rc.progress = mode for the block,
    then restart it as it was (the engine's mode is per process; open nothing across)."""
    import partialcoll as pc
    old = pc.rc.progress
    if here:
        pc.finalize()
        pc.rc.progress = mode
    try:
        yield
    finally:
        if here:
            pc.finalize()
            pc.rc.progress = old


def nap_until_told(side, ranks, limit):
    """Sleep in Python (never calling partialcoll) until each of ranks has sent a message on
    side (a communicator of MPI's own), polling every 10 ms, for at most limit seconds;
    returns the ranks heard from."""
    heard, deadline = set(), time.monotonic() + limit
    while len(heard) < len(ranks) and time.monotonic() < deadline:
        time.sleep(0.01)
        status = MPI.Status()
        while side.iprobe(source=MPI.ANY_SOURCE, status=status):
            heard.add(side.recv(source=status.Get_source()))
    return heard


def quiet_barrier(comm):
    """A barrier that sleeps while it waits (MPICH's blocking calls spin, and the ranks
    share few cores)."""
    req = comm.Ibarrier()
    while not req.Test():
        time.sleep(0.002)


def communicators(world, sizes):
    """world; with sizes (--sizes=P,Q,...): for each P a communicator of world's first P ranks,
    in turn (the others wait), so that one launch checks several P."""
    if not sizes:
        yield world
        return
    for p in sizes:
        sub = world.Split(0 if world.rank < p else MPI.UNDEFINED, world.rank)
        if sub != MPI.COMM_NULL:
            yield sub
            sub.Free()
        quiet_barrier(world)


def run_module(path: str) -> None:
    """``python X_checks.py ARGS`` (under mpiexec) runs the module as ``python -m pytest --with-mpi`` would."""
    import pytest
    sys.exit(pytest.main(checks_args(path, sys.argv[1:])))


def expect_raises(exc_type, fn, *args, match: str = "", **kwargs):
    """fn(*args) must raise exc_type whose message contains match."""
    try:
        fn(*args, **kwargs)
    except exc_type as exc:
        assert match.lower() in str(exc).lower(), f"message {str(exc)!r} lacks {match!r}"
        return exc
    raise AssertionError(f"{getattr(fn, '__name__', fn)} did not raise {exc_type.__name__}")


def main(body) -> None:
    """A plain script (not a check module): run body(comm); print PASSED <rank>, or the
    traceback and abort every rank."""
    comm = MPI.COMM_WORLD
    try:
        body(comm)
    except BaseException:  # noqa: BLE001 - any failure is reported, then the job is aborted
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        comm.Abort(1)
    import partialcoll
    partialcoll.finalize()
    print(f"PASSED {comm.rank}", flush=True)
