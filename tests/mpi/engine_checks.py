"""Schedule engine checks (issue 2), on every rank: mpiexec -n P python -m pytest --with-mpi engine_checks.py"""
from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

import partialcoll as pc
from _util import expect_raises, run_module


def test_ring_pass(comm):
    r, p = comm.rank, comm.size
    send, got = np.full(5, r, np.int64), np.full(5, -1, np.int64)
    s = pc.Schedule(comm)
    s.send(send, (r + 1) % p)
    s.recv(got, (r - 1) % p)
    with s.commit():
        s.start().wait()
        assert (got == (r - 1) % p).all(), got


def test_binomial_bcast_every_root(comm):
    r, p = comm.rank, comm.size
    for root in range(p):
        rel = (r - root) % p
        buf = np.arange(7, dtype=np.float64) * 10 + root if r == root else np.zeros(7)
        s = pc.Schedule(comm)
        got, mask = None, 1
        while mask < p:
            if rel & mask:
                got = s.recv(buf, (rel - mask + root) % p)
                break
            mask <<= 1
        mask >>= 1
        while mask > 0:
            if rel + mask < p:
                s.send(buf, (rel + mask + root) % p, after=got)
            mask >>= 1
        with s.commit():
            s.start().wait()
        assert (buf == np.arange(7) * 10 + root).all(), (root, buf)


def test_binomial_reduce(comm):
    r, p = comm.rank, comm.size
    root = p - 1
    rel = (r - root) % p
    acc = np.array([r + 1, 2 * r, -r], np.int64)
    s = pc.Schedule(comm)
    last, mask = None, 1
    while mask < p:
        if rel & mask:
            s.send(acc, (rel - mask + root) % p, after=last)
            break
        if rel + mask < p:
            tmp = np.zeros_like(acc)
            got = s.recv(tmp, (rel + mask + root) % p)
            last = s.compute(MPI.SUM, tmp, acc, out=acc, after=[got] + ([last] if last else []))
        mask <<= 1
    with s.commit():
        s.start().wait()
    if r == root:
        expect = np.array([p * (p + 1) // 2, p * (p - 1), -p * (p - 1) // 2])
        assert (acc == expect).all(), acc


@pytest.mark.parametrize("need", ["any", 2, 3])
def test_k_of_n(comm, need):
    """Rank 0's op X waits for `need` of three messages; the other messages are sent only
    after X fired (they are gated on a message X sends), so X provably fired at exactly
    `need` completions, and a counter shows it fired exactly once."""
    r, p = comm.rank, comm.size
    senders = [(1 + i) % p for i in range(3)]
    k = 1 if need == "any" else need
    s = pc.Schedule(comm)
    one = np.ones(1, np.int64)
    bufs = [np.zeros(1, np.int64) for _ in range(3)]
    seen, count, gate = np.zeros(1, np.int64), np.zeros(1, np.int64), np.zeros(1, np.int64)
    # Ops are created receiver role first, then sender role, then the gates: per pair of
    # ranks the k-th send then matches the k-th receive, also when a rank sends to itself.
    if r == 0:
        recvs = [s.recv(bufs[i], snd) for i, snd in enumerate(senders)]
        x = s.nop(after=recvs, need=need)
        c0 = s.compute(MPI.SUM, bufs[0], bufs[1], out=seen, after=x)     # snapshot at firing time
        c1 = s.compute(MPI.SUM, seen, bufs[2], out=seen, after=c0)
        s.compute(MPI.SUM, one, count, out=count, after=x)               # count += 1 each firing
    gate_recv = None
    for i, snd in enumerate(senders):                # messages i < k go at once, the others
        if r == snd:                                 # wait for X's gate message
            if i >= k and gate_recv is None:
                gate_recv = s.recv(np.zeros(1, np.int64), 0)
            s.send(one, 0, after=gate_recv if i >= k else None)
    if r == 0:
        for snd in sorted(set(senders[k:])):
            s.send(gate, snd, after=c1)
    with s.commit():
        s.start().wait()
    if r == 0:
        assert seen[0] == k, f"X fired after {seen[0]} completions, expected {k}"
        assert count[0] == 1, f"X fired {count[0]} times"
        assert all(b[0] == 1 for b in bufs)


def test_persistent_1000(comm):
    """1000 executions with fresh data each; no barrier between them, so fast ranks run
    ahead and only the execution versions keep messages apart."""
    r, p = comm.rank, comm.size
    mine, got = np.zeros(3, np.int64), np.zeros(3, np.int64)
    s = pc.Schedule(comm)
    s.send(mine, (r + 1) % p)
    s.recv(got, (r - 1) % p)
    left = (r - 1) % p
    with s.commit(persistent=True):
        for it in range(1000):
            mine[:] = (it * p + r, it, -r)
            s.start().wait()
            assert got[0] == it * p + left and got[1] == it and got[2] == -left, (it, got)


def test_nonpersistent_runs_once(comm):
    s = pc.Schedule(comm)
    s.nop()
    with s.commit(persistent=False):
        s.start().wait()
        expect_raises(pc.StateError, s.start, match="runs once")


def test_bad_inputs(comm):
    p = comm.size
    s = pc.Schedule(comm)
    a32, a64 = np.zeros(4, np.float32), np.zeros(4, np.float64)
    expect_raises(pc.InvalidBufferError, s.compute, MPI.SUM, a32, a64, match="dtype")
    expect_raises(pc.InvalidBufferError, s.compute, MPI.SUM, a32, np.zeros(5, np.float32), match="size")
    expect_raises(pc.InvalidBufferError, s.send, np.zeros((4, 4))[:, 0], 0, match="contiguous")
    ro = np.zeros(4)
    ro.setflags(write=False)
    expect_raises(pc.InvalidBufferError, s.recv, ro, 0, match="read-only")
    expect_raises(pc.InvalidBufferError, s.compute, MPI.SUM, a64, ro, match="read-only")
    expect_raises(pc.InvalidBufferError, s.send, [1, 2, 3], 0, match="NumPy")
    expect_raises(pc.InvalidBufferError, s.send, np.zeros(2, dtype="U3"), 0, match="MPI basic type")
    expect_raises(pc.ArgumentError, s.send, a64, p, match="out of range")
    expect_raises(pc.ArgumentError, s.recv, a64, -1, match="out of range")
    expect_raises(pc.OpError, s.compute, MPI.BAND, a32, a32, match="not defined")
    expect_raises(pc.OpError, s.compute, MPI.MAX, np.zeros(2, np.complex64), np.zeros(2, np.complex64),
                  match="not defined")
    expect_raises(pc.ArgumentError, s.compute, MPI.MAXLOC, a32, a32, match="unsupported")
    n = s.nop()
    expect_raises(pc.ArgumentError, s.nop, after=[n], need=2, match="need")
    expect_raises(pc.StateError, pc.Schedule(comm).start, match="commit")


def test_size_mismatch(comm):
    """A receive that gets a message of another size is an MPIError on the receiver, naming
    the sender (the peer of the receive that failed)."""
    r, p = comm.rank, comm.size
    s = pc.Schedule(comm)
    s.send(np.zeros(4, np.int32), (r + 1) % p)
    s.recv(np.zeros(8, np.int32), (r - 1) % p)
    with s.commit():
        req = s.start()
        exc = expect_raises(pc.MPIError, req.wait, timeout=30, match="bytes")
        assert exc.ranks == ((r - 1) % p,), exc.ranks
        assert f"(recv from rank {(r - 1) % p})" in str(exc), str(exc)
    comm.Barrier()


def test_timeout(comm):
    """A receive that is never matched: wait(timeout=) raises Timeout, it does not hang."""
    r = comm.rank
    s = pc.Schedule(comm)
    s.recv(np.zeros(1), r)
    s.commit()
    req = s.start()
    expect_raises(pc.Timeout, req.wait, timeout=0.2, match="did not complete")
    assert not req.test()


def test_progress_mode_as_configured(comm):
    assert pc.progress_mode() == pc.rc.progress, (pc.progress_mode(), pc.rc.progress)


if __name__ == "__main__":
    run_module(__file__)
