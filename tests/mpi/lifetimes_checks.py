"""Lifetimes of the native objects besides PartialAllreduce: python lifetimes_checks.py

- NeighborAllreduce dropped (a ``with`` block left by an exception) while another thread
  of the rank waits for one of its requests: the waiter gets StateError (the peers
  PeerError), never a freed object (a crash) or a hang;
- AsyncAverager dropped without close(): its __del__ makes no MPI call (an MPI call from
  the garbage collector, on whatever thread runs it, may deadlock or break MPI's
  thread rules); what it withdraws happens on the engine's next pass;
- HierarchicalAllreduce in a pipelined loop (post k, then wait k - 1) across regrouping
  points: every result arrives, and (late="fold", SUM) holds every post of this rank.
"""
from __future__ import annotations

import gc
import threading
import time

import numpy as np
from mpi4py import MPI

import partialcoll as pc
from partialcoll.speed_groups import split_by_speed
from _util import expect_raises, run_module


class Boom(Exception):
    pass


def test_neighbor_dropped_under_a_waiter(comm):
    if comm.size < 2:
        return
    g = pc.ring_graph(comm)
    hop = pc.NeighborAllreduce(4, np.float64, comm=g)
    got: dict = {}
    if comm.rank == 0:
        from partialcoll._engine import ffi, lib
        req = hop.post(np.ones(4))
        inside = threading.Event()
        upd, info = ffi.new("int64_t[]", 3 * comm.size), ffi.new("int64_t[4]")   # pc_hop_wait: 3 per update, 4 of info
        handle = hop._h

        def waiter():
            # the engine's wait in one call (Python's wait returns every 0.25 s, between
            # engine calls, which would hide a free under the call)
            inside.set()
            t0 = time.monotonic()
            got["rc"] = lib.pc_hop_wait(handle, req.iteration, 20.0, upd, info)
            got["seconds"] = time.monotonic() - t0

        t = threading.Thread(target=waiter)
        t.start()
        inside.wait()
        time.sleep(0.05)                 # the waiter is inside the engine's wait now
        try:
            with hop:
                raise Boom()
        except Boom:
            pass
        t.join(30)
        assert not t.is_alive(), "the waiter hangs after its NeighborAllreduce was dropped"
        # woken at once with the state error, not after its 20 s (nor on freed memory)
        assert got["rc"] == lib.PC_ERR_STATE and got["seconds"] < 10, got
        expect_raises(pc.StateError, req.wait, 1.0)
        comm.send("dropped", dest=1, tag=5)
    else:
        if comm.rank == 1:
            comm.recv(source=0, tag=5)
        try:
            hop.post(np.ones(4)).wait(timeout=20)
            hop.close(timeout=20)
        except pc.PartialcollError as exc:
            got["error"] = exc
        # a neighbour of rank 0 hears of it; the others may complete or hear of it too
        if comm.rank in (1, comm.size - 1):
            assert isinstance(got.get("error"), pc.PeerError), got
        if "error" in got:
            hop._abandon()
    g.Free()
    comm.Barrier()


def test_averager_del_makes_no_mpi_call(comm):
    from partialcoll import _engine
    avg = pc.AsyncAverager(4, np.float64, comm=comm, server=0)
    if comm.rank != 0:
        avg.push(np.full(4, float(comm.rank))).wait(timeout=20)
    comm.Barrier()
    calls = []
    lib = _engine.lib

    # the engine calls that make no MPI call (they only mark: the next pass withdraws)
    no_mpi = {"pc_avg_abandon", "pc_sched_abandon"}

    class Spy:
        """lib, recording every engine call the garbage collection of the averager makes."""

        def __getattr__(self, name):
            fn = getattr(lib, name)
            if name.startswith("pc_"):
                def spy(*args):
                    calls.append(name)
                    return fn(*args)
                return spy
            return fn

    _engine.lib = Spy()
    try:
        del avg                      # dropped without close(): the garbage collector's work
        gc.collect()
    finally:
        _engine.lib = lib
    assert calls and set(calls) <= no_mpi, f"__del__ called {calls}: MPI calls from the garbage collector"
    # the server's clients are withdrawn and freed by the next passes, its peers unaffected
    comm.Barrier()


def test_hierarchical_pipelined_across_regroupings(comm):
    """hierarchical_checks' regrouping (two speed classes that swap: regrouped at post 35,
    rank r posts 64**r) in a pipelined loop: post i, then wait for post i - 1. Every rank's
    results plus close() hold exactly its groups' members' posts of each period."""
    p, r = comm.size, comm.rank
    if p < 2:
        return
    before = [0.01 if q % 2 == 0 else 0.08 for q in range(p)]
    after = [0.08 if q % 2 == 0 else 0.01 for q in range(p)]
    after[0] = 0.01                              # a grouping that differs from before's
    n = 50
    h = pc.HierarchicalAllreduce(2, np.int64, MPI.SUM, comm, mode="solo", late="fold", step_time=before[r],
                                 regroup_every=5, window=1, hysteresis=2, seed=3)
    first = h.groups
    x = np.full(2, 64 ** r, np.int64)
    total = np.zeros(2, np.int64)
    prev = None
    for i in range(n):
        req = h.post(x, step_time=(after if i >= 30 else before)[r])
        if prev is not None:
            total += prev.wait(timeout=30).data
        prev = req
    total += prev.wait(timeout=30).data
    second = h.groups
    total += h.close().data
    assert h.regroupings == 1, h.regroupings
    assert tuple(first) == tuple(split_by_speed(before)) and tuple(second) == tuple(split_by_speed(after))
    want = sum(35 * 64 ** q for q in range(p) if first[q] == first[r]) + \
        sum((n - 35) * 64 ** q for q in range(p) if second[q] == second[r])
    assert np.all(total == want), (total, want, first, second)

if __name__ == "__main__":
    run_module(__file__)
