"""Two application threads on two collectives: python threads_checks.py

Thread A of rank 0 waits on a full-mode collective X that rank 1 joins only once it has
heard (a plain MPI message) that thread B of rank 0 posted 4 MiB to another collective Y
four times. So B's posts must complete while A waits: if a waiter held an engine-wide
lock through its wait (as the spin policy's polling did), B's posts queue behind A, rank
1 never hears, and the check fails after 10 s instead of hanging (rank 1 then posts X
anyway). Run with PARTIALCOLL_IDLE=spin and the default.

Waits for MPI's own requests (the torch process group's, the averager's, sync_parameters'),
which wait_request tests in C under the idle policy, from one thread and from two.
"""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from mpi4py import MPI

import partialcoll as pc
from partialcoll._engine import ffi, lib
from partialcoll._status import wait_request
from _util import expect_raises, run_module

GO_TAG = 77


@pytest.mark.mpi(min_size=2)
def test_post_while_another_thread_waits(comm):
    x8 = np.ones(2, np.float32)
    big = np.ones((4 << 20) // 4, np.float32)
    X = pc.allreduce_init(2, np.float32, comm=comm)
    Y = pc.PartialAllreduce(big.size, np.float32, comm=comm, mode="solo", late="fold")
    heard = True
    if comm.rank == 0:
        got = {}
        waiting = threading.Event()

        def a():
            # the engine's wait in one call (Python's wait returns to the interpreter every
            # 0.25 s, which would hide a lock held through it)
            req = X.post(x8)
            res = ffi.new(X._res_type)
            out = np.empty(2, np.float32)
            waiting.set()
            got["rc"] = lib.pc_coll_wait1(X._coll, req.index, 30.0, ffi.from_buffer(out), res)
            got["x"] = out

        ta = threading.Thread(target=a)
        ta.start()
        waiting.wait()
        time.sleep(0.05)                  # A is inside wait() now
        for _ in range(4):
            Y.post(big)
        comm.send("posted", dest=1, tag=GO_TAG)
        ta.join()
        assert got["rc"] == 0 and np.array_equal(got["x"], np.full(2, comm.size, np.float32)), got
    else:
        if comm.rank == 1:
            req = comm.irecv(source=0, tag=GO_TAG)
            deadline = time.monotonic() + 10.0
            ok, _ = req.test()
            while not ok and time.monotonic() < deadline:
                time.sleep(0.01)
                ok, _ = req.test()
            heard = ok
        res = X.post(x8).wait(timeout=60)
        if comm.rank == 1 and not heard:
            req.wait()
        assert np.array_equal(res.data, np.full(2, comm.size, np.float32)), res
    heard = comm.allreduce(heard, op=MPI.LAND)
    Y.close(timeout=60)
    X.close(timeout=60)
    assert heard, "thread B's posts to Y waited for thread A's wait on X"


def test_threads_wait_on_their_own_collectives(comm):
    """Four threads per rank, each posting and waiting on its own collective (1 MiB,
    full mode) 30 times: every result equals MPI_Allreduce's."""
    n = 1 << 18
    colls = [pc.allreduce_init(n, np.float32, comm=comm) for _ in range(4)]
    errors = []

    def run(k):
        try:
            for i in range(30):
                x = np.full(n, float(comm.rank + k + i), np.float32)
                res = colls[k].post(x).wait(timeout=60)
                want = sum(r + k + i for r in range(comm.size))
                assert np.all(res.data == want), (k, i, res.data[:3], want)
        except BaseException as exc:     # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for c in colls:
        c.close(timeout=60)
    assert not errors, errors



def test_waits_for_mpi_requests(comm):
    """wait_request: a receive whose message comes 30 ms late completes with its data and
    status, and mpi4py sees the request done; a nonblocking allreduce that one rank joins
    late completes with MPI's result; two threads wait for their own receives at once; a
    receive nobody matches returns False after its timeout (not before; timeout 0 tests
    it once, so a request already complete returns True), and check() ends
    a wait by raising; the request is then kept and completes later."""
    r, p = comm.rank, comm.size
    src, dst = (r - 1) % p, (r + 1) % p
    buf, st = np.zeros(3, np.int64), MPI.Status()
    req = comm.Irecv(buf, source=src, tag=71)
    time.sleep(0.03)
    send = comm.Isend(np.full(3, r, np.int64), dst, tag=71)
    assert wait_request(req, 10.0, buf, st)
    assert req == MPI.REQUEST_NULL and (st.Get_source(), st.Get_tag()) == (src, 71) and (buf == src).all(), buf
    send.Wait()

    x = np.array([r + 1.0])
    if r == 0:
        time.sleep(0.03)
    assert wait_request(comm.Iallreduce(MPI.IN_PLACE, x), 10.0, x)
    assert x[0] == p * (p + 1) / 2, x

    bufs = [np.zeros(2) for _ in range(2)]
    reqs = [comm.Irecv(bufs[k], source=src, tag=80 + k) for k in range(2)]
    got = [None, None]

    def waiter(k):
        got[k] = wait_request(reqs[k], 10.0, bufs[k])

    threads = [threading.Thread(target=waiter, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    time.sleep(0.02)
    sends = [comm.Isend(np.full(2, 10.0 * r + k), dst, tag=80 + k) for k in (1, 0)]
    for t in threads:
        t.join()
    MPI.Request.Waitall(sends)
    assert got == [True, True] and all((bufs[k] == 10.0 * src + k).all() for k in range(2)), (got, bufs)

    mine = np.zeros(1)
    req = comm.Irecv(mine, source=r, tag=91)
    comm.Send(np.full(1, 5.0), r, tag=91)
    assert wait_request(req, 0.0, mine) and mine[0] == 5.0, mine       # timeout 0 still tests it

    lone = np.zeros(1)
    req = comm.Irecv(lone, source=r, tag=90)
    assert not wait_request(req, 0.0, lone)
    start = time.monotonic()
    assert not wait_request(req, 0.1, lone)
    took = time.monotonic() - start
    assert 0.1 <= took < 5.0, took

    def stop():
        raise RuntimeError("ended by check")

    expect_raises(RuntimeError, wait_request, req, None, lone, check=stop, match="ended by check")
    comm.Send(np.ones(1), r, tag=90)
    req.Wait()
    assert lone[0] == 1.0
    comm.Barrier()


if __name__ == "__main__":
    run_module(__file__)
