"""One collective, two threads (PartialAllreduce's ownership rule): python thread_owner_checks.py

A framework posts on one thread and waits on another (the torch integration's
completion thread). close() must never free what such a wait reads: it raises StateError
while another thread waits, and a wait that starts once close() has begun raises
StateError; the collective stays usable after a refused close()."""
from __future__ import annotations

import threading
import time

import numpy as np
from mpi4py import MPI

import partialcoll as pc
from _util import expect_raises, run_module

N = 1 << 18                       # 1 MiB of float32


def test_close_refused_while_another_thread_waits(comm):
    """Rank 0 posts and a second thread waits (the round cannot complete: the others post
    later); close() on rank 0's main thread raises StateError, the wait then completes with
    the right sum, and close() works."""
    coll = pc.PartialAllreduce(N, np.float32, MPI.SUM, comm, mode="full")
    x = np.full(N, comm.rank + 1, np.float32)
    want = sum(range(1, comm.size + 1))
    got, thread = {}, None
    if comm.rank == 0:
        req = coll.post(x, out=x)
        thread = threading.Thread(target=lambda: got.setdefault("res", req.wait(timeout=60)))
        thread.start()
        if comm.size > 1:                            # (alone, the round completes in the post)
            deadline = time.monotonic() + 10
            while not coll._waiting and time.monotonic() < deadline:  # the thread is inside wait()
                time.sleep(0.001)
            expect_raises(pc.StateError, coll.close, match="another thread waits")
    comm.Barrier()
    if comm.rank != 0:
        coll.post(x, out=x).wait(timeout=60)
    if thread is not None:
        thread.join()
        assert np.all(got["res"].data == want)
    else:
        assert np.all(x == want)
    again = np.full(N, 1.0, np.float32)               # still usable after the refused close
    assert np.all(coll.post(again, out=again).wait(timeout=60).data == comm.size)
    coll.close()


def test_wait_after_close_began(comm):
    """On rank 0 a wait that another thread starts while close() runs raises StateError (it
    would read the collective close() frees); close() returns every post (fold)."""
    coll = pc.PartialAllreduce(N, np.float32, MPI.SUM, comm, mode="solo", late="fold")
    x = np.ones(N, np.float32)
    req = coll.post(x)
    errors = []

    def late_wait():
        time.sleep(0.2)                              # close() has begun on the main thread
        try:
            req.wait(timeout=30)
        except pc.StateError as exc:
            errors.append(exc)

    thread = threading.Thread(target=late_wait) if comm.rank == 0 else None
    if thread is not None:
        thread.start()
    else:
        time.sleep(0.6)                              # keep rank 0's close() open meanwhile
    final = coll.close()
    if thread is not None:
        thread.join()
        assert len(errors) == 1 and "closed" in str(errors[0]), errors
    assert np.all(final.data == comm.size), "close() lost a post"


if __name__ == "__main__":
    run_module(__file__)
