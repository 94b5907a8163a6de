"""Tree allreduce (issue 16): dry builds run by tests/simulate.py for many process
counts, region shapes, chunkings, ops and dtypes; the cross-region traffic formulas;
and the real engine under mpiexec (against MPI_Allreduce, traffic(), every mode's
semantics checks with algorithm="tree")."""
import numpy as np
import pytest

from conftest import run_shared

import simulate
from partialcoll._buffers import BufRef
from partialcoll._errors import ArgumentError
from partialcoll.algorithms import ALGORITHMS, tree
from partialcoll.schedule import SEND, Schedule
from simulate import run

SIZES = list(range(1, 10)) + [13, 16]

# the logical ops, which simulate.py leaves out (the engine: 1 where true, 0 where false)
LOGICAL = {4: np.logical_and, 5: np.logical_or, 6: np.logical_xor}
OPS = {"SUM": 0, "PROD": 1, "MIN": 2, "MAX": 3, "LAND": 4, "LOR": 5, "LXOR": 6, "BAND": 7, "BOR": 8, "BXOR": 9}
DTYPES = [np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64,
          np.float32, np.float64, np.complex64, np.complex128]


def shapes(p):
    third = -(-p // 3)
    return {
        "one": [0] * p,
        "each": list(range(p)),
        "uneven": [0 if r < third else 1 for r in range(p)],
        "interleaved": [r % 3 for r in range(p)],
        "levels": [[r // 2 for r in range(p)], [0 if r < third else 1 for r in range(p)]],
        "three_levels": [[r // 2 for r in range(p)], [r // 3 for r in range(p)], [r % 2 for r in range(p)]],
    }


def simulate_tree(data, groups, op=0, chunks=None, seed=0, rotation=0):
    p = len(data)
    bufs = [d.copy() for d in data]
    scheds = []
    for r in range(p):
        s = Schedule(rank=r, size=p)
        tree.allreduce(s, BufRef.of(bufs[r], writable=True), op, groups=groups, chunks=chunks, seed=seed,
                       rotation=rotation)
        scheds.append(s)
    run(scheds)
    return bufs, scheds


@pytest.mark.parametrize("p", SIZES)
@pytest.mark.parametrize("shape", ["one", "each", "uneven", "interleaved", "levels", "three_levels"])
def test_simulated_tree(p, shape):
    groups = shapes(p)[shape]
    for count in (0, 1, 2, 7, 100):
        for chunks, seed, rotation in ((None, 0, 0), (1, 3, 0), (3, 1, 0), (p + 2, 0, 0), (1, 0, 2), (2, 1, 3)):
            data = [np.arange(count, dtype=np.int64) * (r + 1) + r for r in range(p)]
            bufs, _ = simulate_tree(data, groups, chunks=chunks, seed=seed, rotation=rotation)
            expect = np.sum(data, axis=0) if count else np.zeros(0, np.int64)
            for r in range(p):
                assert np.array_equal(bufs[r], expect), (shape, p, count, chunks, seed, rotation, r)


def _reduce(code, arrays):
    out = arrays[0]
    for a in arrays[1:]:
        out = LOGICAL[code](out, a).astype(a.dtype) if code in LOGICAL else simulate._NUMPY[code](out, a)
    return out


def _defined(code, dt):
    kind = np.dtype(dt).kind
    if code in (0, 1):
        return kind != "b"
    if code in (2, 3):
        return kind in "iuf"
    if code in (4, 5, 6):
        return kind in "biu"
    return kind in "iu"


@pytest.mark.parametrize("name", sorted(OPS))
def test_simulated_every_op_dtype(name, monkeypatch):
    code = OPS[name]
    for code_, fn in LOGICAL.items():
        monkeypatch.setitem(simulate._NUMPY, code_, lambda a, b, fn=fn: fn(a, b).astype(a.dtype))
    p = 7
    groups = shapes(p)["levels"]
    for dt in DTYPES:
        if not _defined(code, dt):
            continue
        for count, chunks in ((1, None), (5, 1), (11, 4)):
            rng = np.random.default_rng([code, count])
            # small integers: exact in every dtype and order of reduction
            data = [(rng.integers(1, 3, count) if code == 1 else rng.integers(0, 4, count)).astype(dt)
                    for _ in range(p)]
            bufs, _ = simulate_tree(data, groups, op=code, chunks=chunks)
            expect = _reduce(code, data)
            for r in range(p):
                assert bufs[r].tobytes() == expect.tobytes(), (name, np.dtype(dt), count, chunks, r)


def cross_bytes(algorithm, regions, count=1024, **kw):
    """Bytes one allreduce of `count` float64 sends across the regions, each way (dry builds)."""
    p = len(regions)
    way = {}
    for r in range(p):
        s = Schedule(rank=r, size=p)
        ALGORITHMS[algorithm](s, BufRef.of(np.zeros(count), writable=True), 0, **kw)
        for op in s.ops:
            if op.kind == SEND and regions[op.peer] != regions[r]:
                key = (regions[r], regions[op.peer])
                way[key] = way.get(key, 0) + op.bufs[0].nbytes
    return way


def test_cross_region_traffic_formulas():
    """8 ranks in 2 contiguous regions of 4, a vector of N bytes: tree sends N each way
    (one vector per aggregator, chunked or not); ring crosses at 3 -> 4 and 7 -> 0, each
    carrying 2(p - 1) segments of N/p: 1.75 N each way; recursive doubling exchanges the
    whole vector across in its last round: 4 N each way."""
    groups, n = [0, 0, 0, 0, 1, 1, 1, 1], 1024 * 8
    for chunks in (None, 1, 4):
        assert cross_bytes("tree", groups, groups=groups, chunks=chunks) == {(0, 1): n, (1, 0): n}
    assert cross_bytes("ring", groups) == {(0, 1): 7 * n // 4, (1, 0): 7 * n // 4}
    assert cross_bytes("recursive_doubling", groups) == {(0, 1): 4 * n, (1, 0): 4 * n}
    # two levels (hosts of 2 in racks of 4): still one vector each way between the racks
    assert cross_bytes("tree", groups, groups=[[r // 2 for r in range(8)], groups]) == {(0, 1): n, (1, 0): n}


def test_aggregators_rotate_over_chunks_and_seeds():
    levels = tree.normalize_groups([0, 0, 0, 1, 1, 1, 1], 7)     # the docstring's example
    aggs = [sorted(tree.Plan(levels, c, seed=0).members[0]) for c in range(4)]
    assert aggs == [[0, 4], [1, 5], [2, 6], [0, 3]]          # chunk c: member (c + seed + g) mod k
    # k chunks in a region of k: every member aggregates exactly one
    assert sorted(a[1] for a in aggs) == [3, 4, 5, 6]
    assert sorted(tree.Plan(levels, 0, seed=1).members[0]) == [1, 5]
    plan = tree.Plan(tree.normalize_groups([[0, 0, 1, 1, 2, 2, 3], [0, 0, 0, 0, 1, 1, 1]], 7), 0, 0)
    assert sorted(plan.members[0]) == [0, 3, 4, 6] and plan.top == [0, 6]   # the docstring's example


def test_aggregators_rotate_with_the_round():
    """Variant r (round n runs on variant n mod R) moves chunk c of region g to member
    (c + r * chunks + seed + g) mod k: over R = ceil(k_max / chunks) rounds every member of
    the largest region aggregates, and every member of the smaller ones too."""
    groups = [0, 0, 0, 1, 1, 1, 1]
    levels = tree.normalize_groups(groups, 7)
    assert tree.rotations(10, 8, levels) == 4                        # one chunk, regions of 3 and 4
    aggs = [sorted(tree.Plan(levels, 0, seed=0, rotation=r).members[0]) for r in range(4)]
    assert aggs == [[0, 4], [1, 5], [2, 6], [0, 3]]
    assert tree.rotations(10, 8, levels, chunks=2) == 2
    assert tree.rotations(10, 8, levels, chunks=4) == 1                # chunks == k_max: as before
    two = [sorted(tree.Plan(levels, c, seed=1, rotation=r, chunks=2).members[0]) for r in range(2) for c in range(2)]
    assert sorted({a for pair in two for a in pair}) == list(range(7)), two
    assert tree.rotations(0, 8, levels) == 1 and tree.rotations(10, 8, ((0,),)) == 1
    assert tree.rotations(10, 8, tree.normalize_groups(list(range(7)), 7)) == 1    # nothing to rotate
    # two levels: the rack aggregators (level 1) rotate too
    levels = tree.normalize_groups([[0, 0, 1, 1, 2, 2, 3], [0, 0, 0, 0, 1, 1, 1]], 7)
    R = tree.rotations(10, 8, levels)
    assert R == 4
    tops = {tuple(tree.Plan(levels, 0, 0, rotation=r).top) for r in range(R)}
    assert len(tops) > 1, tops


def test_rotated_variants_move_the_aggregation_load():
    """Simulated, one chunk, P = 5 in regions of 2 and 3: over R = 3 variants each member
    sends the most bytes (the aggregator's k - 1 vectors down) in its own variant."""
    p, count, groups = 5, 16, [0, 0, 1, 1, 1]
    R = tree.rotations(count, 8, tree.normalize_groups(groups, p))
    assert R == 3
    heavy = []
    for rot in range(R):
        data = [np.arange(count, dtype=np.float64) + r for r in range(p)]
        bufs, scheds = simulate_tree(data, groups, rotation=rot)
        assert all(np.array_equal(b, np.sum(data, axis=0)) for b in bufs)
        sent = [sum(op.bufs[0].nbytes for op in s.ops if op.kind == SEND) for s in scheds]
        heavy.append(max(range(2, 5), key=lambda r: sent[r]))
    assert sorted(heavy) == [2, 3, 4], heavy


def test_chunked_tree_spreads_the_work():
    """With chunks, every rank of a region sends and receives about the same bytes."""
    p, count = 8, 4096
    data = [np.ones(count) for _ in range(p)]
    _, scheds = simulate_tree(data, [0] * 4 + [1] * 4, chunks=4)
    sent = [sum(op.bufs[0].nbytes for op in s.ops if op.kind == SEND) for s in scheds]
    assert max(sent) == min(sent), sent
    _, scheds = simulate_tree(data, [0] * 4 + [1] * 4, chunks=1)
    sent = [sum(op.bufs[0].nbytes for op in s.ops if op.kind == SEND) for s in scheds]
    assert max(sent) == 4 * count * 8 and min(sent) == count * 8, sent    # aggregators: 3 + 1 vectors


def test_default_chunks():
    one = tree.normalize_groups([0, 0, 0, 1, 1], 5)
    assert tree.default_chunks(10, 8, one) == 1                  # small: one tree
    assert tree.default_chunks(1 << 20, 8, one) == 3             # the largest region has 3
    assert tree.default_chunks(3 * tree.CHUNK_BYTES // 16, 8, one) == 1


def test_normalize_groups():
    assert tree.normalize_groups(["b", "a", "b"], 3) == ((0, 1, 0),)
    assert tree.normalize_groups(np.array([5, 5, 2]), 3) == ((0, 0, 1),)
    assert tree.normalize_groups([[1, 2], [7, 7]], 2) == ((0, 1), (0, 0))
    assert tree.normalize_groups(None, 2) == ((0, 0),)
    with pytest.raises(ArgumentError, match="one entry per rank"):
        tree.normalize_groups([0, 1], 3)
    with pytest.raises(ArgumentError, match="at least one level"):
        tree.normalize_groups([], 3)
    with pytest.raises(ArgumentError, match="hashable"):
        tree.normalize_groups([[[0], [1]]], 2)
    with pytest.raises(ArgumentError, match="list of each rank's region"):
        tree.normalize_groups(3, 3)


def test_dump_reads_like_the_docstring():
    s = Schedule(rank=1, size=7)
    tree.allreduce(s, BufRef.of(np.zeros(8), writable=True), 0, groups=[0, 0, 0, 1, 1, 1, 1])
    text = s.dump()
    assert "my part up to 0" in text and "result from 0" in text


@pytest.mark.mpiexec
@pytest.mark.shared_job("tree_checks.py")
@pytest.mark.parametrize("nprocs", [2, 3, 5, 8])
def test_tree_against_mpi_allreduce(mpirun, request, nprocs):
    """Every region shape x counts 0..2^17+3, every op x dtype, traffic(), bad groups."""
    run_shared(mpirun, request, nprocs)


# (mode:shape cases) per process count, each P's in one job (each check runs once per case)
TREE_PARTIAL = {3: "solo:uneven,majority:levels,probe:chunked,quorum:uneven,full:levels",
                5: "solo:chunked,quorum:levels", 8: "probe:uneven"}


@pytest.mark.mpiexec
@pytest.mark.parametrize("nprocs", sorted(TREE_PARTIAL))
def test_tree_partial_semantics(mpirun, nprocs):
    """partial_checks.py's checks (nothing lost, agreement, membership, staleness, liveness,
    bad input) with algorithm="tree", 40 rounds, in TREE_PARTIAL's cases."""
    mpirun("tree_partial_checks.py", nprocs, TREE_PARTIAL[nprocs], "40", timeout=400)
