"""close() with uneven post counts: python close_checks.py MODES LATES COUNTS
(comma-separated lists, e.g. solo,full fold,latest 1,131072: every combination is a check)

Ranks post different numbers of times (3 + 2*rank, then the reverse pattern), some
waiting on every request and some never waiting, then all close(). close() must return
on every rank, and nothing posted may be lost: with late="fold" and SUM, at every rank,
the sum of every result it received plus close()'s result equals the sum of every value
posted by every rank (integers, so exactly). With late="latest" the rounds' results that
reached some rank (a wait or a close()) add up to everything posted, and results of the
same round agree across ranks. The same for two
collectives posted to in turn and closed together (partialcoll.close_all).
"""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from mpi4py import MPI

import partialcoll as pc
from _util import ARGS, run_module

MODES, LATES, COUNTS = ARGS[0].split(","), ARGS[1].split(","), [int(c) for c in ARGS[2].split(",")]

# how many times rank r of p posts, whether it waits for its requests, and how long it
# pauses before its post #i (s; i = its number of posts: before its close())
PATTERNS = {
    # the issue's, all wait; the others pause before post #3, so that rank 0, done after
    # 3, has begun close() when the rounds go on: they show its closing bit (at P = 2 the
    # two rounds after rank 0's last could end before its close() began)
    "increasing": (lambda r, p: 3 + 2 * r, lambda r: True, lambda r, p, i: 0.02 if r > 0 and i == 3 else 0),
    # odd ranks never wait, and pause before close(): rounds they triggered by their post
    # count run after their posts were all taken, without them and before their closing bit
    "reversed": (lambda r, p: 3 + 2 * (p - 1 - r), lambda r: r % 2 == 0,
                 lambda r, p, i: 0.02 if r % 2 and i == 3 + 2 * (p - 1 - r) else 0),
    "one_never_posts": (lambda r, p: 0 if r == 0 else 4, lambda r: True, lambda r, p, i: 0),
    "none_wait": (lambda r, p: 2 + r, lambda r: False, lambda r, p, i: 0),   # every round reaches the ranks in close()
}


def options(mode, size):
    if mode == "quorum":
        return {"quorum": max(1, (size + 1) // 2)}
    return {}


def value(rank, i, count):
    return np.full(count, 1000 * (rank + 1) + i, dtype=np.int64)


def post_in_pattern(comm, colls, count, pattern, pause_before_close=True):
    """Rank r posts posts(r, p) times to each of colls, in turn, waiting and pausing where
    the pattern says (before close() too, if pause_before_close); returns the sum of the
    results it received from each, and the round values seen."""
    posts, waits, pause = PATTERNS[pattern]
    received = [np.zeros(count, np.int64) for _ in colls]
    seen = [{} for _ in colls]

    def nap(i):
        seconds = pause(comm.rank, comm.size, i)
        if seconds:         # never sleep(0): it may hand the GIL to another thread for 5 ms
            time.sleep(seconds)
    for i in range(posts(comm.rank, comm.size)):
        nap(i)
        for k, coll in enumerate(colls):
            req = coll.post(value(comm.rank, i, count) * (k + 1))
            if waits(comm.rank):
                res = req.wait(timeout=60)
                received[k] += res.data
                if res.rounds == 1:
                    seen[k][res.round] = int(res.data[0])
                if res.rounds >= 1:
                    ROUNDS_SEEN.append((k, res.round, res.rounds, res.active, res.closing))
    if pause_before_close:
        nap(posts(comm.rank, comm.size))
    return received, seen


ROUNDS_SEEN: list = []      # (collective, last round, rounds, active, closing) of the results here


def check_closing(comm, final, pattern):
    """After a round that shows a closing bit, every later round is full: each rank is in
    it — active, closing and standing in, or with nothing to give: a rank triggers round n
    once it has posted more than n times, and a round reads every post made before it
    reads the accumulator, so a rank that posted ahead of the rounds (never waiting) may
    have had its post #n taken by an earlier round. A rank neither active nor closing in
    round n must therefore have posted more than n times. `closing` never loses a rank
    once named, and names every rank in the final round. Returns whether a closing bit
    was seen. A result folding rounds a..b (a rank late to some of them, as a loaded
    machine makes it) says who was active in any of them and who was closing by round b:
    it is checked as the rounds a..b together (full after a closing bit seen by an
    earlier result)."""
    everyone = set(range(comm.size))
    posts = PATTERNS[pattern][0]
    rounds = {}
    for theirs in comm.allgather([r for r in ROUNDS_SEEN if r[0] == 0]):
        for _, last, count, active, closing in theirs:
            rounds[(last - count + 1, last)] = (set(active), set(closing))
    ROUNDS_SEEN.clear()
    assert set(final.closing) == everyone, final
    first = min((last for (_, last), (_, closing) in rounds.items() if closing), default=None)
    before, before_at = set(), None
    for (start, last) in sorted(rounds, key=lambda span: (span[1], span[0])):
        active, closing = rounds[(start, last)]
        if before_at is None or last > before_at:
            assert before <= closing, f"round {last}: closing {sorted(closing)} lost some of {sorted(before)}"
            before, before_at = closing, last
        if first is not None and start > first:
            absent = sorted(r for r in everyone - active - closing if posts(r, comm.size) <= last)
            assert not absent, f"rounds {start}-{last} after closing bits in round {first}: not full: ranks " \
                               f"{absent} had posted at most {last} times and were not closing " \
                               f"(active {sorted(active)}, closing {sorted(closing)})"
    return first is not None


def posted_total(comm, pattern, scale=1):
    posts = PATTERNS[pattern][0]
    p = comm.size
    return scale * sum(int(value(r, i, 1)[0]) for r in range(p) for i in range(posts(r, p)))


def check_flushed(comm, pattern, late, received, seen, scale=1):
    """fold: every result received + close()'s == everything posted; the same round's
    results agree across ranks."""
    if late == "fold":
        total = posted_total(comm, pattern, scale)
        assert np.all(received == total), (comm.rank, received[:2], total)
    everyone = comm.allgather(seen)
    for other in everyone:
        for n, v in other.items():
            if n in seen:
                assert seen[n] == v, (n, seen[n], v)


@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("late", LATES)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("count", COUNTS)
def test_uneven_posts(comm, count, mode, late, pattern):
    coll = pc.PartialAllreduce(count, np.int64, MPI.SUM, comm, mode=mode, late=late, **options(mode, comm.size))
    # no pause before close() with late="latest": rounds a pausing rank never waited for
    # and that later ones replace meanwhile are in none of its results (docs/semantics.md),
    # and check_latest_nothing_lost needs every round to reach some rank
    (received,), (seen,) = post_in_pattern(comm, [coll], count, pattern, pause_before_close=late == "fold")
    final = coll.close(timeout=60)
    received += final.data
    check_flushed(comm, pattern, late, received, seen)
    closing_seen = check_closing(comm, final, pattern)
    if pattern == "increasing" and comm.size > 1:
        # rank 0 is done after 3 posts, the last rank waits for 3 + 2 (P - 1) rounds
        assert closing_seen, "no round showed a closing bit: the check saw nothing"
    if late == "latest":
        check_latest_nothing_lost(comm, pattern, seen, final)


def check_latest_nothing_lost(comm, pattern, seen, final):
    """late="latest" loses nothing either: every round's result reached some rank, by a
    wait or inside its close() (which folds the rounds after the last one its waits
    returned), so the rounds' data add up to everything posted. The close() covering the
    most rounds covers every round no wait returned anywhere."""
    known = {}
    for theirs in comm.allgather(seen):
        known.update(theirs)
    finals = comm.allgather((final.round - final.rounds + 1, final.round, int(final.data[0])))
    assert len({last for _, last, _ in finals}) == 1, finals       # one final round everywhere
    first, last, data = min(finals)
    missing = [n for n in range(first) if n not in known]
    assert not missing, f"rounds {missing[:5]} were returned by no rank's wait nor inside a close()"
    total = sum(known[n] for n in range(first)) + data
    assert total == posted_total(comm, pattern), (total, posted_total(comm, pattern), first, last, known)


@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("mode", MODES)
def test_close_all_uneven_posts(comm, mode, pattern):
    """Two collectives posted to in turn, unevenly, closed together (close_all): a rank
    that is done shadows both while the others still post (one by one, a rank in the
    first close() does not trigger the second one's rounds: majority and full hang)."""
    colls = [pc.PartialAllreduce(1, np.int64, MPI.SUM, comm, mode=mode, late="fold", **options(mode, comm.size))
             for _ in range(2)]
    received, seen = post_in_pattern(comm, colls, 1, pattern)
    ROUNDS_SEEN.clear()
    for k, final in enumerate(pc.close_all(colls, timeout=60)):
        check_flushed(comm, pattern, "fold", received[k] + final.data, seen[k], scale=k + 1)


def test_close_all_checks_its_list(comm):
    """A closed collective or one listed twice: an error on every rank before any closing
    begins (the others are still usable, then closed)."""
    a, b = (pc.PartialAllreduce(2, np.float64, MPI.SUM, comm, late="fold") for _ in range(2))
    a.close()
    with pytest.raises(pc.StateError, match="closed already"):
        pc.close_all([b, a])
    with pytest.raises(pc.ArgumentError, match="twice"):
        pc.close_all([b, b])
    with pytest.raises(pc.ArgumentError, match="not list"):
        pc.close_all([b, []])
    got = b.post(np.ones(2)).wait(timeout=60).data + pc.close_all([b])[0].data
    assert np.array_equal(got, np.full(2, comm.size)), got
    assert pc.close_all([]) == []


def test_close_all_while_a_thread_waits(comm):
    """Rank 0's thread waits for a full round the others have not posted to: close_all()
    on rank 0 raises StateError before it begins closing anything; once the round is
    done, every rank closes both collectives."""
    if comm.size == 1:
        pytest.skip("needs a peer that has not posted yet (P >= 2)")
    full = pc.PartialAllreduce(2, np.float64, MPI.SUM, comm, mode="full", late="fold")
    solo = pc.PartialAllreduce(2, np.float64, MPI.SUM, comm, late="fold")
    got = []
    if comm.rank == 0:
        req = full.post(np.ones(2))
        waiter = threading.Thread(target=lambda: got.append(req.wait(timeout=60).data))
        waiter.start()
        while not full._waiting and waiter.is_alive():
            time.sleep(0.001)
        with pytest.raises(pc.StateError, match="another thread waits"):
            pc.close_all([solo, full])
        assert not solo._closing and not full._closing
    comm.Barrier()
    if comm.rank != 0:
        got.append(full.post(np.ones(2)).wait(timeout=60).data)
    else:
        waiter.join()
    finals = pc.close_all([solo, full])
    assert np.array_equal(got[0] + finals[1].data, np.full(2, comm.size)), (got, finals[1].data)
    assert np.array_equal(finals[0].data, np.zeros(2))


if __name__ == "__main__":
    run_module(__file__)
