"""Exact counts: python counts_checks.py MODES LATES [ROUNDS]
(MODES, LATES: comma-separated lists, e.g. solo,probe fold,latest: every combination is a check)

Rank r posts e_r, the r-th unit vector (int64, SUM), so a result's data says whose posts
it holds: its element r is the number of rank r's posts inside; and, in one more element,
1000**r where P <= 6 (where it fits int64), whose base-1000 digit r must say the same.
Ranks sleep a random 0-6 ms before each post and now and then post twice before waiting,
so rounds take leftovers of late posts. Every result must report exactly what its data
holds: posts (the sum of the counts), active (the ranks with a count) and, for one round,
nap == len(active); a fold of several rounds reports at least len(active) and at most
posts. With late="fold", the results plus close() hold every post exactly once.
"""
from __future__ import annotations

import time

import numpy as np
import pytest
from mpi4py import MPI

import partialcoll as pc
from _reference import DIGITS, contribution
from _util import ARGS, run_module

MODES = ARGS[0].split(",") if ARGS else ["majority"]
LATES = ARGS[1].split(",") if len(ARGS) > 1 else ["fold"]
ROUNDS = int(ARGS[2]) if len(ARGS) > 2 else 60


def check_result(res, p: int):
    """Rank r's posts inside a result: element r of its data."""
    k = [int(v) for v in res.data[:p]]
    if p <= DIGITS:
        assert [(int(res.data[p]) // 1000 ** r) % 1000 for r in range(p)] == k, res
    active = tuple(r for r in range(p) if k[r] > 0)
    assert res.posts == sum(k), f"posts={res.posts}, but the data holds {k} posts per rank: {res}"
    assert res.active == active, f"active={res.active}, but the data holds posts of {active}: {res}"
    if res.rounds == 1:
        assert res.nap == len(res.active), res
    else:
        assert len(res.active) <= res.nap <= res.posts, res
    return k


@pytest.mark.parametrize("late", LATES)
@pytest.mark.parametrize("mode", MODES)
def test_counts_are_exact(comm, mode, late):
    p, r = comm.size, comm.rank
    opts = {"quorum": {"quorum": max(1, (p + 1) // 2)}, "probe": {"candidates": 2}}.get(mode, {})
    coll = pc.PartialAllreduce(p + 1, np.int64, MPI.SUM, comm, mode=mode, late=late, seed=3, **opts)
    rng = np.random.default_rng(77 + r)
    x = contribution(r, p)
    posted, seen = 0, [0] * p
    multi = 0
    for _i in range(ROUNDS):
        time.sleep(rng.uniform(0, 0.006))
        reqs = [coll.post(x) for _ in range(1 + (rng.uniform() < 0.2))]
        posted += len(reqs)
        for req in reqs:
            res = req.wait(timeout=60)
            k = check_result(res, p)
            multi += sum(v > 1 for v in k)
            if late == "fold":
                seen = [a + b for a, b in zip(seen, k)]
    final = coll.close(timeout=60)
    k = check_result(final, p)
    if late == "fold":
        seen = [a + b for a, b in zip(seen, k)]
        assert seen == comm.allgather(posted), f"results hold {seen} posts per rank, ranks posted " \
                                               f"{comm.allgather(posted)}"
    # the run exercised leftovers somewhere: a result with two posts of one rank
    assert comm.allreduce(multi) > 0 or p == 1, "no round took two posts of one rank: the check saw no leftovers"


@pytest.mark.mpi(min_size=2)
def test_folded_nap_is_the_sum_of_its_rounds(comm):
    """solo, fold: the last rank sleeps (in Python, not calling the library) while the others
    run 12 rounds; its first post is late and returns the fold of every round it missed, whose
    nap must be exactly the sum of those rounds' active sets as the others' single-round
    results report them (a nap of len(active) lies within the bounds check_result allows)."""
    p, sleeper, rounds = comm.size, comm.size - 1, 12
    coll = pc.PartialAllreduce(p + 1, np.int64, MPI.SUM, comm, mode="solo", late="fold")
    side = comm.Dup()
    single = {}
    if comm.rank == sleeper:
        for _ in range(sleeper):                       # each of the others is done
            side.recv(source=MPI.ANY_SOURCE)
        # ... and this rank's engine has finished their rounds too: the others can be done
        # before it (at P = 5 the folded-in rank hears each result last); a post made before
        # returns the rounds finished here, and the round in flight comes with the next post
        deadline = time.monotonic() + 60
        while coll.stats(local=True).rounds < rounds:
            assert time.monotonic() < deadline, coll.stats(local=True)
            time.sleep(0.001)
        res = coll.post(contribution(comm.rank, p)).wait(timeout=60)
        check_result(res, p)
    else:
        for _ in range(rounds):
            res = coll.post(contribution(comm.rank, p)).wait(timeout=60)
            check_result(res, p)
            if res.rounds == 1:
                single[res.round] = len(res.active)
        side.send(comm.rank, dest=sleeper)
        res = None
    known = {}
    for theirs in comm.allgather(single):
        known.update(theirs)
    folded = comm.bcast(res, root=sleeper)
    coll.close(timeout=60)
    side.Free()
    covered = range(folded.round - folded.rounds + 1, folded.round + 1)
    assert folded.rounds >= rounds and all(n in known for n in covered), (folded, sorted(known))
    assert folded.nap == sum(known[n] for n in covered), (folded, known)


if __name__ == "__main__":
    run_module(__file__)
