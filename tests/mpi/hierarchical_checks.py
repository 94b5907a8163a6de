"""HierarchicalAllreduce under mpiexec: python hierarchical_checks.py (any P).

A NumPy model of the algorithm (full rounds inside groups, averaging between groups in
a fixed order) must match every rank's parameters exactly; under random delays with
solo rounds, late="fold" and a regrouping, every rank's results add up to exactly what
its groups' members posted in each grouping period (nothing lost, nothing counted
twice), also under random step times in every mode; a one-point blip does not regroup
(hysteresis), a sustained change does; real delays split off a slow rank; a rank that misses a regrouping point makes the others
raise Timeout; bad input raises on every rank."""
from __future__ import annotations

import time

import numpy as np
import pytest
from mpi4py import MPI

import partialcoll as pc
from partialcoll.hierarchical import SpeedGrouping
from partialcoll.speed_groups import split_by_speed
from _util import expect_raises, run_module


def quiet(req):
    while not req.Test():
        time.sleep(0.0005)


def test_numpy_model(comm):
    """Two speed classes; full rounds in each group; every 3 steps the groups average
    their models, group 0 first, then group 1, ... The model replays it in NumPy."""
    p, r = comm.size, comm.rank
    times = [0.01 if q < (p + 1) // 2 else 0.05 for q in range(p)]
    groups = split_by_speed(times)
    ngroups = max(groups) + 1
    count, steps, every = 6, 12, 3
    h = pc.HierarchicalAllreduce(count, np.float64, MPI.SUM, comm, mode="full", step_time=times[r])
    assert h.groups == tuple(groups) and h.group == groups[r]
    assert h.group_comm.Get_size() == groups.count(groups[r])
    # the model: every rank's parameters and the server's table
    model = {q: np.zeros(count) for q in range(p)}
    latest: dict = {}
    params = np.zeros(count)
    pushes = [0] * ngroups
    for s in range(steps):
        grad = np.arange(count) + 8.0 * r + s
        res = h.post(grad).wait()
        params -= 0.25 * res.data
        for g in range(ngroups):
            members = [q for q in range(p) if groups[q] == g]
            total = sum(np.arange(count) + 8.0 * q + s for q in members)
            for q in members:
                model[q] = model[q] - 0.25 * total
        assert res.posts == groups.count(groups[r]) and res.active == tuple(
            i for i, q in enumerate(q for q in range(p) if groups[q] == groups[r]))
        if (s + 1) % every == 0:
            for g in range(ngroups):          # one group at a time: the server's order is the model's
                members = [q for q in range(p) if groups[q] == g]
                pusher = members[pushes[g] % len(members)]
                pushes[g] += 1
                latest[g] = model[pusher].copy()
                mean = sum(latest[k] for k in latest) / len(latest)
                for q in members:
                    model[q] = mean.copy()
                if groups[r] == g:
                    params = h.average(params)
                quiet(comm.Ibarrier())
        assert np.array_equal(params, model[r]), (s, params, model[r])
    h.close()


def test_nothing_lost_across_regrouping(comm):
    """Rank r posts 64**r (int64: 50 posts fit a base-64 digit) after random sleeps;
    step times say: two classes until post 20, a one-point blip at post 20 (ignored: hysteresis 2), then from post
    30 the classes swap: regrouped at post 35. Every rank's results plus close() hold
    exactly its groups' members' posts of each period."""
    p, r = comm.size, comm.rank
    if p < 2:
        pytest.skip("one rank: a single group")
    before = [0.01 if q % 2 == 0 else 0.08 for q in range(p)]
    after = [0.08 if q % 2 == 0 else 0.01 for q in range(p)]
    after[0] = 0.01                              # a grouping that differs from before's
    blip = [0.01] * (p - 1) + [0.5]

    def times(i):
        return after if i >= 30 else blip if 20 <= i < 25 else before

    n = 50
    h = pc.HierarchicalAllreduce(2, np.int64, MPI.SUM, comm, mode="solo", late="fold", step_time=before[r],
                                 regroup_every=5, window=1, hysteresis=2, seed=3)
    first = h.groups
    rng = np.random.default_rng(40 + r)
    x = np.full(2, 64 ** r, np.int64)
    total = np.zeros(2, np.int64)
    regrouped_at = None
    for i in range(n):
        time.sleep(rng.uniform(0, 0.003))
        req = h.post(x, step_time=times(i)[r])
        if h.regroupings and regrouped_at is None:
            regrouped_at = i
        total += req.wait().data
    second = h.groups
    total += h.close().data
    assert regrouped_at == 35, regrouped_at
    assert tuple(first) == tuple(split_by_speed(before)) and tuple(second) == tuple(split_by_speed(after))
    want = sum(35 * 64 ** q for q in range(p) if first[q] == first[r]) + \
        sum((n - 35) * 64 ** q for q in range(p) if second[q] == second[r])
    assert np.all(total == want), (total, want, first, second)


@pytest.mark.parametrize("case", range(6))
def test_random_regroupings(comm, case):
    """Random step times (each rank in one of three speed classes, redrawn now and then),
    regroup_every, window and hysteresis; every mode (quorum k = P/2: groups smaller than
    k wait for all their ranks), every other case with max_staleness; some ranks wait for a result only after
    polling it; every few posts the groups average their models. Rank r posts 64**r
    (int64), so every rank's results plus close() must hold exactly, for each post, the
    posts of the members of its group at that post (nothing lost, nothing twice); every
    rank sees the same groups at every post, and (case 0: rank 0 slow for its first posts,
    then every rank alike) regroupings happen."""
    p, r = comm.size, comm.rank
    rng = np.random.default_rng(comm.bcast(int(np.random.default_rng(case).integers(1 << 30))))
    n = int(rng.integers(20, 40))                        # < 64 posts: one base-64 digit per rank
    classes = [0.01, 0.05, 0.3]
    speed = [rng.integers(0, 3, p) for _ in range(n)]     # rank q's class at post i ...
    for i in range(1, n):
        if rng.random() < 0.8:                           # ... mostly kept from post to post
            speed[i] = speed[i - 1]
    if case == 0:                                        # rank 0 slow, then every rank alike: a regrouping
        n = 36
        speed = [np.array([2 if q == 0 and i < 8 else 0 for q in range(p)]) for i in range(n)]
    mode = ["solo", "majority", "probe", "quorum", "full"][case % 5]
    extra = {"quorum": max(1, p // 2)} if mode == "quorum" else {}
    if case % 2:
        extra["max_staleness"] = 3                       # every third round of each group full
    h = pc.HierarchicalAllreduce(3, np.int64, MPI.SUM, comm, mode=mode, late="fold", seed=case,
                                 step_time=classes[speed[0][r]], regroup_every=int(rng.integers(1, 5)),
                                 window=int(rng.integers(1, 4)), hysteresis=int(rng.integers(1, 3)), **extra)
    average_every = int(rng.integers(3, 8))
    mine = np.random.default_rng(case * 100 + r)
    x = np.full(3, 64 ** r, np.int64)
    total = np.zeros(3, np.int64)
    seen = []                                            # the groups in force at each post
    for i in range(n):
        if mine.random() < 0.3:
            time.sleep(float(mine.random()) * 0.002)
        req = h.post(x, step_time=classes[speed[i][r]])
        seen.append(tuple(h.groups))
        while mine.random() < 0.4 and not req.test():
            pass
        total += req.wait(timeout=60).data
        if i % average_every == average_every - 1:
            mean = h.average(np.full(3, float(h.group), np.float64).astype(np.int64))
            assert mean.shape == (3,)
    total += h.close().data
    assert comm.allgather(seen) == [seen] * p
    want = sum(64 ** q for groups in seen for q in range(p) if groups[q] == groups[r])
    assert np.all(total == want), (total, want, seen, mode)
    if p > 1 and case == 0:
        assert h.regroupings >= 1 and seen[0] != seen[-1] == (0,) * p, seen


def test_regroup_on_measured_delays(comm):
    """No step times given: the last rank sleeps 200 ms per step, the others 20 ms; the
    one regrouping point puts it alone into the slowest group."""
    p, r = comm.size, comm.rank
    if p < 3:
        pytest.skip("needs two fast ranks and a slow one")
    h = pc.HierarchicalAllreduce(4, np.float32, MPI.SUM, comm, mode="probe", regroup_every=4, window=3,
                                 hysteresis=1, regroup_points=1)
    assert h.groups == (0,) * p
    for _ in range(9):
        time.sleep(0.2 if r == p - 1 else 0.02)     # far apart, each well above the noise
        h.post(np.ones(4, np.float32)).wait()
    assert h.regroupings == 1                       # at post 4, the only point
    slow = h.groups[p - 1]
    assert slow == max(h.groups) and h.groups.count(slow) == 1 and slow > 0, h.groups
    mean = h.average(np.full(4, float(h.group), np.float32))
    assert mean.shape == (4,)
    h.close()


def test_a_rank_missing_a_regrouping_point_is_a_timeout(comm):
    """The regrouping decision is a collective over the communicator (an allgather of step
    times): where a rank does not reach it (it took fewer steps), the others raise
    Timeout after rc.timeout instead of waiting for ever. The late rank's
    call then completes the allgather."""
    if comm.size == 1:
        pytest.skip("needs a rank that misses the point (P >= 2)")
    dup = comm.Dup()
    g = SpeedGrouping(dup, regroup_every=4)
    g.note(0.01)
    old, pc.rc.timeout = pc.rc.timeout, 0.3
    try:
        if comm.rank != 0:
            t0 = time.monotonic()
            expect_raises(pc.Timeout, g.decide, match="regrouping's allgather")
            assert time.monotonic() - t0 < 5.0
    finally:
        pc.rc.timeout = old
    comm.Barrier()                  # rank 0 comes after every other rank timed out
    if comm.rank == 0:
        assert g.decide() is False  # the same grouping: nothing is due
    comm.Barrier()                  # (the others' MPI calls complete their allgather)
    g.free()
    dup.Free()


def test_shrink_refused(comm):
    """on_failure="shrink" (passed, or partialcoll.rc's) raises ArgumentError on every rank,
    naming why (the averaging server, regrouping over every rank); one rank asking for it
    makes the others raise naming it; with rc's "shrink" and on_failure="raise" passed, the
    groups' collectives and the averager are made with "raise" (they would refuse or shrink
    alone otherwise)."""
    p, r = comm.size, comm.rank
    expect_raises(pc.ArgumentError, pc.HierarchicalAllreduce, 4, np.float32, MPI.SUM, comm, on_failure="shrink",
                  match="AsyncAverager's server")
    expect_raises(pc.ArgumentError, pc.HierarchicalAllreduce, 4, np.float32, MPI.SUM, comm,
                  on_failure="shrink" if r == p - 1 else "raise", match="no on_failure" if r == p - 1 else f"rank {p - 1}")
    pc.rc.on_failure = "shrink"
    try:
        expect_raises(pc.ArgumentError, pc.HierarchicalAllreduce, 4, np.float32, MPI.SUM, comm,
                      match="rc.on_failure is 'shrink'")
        h = pc.HierarchicalAllreduce(4, np.float32, MPI.SUM, comm, on_failure="raise")
    finally:
        pc.rc.on_failure = "raise"
    assert h._coll._shrink is None
    res = h.post(np.ones(4, np.float32)).wait(timeout=30)
    assert np.array_equal(res.data, np.full(4, res.posts, np.float32)), (res.data, res.posts)
    assert np.array_equal(h.average(np.full(4, 3.0, np.float32), timeout=30), np.full(4, 3.0, np.float32))
    h.close()


def test_errors_everywhere(comm):
    p, r = comm.size, comm.rank
    expect_raises(pc.ArgumentError, pc.HierarchicalAllreduce, 4, np.float32, MPI.SUM, comm, server=p,
                  match="server")
    expect_raises(pc.ArgumentError, pc.HierarchicalAllreduce, 4, np.float32, MPI.SUM, comm,
                  step_time=-1.0 if r == p - 1 else 0.1, match="step_time" if r == p - 1 else f"rank {p - 1}")
    if p > 1:
        expect_raises(pc.ArgumentError, pc.HierarchicalAllreduce, 4, np.float32, MPI.SUM, comm,
                      regroup_every=4 + r, match="regroup_every")
        expect_raises(pc.ArgumentError, pc.HierarchicalAllreduce, 4, np.float32, MPI.SUM, comm,
                      step_time=0.1 if r else None, match="step_time")
    expect_raises(pc.ArgumentError, pc.HierarchicalAllreduce, 4, np.float32, MPI.MAX, comm, regroup_every=3,
                  match="MPI.SUM")
    # average() with the wrong number of elements on one rank (the first call's pusher, then
    # another): every member raises at once; then good calls work (values convert to the
    # dtype, as np.asarray does)
    h = pc.HierarchicalAllreduce(4, np.float32, MPI.SUM, comm)
    for bad_rank, bad in ((0, np.zeros(5, np.float32)), (p - 1, np.zeros(3, np.float32))):
        x = bad if r == bad_rank else np.zeros(4, np.float32)
        exc = expect_raises(pc.PartialcollError, h.average, x, timeout=20)
        assert isinstance(exc, pc.InvalidBufferError) if r == bad_rank else f"rank {bad_rank}" in str(exc), exc
    for x in (np.full(4, 2.0, np.float32), [2.0] * 4 if r == p - 1 else np.full((2, 2), 2.0)):
        assert np.array_equal(h.average(x, timeout=20), np.full(4, 2.0, np.float32))
    h.close()
    # quorum k beyond the communicator, on one rank, while the first grouping splits it
    split = [0.01 if q % 2 else 1.0 for q in range(p)]
    expect_raises(pc.ArgumentError, pc.HierarchicalAllreduce, 4, np.float32, MPI.SUM, comm, mode="quorum",
                  quorum=p + 1 if r == p - 1 else 1, step_time=split[r],
                  match="quorum" if r == p - 1 else f"rank {p - 1}")


if __name__ == "__main__":
    run_module(__file__)
