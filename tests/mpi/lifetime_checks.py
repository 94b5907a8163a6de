"""Lifetime (issue 11, finding 3): python lifetime_checks.py

1. A collective dropped without close() while its round moves 1 MiB: before, its
   NumPy scratch buffers were freed under receives still posted into them (a crash or
   silent corruption); now the engine owns that memory and frees it when the round is over.
   Results of collectives made afterwards equal MPI_Allreduce's.
2. A with-block left by an exception on one rank does not run the collective close()
   there (which waited for ranks that never close): the exception propagates at once.
3. Schedules dropped while running, and a thousand dropped idle ones: nothing leaks
   into later executions, and the duplicated communicators are freed.
4. post() repeats the last host arrays without checking them again: an out= buffer the
   caller dropped while its round was in flight stays alive when the next post switches
   to another one, and the same arrays posted after close() or after an abandoning
   exception raise StateError.
5. Collectives and schedules closed, freed or dropped while the progress thread passes
   (another collective keeps a round armed): a pass that ends while the freeing thread
   still holds the freed object's lock must not free it under that thread (it wrote
   the freed memory when it let go: glibc's heap broke at a later free, once in a few
   thousand closes). tests/test_engine.py runs this module with PARTIALCOLL_DOOM_PAUSE_US,
   which holds the lock that much longer: every free meets a pass then.
"""
from __future__ import annotations

import gc
import time

import numpy as np
from mpi4py import MPI

import partialcoll as pc
from partialcoll import _engine
from _util import expect_raises, run_module

COUNT = 1 << 18                     # 1 MiB of float32


def check_fresh(comm, mode):
    x = np.arange(COUNT, dtype=np.float32) % 97 + comm.rank
    expect = np.empty_like(x)
    comm.Allreduce(x, expect, op=MPI.SUM)
    coll = pc.PartialAllreduce(COUNT, np.float32, MPI.SUM, comm, mode="full")
    for _ in range(2):
        assert np.array_equal(coll.post(x).wait(timeout=60).data, expect)
    coll.close(timeout=60)


def test_dropped_mid_round(comm):
    for mode in ("solo", "full"):
        coll = pc.PartialAllreduce(COUNT, np.float32, MPI.SUM, comm, mode=mode)
        x = np.ones(COUNT, np.float32)
        for _ in range(3):
            coll.post(x).wait(timeout=60)
        coll.post(x)                       # round 3 starts here (solo) or when all post (full)
        # every rank has posted round 3 before rank 0 drops the collective: its report
        # ("dropped") would make a later post raise PeerError, which is not this check's point
        comm.Barrier()
        if comm.rank == 0:
            del coll                       # ... and rank 0 drops it at once, round in flight
            gc.collect()
            junk = [np.full(COUNT, 7, np.float32) for _ in range(8)]   # reuse freed memory
            del junk
        else:
            time.sleep(0.2)
            del coll
            gc.collect()
        comm.Barrier()
        check_fresh(comm, mode)


def test_with_block_exception(comm):
    coll = pc.PartialAllreduce(4, np.int64, MPI.SUM, comm, mode="solo")
    t0 = time.perf_counter()
    if comm.rank == 0:
        try:
            with coll:
                raise ValueError("boom")
        except ValueError:
            pass
        assert time.perf_counter() - t0 < 2.0, "the exception waited for a collective close()"
        # abandoned on this rank only: unusable, and its communicator is freed later by an
        # application call, not here (nor from a garbage collector's __del__)
        expect_raises(pc.StateError, coll.post, np.zeros(4, np.int64), match="closed")
        assert coll._comm is None
        pending = list(_engine._free_later) + list(_engine._kept)
        assert any(c is not None and isinstance(c, MPI.Comm) and c != MPI.COMM_NULL for c in pending), pending
    else:
        time.sleep(0.5)
        del coll                           # the others drop it too (no collective close)
    gc.collect()
    comm.Barrier()


def test_dropped_schedules(comm):
    r, p = comm.rank, comm.size
    for _ in range(1000):                  # idle: freed at once, communicators too
        s = pc.Schedule(comm)
        s.send(np.zeros(1), (r + 1) % p)
        s.recv(np.zeros(1), (r - 1) % p)
        s.commit()
        del s
    s = pc.Schedule(comm)                  # running, never matched: withdrawn, then freed
    s.recv(np.zeros(1 << 18), (r - 1) % p)
    s.commit()
    s.start()
    del s
    gc.collect()
    comm.Barrier()
    buf = np.full(5, float(r))
    got = np.zeros(5)
    s = pc.Schedule(comm)
    s.send(buf, (r + 1) % p)            # never rely on eager sends: both posted at once
    s.recv(got, (r - 1) % p)
    with s.commit():
        for _ in range(3):
            s.start().wait(timeout=30)
            assert np.array_equal(got, np.full(5, float((r - 1) % p))), got


def test_freed_while_passes_run(comm):
    r, p = comm.rank, comm.size
    keep = pc.PartialAllreduce(4, np.int64, MPI.SUM, comm, mode="solo", late="fold")   # its armed round: passes run
    kept = keep.post(np.ones(4, np.int64)).wait(timeout=30).data.copy()
    ring = pc.ring_graph(comm)
    for i in range(12):
        n = 64 + i % 5
        coll = pc.PartialAllreduce(n, np.int64, MPI.SUM, comm, mode="full")
        got = coll.post(np.full(n, i + r, np.int64)).wait(timeout=30).data
        assert np.array_equal(got, np.full(n, p * i + p * (p - 1) // 2)), (i, got)
        coll.close(timeout=30)
        dropped = pc.PartialAllreduce(n, np.int64, MPI.SUM, comm, mode="solo")
        del dropped                        # abandoned: freed by the engine
        with pc.NeighborAllreduce(n, np.float64, comm=ring) as hop:
            hop.post(np.full(n, 1.0)).wait(timeout=30)
        s = pc.Schedule(comm)
        s.send(np.zeros(1), (r + 1) % p)
        s.recv(np.zeros(1), (r - 1) % p)
        s.commit()
        del s
        gc.collect()
    kept += keep.close(timeout=30).data          # nothing posted to it is lost meanwhile
    assert np.array_equal(kept, np.full(4, p)), kept
    ring.Free()


def test_repeated_arrays(comm):
    n = 512                               # 2 KiB: freed memory is reused by the next arrays
    x = np.arange(n, dtype=np.float32) + comm.rank
    expect = np.empty_like(x)
    comm.Allreduce(x, expect, op=MPI.SUM)
    coll = pc.PartialAllreduce(n, np.float32, MPI.SUM, comm, mode="full")
    y = np.empty_like(x)
    for _ in range(3):
        assert np.array_equal(coll.post(x, out=y).wait(timeout=60).data, expect)
    if comm.rank == 0:
        time.sleep(0.3)                   # the other ranks' round runs while they go on
    coll.post(x, out=y)                   # request and y dropped while the round runs in y
    del y
    gc.collect()
    y2 = np.empty_like(x)
    req = coll.post(x, out=y2)            # switches out: the engine may still write the old y
    junk = [np.full(n, 7, np.float32) for _ in range(64)]
    assert np.array_equal(req.wait(timeout=60).data, expect)
    assert all((j == 7).all() for j in junk), "a round wrote into memory the caller had freed"
    assert np.array_equal(coll.post(x, out=y2).wait(timeout=60).data, expect)
    coll.close(timeout=60)
    expect_raises(pc.StateError, coll.post, x, y2, match="closed")
    coll = pc.PartialAllreduce(n, np.float32, MPI.SUM, comm, mode="solo")
    try:
        with coll:
            coll.post(x, out=y2).wait(timeout=60)
            comm.Barrier()                # every rank's round is over before any abandons
            raise ValueError("boom")
    except ValueError:
        pass
    expect_raises(pc.StateError, coll.post, x, y2, match="closed")
    comm.Barrier()


if __name__ == "__main__":
    run_module(__file__)
