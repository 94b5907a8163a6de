"""AsyncAverager under mpiexec: python averager_checks.py (P >= 2).

The server's reply must be the exact mean of the latest vector pushed under every key so
far (a NumPy model replays the same pushes), for every dtype; a push never waits for
another key (a fast pusher completes many pushes before a slow rank pushes at all); a
server that only serves works; bad input raises on every rank."""
from __future__ import annotations

import time

import numpy as np
import pytest

import partialcoll as pc
from partialcoll._types import BFLOAT16
from _util import expect_raises, progress, run_module

DTYPES = [np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64,
          np.float16, np.float32, np.float64, np.complex64, np.complex128, BFLOAT16]


def quiet(req):
    """Wait for an mpi4py request without spinning a shared core."""
    while not req.Test():
        time.sleep(0.0005)


def quiet_barrier(comm):
    quiet(comm.Ibarrier())


def model_mean(latest: dict, dtype) -> np.ndarray:
    """The mean the server must reply: wide sums, one rounding (integers: truncated)."""
    vecs = [latest[k] for k in latest]
    dt = np.dtype(dtype)
    if dt.kind in "iu":
        acc = np.int64 if dt.kind == "i" else np.uint64
        s = np.sum([v.astype(acc) for v in vecs], axis=0, dtype=acc)
        if dt.kind == "i":
            q = np.abs(s) // len(vecs) * np.sign(s)          # C's truncation toward zero
        else:
            q = s // np.uint64(len(vecs))
        return q.astype(dt)
    wide = np.complex128 if dt.kind == "c" else np.float64
    s = np.zeros(vecs[0].shape, wide)
    for v in vecs:                                       # in the order of the keys' first push
        s = s + v.astype(wide)
    return (s / len(vecs)).astype(dt)


def vector(dtype, count, seed, exact=True):
    """Small integers (exact in every dtype, bfloat16 included), or random values."""
    rng = np.random.default_rng(seed)
    dt = np.dtype(dtype)
    if exact or dt.kind in "iu":
        v = rng.integers(0, 60, count)
        if dt.kind == "i":
            v = v - 30
        out = v.astype(np.float32).astype(dt) if dt == BFLOAT16 else v.astype(dt)
        if dt.kind == "c":
            out = out + 1j * rng.integers(-30, 30, count).astype(dt)
        return out
    v = rng.standard_normal(count)
    return (v + 1j * rng.standard_normal(count) if dt.kind == "c" else v).astype(dt)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name if d is not BFLOAT16 else "bfloat16")
def test_model_replay(comm, dtype):
    """Pushes in turn (one rank at a time), keys shared by several ranks: every reply is
    the model's mean of every key's latest vector, on whichever rank pushed."""
    p, r = comm.size, comm.rank
    count = 37
    server = p - 1 if p > 2 else 0
    keys = max(1, p - 1)
    with pc.AsyncAverager(count, dtype, comm=comm, server=server) as avg:
        latest: dict = {}
        for turn in range(3 * p):
            who, key = turn % p, (turn * 5) % keys + 100        # keys are not ranks
            v = vector(dtype, count, seed=turn, exact=np.dtype(dtype).itemsize <= 2 or dtype is BFLOAT16)
            latest[key] = v
            if r == who:
                req = avg.push(v, key=key)
                mean = req.wait()
                assert req.keys == len(latest)
                assert req.pushes == turn + 1
                want = model_mean(latest, dtype)
                assert mean.dtype == np.dtype(dtype)
                if np.dtype(dtype).kind in "fc" and np.dtype(dtype).itemsize >= 8 and dtype is not BFLOAT16:
                    np.testing.assert_allclose(mean, want, rtol=1e-6)
                else:
                    assert np.array_equal(mean.view(np.uint8), want.view(np.uint8)), (turn, mean, want)
            quiet_barrier(comm)
        if r == server:
            assert avg.state() == (len(latest), 3 * p)


def test_exact_mean_all_pushed(comm):
    """Every rank pushes under its rank (the default key) at once; once all have pushed,
    a second push returns exactly the mean of all P vectors."""
    p, r = comm.size, comm.rank
    with pc.AsyncAverager(1000, np.float64, comm=comm) as avg:
        x = np.arange(1000, dtype=np.float64) + p * r       # mean: arange + p (p - 1) / 2
        first = avg.push(x).wait()
        quiet_barrier(comm)
        req = avg.push(x)
        mean = req.wait()
        assert req.keys == p
        assert np.array_equal(mean, np.arange(1000, dtype=np.float64) + p * (p - 1) / 2)
        assert first.shape == (1000,)


def test_fast_pusher_not_delayed(comm):
    """Rank 0 pushes 30 times while the last rank computes: all 30 replies come back
    before the last rank pushes anything (it waits for rank 0's word to start), and no
    reply counts the slow key. A server that waited for every key would deadlock here."""
    p, r = comm.size, comm.rank
    slow = p - 1
    server = 1 if p > 2 else 0              # at P >= 3 a rank that only serves
    with pc.AsyncAverager(256, np.float32, comm=comm, server=server) as avg:
        if r == 0:
            t0 = time.monotonic()
            for i in range(30):
                req = avg.push(np.full(256, i, np.float32))
                mean = req.wait(timeout=20)
                assert req.keys == 1, req.keys      # the slow key is not in yet
                assert np.all(mean == i)
            elapsed = time.monotonic() - t0
            comm.isend(elapsed, dest=slow, tag=7).wait()
        if r == slow:
            req = comm.irecv(source=0, tag=7)
            while True:
                ok, _ = req.test()
                if ok:
                    break
                time.sleep(0.001)            # "computing": no push before rank 0 is done
            mean = avg.push(np.full(256, 100.0, np.float32)).wait()
            assert np.all(mean == (29 + 100) / 2)


@pytest.mark.parametrize("dtype", [np.float64, np.float16, np.int32, np.complex64, BFLOAT16],
                         ids=["float64", "float16", "int32", "complex64", "bfloat16"])
def test_concurrent_pushes_replay(comm, dtype):
    """Every rank, the server too, pushes at once under keys shared between ranks, with
    random sleeps, test() polls and pushes whose request it drops unwaited (the next
    push waits for it). Each reply's `pushes` is its push's place in the server's order:
    across all ranks the places are 1 .. total, each once (nothing lost or served twice),
    and each reply is exactly the model's mean of the latest vector of every key among
    the pushes up to its place, with `keys` the number of those keys."""
    p, r = comm.size, comm.rank
    count, n = 33, 25
    rng = np.random.default_rng(1000 + r)
    server = p // 2
    mine = []                                        # (place, key, seed, reply, keys)
    with pc.AsyncAverager(count, dtype, comm=comm, server=server) as avg:
        waiting = None
        for i in range(n):
            key, seed = int(rng.integers(0, p + 1)), 1000 * r + i
            if rng.random() < 0.3:
                time.sleep(float(rng.random()) * 0.002)
            req = avg.push(vector(dtype, count, seed), key=key)
            if waiting is not None:                  # the push above waited for it
                mine.append(waiting)
                waiting = None
            if rng.random() < 0.3:
                waiting = (req, key, seed)           # not waited for here
                continue
            while rng.random() < 0.5 and not req.test():
                pass
            mean = req.wait(timeout=60)
            mine.append((req, key, seed, mean))
        if waiting is not None:
            mine.append(waiting)
        done = []
        for req, key, seed, *mean in mine:
            got = mean[0] if mean else req.wait(timeout=60)
            done.append((req.pushes, key, seed, got, req.keys))
        every = [row for rows in comm.allgather(done) for row in rows]
        if r == server:
            assert avg.state() == (len({key for _, key, _, _, _ in every}), n * p)
    every.sort(key=lambda row: row[0])
    assert [row[0] for row in every] == list(range(1, n * p + 1)), [row[0] for row in every]
    latest: dict = {}
    for place, key, seed, got, keys in every:
        latest[key] = vector(dtype, count, seed)
        want = model_mean(latest, dtype)
        assert keys == len(latest), (place, keys, len(latest))
        assert np.array_equal(got.view(np.uint8), want.view(np.uint8)), (place, got, want)


@pytest.mark.mpi(min_size=3)
def test_server_only_serves(comm):
    """The server never pushes; the others push twice each under two group keys."""
    p, r = comm.size, comm.rank
    with pc.AsyncAverager(8, np.int32, comm=comm, server=0) as avg:
        if r != 0:
            avg.push(np.full(8, 10 * (r % 2), np.int32), key=r % 2).wait()
        quiet_barrier(comm)
        if r != 0:
            req = avg.push(np.full(8, 10 * (r % 2), np.int32), key=r % 2)
            mean = req.wait()
            keys = len({q % 2 for q in range(1, p)})
            assert req.keys == keys
            assert np.all(mean == (10 // keys if keys == 2 else 10 * (1 % 2)))
        if r == 0:
            keys, pushes = avg.state()
            assert pushes >= p - 1


def test_many_keys_and_empty(comm):
    """Forty keys (the server's table grows); count 0 works."""
    with pc.AsyncAverager(0, np.float32, comm=comm) as avg:
        assert avg.push(np.zeros(0, np.float32)).wait().shape == (0,)
    with pc.AsyncAverager(3, np.int64, comm=comm) as avg:
        for k in range(40):
            if k % comm.size == comm.rank:
                avg.push(np.full(3, k, np.int64), key=k).wait()
            quiet_barrier(comm)
        req = avg.push(np.full(3, 39, np.int64), key=39)
        assert np.all(req.wait() == sum(range(40)) // 40) and req.keys == 40


def test_errors_everywhere(comm):
    p, r = comm.size, comm.rank
    expect_raises(pc.ArgumentError, pc.AsyncAverager, 4, np.float32, comm=comm, server=p, match="outside")
    expect_raises(pc.ArgumentError, pc.AsyncAverager, 4, np.float32, comm=comm, server=r % 2 if p > 1 else -1,
                  match="server")
    expect_raises(pc.ArgumentError, pc.AsyncAverager, 4 + (r == p - 1), np.float32, comm=comm, match="count")
    expect_raises(pc.ArgumentError, pc.AsyncAverager, 4, np.float32 if r else np.float64, comm=comm, match="dtype")
    expect_raises(pc.OpError, pc.AsyncAverager, 4, np.bool_, comm=comm, match="bool")
    avg = pc.AsyncAverager(4, np.float32, comm=comm)
    expect_raises(pc.InvalidBufferError, avg.push, np.zeros(4, np.float64), match="dtype")
    expect_raises(pc.InvalidBufferError, avg.push, np.zeros(5, np.float32), match="elements")
    expect_raises(pc.ArgumentError, avg.push, np.zeros(4, np.float32), key=1.5, match="key")
    avg.close()
    expect_raises(pc.StateError, avg.push, np.zeros(4, np.float32), match="closed")


def test_shrink_refused(comm):
    """on_failure="shrink" (passed, or partialcoll.rc's) raises ArgumentError on every rank,
    naming why (the server holds every key's latest vector); one rank asking for it makes
    the others raise naming it; "raise" works."""
    p, r = comm.size, comm.rank
    expect_raises(pc.ArgumentError, pc.AsyncAverager, 4, np.float32, comm=comm, on_failure="shrink",
                  match="server holds every key's latest vector")
    pc.rc.on_failure = "shrink"
    try:
        expect_raises(pc.ArgumentError, pc.AsyncAverager, 4, np.float32, comm=comm, match="rc.on_failure is 'shrink'")
    finally:
        pc.rc.on_failure = "raise"
    expect_raises(pc.ArgumentError, pc.AsyncAverager, 4, np.float32, comm=comm,
                  on_failure="shrink" if r == p - 1 else "raise", match="no on_failure" if r == p - 1 else f"rank {p - 1}")
    avg = pc.AsyncAverager(4, np.float32, comm=comm, on_failure="raise")
    assert np.array_equal(avg.push(np.ones(4, np.float32)).wait(timeout=30), np.ones(4, np.float32))
    avg.close()


def test_server_needs_the_progress_thread(comm):
    """The server serves on its progress thread. Where its process progresses inline it
    would serve only inside its own calls of the engine (its own pushes fold locally: it
    may make none), and every client's push would wait until its timeout: creation raises
    on every rank instead. A client may progress inline: its waits drive its engine."""
    p, r = comm.size, comm.rank
    server = p - 1
    if p == 1:                           # nobody waits for a server alone: it works inline
        with progress("inline"):
            avg = pc.AsyncAverager(4, np.float32, comm=comm)
            assert np.array_equal(avg.push(np.ones(4, np.float32)).wait(timeout=30), np.ones(4, np.float32))
            avg.close()
        return
    with progress("inline", here=r == server):
        expect_raises(pc.ArgumentError, pc.AsyncAverager, 4, np.float32, comm=comm, server=server,
                      match=f"rank {server}")
    with progress("inline", here=r == 0):
        avg = pc.AsyncAverager(4, np.float32, comm=comm, server=server)
        avg.push(np.full(4, r, np.float32)).wait(timeout=30)
        quiet_barrier(comm)              # every key has pushed: the next replies cover all of them
        req = avg.push(np.full(4, r, np.float32))
        assert np.array_equal(req.wait(timeout=30), np.full(4, (p - 1) / 2, np.float32)) and req.keys == p
        avg.close()


if __name__ == "__main__":
    run_module(__file__)
