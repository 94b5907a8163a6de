"""The parameter-server allreduce (algorithm "ps") as a pure builder, run in the
simulator for many P, block sizes and assignments (no MPI processes)."""
import numpy as np
import pytest

from partialcoll._buffers import BufRef
from partialcoll.algorithms import ps
from partialcoll.schedule import Schedule
from simulate import run

SIZES = [1, 2, 3, 4, 5, 7, 8]


def simulate(p, data, op=0, divisor=1.0, **kw):
    bufs = [d.copy() for d in data]
    scheds, timers = [], []
    for r in range(p):
        s = Schedule(rank=r, size=p)
        t = []
        ps.allreduce(s, BufRef.of(bufs[r], writable=True), op, divisor=divisor, timers=t, **kw)
        scheds.append(s)
        timers.append(t)
    run(scheds)
    return bufs, scheds, timers


@pytest.mark.parametrize("p", SIZES)
@pytest.mark.parametrize("count", [0, 1, 3, 8, 9, 100])
@pytest.mark.parametrize("block", [8, 24, 4 << 20])
def test_simulated_ps_round_robin(p, count, block):
    """Every rank ends with the sum, whatever the count is against the block (one
    block, a partial last block, no elements)."""
    data = [np.arange(count, dtype=np.int64) * (r + 1) + r for r in range(p)]
    bufs, scheds, timers = simulate(p, data, block_bytes=block)
    expect = np.sum(data, axis=0) if count else np.zeros(0, np.int64)
    for r in range(p):
        assert np.array_equal(bufs[r], expect), (p, count, block, r)
    nblocks = ps.block_count(count, 8, block)
    if p > 1 and count:
        owners = ps.round_robin(nblocks, list(range(p)))
        for r in range(p):   # a timer per block sent away, naming its owner
            assert [o for _, _, o in timers[r]] == [o for o in owners if o != r]


@pytest.mark.parametrize("p", SIZES)
def test_simulated_ps_any_assignment(p):
    """Any owner map, servers= restricting ownership, one owner for everything; the
    divisor applied exactly once (by the owner); the owner's scratch stays two blocks
    per peer however many blocks it owns."""
    rng = np.random.default_rng(p)
    count = 37
    data = [rng.standard_normal(count) for _ in range(p)]
    nblocks = ps.block_count(count, 8, 40)
    for assignment in (rng.integers(0, p, nblocks).tolist(), [p - 1] * nblocks, None):
        bufs, scheds, _ = simulate(p, data, divisor=3.0, block_bytes=40, assignment=assignment)
        for r in range(p):
            assert np.allclose(bufs[r], np.sum(data, axis=0) / 3.0)
            assert np.array_equal(bufs[r], bufs[0])       # one reduction path: the same bits
        if p > 1:
            divided = sum(op.bufs[2].count for s in scheds for op in s.ops if op.kind == 2 and op.divisor != 1)
            assert divided == count
            assert max(s.scratch_bytes for s in scheds) <= 2 * (p - 1) * 64 * -(-40 // 64) + 64 * 2 * p
    if p > 1:
        servers = [0, p - 1]
        bufs, scheds, timers = simulate(p, data, block_bytes=40, servers=servers)
        assert all(np.allclose(b, np.sum(data, axis=0)) for b in bufs)
        owners = {o for t in timers for _, _, o in t}
        assert owners <= set(servers)
        for r in range(1, p - 1):           # a rank that serves nothing receives nothing but results
            assert sum(op.kind == 1 for op in scheds[r].ops) == nblocks
