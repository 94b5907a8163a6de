"""Who is slow (issue 55) under mpiexec: python stats_checks.py [ROUNDS]

The reference is what the test injects, never the library: rank s sleeps 20 ms +- 5 ms
before every post (its own random stream), and coll.stats() must name it:
stragglers()[0] is s in every mode; in full mode it holds >= 90 % of waited_for_s; with
nobody delayed, no rank is blamed for more than a tenth of what s was; two delayed ranks
(20 ms and 10 ms) are both named, in that order. A rank that is late without being slow
(every rank steps every 60 ms, one of them 20 ms after the others) is named too: the telemetry
comes from the rounds, not from step timers. stats() is collective and every rank gets
the same view (checked against rank 0's); close() keeps it for stats() after close.
"""
from __future__ import annotations

import random
import time

import numpy as np
import pytest
from mpi4py import MPI

import partialcoll as pc
from _util import ARGS, run_module

MODES = ["solo", "majority", "probe", "quorum", "full"]
ROUNDS = int(ARGS[0]) if ARGS else 30
# A full round's end is noted by the progress pass that sees its last message; a waiting
# rank's thread naps up to deep_sleep_us (20 ms by default) after 20 ms without events,
# and that nap would blur the on-time ranks' arrivals by milliseconds with 8 ranks on 2
# cores. 1 ms keeps what is measured the ranks' arrivals (docs/who-is-slow.md).
pc.rc.deep_sleep_us = 1000.0


def _coll(comm, mode):
    kw = {"candidates": 2} if mode == "probe" else {"quorum": max(1, comm.size // 2)} if mode == "quorum" else {}
    return pc.PartialAllreduce(4, np.float32, MPI.SUM, comm, mode=mode, **kw)


def _run(comm, mode, delays, rounds=ROUNDS):
    """rounds of post+wait, rank r sleeping delays[r] +- 5 ms before each post."""
    coll = _coll(comm, mode)
    rng = random.Random(1000 * comm.rank + len(delays))
    d = delays.get(comm.rank, 0.0)
    x = np.ones(4, np.float32)
    comm.Barrier()
    for _ in range(rounds):
        if d:
            time.sleep(d + rng.uniform(-0.005, 0.005))
        coll.post(x).wait()
    coll.close()
    stats = coll.stats()
    _same_everywhere(comm, stats)
    return stats


def _same_everywhere(comm, stats):
    mine = stats.to_dict()
    mine.pop("rank")
    first = comm.bcast(mine, root=0)
    assert mine == first, f"rank {comm.rank}'s view differs from rank 0's:\n{stats}"


def _slow(comm):
    return comm.size - 2          # neither rank 0 nor the last


@pytest.mark.parametrize("mode", MODES)
def test_one_delayed(comm, mode):
    s = _slow(comm)
    delayed = _run(comm, mode, {s: 0.020})
    assert delayed.rounds >= ROUNDS - 1, delayed        # a closing round is not counted
    assert delayed.stragglers()[0] == s, f"{mode}: rank {s} was delayed\n{delayed}"
    if mode == "full":
        share = delayed.waited_for_s[s] / delayed.waited_for_s.sum()
        assert share >= 0.9, f"full: rank {s} holds {share:.0%} of the waiting\n{delayed}"
        assert delayed.full == delayed.rounds, delayed
    calm = _run(comm, mode, {})
    worst = calm.blame().max()
    assert worst <= 0.1 * delayed.blame()[s], (f"{mode}: with nobody delayed rank {int(calm.blame().argmax())} is "
                                              f"blamed for {worst:.4f}, rank {s} delayed for "
                                              f"{delayed.blame()[s]:.4f}\n{calm}\n{delayed}")


@pytest.mark.parametrize("mode", MODES)
def test_two_delayed(comm, mode):
    if comm.size < 3:
        pytest.skip("two delayed ranks and a prompt one need P >= 3")
    a, b = comm.size - 1, 1          # 20 ms and 10 ms
    stats = _run(comm, mode, {a: 0.020, b: 0.010})
    assert stats.stragglers()[:2] == [a, b], f"{mode}: ranks {a} (20 ms) and {b} (10 ms) were delayed\n{stats}"


@pytest.mark.parametrize("mode", ["full", "solo"])
def test_late_without_being_slow(comm, mode, period=0.06, shift=0.02):
    """Every rank's step takes `period` (it sleeps until its next slot); rank s's slots are
    `shift` later than the others'. Each rank reads only its own clock."""
    s = _slow(comm)
    coll = _coll(comm, mode)
    x = np.ones(4, np.float32)
    comm.Barrier()
    t0 = time.monotonic() + 0.01 + (shift if comm.rank == s else 0.0)
    steps = []
    for k in range(ROUNDS):
        time.sleep(max(0.0, t0 + k * period - time.monotonic()))
        start = time.monotonic()
        coll.post(x).wait()
        steps.append(time.monotonic() - start)
    stats = coll.stats()
    coll.close()
    _same_everywhere(comm, stats)
    assert stats.stragglers()[0] == s, f"{mode}: rank {s}'s steps were shifted by {shift} s\n{stats}"


def test_neighbor_stats_name_the_slow_neighbour(comm):
    """NeighborAllreduce (a two-way ring, staleness 2): the ring neighbours of the rank that
    sleeps 20 ms before each post find its updates late most often (their own view), and
    latest on average, and blame it for most of their waiting (lateness_s, waited_for_s:
    the updates' arrival times against this rank's entries); the seconds blamed are
    within the loop's own time (time.monotonic); ranks that are not in-neighbours have
    none."""
    s, r, P = _slow(comm), comm.rank, comm.size
    adjacency = sorted({(r - 1) % P, (r + 1) % P} - {r})
    g = comm.Create_dist_graph_adjacent(adjacency, adjacency, reorder=False)
    coll = pc.NeighborAllreduce(2, np.float64, comm=g, max_staleness=2)
    x = np.ones(2)
    t0 = time.monotonic()
    for _ in range(ROUNDS):
        if r == s:
            time.sleep(0.02)
        coll.post(x).wait()
    spent = time.monotonic() - t0
    stats = coll.stats
    coll.close()
    g.Free()
    assert stats["rounds"] == ROUNDS and len(stats["late"]) == P, stats
    waited, mean = np.array(stats["waited_for_s"]), np.array(stats["lateness_s"]["mean"])
    others = [q for q in range(P) if q not in adjacency]
    assert 0 <= waited.sum() <= spent and not waited[others].any() and np.isnan(mean[others]).all(), stats
    if s in adjacency:
        assert stats["stragglers"][:1] == [s], f"rank {r}: its neighbour {s} was delayed: {stats}"
        assert max(adjacency, key=lambda q: waited[q]) == s and max(adjacency, key=lambda q: mean[q]) == s, \
            f"rank {r}: its neighbour {s} was delayed: {stats}"
        assert waited[s] >= 0.5 * waited.sum() > 0 and mean[s] > 0, f"rank {r}: its neighbour {s} was delayed: {stats}"


def test_local_view_and_after_close(comm):
    """stats(local=True) asks nobody; stats() after close() gathers the kept records."""
    coll = _coll(comm, "full")
    for _ in range(5):
        coll.post(np.ones(4, np.float32)).wait()
    mine = coll.stats(local=True)
    assert not mine.gathered and mine.rank == comm.rank and mine.rounds == 5, mine
    others = [r for r in range(comm.size) if r != comm.rank]
    assert np.isnan(mine.lateness[others]).all(), mine.lateness
    full = coll.stats()
    assert full.gathered and full.rounds == 5 and "who is slow" in str(full), full
    coll.close()
    after = coll.stats()
    assert after.rounds == 5 and after.to_dict()["waited_for_s"] == full.to_dict()["waited_for_s"], (after, full)
    assert pc.Stats.from_dict(after.to_dict()).to_dict() == after.to_dict()


def test_a_round_ending_here_during_construction_is_counted(comm, monkeypatch):
    """The telemetry records from the first round: a peer's solo round 0 that ends here
    while this rank's constructor is still running (held up here for 0.3 s right where
    the constructor switches the telemetry on) is in stats(local=True).rounds."""
    from partialcoll import _stats
    if comm.rank != 0:
        switch_on = _stats.switch_on
        monkeypatch.setattr(_stats, "switch_on", lambda coll, c: (time.sleep(0.3), switch_on(coll, c))[1])
    coll = _coll(comm, "solo")
    if comm.rank == 0:
        assert coll.post(np.ones(4, np.float32)).wait(timeout=30).round == 0
    deadline = time.monotonic() + 10
    while coll.stats(local=True).rounds < 1 and time.monotonic() < deadline:
        time.sleep(0.002)           # round 0 ends here with rank 0's data, or not at all
    assert coll.stats(local=True).rounds == 1, coll.stats(local=True)
    coll.close()


if __name__ == "__main__":
    run_module(__file__)
