"""Partial allreduce semantics (issue 4): python partial_checks.py MODES [ROUNDS]

MODES: one mode or several, comma-separated (solo,majority,...): every check runs once
per mode in the one job (its id names the mode, e.g. test_staleness[probe]).

Every rank sleeps a random 0-20 ms before each post (seeded per rank), so rounds start
with different initiators and different active sets. PC_TEST_BUFFERS=cupy|emulated runs the
same checks with device buffers (tests/mpi/_devices.py).
"""
from __future__ import annotations

import time

import numpy as np
import pytest
from mpi4py import MPI

import partialcoll as pc
from _devices import KIND, on_buffers
from _reference import candidates
from _util import ARGS, expect_raises, nap_until_told, run_module

MODES = ARGS[0].split(",") if ARGS else ["solo"]
ROUNDS = int(ARGS[1]) if len(ARGS) > 1 else 100
COUNT = 5


@pytest.fixture(params=MODES)
def mode(request) -> str:
    """The partial mode the check runs in: each of MODES in turn."""
    return request.param


def options(comm, mode):
    if mode == "quorum":
        return {"quorum": max(1, (comm.size + 1) // 2)}
    if mode == "probe":
        return {"candidates": 2}
    return {}


def make(*args, **kwargs):
    return on_buffers(pc.PartialAllreduce(*args, **kwargs))


def skewed_rounds(comm, coll, rounds, value_of, max_sleep=0.01):
    """Post value_of(i) after a random sleep (none at P = 1: nobody to be skewed against),
    wait; returns [(request, result, posted)]."""
    rng = np.random.default_rng(1000 + comm.rank)
    max_sleep = max_sleep if comm.size > 1 else 0.0
    out = []
    for i in range(rounds):
        time.sleep(rng.uniform(0, max_sleep))
        x = value_of(i)
        req = coll.post(x)
        out.append((req, req.wait(), x))
    return out


def check_membership(comm, coll, log, mode):
    p, k = comm.size, options(comm, mode).get("quorum")
    for req, res, _ in log:
        n = res.round
        if res.rounds == 1 and not res.closing:      # rounds forced by close() are exempt
            if mode == "full":
                assert res.active == tuple(range(p)), res
            elif mode == "quorum":
                assert res.nap >= k, (n, res.active, k)
            elif mode in ("majority", "probe"):
                # the reference, not the engine's own pc_candidates (a choice that ignored
                # the seed or the round would agree with itself)
                cand = candidates(coll.seed, n, p, coll.candidates if mode == "probe" else 1)
                assert cand == coll.candidates_of(n), (n, cand, coll.candidates_of(n))
                assert set(cand) & set(res.active), (mode, n, cand, res.active)
                if mode == "majority":
                    assert cand[0] in res.active
        if res.round == req.index and res.rounds == 1:
            # a late post's data waits for a later round, but the rank is active if a
            # leftover of its earlier posts is inside
            assert res.contributed == (not req.late), (req.index, res)
            assert comm.rank in res.active or not res.contributed, (req.index, res)
        elif not req.late and res.round - res.rounds < req.index <= res.round:
            assert res.contributed, (req.index, res)     # its own round is among those data covers
        if res.rounds == 1:
            assert res.nap == len(res.active), res
        assert res.round >= req.index, "a post returned before its round completed"


def check_agreement(comm, log):
    """Single-round results: data, active and round identical on every rank."""
    mine = {res.round: (res.data.tobytes(), res.active) for _, res, _ in log if res.rounds == 1}
    everyone = comm.allgather(mine)
    for n, val in mine.items():
        for r, theirs in enumerate(everyone):
            if n in theirs:
                assert theirs[n] == val, f"round {n}: rank {comm.rank} and rank {r} disagree"


def test_fold_sum_nothing_lost(comm, mode):
    coll = make(COUNT, np.int64, MPI.SUM, comm, mode=mode, late="fold", seed=7, **options(comm, mode))
    log = skewed_rounds(comm, coll, ROUNDS, lambda i: np.arange(COUNT, dtype=np.int64) * 1000 + comm.rank * 7 + i)
    final = coll.close()
    received = sum(res.data for _, res, _ in log) + final.data
    posted = comm.allreduce(sum(x for _, _, x in log))
    assert np.array_equal(received, posted), (received, posted)
    rounds = sum(res.rounds for _, res, _ in log) + final.rounds
    assert rounds == final.round + 1, f"fold covered {rounds} rounds, {final.round + 1} ran"
    # Counts: every rank's results cover every round once, so their posts add up to every
    # post of every rank, each counted once; the NAPs count each (rank, round) whose data
    # is inside: at least the posts that were not late (each in its own round), at most
    # every post
    posts = sum(res.posts for _, res, _ in log) + final.posts
    assert posts == comm.allreduce(len(log)), (posts, comm.allreduce(len(log)))
    naps = sum(res.nap for _, res, _ in log) + final.nap
    assert comm.allreduce(sum(not req.late for req, _, _ in log)) <= naps <= posts, naps
    # contributed: with fold, a post that was not late finds its own round in its result;
    # a late one's data waits for a later round, so it is inside only if that round is
    for req, res, _ in log:
        assert res.contributed or req.late, (req.index, res)
        assert not (req.late and res.round == req.index and res.contributed), (req.index, res)
    check_membership(comm, coll, log, mode)
    check_agreement(comm, log)
    expect_raises(pc.StateError, coll.post, np.zeros(COUNT, np.int64), match="closed")


def test_fold_in_place_nothing_lost(comm, mode):
    """In-place posts, post(x, out=x), lend x to the engine as its accumulator: 1 MiB
    buffers, now and then two posts before a wait (the second folds the first's lent
    buffer into its own), now and then a copying post in between. Nothing posted is lost
    or counted twice, and each in-place result lands in its own buffer."""
    n = 1 << 17                                        # 1 MiB of int64
    coll = make(n, np.int64, MPI.SUM, comm, mode=mode, late="fold", seed=11, **options(comm, mode))
    rng = np.random.default_rng(2000 + comm.rank)
    posted = np.zeros(n, np.int64)
    received = np.zeros(n, np.int64)
    rounds = 0
    for i in range(max(20, ROUNDS // 4)):
        time.sleep(rng.uniform(0, 0.01))
        bufs = [np.arange(n, dtype=np.int64) * (k + 1) + comm.rank * 7 + i for k in range(1 + (i % 3 == 1))]
        for b in bufs:
            posted += b
        in_place = i % 5 != 4
        reqs = [coll.post(b, out=b) if in_place else coll.post(b) for b in bufs]
        for b, req in zip(bufs, reqs):
            res = req.wait(timeout=60)
            if in_place and KIND == "host":
                assert np.shares_memory(res.data, b) and np.array_equal(res.data, b)
            received += res.data
            rounds += res.rounds
    final = coll.close()
    received += final.data
    assert rounds + final.rounds == final.round + 1, (rounds, final.rounds, final.round)
    assert np.array_equal(received, comm.allreduce(posted))


def test_fold_max_nothing_lost(comm, mode):
    coll = make(3, np.float64, MPI.MAX, comm, mode=mode, late="fold", seed=3, **options(comm, mode))
    rng = np.random.default_rng(comm.rank)
    log = skewed_rounds(comm, coll, ROUNDS // 4, lambda i: rng.normal(size=3), max_sleep=0.005)
    final = coll.close()
    # identity handling: rounds that folded nothing return -inf, not 0
    results = [res.data for _, res, _ in log if res.rounds > 0] + [final.data]
    for _, res, _ in log:
        if res.rounds == 0:
            assert (res.data == -np.inf).all()
    got = np.max(results, axis=0)
    posted = np.empty(3)
    comm.Allreduce(np.max([x for _, _, x in log], axis=0), posted, op=MPI.MAX)
    assert np.array_equal(got, posted), (got, posted)


def test_latest_each_value_once(comm, mode):
    """late="latest": every posted value appears in exactly one round's result."""
    coll = make(COUNT, np.int64, MPI.SUM, comm, mode=mode, late="latest", seed=11,
                               **options(comm, mode))
    log = skewed_rounds(comm, coll, ROUNDS, lambda i: np.full(COUNT, 1 + comm.rank + 10 * i, np.int64))
    final = coll.close()
    check_membership(comm, coll, log, mode)
    check_agreement(comm, log)
    rounds = {}
    for _, res, _ in log:
        assert res.rounds == 1
        rounds[res.round] = res.data
    everyone = comm.allgather(rounds)
    known = {}
    for theirs in everyone:
        known.update(theirs)
    # close() folds the rounds no wait() returned here: [final.round - rounds + 1, final.round]
    first = final.round - final.rounds + 1
    unknown_in_close = final.data - sum((known[n] for n in range(first, final.round + 1) if n in known),
                                        np.zeros(COUNT, np.int64))
    missing = [n for n in range(first) if n not in known]
    assert not missing, f"rounds {missing[:5]} were returned by no rank"
    total = sum((v for n, v in known.items() if n < first), np.zeros(COUNT, np.int64)) \
        + sum((known[n] for n in range(first, final.round + 1) if n in known), np.zeros(COUNT, np.int64)) \
        + unknown_in_close
    posted = comm.allreduce(sum(x for _, _, x in log))
    assert np.array_equal(total, posted), (total, posted)


def test_several_open_at_once(comm, mode):
    """Three collectives (one per 'layer') interleaved: they never interfere."""
    colls = [make(4 + j, np.int64, MPI.SUM, comm, mode=mode, late="fold", seed=j, **options(comm, mode))
             for j in range(3)]
    sums = [np.zeros(4 + j, np.int64) for j in range(3)]
    for _i in range(20):
        reqs = [c.post(np.full(4 + j, (j + 1) * 100 + comm.rank, np.int64)) for j, c in enumerate(colls)]
        for j, r in enumerate(reqs):
            sums[j] += r.wait().data
    for j, c in enumerate(colls):
        sums[j] += c.close().data
        expect = 20 * sum((j + 1) * 100 + r for r in range(comm.size))
        assert (sums[j] == expect).all(), (j, sums[j], expect)


def test_staleness(comm, mode):
    s = 3
    coll = make(2, np.int64, MPI.SUM, comm, mode=mode, late="fold", max_staleness=s,
                               **options(comm, mode))
    rng = np.random.default_rng(comm.rank)
    total = np.zeros(2, np.int64)
    covered = []                 # the staleness rounds inside each result: every one, once
    for i in range(40):
        time.sleep(rng.uniform(0, 0.004) * (comm.rank + 1))
        res = coll.post(np.ones(2, np.int64)).wait()
        assert res.round - i <= s, f"post {i} got round {res.round}: more than {s} rounds behind"
        full = [n for n in range(res.round - res.rounds + 1, res.round + 1) if (n + 1) % s == 0]
        if full:                 # a full round's active set is everyone: so is the fold's
            assert res.active == tuple(range(comm.size)), f"rounds {full} are staleness rounds: {res}"
        covered += full
        total += res.data
    last = res.round
    total += coll.close().data
    assert (total == 40 * comm.size).all()
    # fold: this rank's results cover every round up to the last once, so every staleness
    # round up to it was checked here (at least 39 // s of them: the last post's round >= 39)
    assert covered == [n for n in range(last + 1) if (n + 1) % s == 0] and len(covered) >= 39 // s, covered


@pytest.mark.mpi(min_size=2)
def test_liveness(comm, mode):
    """solo: one rank asleep in Python (not calling the library) until the others have
    completed 100 rounds (they tell it over a communicator of MPI's own); its later post
    returns at once; close() flushes its data."""
    if mode != "solo" or pc.rc.progress != "thread":
        pytest.skip("solo with the progress thread only")
    sleeper = comm.size - 1
    coll = make(1, np.int64, MPI.SUM, comm, mode="solo", late="fold")
    side = comm.Dup()
    got = 0
    if comm.rank == sleeper:
        heard = nap_until_told(side, range(sleeper), limit=30)
        assert heard == set(range(sleeper)), f"after 30 s asleep, only ranks {sorted(heard)} finished 100 rounds"
        req = coll.post(np.array([1000], np.int64))
        assert req.late and req.test(), "the sleeper's post should be late and complete at once"
        res = req.wait(timeout=1)
        assert res.round >= 99 and not res.contributed, res
        got += int(res.data[0])
    else:
        for _ in range(100):
            got += int(coll.post(np.array([1], np.int64)).wait().data[0])
        side.send(comm.rank, dest=sleeper)
    side.Free()
    got += int(coll.close().data[0])
    assert got == 100 * (comm.size - 1) + 1000, got


def test_bad_input(comm, mode):
    r = comm.rank
    for key, value in [("count", 5 + (r == comm.size - 1)), ("seed", r), ("mode", "solo" if r else "majority")]:
        if comm.size == 1 and key != "count":
            continue
        kw = {"count": 5, "seed": 0, "mode": mode}
        kw[key] = value
        if comm.size == 1:
            continue
        if kw["mode"] == "quorum":
            kw["quorum"] = 1
        if kw["mode"] == "probe":
            kw["candidates"] = 2
        count = kw.pop("count")
        expect_raises(pc.ArgumentError, pc.PartialAllreduce, count, np.float32, MPI.SUM, comm,
                      match="differs across ranks", **kw)
    expect_raises(pc.ArgumentError, pc.PartialAllreduce, 5, np.float32 if r else np.float64, MPI.SUM, comm,
                  match="dtype" if comm.size > 1 else "", **({} if comm.size > 1 else {"mode": "nonsense"}))
    expect_raises(pc.OpError, pc.PartialAllreduce, 5, np.float32, MPI.BXOR, comm, match="not defined")
    if comm.size > 1:                 # one rank's bad argument: it raises its error, the others name it
        bad = comm.rank == 1
        exc = expect_raises(pc.ArgumentError, pc.PartialAllreduce, -1 if bad else 5, np.float32, MPI.SUM, comm)
        assert ("count must be" in str(exc)) if bad else ("rank 1 rejected" in str(exc) and "count" in str(exc)), exc
    expect_raises(pc.ArgumentError, pc.PartialAllreduce, 5, np.float32, MPI.SUM, comm, mode="quorum",
                  quorum=comm.size + 1, match="quorum")
    if comm.size > 1:                 # intercommunicators are refused with a clear error
        half = comm.Split(comm.rank % 2)
        inter = half.Create_intercomm(0, comm, 1 - comm.rank % 2)
        expect_raises(pc.ArgumentError, pc.PartialAllreduce, 5, np.float32, MPI.SUM, inter, match="intercomm")
        expect_raises(pc.ArgumentError, pc.Schedule, inter, match="intercomm")
        inter.Free()
        half.Free()
    coll = pc.PartialAllreduce(5, np.float32, MPI.SUM, comm, mode=mode, **options(comm, mode))
    expect_raises(pc.InvalidBufferError, coll.post, np.zeros(4, np.float32), match="elements")
    expect_raises(pc.InvalidBufferError, coll.post, np.zeros(5, np.float64), match="dtype")
    expect_raises(pc.InvalidBufferError, coll.post, np.zeros((5, 2), np.float32)[:, 0], match="contiguous")
    coll.close()
    expect_raises(pc.StateError, coll.post, np.zeros(5, np.float32), match="closed")
    expect_raises(pc.StateError, coll.close, match="closed")


if __name__ == "__main__":
    run_module(__file__)
