"""Algorithm "ps" (blocks reduced by their owners) against MPI_Allreduce, and its owner
options: python ps_checks.py

Every op x dtype at counts of no block, less than one block, several blocks and a
partial last block, with every rank a server and with dedicated servers; divisor=;
a rank that only serves and never posts; owner_times() and assignment() agreed by
every rank; bad owner options raise the same error on every rank."""
from __future__ import annotations

import os
import time

import numpy as np
import pytest
from mpi4py import MPI

import partialcoll as pc
from _data import Bitwise, assert_matches, combos, covering_combos, values
from _util import expect_raises, run_module


def server_sets(p):
    sets = [None, [0]]
    if p > 2:
        sets.append([p - 1, 1])          # a subset, unordered: rank 0 only sends
    return sets


def check(comm, bitwise, count, dtype, op, servers, block_items=3):
    """The result against MPI_Allreduce's, and into bitwise (a _data.Bitwise) to compare across ranks."""
    x = values(dtype, op, count, comm.rank, 7)
    ref = np.empty_like(x)
    comm.Allreduce(x, ref, op=op)
    coll = pc.allreduce_init(count, dtype, op, comm, algorithm="ps", servers=servers,
                             block_bytes=block_items * np.dtype(dtype).itemsize)
    res = coll.post(x).wait(timeout=60)
    what = f"ps count={count} {np.dtype(dtype)} {op} servers={servers} P={comm.size}"
    assert_matches(res.data, ref, op, what)
    bitwise.add(what, res.data)
    owners = coll.assignment()
    assert owners.dtype.kind == "i" and len(owners) == -(-count // block_items), (what, owners)
    assert set(owners.tolist()) <= set(servers if servers is not None else range(comm.size)), owners
    coll.close()


def test_every_op_dtype_count(comm):
    """Every op x dtype (at P <= 4; each op and each dtype at P = 5, 8) at 2 elements (less
    than one block) and 10 (a partial fourth block), every rank a server; with dedicated
    servers at 10; no elements and exactly one block with SUM."""
    p, bitwise = comm.size, Bitwise(comm)
    # every pair at P <= 4; at P = 5 and 8 each op and each dtype (covering_combos)
    for dtype, op in combos() if p <= 4 else covering_combos():
        for count in (2, 10):
            check(comm, bitwise, count, dtype, op, None)
        for servers in server_sets(p)[1:]:
            check(comm, bitwise, 10, dtype, op, servers)
    for servers in server_sets(p):
        for count in (0, 3):
            check(comm, bitwise, count, np.float64, MPI.SUM, servers)
    bitwise.check()


def test_default_block_and_large(comm):
    """The default 4 MiB blocks: one block below them, several (the last shorter) above."""
    for count in (1000, (9 << 20) // 4 + 5):
        x = values(np.float32, MPI.SUM, count, comm.rank)
        ref = np.empty_like(x)
        comm.Allreduce(x, ref, op=MPI.SUM)
        coll = pc.allreduce_init(count, np.float32, MPI.SUM, comm, algorithm="ps")
        for _ in range(2):
            assert_matches(coll.post(x).wait(timeout=60).data, ref, MPI.SUM, f"ps {count}")
        assert len(coll.assignment()) == -(-count * 4 // (4 << 20))
        coll.close()


def test_many_blocks_in_windows(comm):
    """More blocks than a rank keeps in flight (ps.WINDOW), so sends wait for earlier
    results: small blocks (eager messages; every server set) and 128 KiB ones (MPI's
    rendezvous; one owner for everything, its results to each peer windowed too): full
    rounds equal to MPI_Allreduce's; solo rounds (late="fold", small blocks) whose
    results and close() sum to everything posted."""
    from partialcoll.algorithms.ps import WINDOW
    for count, block, sets in ((600, 16, server_sets(comm.size)), ((80 * 128 << 10) // 8, 128 << 10, [[0]])):
        assert count * 8 // block > WINDOW
        for servers in sets:
            for mode in ("full", "solo") if block < 64 << 10 else ("full",):
                what = f"{count} in {block} B blocks, servers={servers}, {mode}, P={comm.size}"
                coll = pc.PartialAllreduce(count, np.float64, MPI.SUM, comm, mode=mode, algorithm="ps",
                                           block_bytes=block, servers=servers, late="fold")
                posted, got = np.zeros(count), np.zeros(count)
                for n in range(3):
                    x = values(np.float64, MPI.SUM, count, comm.rank, n)
                    ref = np.empty_like(x)
                    comm.Allreduce(x, ref, op=MPI.SUM)
                    res = coll.post(x).wait(timeout=60)
                    posted += ref
                    got += res.data
                    if mode == "full":
                        assert_matches(res.data, ref, MPI.SUM, what)
                got += coll.close(timeout=60).data
                assert np.allclose(got, posted, rtol=1e-12, atol=1e-9), (what, np.abs(got - posted).max())


def test_divisor(comm):
    p = comm.size
    x = (np.arange(50) % 7 + comm.rank).astype(np.float64)
    want = comm.allreduce(x) / p
    for servers in server_sets(p):
        coll = pc.allreduce_init(50, np.float64, MPI.SUM, comm, algorithm="ps", block_bytes=64, servers=servers,
                                 divisor=p)
        assert np.array_equal(coll.post(x).wait(timeout=60).data, want)
        coll.close()


def test_server_that_never_posts(comm):
    """solo, rank 0 a server that never posts: every round is reduced by it (its progress
    thread serves), and its close() flushes nothing of its own. As a dedicated server
    (workers= the others) it moves only the blocks it owns and its post() raises; with
    every rank a server, psld moves blocks between it and the workers."""
    p = comm.size
    others = list(range(1, p)) or None
    for servers, workers in (([0], None), ([0], others), (None, others)):
        coll = pc.solo_allreduce(20, np.int64, MPI.SUM, comm, algorithm="ps", servers=servers, block_bytes=40,
                                 late="fold", balance="psld", rebalance_every=2, workers=workers)
        got = np.zeros(20, np.int64)
        posted = np.zeros(20, np.int64)
        if comm.rank:
            for i in range(12):
                x = np.arange(20, dtype=np.int64) + 100 * comm.rank + i
                posted += x
                got += coll.post(x).wait(timeout=60).data
        elif workers:
            expect_raises(pc.ArgumentError, coll.post, np.zeros(20, np.int64), match="dedicated server")
        got += coll.close().data
        if servers == [0]:
            assert np.array_equal(coll.assignment(), np.zeros(4, np.int64))     # one server: nothing to move
        total = comm.allreduce(posted)
        if comm.rank:
            assert np.array_equal(got, total), (servers, workers, got[:4], total[:4])


def test_owner_times_and_assignment(comm):
    """owner_times(): seconds per block for every owner that served blocks, NaN for the
    others, the same on every rank (agreed in the rounds): static (all rounds so far) and
    proportional (the latest epoch, assignments switching)."""
    p = comm.size
    for balance in ("static", "proportional"):
        coll = pc.allreduce_init(4000, np.float64, MPI.SUM, comm, algorithm="ps", block_bytes=8000,
                                 balance=balance, rebalance_every=3)
        x = np.ones(4000)
        for _ in range(10):
            assert np.array_equal(coll.post(x).wait(timeout=60).data, x * p)
        t = coll.owner_times()
        assert t.shape == (p,) and t.dtype == np.float64
        if p == 1:
            assert np.all(np.isnan(t))      # nobody sends a block away
        elif balance == "static":
            owners = set(coll.assignment().tolist())
            assert all(np.isfinite(t[r]) == (r in owners) for r in range(p)), (t, owners)
        assert np.all(t[np.isfinite(t)] > 0), t
        everyone = comm.allgather((t.tobytes(), coll.assignment(round=9).tobytes()))
        assert all(e == everyone[0] for e in everyone), "owner_times or assignment differ across ranks"
        coll.close()


def _pattern(e, nblocks, p):
    """Decision e's assignment in the switch tests: distinct for every e < nblocks - 1
    (block b to (b // (e + 2)) % p), and from the round-robin start."""
    return [(b // (e + 2)) % p for b in range(nblocks)]


def _switch_proxy(real_lib, after):
    """The engine's lib, but pc_coll_switch calls after(epoch) once the real one returned
    (install it as _engine.lib before the collective is made: its balancer keeps it)."""
    class Proxy:
        def __getattr__(self, name):
            return getattr(real_lib, name)

        def pc_coll_switch(self, c, epoch, s0, s1):
            rc = real_lib.pc_coll_switch(c, epoch, s0, s1)
            after(epoch)
            return rc
    return Proxy()


def _run_switches(comm, rounds, every, decide_wait=None, switch_sleep=0.0):
    """Rounds of a "ps" allreduce whose decisions are _pattern(e) (decide_wait(e, done),
    first: a late decider, done[0] the rounds whose wait returned here; switch_sleep: a
    balancer slow to come back from the switch). Returns the decision each round ran
    (-1: none), after checking every result against MPI_Allreduce, that
    assignment(round=n) read right after round n's wait is never revised, and that every
    rank agrees."""
    from partialcoll import _engine, balance
    p = comm.size
    count, block = 4 * p * 8, 64
    nblocks = 4 * p
    real_decide, real_lib = balance.decide, _engine.lib

    done = [0]                           # rounds whose wait returned here

    def fake(kind, measured, predictor, servers, current, seed, epoch, epsilon):
        if decide_wait is not None:
            decide_wait(epoch, done)
        return _pattern(epoch, nblocks, p)

    balance.decide = fake
    if switch_sleep:
        _engine.lib = _switch_proxy(real_lib, lambda epoch: time.sleep(switch_sleep))
    try:
        coll = pc.allreduce_init(count, np.float64, MPI.SUM, comm, algorithm="ps", block_bytes=block,
                                 balance="proportional", rebalance_every=every)
        seen = []
        for n in range(rounds):
            x = np.arange(count, dtype=np.float64) * (comm.rank + 1) + n
            assert np.array_equal(coll.post(x).wait(timeout=60).data, comm.allreduce(x)), n
            seen.append(coll.assignment(round=n).tolist())
            done[0] = n + 1
        coll.close()
    finally:
        balance.decide, _engine.lib = real_decide, real_lib
    later = [coll.assignment(round=n).tolist() for n in range(rounds)]
    assert seen == later, (seen, later)
    everyone = comm.allgather(later)
    assert all(e == later for e in everyone), "ranks ran different assignments"
    which = {tuple(_pattern(e, nblocks, p)): e for e in range(nblocks - 1)}
    start = later[0]
    assert tuple(start) not in which, start
    return [-1 if a == start else which[tuple(a)] for a in later]


@pytest.mark.mpi(min_size=2)
def test_assignment_of_a_round_that_ran(comm):
    """assignment(round=n) read as soon as round n's wait returned is the assignment it
    ran with, never revised later: the balancer thread publishes a decision before the
    engine may run a round with it (here it is slow to come back from the switch, and
    every decision is an assignment of its own, so a stale answer differs). Decision e
    runs from round e + 2 at the earliest (rebalance_every=1), decisions in order, and
    at most 3 epochs behind (then a round waits for it)."""
    rounds = 8
    ran = _run_switches(comm, rounds, 1, switch_sleep=0.2)
    assert ran[:2] == [-1, -1], ran
    for n in range(2, rounds):
        assert ran[n - 1] <= ran[n] <= n - 2, (n, ran)
        assert ran[n] >= n - 5, (n, ran)


@pytest.mark.mpi(min_size=2)
def test_late_decider_delays_the_switch_not_the_rounds(comm):
    """The last rank's decisions come late: decision e waits, on that rank, until round
    (e + 3) K - 1 completed there, past the round (e + 2) K it may run from. Rounds go on
    without it (had they waited for it, this would deadlock: the decision waits for a
    round that waits for the decision), and every rank switches at the same later round.
    The decision is made after round (e + 3) K - 1's TAKE, so the first masks to show it
    are round (e + 3) K's: it runs from (e + 4) K at the earliest; and a round n is armed
    only with decisions n // K - 3 in, so every rank has had decision n // K - 4 since
    round n - 1 and it runs by the boundary of n."""
    p, every, rounds = comm.size, 2, 16
    late = comm.rank == p - 1

    def wait(e, done):
        t0 = time.monotonic()
        while late and done[0] < min((e + 3) * every, rounds):      # (the last rounds: no wait)
            assert time.monotonic() - t0 < 20, f"round {(e + 3) * every - 1} never completed for decision {e}"
            time.sleep(0.001)

    ran = _run_switches(comm, rounds, every, decide_wait=wait)
    for n in range(rounds):
        assert ran[n] <= max(n // every - 4, -1), (n, ran)
        assert ran[n] >= n // every - 5, (n, ran)
    assert ran[-1] >= 0, ran


@pytest.mark.mpi(min_size=2)
def test_a_rank_that_fails_with_switches_pending(comm):
    """The last rank raises inside its ``with`` block while decisions wait for their
    switch (its decisions come an epoch late, so every rank holds decided schedules not
    yet run): every other rank's wait raises PeerError naming it, well within the wait's
    timeout; the pending schedules go with the abandoned collectives (nothing hangs or
    crashes), and every result before it equals MPI_Allreduce's."""
    from partialcoll import balance
    p, bad, every = comm.size, comm.size - 1, 2
    real = balance.decide
    done = [0]

    def late(kind, measured, *args):
        epoch = args[-2]
        t0 = time.monotonic()
        while comm.rank == bad and done[0] < (epoch + 3) * every and time.monotonic() - t0 < 5:
            time.sleep(0.001)
        return _pattern(epoch, 4 * p, p)

    balance.decide = late
    got, t0 = None, time.perf_counter()
    try:
        coll = pc.allreduce_init(4 * p * 8, np.float64, MPI.SUM, comm, algorithm="ps", block_bytes=64,
                                 balance="proportional", rebalance_every=every)
        with coll:
            for i in range(40):
                if comm.rank == bad and i == 13:
                    done[0] = 1 << 30            # its balancer's late decisions: no more waiting
                    raise RuntimeError("this rank fails on purpose")
                x = np.arange(4 * p * 8, dtype=np.float64) * (comm.rank + 1) + i
                res = coll.post(x).wait(timeout=30)
                if i < 13:
                    assert np.array_equal(res.data, comm.allreduce(x)), i
                done[0] = i + 1
    except (RuntimeError, pc.PartialcollError) as exc:
        got = exc
    finally:
        balance.decide = real
    assert time.perf_counter() - t0 < 25, time.perf_counter() - t0
    if comm.rank == bad:
        assert isinstance(got, RuntimeError) and "on purpose" in str(got), repr(got)
    else:
        assert isinstance(got, pc.PeerError) and got.rank == bad, repr(got)


@pytest.mark.mpi(min_size=2)
def test_balancer_sleeps_while_rounds_run(comm):
    """The balancer thread waits for an epoch's times without driving progress: it wakes
    when the engine notifies (a few times a round) or its slice ends, not every
    sleep_max_us while the progress thread reduces a large round (that took the CPU from
    the progress thread where ranks share cores). Counted as the thread's voluntary
    context switches over 20 rounds of 16 MiB, no decision due (rebalance_every=1000)."""
    from partialcoll import balance
    p, rounds, n = comm.size, 20, 4 << 20
    if not os.path.exists("/proc/thread-self/status"):
        pytest.skip("counts the balancer thread's context switches in /proc/self/task/*/status (Linux)")
    coll = pc.allreduce_init(n, np.float32, MPI.SUM, comm, algorithm="ps", block_bytes=4 << 20,
                             balance="psld", rebalance_every=1000)
    x = np.ones(n, np.float32)

    def switches():
        with open(f"/proc/self/task/{coll._balancer.thread.native_id}/status") as f:
            return int(next(line for line in f if line.startswith("voluntary_ctxt_switches")).split()[1])

    coll.post(x).wait(timeout=60)
    before, t0 = switches(), time.perf_counter()
    for _ in range(rounds):
        assert np.array_equal(coll.post(x).wait(timeout=60).data, x * p)
    elapsed = time.perf_counter() - t0
    woke = switches() - before
    coll.close()
    assert woke <= 3 * rounds + 2 * elapsed / balance.Balancer.SLICE + 5, (woke, rounds, elapsed)


@pytest.mark.mpi(min_size=2)
def test_balancer_sleeps_between_epochs_and_stops_at_once(comm):
    """The balancer thread sleeps until the engine wakes it (an epoch's end, the
    collective's end, stop()), not on a timer: over 0.5 s in which no round runs it wakes
    at most twice (at a 50 ms slice it woke 10 times, and cost the progress threads of
    ranks sharing cores 1.5 - 2.5 ms of CPU a round: docs/results.md); a collective
    dropped without close() stops it at once, not after its slice."""
    from partialcoll import balance
    if not os.path.exists("/proc/thread-self/status"):
        pytest.skip("counts the balancer thread's context switches in /proc/self/task/*/status (Linux)")
    p = comm.size
    coll = pc.allreduce_init(64 * p, np.float64, MPI.SUM, comm, algorithm="ps", block_bytes=64,
                             balance="psld", rebalance_every=2)
    x = np.ones(64 * p)
    for _ in range(4):                   # two epochs: decisions made, the balancer waits for the third
        assert np.array_equal(coll.post(x).wait(timeout=60).data, x * p)
    thread = coll._balancer.thread

    def switches():
        with open(f"/proc/self/task/{thread.native_id}/status") as f:
            return int(next(line for line in f if line.startswith("voluntary_ctxt_switches")).split()[1])

    time.sleep(0.1)
    before = switches()
    time.sleep(0.5)
    woke = switches() - before
    comm.Barrier()
    t0 = time.perf_counter()
    coll._abandon()                      # what a collective dropped without close() does
    took = time.perf_counter() - t0
    assert not thread.is_alive()
    assert woke <= 2, (woke, balance.Balancer.SLICE)
    assert took < 1.0, took


@pytest.mark.mpi(min_size=2)
def test_a_failing_balancer_fails_the_collective(comm):
    """A decision that raises (here on the last rank only, at epoch 1) leaves no round
    parked for good: that rank's wait raises with the balancer's exception, the others'
    PeerError naming that rank; within a wait's timeout, never a Timeout or a hang."""
    from partialcoll import balance
    p, bad = comm.size, comm.size - 1
    real = balance.decide

    def failing(kind, measured, predictor, servers, current, seed, epoch, epsilon):
        if epoch == 1 and comm.rank == bad:
            raise RuntimeError("this decision fails on purpose")
        return real(kind, measured, predictor, servers, current, seed, epoch, epsilon)

    balance.decide = failing
    got = None
    t0 = time.perf_counter()
    try:
        coll = pc.allreduce_init(4000, np.float64, MPI.SUM, comm, algorithm="ps", block_bytes=8000,
                                 balance="proportional", rebalance_every=1)
        x = np.ones(4000)
        for i in range(40):
            assert np.array_equal(coll.post(x).wait(timeout=30).data, x * p), i
    except pc.PartialcollError as exc:
        got = exc
    finally:
        balance.decide = real
    assert got is not None and not isinstance(got, pc.Timeout), repr(got)
    assert time.perf_counter() - t0 < 25, time.perf_counter() - t0
    if comm.rank == bad:
        assert "this decision fails on purpose" in str(got) + str(got.__cause__), repr(got)
    else:
        assert isinstance(got, pc.PeerError) and got.rank == bad, repr(got)
        assert "this decision fails on purpose" in str(got), repr(got)
    del coll
    comm.Barrier()


@pytest.mark.mpi(min_size=2)
def test_transient_owner_wins_its_blocks_back(comm):
    """psld with a straggling owner that recovers, on real ranks: the balancer threads
    decide from a model of the owners' times (every owner that served blocks in the
    epoch, as the engine saw it, takes 1 ms to start and 1 ms per block; the last rank
    50 ms more to start for the first 3 epochs), so the decisions do not depend on this
    machine's noise. It loses its blocks; exploration gives it one again, the new
    measurement replaces its stale prediction, and it holds its share over the last
    third of the rounds; every round equals MPI_Allreduce's and every rank switched
    alike. Each rank posts round i once it has handed in decision i - 1, so every
    decision is in before the next round's masks and runs two rounds after its epoch,
    the earliest the engine allows (a decision that comes later runs later)."""
    from partialcoll import _engine, balance
    p, slow, rounds = comm.size, comm.size - 1, 36
    real, real_lib = balance.decide, _engine.lib
    handed = [-1]

    def decide(kind, measured, *args):
        epoch, held = args[-2], ~np.isnan(measured.marginal)
        measured.marginal = np.where(held, 1e-3, np.nan)
        measured.fixed = np.where(held, 1e-3 + 0.05 * ((np.arange(p) == slow) & (epoch < 3)), np.nan)
        measured.starved = np.zeros(p)       # nobody starved of CPU (this machine's run delays)
        return real(kind, measured, *args)

    balance.decide, _engine.lib = decide, _switch_proxy(real_lib, lambda epoch: handed.__setitem__(0, epoch))
    try:
        count = 4 * p * 64                   # 4 blocks per rank
        coll = pc.allreduce_init(count, np.float64, MPI.SUM, comm, algorithm="ps", block_bytes=64 * 8,
                                 balance="psld", epsilon=0.2, rebalance_every=1, seed=4)
        for i in range(rounds):
            t0 = time.monotonic()
            while handed[0] < i - 1:
                assert time.monotonic() - t0 < 30, f"decision {i - 1} never came"
                time.sleep(0.0005)
            x = np.arange(count, dtype=np.float64) * (comm.rank + 1) + i
            assert np.array_equal(coll.post(x).wait(timeout=60).data, comm.allreduce(x)), i
        coll.close()
    finally:
        balance.decide, _engine.lib = real, real_lib
    share = [float(np.mean(coll.assignment(round=n) == slow)) for n in range(rounds)]
    assert min(share[3:6]) == 0, share                  # dropped by decision 0 (round 2 on)
    assert np.mean(share[2 * rounds // 3:]) >= 1 / (2 * p), share
    everyone = comm.allgather([coll.assignment(round=n).tobytes() for n in range(rounds)])
    assert all(e == everyone[0] for e in everyone), "ranks disagree on the assignments"


def late_rounds(comm, delay, rounds=40, shuffle=False):
    """Full mode, psld, rebalance_every 1: the last rank sleeps `delay` before every post
    (none at 0: even time.sleep(0) gives up the core, and on an oversubscribed machine the
    rank gets it back milliseconds later, late to every round: psld rightly moves its blocks).
    The owners' times are replaced by equal ones (1 ms to start, 1 ms a block) in every
    decision, so only the lateness (the telemetry's waits, carried in the rounds) can move
    blocks. Every result is checked against the closed form; returns every round's
    assignment and epoch 18's arrivals (round 18's; OwnerTimes), after checking that every
    rank read the same arrivals and ran the same assignments. shuffle: every decision
    sees its epoch's lateness, run delays and CPU times shuffled among the ranks (the same
    permutation on every rank, seeded by the epoch): who is late or starved in an epoch is
    chance by construction; else no CPU time is measured (nobody can be found starved)."""
    from partialcoll import balance
    p, late = comm.size, comm.size - 1
    count = 4 * p * 64                   # 4 blocks per rank
    real = balance.decide

    def decide(kind, measured, predictor, servers, current, seed, epoch, epsilon):
        held = ~np.isnan(measured.marginal)
        measured.marginal = measured.fixed = np.where(held, 1e-3, np.nan)
        if shuffle:                      # who is late or starved of CPU: chance (the same permutation)
            order = np.random.default_rng([epoch, 0x5f]).permutation(len(measured.late))
            measured.late, measured.starved, measured.cpu = (measured.late[order], measured.starved[order],
                                                             measured.cpu[order])
        else:                            # the lateness alone: the CPU times as not measured (StarveTest
            measured.cpu = np.zeros(len(measured.cpu))  # skips the epoch): under a loaded machine's suite
            # one of the other ranks could be starved of CPU for real, and its blocks go to the late one
        return real(kind, measured, predictor, servers, current, seed, epoch, epsilon)

    balance.decide = decide
    try:
        coll = pc.allreduce_init(count, np.float64, MPI.SUM, comm, algorithm="ps", block_bytes=64 * 8,
                                 balance="psld", epsilon=0.0, rebalance_every=1)
        for i in range(rounds):
            if comm.rank == late and delay > 0:
                time.sleep(delay)        # not sleep(0): it yields the core, late every round
            x = np.arange(count, dtype=np.float64) * (comm.rank + 1) + i
            want = np.arange(count, dtype=np.float64) * (p * (p + 1) // 2) + p * i
            assert np.array_equal(coll.post(x).wait(timeout=60).data, want), i
            if i == 20:                  # while the engine keeps it (its last few epochs)
                measured = coll._owners_measured(18)
        coll.close()
    finally:
        balance.decide = real
    ran = [coll.assignment(round=n) for n in range(rounds)]
    everyone = comm.allgather((measured.late.tobytes(), [a.tobytes() for a in ran]))
    assert all(e == everyone[0] for e in everyone), "ranks disagree on the arrivals or the assignments"
    return ran, measured.late


@pytest.mark.mpi(min_size=2)
def test_psld_takes_the_blocks_of_a_rank_late_to_the_rounds(comm):
    """The last rank sleeps 30 ms before every post, late to every round: every rank reads
    the same sums, in which it is the latest; psld's LateTest finds it within its window
    (17 epochs at P = 2, 8 at P = 8) and gives its blocks to the others, to the end."""
    ran, late = late_rounds(comm, 0.03, rounds=32)
    held = [int(np.count_nonzero(a == comm.size - 1)) for a in ran]
    assert int(np.argmax(late)) == comm.size - 1 and late[-1] > 0.02, late
    assert held[-1] == 0 and held[0] == 4, f"rank {comm.size - 1}, 30 ms late to every round, still holds blocks: {held}"


@pytest.mark.mpi(min_size=2)
def test_psld_moves_no_block_with_nobody_late(comm):
    """Nobody sleeps, and the lateness psld sees is each epoch's real values shuffled among
    the ranks: LateTest finds nobody (per decision, by chance, with probability <=
    LATE_ALPHA = 1e-4): no block ever moves (every round ran the first round's round-robin
    assignment). Unshuffled, "nobody late" is not true on a shared, oversubscribed machine:
    a rank that shares its core with a busy process (CI's background jobs, another job's
    ranks) is late in every round, and psld rightly moves its blocks (with two busy loops
    beside P = 8 here: 1 run in 6)."""
    ran, _ = late_rounds(comm, 0.0, shuffle=True)
    moved = [(n, np.bincount(a, minlength=comm.size).tolist()) for n, a in enumerate(ran) if not np.array_equal(a, ran[0])]
    assert np.array_equal(ran[0], np.arange(len(ran[0])) % comm.size) and not moved, \
        f"nobody late, yet blocks moved: (round, blocks per rank) {moved[:3]}"


def _run_delay(field: int = 1) -> float:
    """Seconds this process's threads have been runnable but not running (the second field
    of /proc/self/task/*/schedstat; field 0: running, their CPU time), read here in Python:
    the reference for the engine's."""
    total = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                total += int(f.read().split()[field])
        except (OSError, IndexError, ValueError):
            continue
    return total / 1e9


@pytest.mark.mpi(min_size=2)
def test_rows_carry_each_ranks_run_delay(comm):
    """Where owners are rebalanced, each rank's run delay (its threads' time runnable but
    not running) and CPU time ride in its words of the rounds' rows. The last rank, all its
    threads pinned to one CPU beside a busy process, computes 3 ms before each post: epoch
    0's sums (rounds 0 - 19), the same on every rank, give it at least a quarter of the run
    delay its /proc showed from before its first post to after its last wait (read in
    Python), every rank at most what its own showed of either, and the last rank at least
    a quarter of its CPU time (of its 20 x 3 ms of work, the busy process leaves it about
    half: > 10 ms)."""
    import subprocess
    import sys
    if not os.path.exists("/proc/self/task/%d/schedstat" % os.getpid()):
        pytest.skip("reads the threads' run delays in /proc/self/task/*/schedstat (Linux, schedstats)")
    p, rounds, last = comm.size, 20, comm.size - 1
    coll = pc.allreduce_init(4 * p * 64, np.float64, MPI.SUM, comm, algorithm="ps", block_bytes=64 * 8,
                             balance="psld", epsilon=0.0, rebalance_every=rounds)
    hog, pinned = None, {}
    if comm.rank == last:                # every thread (the progress thread too) and the busy process on one CPU
        cpu = min(os.sched_getaffinity(0))
        for tid in map(int, os.listdir("/proc/self/task")):
            pinned[tid] = os.sched_getaffinity(tid)
            os.sched_setaffinity(tid, {cpu})
        hog = subprocess.Popen([sys.executable, "-c", "while True: pass"],
                               preexec_fn=lambda: os.sched_setaffinity(0, {cpu}))
    x, work = np.ones(4 * p * 64), np.ones(1 << 16)
    try:
        comm.Barrier()
        before, ran = _run_delay(), _run_delay(0)
        for i in range(rounds):
            t0 = time.perf_counter()
            while comm.rank == last and time.perf_counter() - t0 < 0.003:
                work.sum()                   # runnable: it waits for the CPU the busy process holds
            assert np.array_equal(coll.post(x).wait(timeout=60).data, x * p), i
        own, ran = _run_delay() - before, _run_delay(0) - ran
        measured = coll._owners_measured(0)
        coll.close()
    finally:
        if hog is not None:
            hog.kill()
            hog.wait()
        for tid, cpus in pinned.items():
            try:
                os.sched_setaffinity(tid, cpus)
            except OSError:                  # a thread that ended meanwhile
                pass
    engine = measured.starved * rounds       # seconds over the epoch's rounds, per rank
    cpu = measured.cpu * rounds
    everyone = comm.allgather((engine.tobytes() + cpu.tobytes(), own, ran))
    assert all(e[0] == everyone[0][0] for e in everyone), "ranks disagree on the run delays"
    mine, used = [e[1] for e in everyone], [e[2] for e in everyone]
    assert all(0 <= engine[r] <= mine[r] + 1e-6 for r in range(p)), (engine.tolist(), mine)
    assert mine[last] > 0.005 and engine[last] >= 0.25 * mine[last], (engine.tolist(), mine)
    assert all(0 < cpu[r] <= used[r] + 1e-6 for r in range(p)), (cpu.tolist(), used)
    assert cpu[last] >= 0.25 * used[last] and used[last] > 0.01, (cpu.tolist(), used)


def test_bad_owner_options(comm):
    p = comm.size
    for kwargs, exc, match in [
        ({"algorithm": "ps", "block_bytes": 0}, pc.ArgumentError, "block_bytes"),
        ({"algorithm": "ps", "block_bytes": -4}, pc.ArgumentError, "block_bytes"),
        ({"algorithm": "ps", "servers": [p]}, pc.ArgumentError, "servers"),
        ({"algorithm": "ps", "servers": [-1]}, pc.ArgumentError, "servers"),
        ({"algorithm": "ps", "servers": []}, pc.ArgumentError, "empty"),
        ({"algorithm": "ps", "balance": "fastest"}, pc.ArgumentError, "balance"),
        ({"algorithm": "ring", "balance": "psld"}, pc.ArgumentError, "owners"),
        ({"algorithm": "auto", "balance": "static"}, pc.ArgumentError, "owners"),
        ({"algorithm": "tree", "block_bytes": 8}, pc.ArgumentError, "owners"),
        ({"algorithm": "recursive_doubling", "servers": [0]}, pc.ArgumentError, "owners"),
        ({"algorithm": "ps", "epsilon": 2.0}, pc.ArgumentError, "epsilon"),
        ({"algorithm": "tree", "balance": "psld"}, pc.ArgumentError, "does not fit the tree"),
        ({"algorithm": "ps", "workers": [0]}, pc.ArgumentError, "solo"),       # allreduce_init: full mode
    ]:
        expect_raises(exc, pc.allreduce_init, 10, np.float32, MPI.SUM, comm, match=match, **kwargs)
    for kwargs, match in [
        ({"algorithm": "ps", "workers": []}, "empty"),
        ({"algorithm": "ps", "workers": [p]}, "workers"),
        ({"algorithm": "ring", "workers": [0]}, "owners"),
        ({"algorithm": "ps", "workers": [0], "mode": "majority"}, "solo"),
        ({"algorithm": "ps", "workers": [0], "max_staleness": 2}, "max_staleness"),
        ({"algorithm": "ps", "workers": [0], "mode": "quorum", "quorum": 2}, "quorum"),
    ]:
        kwargs.setdefault("mode", "solo")
        expect_raises(pc.ArgumentError, pc.PartialAllreduce, 10, np.float32, MPI.SUM, comm, match=match, **kwargs)
    if p > 1:                            # one rank's bad server list: every rank raises
        servers = [p] if comm.rank == p - 1 else [0]
        exc = expect_raises(pc.ArgumentError, pc.allreduce_init, 10, np.float32, MPI.SUM, comm, algorithm="ps",
                            servers=servers)
        assert "servers" in str(exc), exc
        exc = expect_raises(pc.ArgumentError, pc.allreduce_init, 10, np.float32, MPI.SUM, comm, algorithm="ps",
                            balance="psld" if comm.rank else "static")
        assert "balance" in str(exc), exc
    coll = pc.allreduce_init(10, np.float32, MPI.SUM, comm, algorithm="ring")
    expect_raises(pc.ArgumentError, coll.assignment, match="ps")
    expect_raises(pc.ArgumentError, coll.owner_times, match="ps")
    coll.close()


if __name__ == "__main__":
    run_module(__file__)
