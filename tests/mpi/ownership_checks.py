"""Who owns a collective, a request's result and an out= buffer: python ownership_checks.py

Run at P = 2 and 3 with PARTIALCOLL_IDLE=spin and the default (tests/test_ownership.py).
Every result is checked against the sum of what the ranks posted (a reference computed
here, never the library's own output), and a failure is a clear PartialcollError, never
zeros, another round's data, a hang or a false Timeout:

- a collective dropped (a ``with`` block left by an exception) while another thread of
  the rank is inside ``wait()`` or ``test()`` of one of its requests: the engine must not
  free it under that thread (it did: the waiter read freed memory, hung on its mutex or
  raised a false Timeout);
- two threads waiting on one request: both get the round's data and the same Result (the
  second got the identity, with late="latest" and "fold");
- one out= buffer named by two outstanding posts (full mode): the first wait gets its
  own round's data (it got the second post's raw input), and nothing writes the buffer
  once the last request naming it was waited for;
- inline progress: ``wait(timeout=0)`` progresses, so a polling loop completes rounds;
- a thread that prunes ``out=`` buffers while another thread's wait drops its own;
- post+wait in one engine call (the same x and out as the last post: the post takes the
  result where its round completed within it): the right data under the right round,
  also when a later post names the same out before the first request's wait, and when
  two threads wait on a request whose post took the result;
- post() recycles the last request and its Result only where nobody else holds them: a
  kept request or Result never changes.
"""
from __future__ import annotations

import sys
import threading
import time

import numpy as np
import pytest

import partialcoll as pc
from _util import run_module

N = 3                                     # elements: small (the direct full-mode path)
RUNS = 6


class Boom(Exception):
    """What the owner thread raises inside ``with coll:``."""


def value(rank, k):
    """What rank posts in its k-th post: distinct per rank, per post and per element."""
    return (np.arange(N) + 1.0) * (rank + 1) + 100.0 * k


def total(size, k):
    return sum(value(r, k) for r in range(size))


def _in_thread(fn):
    box = {}

    def run():
        try:
            box["result"] = fn()
        except BaseException as exc:        # noqa: BLE001 - checked by the caller
            box["error"] = exc
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, box


def _judge(box, size, k, what):
    """A waiter's outcome: the round's data, or a clear error that is not a Timeout."""
    if "error" in box:
        exc = box["error"]
        assert isinstance(exc, pc.PartialcollError) and not isinstance(exc, pc.Timeout), \
            f"{what}: {type(exc).__name__}: {exc}"
        return
    res = box["result"]
    if isinstance(res, bool):
        return
    assert np.array_equal(res.data, total(size, res.round)), (what, res)


@pytest.mark.parametrize("how", ["wait", "test", "drop"])
def test_dropped_under_a_waiting_thread(comm, how):
    """Rank 0's owner thread leaves ``with coll:`` by an exception while its other thread
    waits (or polls test()) on round 0; the peers post 50 ms later. "drop": the owner
    drops it without a report (what the with block, close_all and the torch hooks do
    after theirs: _abandon), so nothing but the drop itself can end the wait."""
    for run in range(RUNS):
        coll = pc.allreduce_init(N, np.float64, comm=comm)
        x = value(comm.rank, 0)
        if comm.rank == 0:
            req = coll.post(x)

            def waiter():
                if how == "wait":
                    return req.wait(timeout=4.0)
                deadline = time.monotonic() + 4.0
                while not req.test():
                    if time.monotonic() > deadline:
                        raise pc.Timeout("test() never completed")
                return req.wait(timeout=1.0)
            if how == "drop":
                def waiter():
                    return req.wait(timeout=4.0)
            t, box = _in_thread(waiter)
            time.sleep(0.01 + 0.004 * run)
            if how == "drop":
                coll._abandon()
            else:
                try:
                    with coll:
                        raise Boom("dropped")
                except Boom:
                    pass
            t.join(20.0)
            assert not t.is_alive(), f"run {run}: the waiting thread hangs after the collective was dropped"
            _judge(box, comm.size, 0, f"run {run}, rank 0's waiter")
        else:
            time.sleep(0.05)
            try:
                res = coll.post(x).wait(timeout=10.0)
                assert np.array_equal(res.data, total(comm.size, 0)), res
            except pc.PeerError:
                pass                         # rank 0's report: the expected outcome
            coll._abandon()
        comm.Barrier()


def _two_waits(req):
    """Two threads wait on req at once; their Results (each thread ended without an error)."""
    start = threading.Barrier(2)

    def one():
        start.wait()
        return req.wait(timeout=30.0)
    ts = [_in_thread(one) for _ in range(2)]
    for t, box in ts:
        t.join(60.0)
        assert not t.is_alive() and "error" not in box, box
    return [box["result"] for _, box in ts]


@pytest.mark.parametrize("late", ["latest", "fold"])
@pytest.mark.parametrize("with_out", [True, False])
def test_two_threads_wait_on_one_request(comm, late, with_out):
    """Full mode: two threads wait on the same request; both get the round's data, the
    same round and counts, and out holds the data after both returned."""
    coll = pc.allreduce_init(N, np.float64, comm=comm, late=late)
    y = np.empty(N)
    for k in range(12):
        req = coll.post(value(comm.rank, k), out=y if with_out else None)
        results = _two_waits(req)
        want = total(comm.size, k)
        for res in results:
            assert res.round == k and res.rounds == 1 and res.posts == comm.size, (k, res)
            assert np.array_equal(res.data, want), (k, late, res)
        assert results[0].data is results[1].data or np.array_equal(results[0].data, results[1].data)
        if with_out:
            assert np.array_equal(y, want), (k, y, want)
    coll.close(timeout=30)


def test_one_out_for_two_posts(comm):
    """Full mode, post(x0, out=y) then post(x1, out=y) before any wait: both are served.
    The first wait gives a completed round's data under its round number (its own round,
    or with late="latest" a later one that completed before it: never the second post's
    input), the second its round's, and y does not change once the last request naming it
    was waited for."""
    coll = pc.allreduce_init(N, np.float64, comm=comm)
    y = np.empty(N)
    k = 0
    for _ in range(6):
        r0 = coll.post(value(comm.rank, k), out=y)
        comm.Barrier()                    # round k completes here before the second post
        time.sleep(0.002)
        r1 = coll.post(value(comm.rank, k + 1), out=y)
        a = r0.wait(timeout=30.0)
        assert a.round in (k, k + 1) and np.array_equal(a.data, total(comm.size, a.round)), (k, a.round, a.data)
        b = r1.wait(timeout=30.0)
        assert b.round == k + 1 and np.array_equal(b.data, total(comm.size, k + 1)), (k, b.round, b.data)
        snap = y.copy()
        comm.Barrier()
        time.sleep(0.01)
        assert np.array_equal(y, snap), "y written after every request naming it was waited for"
        k += 2
    coll.close(timeout=30)


def test_keep_out_while_a_thread_waits(comm):
    """post() prunes the out= buffers of requests the engine no longer holds while another
    thread's wait drops its own entry: never "dictionary changed size during iteration"."""
    coll = pc.PartialAllreduce(N, np.float64, comm=comm, mode="solo")
    ys = [np.empty(N) for _ in range(8)]
    errors = []
    stop = threading.Event()
    reqs: list = []

    def drain():
        while not stop.is_set() or reqs:
            try:
                req = reqs.pop(0)
            except IndexError:
                time.sleep(0)
                continue
            try:
                req.wait(timeout=30.0)
            except Exception as exc:       # noqa: BLE001 - reported below
                errors.append(exc)
    t = threading.Thread(target=drain, daemon=True)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)           # threads switch inside post()'s bookkeeping
    t.start()
    try:
        for k in range(400):
            reqs.append(coll.post(value(comm.rank, k), out=ys[k % 8]))
    except Exception as exc:               # noqa: BLE001 - reported below
        errors.append(exc)
    finally:
        sys.setswitchinterval(interval)
    stop.set()
    t.join(60.0)
    coll.close(timeout=30)
    assert not errors, errors[:3]


def test_inline_poll_with_zero_timeout(comm):
    """wait(timeout=0) makes a progress pass: polling with it completes a round (inline
    progress has no other thread to do it)."""
    coll = pc.allreduce_init(N, np.float64, comm=comm)
    for k in range(5):
        req = coll.post(value(comm.rank, k))
        deadline = time.monotonic() + 20.0
        while True:
            try:
                res = req.wait(timeout=0)
                break
            except pc.Timeout:
                assert time.monotonic() < deadline, f"round {k}: wait(timeout=0) never completed it"
        assert np.array_equal(res.data, total(comm.size, k)), (k, res)
    coll.close(timeout=30)


def _post_last(comm, coll, x, y, k):
    """Every rank posts x = value(rank, k) (x filled anew: the same array as the last
    post) with out=y; rank 0 last, once the peers' messages can be in: its post completes
    the round (full mode, P = 2: one exchange) and takes the result itself."""
    x[:] = value(comm.rank, k)
    if comm.rank != 0:
        req = coll.post(x, out=y)
    comm.Barrier()
    if comm.rank == 0:
        time.sleep(0.002)
        req = coll.post(x, out=y)
    return req


@pytest.mark.parametrize("late", ["latest", "fold"])
def test_post_wait_in_one_engine_call(comm, late):
    """The post+wait loop (bench/small.py's): every result is its round's sum, in y. At
    P = 2 rank 0, posting last, takes results in its posts (the path is taken). A later
    post naming y before the earlier request's wait: each wait leaves its own round's data
    in y, in either order. Two threads waiting on a request whose post took the result:
    the same Result, its data in y."""
    coll = pc.allreduce_init(N, np.float64, comm=comm, late=late)
    x, y = np.empty(N), np.empty(N)
    early = 0
    k = 0
    for _ in range(20):                   # the loop
        req = _post_last(comm, coll, x, y, k)
        early += req._result is not None
        res = req.wait(timeout=30.0)
        assert res.data is y and res.round == k and res.rounds == 1, (k, res)
        assert np.array_equal(y, total(comm.size, k)), (k, y)
        k += 1
    if comm.size == 2 and comm.rank == 0:
        assert early >= 10, f"rank 0 posted last in 20 rounds; its post took the result in {early}"
    for order in ("first", "second"):     # a later post names y before the first request's wait
        r0 = _post_last(comm, coll, x, y, k)
        x[:] = value(comm.rank, k + 1)
        r1 = coll.post(x, out=y)
        waits = [r0, r1] if order == "first" else [r1, r0]
        for req in waits:
            res = req.wait(timeout=30.0)
            # latest: a completed round's data (its own or a later one's); fold: the rounds
            # completed since the last result, summed (none: the identity)
            want = sum((total(comm.size, j) for j in range(res.round - res.rounds + 1, res.round + 1)), np.zeros(N))
            assert res.data is y and np.array_equal(y, want), (order, k, res, y)
            assert res.round >= req.index or res.rounds == 0, (order, req.index, res)
        k += 2
    for _ in range(4):                    # two threads on a request whose post took the result
        a, b = _two_waits(_post_last(comm, coll, x, y, k))
        assert a is b and a.round == k and np.array_equal(y, total(comm.size, k)), (k, a, y)
        k += 1
    # requests never waited for, one whose post took the result: close() folds their rounds
    # in (late="fold": nothing posted is dropped), and their waits raise StateError
    ra = _post_last(comm, coll, x, y, k)
    x[:] = value(comm.rank, k + 1)
    rb = coll.post(x, out=y)
    final = coll.close(timeout=30)
    if late == "fold":
        assert np.array_equal(final.data, total(comm.size, k) + total(comm.size, k + 1)), (k, final)
    for req in (ra, rb):
        with pytest.raises(pc.StateError):
            req.wait(timeout=5.0)


@pytest.mark.parametrize("mode", ["full", "solo"])
def test_kept_requests_and_results_stay_theirs(comm, mode):
    """post() recycles the last request and its Result where nobody else holds them (a
    post+wait loop that keeps neither): a loop that keeps every third Result and every
    third request (the rest dropped) finds each kept one unchanged by later posts, each
    kept request's wait returning its own Result; the dropped ones were recycled (the
    next post's request has their token list, held here: no new request could have it).
    Full mode: every result is its round's sum, in y."""
    coll = pc.PartialAllreduce(N, np.float64, comm=comm, mode=mode)
    x, y = np.empty(N), np.empty(N)
    kept_res, kept_req = [], []
    tok, recycled, want = None, [], []
    for k in range(30):
        x[:] = value(comm.rank, k)
        req = coll.post(x, out=y)
        recycled.append(req._token is tok)
        want.append(k >= 2 and (k - 1) % 3 != 1)    # the first post makes its request (new x, y)
        res = req.wait(timeout=30.0)
        if mode == "full":
            assert res.round == k and np.array_equal(y, total(comm.size, k)), (k, res, y)
        fields = (res.round, res.rounds, res.nap, res.posts, res.active, res.closing, res.contributed)
        tok = None
        if k % 3 == 0:
            kept_res.append((res, fields))
            tok = req._token                 # the request is dropped: recycled, not the Result
        elif k % 3 == 1:
            kept_req.append((req, req.index, res))
        else:
            tok = req._token
        del req, res
    for res, fields in kept_res:
        assert res.data is y and (res.round, res.rounds, res.nap, res.posts, res.active, res.closing,
                                  res.contributed) == fields, (fields, res)
    for req, index, res in kept_req:
        assert req.index == index and req.wait(timeout=5.0) is res, (index, req.index, res)
    assert recycled == want, (recycled, want)
    coll.close(timeout=30)


def test_engine_takes_each_request_once(comm):
    """The engine's own claim (a C caller, not Python's wait): a second take of a request
    is refused with StateError, and does not count as a take (the next request's post
    still runs in place: the round's data comes back in y)."""
    from partialcoll import _engine
    ffi, lib = _engine.ffi, _engine.lib
    coll = pc.allreduce_init(N, np.float64, comm=comm)
    y = np.empty(N)
    res = ffi.new(coll._res_type)
    req = coll.post(value(comm.rank, 0), out=y)
    assert req.wait(timeout=30.0).round == 0
    code = lib.pc_coll_wait1(coll._coll, req.index, 30.0, ffi.from_buffer(y), res)
    assert code == lib.PC_ERR_STATE, f"a second take of request {req.index} returned {code}"
    assert "taken already" in ffi.string(lib.pc_last_error()).decode()
    res1 = coll.post(value(comm.rank, 1), out=y).wait(timeout=30.0)
    assert res1.round == 1 and np.array_equal(y, total(comm.size, 1)), (res1, y)
    coll.close(timeout=30)


def test_round_completed_before_a_report_keeps_its_result(comm):
    """docs/faults.md: after a peer's report, a wait for a round that had completed here
    returns that round's data; a later post raises PeerError naming the reporter."""
    coll = pc.allreduce_init(N, np.float64, comm=comm)
    req = coll.post(value(comm.rank, 0))
    deadline = time.monotonic() + 20.0
    while not req.test():                 # completed here, not taken
        assert time.monotonic() < deadline
    comm.Barrier()
    if comm.rank == 0:
        try:
            with coll:
                raise Boom("after round 0")
        except Boom:
            pass
        comm.Barrier()
        return
    comm.Barrier()                        # rank 0 has reported
    deadline = time.monotonic() + 20.0
    while True:                           # the report arrives (test(): a pass, inline too)
        try:
            coll.post(value(comm.rank, 1)).test()
        except pc.PeerError as exc:
            assert exc.rank == 0, exc
            break
        assert time.monotonic() < deadline, "no PeerError after rank 0's report"
        time.sleep(0.01)
    res = req.wait(timeout=10.0)
    assert res.round == 0 and np.array_equal(res.data, total(comm.size, 0)), res
    coll._abandon()


def test_dropped_while_idle_tells_the_peers(comm):
    """Issue 54, item 6: a collective the garbage collector drops on rank 0 while no round
    of it runs there (every post waited for): its "dropped" report, deferred (no MPI
    call from __del__), still reaches the peers, whose next round raises PeerError
    naming rank 0, not a Timeout."""
    coll = pc.allreduce_init(N, np.float64, comm=comm)
    res = coll.post(value(comm.rank, 0)).wait(timeout=20.0)
    assert np.array_equal(res.data, total(comm.size, 0)), res
    comm.Barrier()
    if comm.rank == 0:
        del coll                          # the last reference: __del__, the engine idle here
        comm.Barrier()
        comm.Barrier()                    # alive until the peers are done
        return
    comm.Barrier()
    t0 = time.monotonic()
    with pytest.raises(pc.PeerError) as info:
        coll.post(value(comm.rank, 1)).wait(timeout=5.0)
    assert info.value.rank == 0 and "dropped" in str(info.value), info.value
    assert time.monotonic() - t0 < 4.0, f"PeerError after {time.monotonic() - t0:.1f} s"
    coll._abandon()
    comm.Barrier()


@pytest.mark.parametrize("who", ["hears", "tells"])
def test_parked_collective_hears_and_tells(comm, who):
    """Issue 54, item 6: a round that waits for a decision of the balancer (parked: no
    schedule of the collective runs) on rank 0, whose balancer is held back. "hears": a
    peer reports (a with block left by an exception); rank 0's wait for the parked round
    raises PeerError naming it, not a Timeout. "tells": rank 0 drops the collective as
    the garbage collector does (the "dropped" report deferred: no MPI call, then
    abandon); the peers' waits raise PeerError naming rank 0, not a Timeout."""
    from partialcoll import balance
    if comm.size == 1:
        return
    real, release = balance.decide, threading.Event()

    def held(*args, **kwargs):
        if comm.rank == 0:
            release.wait(20.0)
        return real(*args, **kwargs)

    balance.decide = held
    try:
        coll = pc.allreduce_init(4000, np.float64, comm=comm, algorithm="ps", block_bytes=8000,
                                 balance="proportional", rebalance_every=1)
        x = np.ones(4000)
        for i in range(4):                # rounds 0-3 need no decision yet
            assert np.array_equal(coll.post(x).wait(timeout=30).data, x * comm.size), i
        req = coll.post(x)                # round 4 needs decision 0: parked on rank 0
        comm.Barrier()
        t0 = time.monotonic()
        if who == "hears":
            if comm.rank == 0:
                with pytest.raises(pc.PeerError) as info:
                    req.wait(timeout=6.0)
                assert info.value.rank != 0, info.value
                assert time.monotonic() - t0 < 5.0, f"PeerError after {time.monotonic() - t0:.1f} s"
                release.set()
                coll._abandon()
            else:
                try:
                    with coll:
                        raise Boom("a peer of a parked collective")
                except Boom:
                    pass
        else:
            if comm.rank == 0:
                coll._report("dropped", "the collective was dropped without close() (the check)", -1.0)
                release.set()             # as __del__: the deferred report, then abandon
                coll._abandon()
            else:
                with pytest.raises(pc.PeerError) as info:
                    req.wait(timeout=6.0)
                assert info.value.rank == 0 and "dropped" in str(info.value), info.value
                assert time.monotonic() - t0 < 5.0, f"PeerError after {time.monotonic() - t0:.1f} s"
                coll._abandon()
    finally:
        release.set()
        balance.decide = real
    comm.Barrier()


if __name__ == "__main__":
    run_module(__file__)
