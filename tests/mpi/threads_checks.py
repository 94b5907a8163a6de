"""Two application threads on two collectives: python threads_checks.py

Thread A of rank 0 waits on a full-mode collective X that rank 1 joins only once it has
heard (a plain MPI message) that thread B of rank 0 posted 4 MiB to another collective Y
four times. So B's posts must complete while A waits: if a waiter held an engine-wide
lock through its wait (as the spin policy's polling did), B's posts queue behind A, rank
1 never hears, and the check fails after 10 s instead of hanging (rank 1 then posts X
anyway). Run with PARTIALCOLL_IDLE=spin and the default.
"""
from __future__ import annotations

import threading
import time

import numpy as np
from mpi4py import MPI

import partialcoll as pc
from partialcoll._engine import ffi, lib
from _util import run_module

GO_TAG = 77


def test_post_while_another_thread_waits(comm):
    if comm.size < 2:
        return
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


if __name__ == "__main__":
    run_module(__file__)
