"""Tree allreduce (issue 16) against MPI_Allreduce, and traffic(): python tree_checks.py

Region shapes over P ranks: one region, P regions, uneven contiguous, interleaved
(r % 3), two levels, and the default (one region per shared-memory node).
"""
from __future__ import annotations

import zlib

import numpy as np
import pytest
from mpi4py import MPI

import partialcoll as pc
from partialcoll._buffers import SLOT_MASK
from partialcoll.algorithms import tree
from partialcoll.schedule import SEND
from _data import Bitwise, assert_matches, combos, covering_combos, values
from _util import expect_raises, run_module


def shapes(p):
    third = -(-p // 3)
    return {
        "one": [0] * p,
        "each": list(range(p)),
        "uneven": [0 if r < third else 1 for r in range(p)],
        "interleaved": [r % 3 for r in range(p)],
        "levels": [[r // 2 for r in range(p)], [0 if r < third else 1 for r in range(p)]],
        "default": None,
    }


def check_one(comm, bitwise, groups, count, dtype, op, rounds=1, seed=0, mode="full"):
    """Each round against MPI_Allreduce's, and into bitwise (a _data.Bitwise) to compare across ranks."""
    coll = pc.PartialAllreduce(count, dtype, op, comm, mode=mode, algorithm="tree", groups=groups, seed=seed)
    assert coll.algorithm == "tree"
    what = f"tree groups={groups} count={count} {np.dtype(dtype)} {op} P={comm.size}"
    for salt in range(rounds):
        x = values(dtype, op, count, comm.rank, salt)
        ref = np.empty_like(x)
        comm.Allreduce(x, ref, op=op)
        res = coll.post(x).wait()
        assert_matches(res.data, ref, op, what)
        assert res.round == salt and res.active == tuple(range(comm.size)), (what, res)
        bitwise.add(f"{what} round {salt}", res.data)
    coll.close()
    return coll


def test_every_shape(comm):
    p, bitwise = comm.size, Bitwise(comm)
    for _name, groups in shapes(p).items():
        for count in sorted({0, 1, p + 1, 1000, 2 ** 17 + 3}):       # 2^17 + 3 float64: chunked
            check_one(comm, bitwise, groups, count, np.float64, MPI.SUM, rounds=2, seed=count)
            check_one(comm, bitwise, groups, count, np.int64, MPI.MAX)
        bitwise.check()
    # the default: one region per node (all ranks share this machine's memory)
    coll = pc.allreduce_init(4, np.float32, comm=comm, algorithm="tree")
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    assert coll.groups == ((0,) * p,) or node.size < p, coll.groups
    node.Free()
    coll.close()


def test_every_op_dtype(comm):
    """Every op x dtype at P <= 4, one tree and chunked trees (two levels, uneven); at P = 5
    and 8, whose trees have more levels and members, each op and each dtype (covering_combos):
    the pairing of op and dtype is the kernels', which do not depend on P."""
    groups = shapes(comm.size)["levels"]
    saved = tree.CHUNK_BYTES
    try:
        for chunk_bytes, count in ((saved, 5), (1, comm.size + 3)):
            tree.CHUNK_BYTES = chunk_bytes
            bitwise = Bitwise(comm)
            for dtype, op in combos() if comm.size <= 4 else covering_combos():
                check_one(comm, bitwise, groups, count, dtype, op)
            bitwise.check()
    finally:
        tree.CHUNK_BYTES = saved


def sent_by_dry_build(coll, data_only, round=0):
    """Bytes per peer that full round `round` sends, from its dry-built schedule (the
    variant round mod R)."""
    out = np.zeros(coll.size, np.int64)
    variants = coll._schedules[1]
    for op in variants[round % len(variants)].ops:
        if op.kind == SEND and not (data_only and op.bufs[0].slot == SLOT_MASK):
            out[op.peer] += op.bufs[0].nbytes
    return out


def test_traffic(comm):
    """traffic() counts what the schedules send; tree: one vector per aggregator each way."""
    p, count, rounds = comm.size, 1000, 3
    half = [0 if r < p // 2 else 1 for r in range(p)]
    for algorithm in ("tree", "ring", "recursive_doubling"):
        kw = {"groups": half} if algorithm == "tree" else {}
        coll = pc.allreduce_init(count, np.float64, comm=comm, algorithm=algorithm, **kw)
        assert (coll.traffic() == 0).all()
        for _ in range(rounds):
            coll.post(np.ones(count)).wait()
        expect = sum(sent_by_dry_build(coll, False, n) for n in range(rounds))
        assert (coll.traffic() == expect).all(), (algorithm, coll.traffic(), expect)
        coll.close()                       # one more (final) round; traffic() still answers
        expect += sent_by_dry_build(coll, False, rounds)
        assert (coll.traffic() == expect).all(), algorithm
        if algorithm == "tree" and p > 1:
            # data crossing between the halves, per round: one vector each way
            data = np.array(comm.allgather(sent_by_dry_build(coll, True)))
            lo, hi = [r for r in range(p) if half[r] == 0], [r for r in range(p) if half[r] == 1]
            assert data[np.ix_(lo, hi)].sum() == count * 8 == data[np.ix_(hi, lo)].sum(), data


@pytest.mark.mpi(min_size=2)
def test_rotation(comm):
    """Aggregators rotate with the round (a vector of one chunk): in each round a member
    sends its N bytes to one peer only (its aggregator), an aggregator sends N to each of
    its members and to at least one peer above (the next level's aggregator, or its
    partners in the top allreduce); so, from traffic(), over R consecutive rounds every
    member of every region of several ranks is the aggregator once. Every round's result
    equals MPI_Allreduce, the same bits on every rank. Shapes: uneven, two levels (at
    P = 2 both have a single top aggregator or no region of two, so only the results
    are checked there)."""
    p = comm.size
    count, n = 1000, 8000                     # float64, one chunk
    for name in ("uneven", "levels"):
        groups = shapes(p)[name]
        levels = tree.normalize_groups(groups, p)
        coll = pc.allreduce_init(count, np.float64, comm=comm, algorithm="tree", groups=groups, seed=1)
        R = coll._variants
        biggest = max(levels[0].count(g) for g in set(levels[0]))
        assert R == tree.rotations(count, 8, levels) and R >= biggest, (R, levels)
        region = [r for r in range(p) if levels[0][r] == levels[0][comm.rank]]
        aggregated = set()
        before = coll.traffic()
        for rnd in range(2 * R):
            x = values(np.float64, MPI.SUM, count, comm.rank, rnd)
            ref = np.empty_like(x)
            comm.Allreduce(x, ref, op=MPI.SUM)
            res = coll.post(x).wait()
            assert_matches(res.data, ref, MPI.SUM, f"rotation {name} round {rnd}")
            assert len(set(comm.allgather(zlib.crc32(res.data.tobytes())))) == 1, f"round {rnd}: ranks disagree"
            after = coll.traffic()
            delta, before = after - before, after
            # innermost level: am I my region's aggregator this round? (N to 2 peers or more)
            mine = [m for m in region if m != comm.rank]
            agg_here = len(mine) > 0 and int((delta >= n).sum()) >= 2
            plan = tree.Plan(levels, 0, 1, rotation=rnd % R)
            if len(plan.top) > 1:
                assert agg_here == (comm.rank in plan.members[0] and len(mine) > 0), (name, rnd, delta, plan.members)
            aggs = comm.allgather(agg_here)
            if rnd < R:
                aggregated |= {r for r in range(p) if aggs[r]}
        coll.close()
        # over R rounds every member of every region of several ranks aggregated
        several = {r for r in range(p) if levels[0].count(levels[0][r]) > 1}
        if len(tree.Plan(levels, 0, 1).top) > 1:
            assert aggregated == several, (name, sorted(aggregated), sorted(several))


def test_auto_with_groups(comm):
    """algorithm="auto" with groups=: what the model picks with these regions and this
    machine's parameters (the tree only where the regions are non-trivial), equal to
    MPI_Allreduce, the same bits on every rank. Without groups= on one node: never the tree."""
    from partialcoll.algorithms import explain, model
    p = comm.size
    big = (64 << 10) // 8 + 3                        # float64 elements
    for name in ("uneven", "levels", "one", "each"):
        groups = shapes(p)[name]
        for count in (big, 5):
            nbytes = count * 8
            coll = pc.PartialAllreduce(count, np.float64, MPI.SUM, comm, mode="full", groups=groups)
            want = explain("auto", nbytes, p, tree.normalize_groups(groups, p), model.load(), 8)
            assert coll.algorithm == want[0] and coll.algorithm_reason == want[1], (name, count, coll.algorithm, want)
            assert coll.algorithm != "tree" or name in ("uneven", "levels"), (name, p, count)
            for salt in range(2):
                x = values(np.float64, MPI.SUM, count, comm.rank, salt)
                ref = np.empty_like(x)
                comm.Allreduce(x, ref, op=MPI.SUM)
                res = coll.post(x).wait()
                assert_matches(res.data, ref, MPI.SUM, f"auto groups={name} count={count}")
                assert len(set(comm.allgather(zlib.crc32(res.data.tobytes())))) == 1
            coll.close()
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    if node.size == p:                               # one node: one region, nothing for a tree
        coll = pc.allreduce_init(big, np.float64, comm=comm)
        assert coll.algorithm != "tree" and coll.groups is None, coll.algorithm
        coll.close()
    node.Free()


def test_bad_groups(comm):
    p, r = comm.size, comm.rank
    expect_raises(pc.ArgumentError, pc.allreduce_init, 4, comm=comm, algorithm="tree", groups=[0] * (p + 1),
                  match="one entry per rank")
    expect_raises(pc.ArgumentError, pc.allreduce_init, 4, comm=comm, algorithm="ring", groups=[0] * p,
                  match="algorithm='tree'")
    if p > 1:
        expect_raises(pc.ArgumentError, pc.allreduce_init, 4, comm=comm, algorithm="tree",
                      groups=[0] * p if r else list(range(p)), match="groups differs across ranks")
        exc = expect_raises(pc.ArgumentError, pc.allreduce_init, 4, comm=comm, algorithm="tree",
                            groups=[[0]] * p if r == 1 else [0] * p)
        assert ("rank 1 rejected" in str(exc)) if r != 1 else ("level" in str(exc)), exc


if __name__ == "__main__":
    run_module(__file__)
