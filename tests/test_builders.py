"""Schedule builders as pure functions: dry builds, dumps, and a simulated execution
for many process counts (no MPI processes needed)."""
import numpy as np
import pytest

from partialcoll.activation.flood import neighbours
from partialcoll.activation.quorum import binomial_tree
from partialcoll.algorithms import ALGORITHMS, choose
from partialcoll.algorithms.ring import segments
from partialcoll._buffers import BufRef
from partialcoll.schedule import Schedule
from simulate import run

SIZES = list(range(1, 10)) + [13, 16, 24]


@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
@pytest.mark.parametrize("p", SIZES)
@pytest.mark.parametrize("count", [0, 1, 2, 7, 100])
def test_simulated_allreduce(algorithm, p, count):
    data = [np.arange(count, dtype=np.int64) * (r + 1) + r for r in range(p)]
    bufs = [d.copy() for d in data]
    scheds = []
    for r in range(p):
        s = Schedule(rank=r, size=p)
        ALGORITHMS[algorithm](s, BufRef.of(bufs[r], writable=True), 0)
        scheds.append(s)
    run(scheds)
    expect = np.sum(data, axis=0) if count else np.zeros(0, np.int64)
    for r in range(p):
        assert np.array_equal(bufs[r], expect), (algorithm, p, count, r)


@pytest.mark.parametrize("algorithm,groups", [("recursive_doubling", None), ("ring", None), ("tree", None),
                                              ("tree", "pairs"), ("packed", None)])
@pytest.mark.parametrize("p", SIZES)
@pytest.mark.parametrize("count", [0, 1, 2, 7, 100])
def test_simulated_divisor(algorithm, groups, p, count):
    """divisor=d: every rank ends with sum / d, and each element is divided exactly once,
    on the path that makes its sum (no division pass of its own where ranks exchange)."""
    from partialcoll.algorithms.recursive_doubling import allreduce_packed
    data = [np.arange(count, dtype=np.float64) * (r + 1) + r for r in range(p)]
    bufs, scheds, d = [x.copy() for x in data], [], 3.0
    for r in range(p):
        s = Schedule(rank=r, size=p)
        ref = BufRef.of(bufs[r], writable=True)
        if algorithm == "packed":
            allreduce_packed(s, [(ref, 0, d)])
        elif groups:
            ALGORITHMS[algorithm](s, ref, 0, divisor=d, groups=[[i // 2 for i in range(p)]])
        else:
            ALGORITHMS[algorithm](s, ref, 0, divisor=d)
        scheds.append(s)
    run(scheds)
    expect = np.sum(data, axis=0) / d if count else np.zeros(0)
    for r in range(p):
        assert np.array_equal(bufs[r], expect), (algorithm, p, count, r, bufs[r], expect)
    divided = sum(op.bufs[2].count for s in scheds for op in s.ops if op.kind == 2 and op.divisor != 1)
    # (a second division on a path would show in the results above; here: no extra pass)
    if p > 1 and algorithm == "ring":
        assert divided == count, (p, count, divided)                  # by the segment's owner
    elif p > 1 and algorithm != "tree":
        assert divided == count * (1 << (p.bit_length() - 1)), (p, count, divided)   # by every pof2 rank


@pytest.mark.parametrize("p", SIZES)
@pytest.mark.parametrize("count", [0, 1, 2, 7])
def test_simulated_packed_allreduce(p, count):
    """Data (SUM, float32) and bitmasks (BOR, uint64) in one message per step, as a small
    round of a partial collective sends them (issue 13): both results right at every rank,
    and half the messages of two separate allreduces."""
    from partialcoll.algorithms.recursive_doubling import allreduce_packed
    data = [np.arange(count, dtype=np.float32) * (r + 1) + r for r in range(p)]
    masks = [np.array([1 << r % 64, 1 << (r * 7) % 64], np.uint64) for r in range(p)]
    bufs, mbufs, scheds = [d.copy() for d in data], [m.copy() for m in masks], []
    for r in range(p):
        s = Schedule(rank=r, size=p)
        allreduce_packed(s, [(BufRef.of(bufs[r], writable=True), 0, 1.0), (BufRef.of(mbufs[r], writable=True), 8, 1.0)])
        scheds.append(s)
    run(scheds)
    expect_mask = np.bitwise_or.reduce(np.array(masks), axis=0)
    for r in range(p):
        assert np.array_equal(bufs[r], np.sum(data, axis=0) if count else data[r]), (p, count, r)
        assert np.array_equal(mbufs[r], expect_mask), (p, count, r)
    two = []
    for r in range(p):
        s = Schedule(rank=r, size=p)
        ALGORITHMS["recursive_doubling"](s, BufRef.of(bufs[r], writable=True), 0)
        ALGORITHMS["recursive_doubling"](s, BufRef.of(mbufs[r], writable=True), 8)
        two.append(s)
    sends = [sum(op.kind == 0 for op in s.ops) for s in scheds]
    assert sends == [sum(op.kind == 0 for op in s.ops) // (2 if count else 1) for s in two], (sends, p, count)


@pytest.mark.parametrize("p", SIZES)
def test_small_round_data_carries_the_activation(p):
    """A small partial round (the flood, TAKE, packed recursive doubling, DELIVER) whose
    flood leaves out the empty messages that the data's first messages carry: from each
    rank alone, and from all at once, every rank joins, every message is received and
    every rank ends with the sum; each flood edge still carries exactly one message (an
    empty one, or the data that stands for it); at P = 2, one message each way."""
    from partialcoll.activation import flood
    from partialcoll.algorithms.recursive_doubling import allreduce_packed

    def data_of(buf):
        return lambda s, after: allreduce_packed(s, [(BufRef.of(buf, writable=True), 0, 1.0)], after=after)
    carry = [flood.carried(r, p, data_of(np.zeros(3, np.int64))) for r in range(p)]
    for r in range(p):
        assert carry[r].out <= set(neighbours(r, p)) and carry[r].into <= set(neighbours(r, p))
        assert all(r in carry[q].into for q in carry[r].out) and all(r in carry[q].out for q in carry[r].into)
    for starts in [[r] for r in range(p)] + [list(range(p))]:
        inputs = [np.arange(3, dtype=np.int64) * (r + 1) + r for r in range(p)]
        bufs, scheds, held = [x.copy() for x in inputs], [], []
        for r in range(p):
            s = Schedule(rank=r, size=p)
            trigger = s._trigger()
            go = flood.activation(s, trigger, carry[r])
            take = s._take(after=go)
            done = data_of(bufs[r])(s, take)
            flood.hear(s, go, carry[r])
            s._deliver(after=done)
            scheds.append(s)
            if r not in starts:
                held.append((r, trigger.index))     # this rank does not post: its trigger never fires
        run(scheds, held)
        for r in range(p):
            assert np.array_equal(bufs[r], np.sum(inputs, axis=0)), (p, starts, r)
    for r, s in enumerate(scheds):
        empty = sorted(op.peer for op in s.ops if op.kind == 0 and op.bufs[0].nbytes == 0)
        assert empty == sorted(set(neighbours(r, p)) - carry[r].out), (p, r, empty)
    if p == 2:
        assert [sum(op.kind == 0 for op in s.ops) for s in scheds] == [1, 1]
    if p & (p - 1) == 0 and p > 1:               # the first exchange's partner is the first neighbour
        assert all(carry[r].out == carry[r].into == {r ^ 1} for r in range(p))


def test_recursive_doubling_round_count():
    # p = 7: fold in, log2(4) = 2 exchange rounds, fold out -> rank 1 sends 4 messages
    s = Schedule(rank=1, size=7)
    ALGORITHMS["recursive_doubling"](s, BufRef.of(np.zeros(4), writable=True), 0)
    assert sum(op.kind == 0 for op in s.ops) == 3     # 2 exchanges + fold out
    assert sum(op.kind == 1 for op in s.ops) == 3     # fold in + 2 exchanges
    text = s.dump()
    assert "fold in" in text and "round 1" in text and "fold out" in text


def test_ring_segments_uneven_and_empty():
    assert segments(7, 3) == [0, 3, 5, 7]
    assert segments(2, 5) == [0, 1, 2, 2, 2, 2]
    s = Schedule(rank=0, size=3)
    ALGORITHMS["ring"](s, BufRef.of(np.zeros(7), writable=True), 0)
    assert sum(op.kind == 0 for op in s.ops) == 4      # 2(p - 1) sends


@pytest.mark.parametrize("p", SIZES)
def test_flood_graph_is_symmetric_and_connected(p):
    nb = {r: neighbours(r, p) for r in range(p)}
    for r in range(p):
        for q in nb[r]:
            assert r in nb[q] and 0 <= q < p
    # breadth-first from every rank reaches all within ceil(log2 p) hops
    for start in range(p):
        dist, frontier = {start: 0}, [start]
        while frontier:
            nxt = []
            for r in frontier:
                for q in nb[r]:
                    if q not in dist:
                        dist[q] = dist[r] + 1
                        nxt.append(q)
            frontier = nxt
        assert len(dist) == p
        assert max(dist.values()) <= max(p - 1, 1).bit_length()


@pytest.mark.parametrize("p", SIZES)
def test_binomial_tree_covers_everyone_once(p):
    reached = [0]
    for r in range(p):
        parent, children = binomial_tree(r, p)
        assert (parent is None) == (r == 0)
        for c in children:
            assert binomial_tree(c, p)[0] == r
            reached.append(c)
    assert sorted(reached) == list(range(p))


def test_auto_choice():
    assert choose("auto", 8, 4) == "recursive_doubling"
    assert choose("auto", 16 << 20, 4) == "rabenseifner"     # by the model: tests/test_rabenseifner.py
    assert choose("ring", 8, 4) == "ring"
    assert choose("tree", 8, 4) == "tree"
    with pytest.raises(ValueError, match="unknown algorithm"):
        choose("no_such_algorithm", 8, 4)


def test_dry_schedule_cannot_commit():
    s = Schedule(rank=0, size=2)
    s.nop()
    with pytest.raises(RuntimeError, match="dry-built"):
        s.commit()


def test_divisor_is_checked_and_printed():
    import partialcoll as pc
    s = Schedule(rank=0, size=1)
    a, b = np.ones(4, np.float32), np.ones(4, np.float32)
    op = s.compute(0, a, b, divisor=4)
    assert op.divisor == 4.0 and op.describe().endswith("/ 4")
    with pytest.raises(pc.OpError):
        s.compute(0, np.ones(4, np.int32), np.ones(4, np.int32), divisor=2)     # an integer average
    with pytest.raises(pc.OpError):
        s.compute(3, a, b, divisor=2)                                            # MAX, not SUM
    for bad in (0, float("inf"), "2", True):
        with pytest.raises(pc.ArgumentError):
            s.copy(a, b, divisor=bad)
