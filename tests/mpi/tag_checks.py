"""A smaller MPI_TAG_UB: python tag_checks.py, under PARTIALCOLL_TAG_UB=255 or 2047.

Tags are (version mod 2^vbits) << seqbits | seq, seqbits counting the most messages
between one pair of ranks in the communicator's schedules (agreed by every rank at
commit), vbits the rest of MPI_TAG_UB. Under the forced view a one-message schedule has
8 (11) bits of version: a persistent schedule and partial allreduces run past the wrap
point twice, results checked every time; more messages between one pair than the tag
space allows is a clear error at commit; and an execution withdrawn with its receive
cancelled (finalize) never lets a peer's late message match a later execution.
"""
from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

import partialcoll as pc
from partialcoll import _engine
from partialcoll.schedule import pair_messages
from _util import expect_raises, run_module


def tag_bits(comm, pairs):
    seq, ver = _engine.ffi.new("int *"), _engine.ffi.new("int *")
    assert _engine.lib.pc_tag_bits(_engine.comm_handle(comm), pairs, seq, ver) == 0
    return seq[0], ver[0]


def test_persistent_schedule(comm):
    r, p = comm.rank, comm.size
    buf, got = np.zeros(3, np.int64), np.zeros(3, np.int64)
    s = pc.Schedule(comm)
    s.send(buf, (r + 1) % p)
    s.recv(got, (r - 1) % p)
    _, vbits = tag_bits(comm, pair_messages(s))
    with s.commit():
        for i in range(2 * (1 << vbits) + 10):
            buf[:] = 1000 * r + i
            s.start().wait(timeout=30)
            assert np.all(got == 1000 * ((r - 1) % p) + i), (i, got)


def test_partial_rounds(comm):
    p = comm.size
    for mode in ("full", "solo"):
        coll = pc.PartialAllreduce(4, np.int64, MPI.SUM, comm, mode=mode, late="fold")
        every = [s for scheds in coll._schedules.values() for s in scheds]
        _, vbits = tag_bits(comm, comm.allreduce(pair_messages(*every), op=MPI.MAX))
        runs = 2 * (1 << vbits) + 10
        total = np.zeros(4, np.int64)
        for i in range(runs):
            res = coll.post(np.full(4, comm.rank + 10 * i, np.int64)).wait(timeout=30)
            if mode == "full":
                assert np.all(res.data == p * 10 * i + p * (p - 1) // 2), (i, res)
            total += res.data
        total += coll.close(timeout=30).data
        assert np.all(total == sum(r + 10 * i for r in range(p) for i in range(runs))), total


@pytest.mark.mpi(min_size=2)
def test_pair_limit(comm):
    seqbits, vbits = tag_bits(comm, 1)
    most = 1 << (seqbits + vbits - 4)            # at least 4 bits stay the version's
    s = pc.Schedule(comm)
    buf = np.zeros(1)
    peer = (comm.rank + 1) % comm.size
    for _ in range(most + 1):
        s.send(buf, peer)
    expect_raises(pc.ArgumentError, s.commit, match="messages between ranks")


@pytest.mark.mpi(min_size=2)
def test_withdrawn_receive_never_matches_later(comm):
    """Rank 0's execution is withdrawn (finalize) before rank 1 sends; rank 1's message
    then stays unmatched. The schedule refuses to run again: a later execution with the
    same version bits would receive it (before, after 2^vbits executions, silently)."""
    r = comm.rank
    got, buf = np.zeros(1), np.zeros(1)
    s = pc.Schedule(comm)
    if r == 0:
        s.recv(got, 1)
    elif r == 1:
        s.send(buf, 0)
    s.commit()
    if r == 0:
        s.start()
        pc.finalize()                    # withdraws the execution: its receive is cancelled
    comm.Barrier()
    if r == 1:
        buf[:] = -1.0
        s.start().wait(timeout=30)       # small: buffered by the MPI, unmatched at rank 0
    comm.Barrier()
    if r == 0:
        _engine.ensure_started()         # as anything created after finalize() does
        expect_raises(pc.StateError, s.start, match="withdrawn with receives cancelled")
    s.free()
    comm.Barrier()


if __name__ == "__main__":
    run_module(__file__)
