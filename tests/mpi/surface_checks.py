"""Issue 11, finding 7 on several ranks: an option one rank passes in a mode that does not
use it, or an engine out-of-memory, is an error on every rank (never a hang); NumPy integers
are accepted for every integer option and give MPI_Allreduce's result."""
import numpy as np
from mpi4py import MPI

import partialcoll as pc
from _util import expect_raises, run_module


def test_unused_option_on_one_rank(comm):
    """candidates= in solo mode, quorum= in full mode...: the rank that passed it names the
    option, every other rank names that rank; nobody waits for the others."""
    culprit = comm.size - 1
    for mode, key, value in [("solo", "candidates", 3), ("majority", "candidates", 2),
                             ("full", "quorum", 1), ("probe", "quorum", 1), ("quorum", "candidates", 2)]:
        kw = {"mode": mode}
        if mode == "quorum":
            kw["quorum"] = 1
        if comm.rank == culprit:
            kw[key] = value
        exc = expect_raises(pc.ArgumentError, pc.PartialAllreduce, 4, np.float32, MPI.SUM, comm, **kw)
        if comm.rank == culprit:
            assert f"{key}=" in str(exc) and repr(mode) in str(exc), exc
        else:
            assert f"rank {culprit} rejected" in str(exc) and f"{key}=" in str(exc), exc


def test_numpy_integers(comm):
    """Rank 0 passes NumPy integers, the others Python ints: the options agree, and the
    results equal MPI_Allreduce's."""
    r, p = comm.rank, comm.size
    np_ints = r == 0
    count = np.int64(6) if np_ints else 6
    for mode, extra in [("probe", {"candidates": np.int32(2) if np_ints else 2}),
                        ("quorum", {"quorum": np.uint8(p) if np_ints else p}),
                        ("full", {"max_staleness": np.int16(2) if np_ints else 2})]:
        coll = pc.PartialAllreduce(count, np.int64, MPI.SUM, comm, mode=mode, seed=np.uint32(9) if np_ints else 9,
                                   late="fold", **extra)
        x = np.arange(6, dtype=np.int64) * (r + 1)
        expected = np.empty_like(x)
        comm.Allreduce(x, expected, op=MPI.SUM)
        # fold: a round may miss a post, close() flushes it; nothing is lost or counted twice
        total = coll.post(x).wait().data + coll.close().data
        assert total.tolist() == expected.tolist(), (mode, total, expected)

    # Schedule: peers and need= as NumPy integers; a ring shift, checked against the sender.
    s = pc.Schedule(comm)
    got = np.full(3, -1, np.int64)
    sent = s.send(np.full(3, r, np.int64), np.int64((r + 1) % p))
    recv = s.recv(got, np.int32((r - 1) % p))
    s.nop(after=[sent, recv], need=np.uint16(2))
    s.commit().start().wait()
    assert got.tolist() == [(r - 1) % p] * 3, got
    s.free()


def test_out_of_memory(comm):
    """A collective the engine cannot allocate (2^60 bytes): pc.OutOfMemory (a MemoryError)
    on every rank, and the engine still works afterwards."""
    exc = expect_raises(pc.OutOfMemory, pc.allreduce_init, 2 ** 57, np.float64, MPI.SUM, comm)
    assert isinstance(exc, MemoryError) and isinstance(exc, pc.PartialcollError)
    with pc.allreduce_init(2, np.int64, MPI.SUM, comm) as coll:
        assert coll.post(np.ones(2, np.int64)).wait().data.tolist() == [comm.size] * 2


if __name__ == "__main__":
    run_module(__file__)
