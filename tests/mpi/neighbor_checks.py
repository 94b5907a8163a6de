"""NeighborAllreduce (Hop) on every graph at this process count (tests/test_neighbor.py).

    mpiexec -n P python tests/mpi/neighbor_checks.py [graphs|fig3|errors] ...

graphs: for each of Hop's three graphs
  - standard mode: exact neighbour averages against a NumPy reference (one run with
    1 MiB vectors), every in-neighbour's update of iteration k in iteration k;
  - the iteration-gap bounds, checked on every rank's logged entries (a shared monotonic
    clock orders them): Theorem 1 (standard, and staleness s: (s + 1) x len(path j -> i)),
    Theorem 2 (tokens: g x len(path i -> j));
  - backup workers with and without tokens, staleness with staleness weights, skipping:
    every result's data equals the combination of exactly the updates it reports, no
    update of another iteration ever goes in (late ones are dropped), the token
    invariant (consumed <= g + received <= g + granted), the occupancy bound
    (max buffered <= (1 + g) x |N_in| with tokens);
fig3: Hop's Fig. 3 on 3 workers: worker 2 stalls; standard: the others stop at 1; backup:
  they advance; tokens: they stop at g; worker 2's late updates are dropped;
errors: bad input raises ArgumentError on every rank, misuse raises StateError;
engine: the engine does Hop's work, not the application's calls: depth requests
  outstanding at once, waited in order, each equal to its exact neighbour average; and an
  iteration whose in-neighbours have posted completes while the application computes
  (its result appears in the out buffer before wait() is called, which then reports it
  as early, as does the engine's counter). Needs the progress thread.
"""
from __future__ import annotations

import random
import time
import weakref

import numpy as np
import pytest
from mpi4py import MPI

import partialcoll as pc
from partialcoll import topology
from _util import ARGS, expect_raises, run_module

GRAPHS = topology.GRAPHS
WHAT = ARGS or ["graphs"]           # which of graphs, fig3, errors, engine to check


def asked(what: str) -> None:
    if what not in WHAT:
        pytest.skip(f"not asked for (asked: {' '.join(WHAT)})")


def val(rank: int, k: int) -> float:
    """Rank r's update of iteration k: an integer, so every sum is exact."""
    return float(rank * 1000 + k)


def run(comm, g, n_iter, *, seed, sleep_p=0.3, sleep_max=0.004, count=3, slow=None, skipper=None,
        **options):
    """Run n_iter iterations with random sleeps; return (results, trace, stats, posts)."""
    coll = pc.NeighborAllreduce(count, np.float64, comm=g, **options)
    coll.trace = []
    rng = random.Random(seed * 7919 + comm.rank)
    results, posts = [], []
    while coll.iteration + 1 < n_iter:
        if slow is not None and comm.rank == slow:
            time.sleep(0.006)
        elif rng.random() < sleep_p:
            time.sleep(rng.random() * sleep_max)
        k = coll.iteration + 1
        x = np.full(count, val(comm.rank, k))
        res = coll.post(x).wait(timeout=60)
        assert res.iteration == k, (res.iteration, k)
        posts.append(k)
        results.append((k, res.updates, res.nap, float(res.data[0]), bool(np.all(res.data == res.data[0]))))
        if skipper is not None and comm.rank == skipper and coll.iteration + 1 < n_iter:
            lag = coll.lag
            if lag:
                got = coll.skip(min(lag, n_iter - 1 - coll.iteration))
                assert 0 <= got <= lag
    stats = coll.stats
    trace = list(coll.trace)
    n_in = len(coll.sources)
    depth = coll.depth
    coll.close()
    assert stats["buffers"] == depth * n_in
    return results, trace, stats, posts


def check_data(comm, g, results, options, all_posts):
    """Every result is exactly the combination of the updates it reports."""
    s = options.get("max_staleness") or 0
    weights = options.get("weights", "mean")
    backup = options.get("backup", 0)
    sources = g.Get_dist_neighbors()[0]
    for k, updates, nap, first, uniform in results:
        assert uniform
        assert nap == 1 + len(updates)
        assert len(updates) >= len(sources) - backup, (k, updates)
        assert [r for r, _ in updates] == sorted(r for r, _ in updates)
        assert {r for r, _ in updates} <= set(sources)
        terms = [(1.0, val(comm.rank, k))]
        for r, m in updates:
            assert k - s <= m <= k, f"rank {comm.rank} iteration {k} used rank {r}'s update of iteration {m}"
            real = max(p for p in all_posts[r] if p <= m)     # a skipped iteration carries the last post
            terms.append((1.0 / (1 + k - m) if weights == "staleness" else 1.0, val(r, real)))
        if weights == "staleness":
            acc = np.float64(terms[0][0] * terms[0][1])
            for w, v in terms[1:]:
                acc += w * v
            expected = acc / sum(w for w, _ in terms)
        else:
            expected = sum(v for _, v in terms) / len(terms)
        assert first == expected, (comm.rank, k, updates, first, expected)


def iter_at(entries, t):
    """A rank's iteration at time t: the last entry logged at or before t (-1: none yet)."""
    it = -1
    for k, tk, _ in entries:
        if tk <= t:
            it = max(it, k)
    return it


def check_gaps(comm, kind, trace, options, adjacency=None, theorem1=True):
    """Theorems 1 and 2 at every entry of every rank (Theorem 1 where theorem1 and there are
    no backup workers: it also needs every rank to wait for each iteration before the next)."""
    every = comm.allgather(trace)
    size = comm.size
    adjacency = adjacency or topology.neighbors(kind, size)
    dist = topology.distances(adjacency)
    s = options.get("max_staleness") or 0
    g = options.get("max_gap")
    backup = options.get("backup", 0)
    worst = 0
    for i in range(size):
        for k, t, spare in every[i]:
            if g is not None and adjacency[i][1]:          # tokens come from out-neighbours only
                assert spare is not None and spare >= 0, f"rank {i} entered {k} without tokens (spare {spare})"
            for j in range(size):
                if j == i:
                    continue
                gap = k - iter_at(every[j], t)
                bounds = [float("inf")]
                if theorem1 and not backup:
                    bounds.append((s + 1) * dist[j][i])             # Theorem 1 (s = 0: standard)
                if g is not None:
                    bounds.append(g * dist[i][j])                   # Theorem 2
                assert gap <= min(bounds), (f"{kind} P={size} {options}: Iter({i}) - Iter({j}) = {gap} > "
                                            f"{min(bounds)} at rank {i}'s entry into {k}")
                worst = max(worst, gap)
    return worst


def check_tokens(comm, stats, options, last):
    """The token invariant: the queue i <- j holds g + granted - consumed >= 0 tokens, where
    consumed = Iter(i) + 1 and nothing is received that j did not grant (granted <= Iter(j) + 1)."""
    g = options["max_gap"]
    every = comm.allgather((stats["tokens_received"], stats["tokens_granted"]))
    consumed = last[comm.rank] + 1
    for dst, got in stats["tokens_received"].items():
        granted = every[dst][1][comm.rank]
        assert consumed <= g + got, (comm.rank, dst, consumed, got)
        assert got <= granted <= last[dst] + 1, (comm.rank, dst, got, granted, last[dst])


@pytest.mark.parametrize("kind", GRAPHS)
def test_graph(comm, kind):
    asked("graphs")
    rank = comm.rank
    g = topology.graph(comm, kind)
    n_in = len(g.Get_dist_neighbors()[0])
    # standard mode: exact averages against NumPy, every update of iteration k
    count = 262144 if kind == "ring" else 1000           # 1 MiB of float32 once per P
    coll = pc.NeighborAllreduce(count, np.float32, comm=g)
    base = np.arange(count, dtype=np.float32) % 97
    for k in range(3):
        x = base + np.float32(rank * 100 + k)
        res = coll.post(x).wait(timeout=60)
        ref = x.copy()
        for src in sorted(coll.sources):
            ref += base + np.float32(src * 100 + k)
        ref /= np.float32(1 + n_in)
        assert res.updates == tuple((src, k) for src in sorted(coll.sources)), res.updates
        assert res.nap == 1 + n_in and res.active == tuple(sorted((rank,) + coll.sources))
        np.testing.assert_array_equal(res.data, ref)
    coll.close()
    # every mode with random sleeps: data, gaps, tokens, occupancy
    b = 1 if n_in > 1 else 0                             # P <= 2: a single in-neighbour (or none)
    modes = [dict(), dict(backup=b), dict(backup=b, max_gap=2), dict(max_staleness=2, weights="staleness"),
             dict(backup=b, max_gap=1, max_staleness=1)]
    if kind == "ring_based" and comm.size > 2:
        modes.append(dict(backup=b, max_gap=2, skipper=0, slow=0))
    for seed, options in enumerate(modes):
        opts = {k: v for k, v in options.items() if k not in ("skipper", "slow")}
        results, trace, stats, posts = run(comm, g, 24, seed=seed, slow=options.get("slow"),
                                           skipper=options.get("skipper"), **opts)
        all_posts = comm.allgather(posts)
        last = comm.allgather(trace[-1][0] if trace else -1)
        check_data(comm, g, results, opts, all_posts)
        check_gaps(comm, kind, trace, opts)
        if opts.get("max_gap") is not None:
            check_tokens(comm, stats, opts, last)
            if not opts.get("max_staleness"):
                assert stats["max_buffered"] <= (1 + opts["max_gap"]) * n_in, stats
        if not opts.get("backup") and not opts.get("max_staleness"):
            assert stats["dropped"] == 0, stats       # standard mode never has a late update
        if options.get("skipper") == rank:
            assert stats["skipped"] > 0, "the slow rank never skipped"
    g.Free()


def test_one_way_ring(comm):
    asked("graphs")
    size, rank = comm.size, comm.rank
    if size < 2:
        pytest.skip("a one-way ring needs two ranks (P = 1 would be a self-loop)")
    # a directed graph, the one-way ring r -> r + 1: path lengths differ with direction
    adjacency = {r: ([(r - 1) % size], [(r + 1) % size]) for r in range(size)}
    g = comm.Create_dist_graph_adjacent(*adjacency[rank], reorder=False)
    for seed, options in enumerate([dict(), dict(max_gap=1), dict(max_staleness=1, max_gap=2)]):
        results, trace, stats, posts = run(comm, g, 16, seed=seed + 10, **options)
        check_data(comm, g, results, options, comm.allgather(posts))
        check_gaps(comm, "one-way ring", trace, options, adjacency)
        if options.get("max_gap"):
            check_tokens(comm, stats, options, comm.allgather(trace[-1][0]))
    g.Free()


def test_fig3(comm):
    asked("fig3")
    """Hop's Fig. 3: three workers, worker 2 stalls in iteration 1."""
    assert comm.size == 3
    g = pc.ring_graph(comm)                      # on 3 ranks: the triangle
    stall = 0.8
    for options, expect in ((dict(), "standard"), (dict(backup=1), "backup"),
                            (dict(backup=1, max_gap=2), "tokens")):
        coll = pc.NeighborAllreduce(2, np.float64, comm=g, **options)
        coll.trace = []
        coll.post(np.full(2, val(comm.rank, 0))).wait(timeout=30)
        t_resume = None
        results = []
        for k in range(1, 12):
            if comm.rank == 2 and k == 1:
                time.sleep(stall)                # stalled inside iteration 0's compute
                t_resume = time.monotonic()
            res = coll.post(np.full(2, val(comm.rank, k))).wait(timeout=30)
            results.append((k, res.updates, res.nap, float(res.data[0]), True))
        t_end = time.monotonic() + 20
        while coll.stats["received"] < 2 * 12 and time.monotonic() < t_end:
            _ = coll.lag                         # serves the channels: every update has come in
            time.sleep(0.001)
        stats = coll.stats
        trace = list(coll.trace)
        depth = coll.depth
        coll.close()
        assert stats["received"] == 2 * 12, stats
        t_resume = comm.bcast(t_resume, root=2)
        check_data(comm, g, results, options, comm.allgather(list(range(12))))
        ahead = comm.allgather(max(k for k, t, _ in trace if t < t_resume))
        if comm.rank in (0, 1):
            if expect == "standard":
                assert ahead[comm.rank] == 1, ahead          # waits for worker 2's update of 1
            elif expect == "tokens":
                assert ahead[comm.rank] == 2, ahead          # g tokens, then none from worker 2
            else:
                assert ahead[comm.rank] >= 2 + 2, (ahead, depth)   # well past g (eager messages: to the end)
            if expect != "standard":
                assert stats["dropped"] > 0, stats           # worker 2's late updates
                late = [(k, u) for k, u, *_ in results if any(r == 2 and m != k for r, m in u)]
                assert not late, late
        if comm.rank == 2:
            assert ahead[2] == 0


def test_errors(comm):
    asked("errors")
    rank, size = comm.rank, comm.size
    g = pc.ring_graph(comm)
    n_in = len(g.Get_dist_neighbors()[0])
    E = pc.ArgumentError
    expect_raises(E, pc.NeighborAllreduce, 4, np.float32, comm=comm, match="distributed-graph")
    expect_raises(E, pc.NeighborAllreduce, 4, np.float32, match="comm=")
    cart = comm.Create_cart([size])
    expect_raises(E, pc.NeighborAllreduce, 4, np.float32, comm=cart, match="Cartesian")
    cart.Free()
    expect_raises(E, pc.NeighborAllreduce, 4, np.float32, comm=g, backup=max(n_in, 1), match="backup")
    expect_raises(E, pc.NeighborAllreduce, 4, np.float32, comm=g, backup=-1, match="backup")
    expect_raises(E, pc.NeighborAllreduce, 4, np.float32, comm=g, backup=1.5, match="backup")
    if size > 2:
        # one rank's bad backup: the error reaches every rank
        expect_raises(E, pc.NeighborAllreduce, 4, np.float32, comm=g, backup=5 if rank == 1 else 0,
                      match="backup")
        expect_raises(E, pc.NeighborAllreduce, 4, np.float32, comm=g, backup=1 if rank == 0 else 0,
                      match="backup differs")
    if size > 1:                                     # one rank's count differs from the others'
        expect_raises(E, pc.NeighborAllreduce, 4 + (rank == size - 1), np.float32, comm=g, match="count differs")
    expect_raises(E, pc.NeighborAllreduce, 4, np.float32, comm=g, max_gap=0, match="max_gap")
    expect_raises(E, pc.NeighborAllreduce, 4, np.float32, comm=g, max_staleness=-1, match="max_staleness")
    expect_raises(E, pc.NeighborAllreduce, 4, np.float32, comm=g, weights="median", match="weights")
    expect_raises(E, pc.NeighborAllreduce, 4, np.float32, MPI.MAX, comm=g, match="weights=None")
    expect_raises(E, pc.NeighborAllreduce, 4, np.int32, comm=g, match="floating")
    if size > 2:
        # an inconsistent graph (rank 0 stops sending to a rank that still receives from it)
        srcs, dsts = g.Get_dist_neighbors()[:2]
        if rank == 0:
            dsts = dsts[:-1]
        bad = comm.Create_dist_graph_adjacent(srcs, dsts, reorder=False)
        expect_raises(E, pc.NeighborAllreduce, 4, np.float32, comm=bad, match="inconsistent")
        bad.Free()
    # misuse
    coll = pc.NeighborAllreduce(4, np.float32, MPI.MAX, comm=g, weights=None)
    expect_raises(pc.StateError, coll.skip, 1, match="first post")
    expect_raises(pc.InvalidBufferError, coll.post, np.zeros(4, np.float64), match="dtype")
    expect_raises(pc.InvalidBufferError, coll.post, np.zeros(5, np.float32), match="elements")
    # up to depth requests outstanding; one more is refused until the oldest is waited for
    reqs = [coll.post(np.full(4, rank + 10 * k, np.float32)) for k in range(coll.depth)]
    expect_raises(pc.StateError, coll.post, np.zeros(4, np.float32), match="still pending")
    for k, req in enumerate(reqs):
        res = req.wait(timeout=30)
        assert res.iteration == k and res.data[0] == max([rank] + list(coll.sources)) + 10 * k, res   # MPI.MAX
        assert req.test()
    coll.close()
    expect_raises(pc.StateError, coll.post, np.zeros(4, np.float32), match="closed")
    # still usable afterwards: a valid collective completes on every rank
    with pc.NeighborAllreduce(1, np.float64, comm=g) as ok:
        assert ok.post(np.ones(1)).wait(timeout=30).data[0] == 1.0
    # uneven post counts: rank 0 posts one more and closes with a request pending
    coll = pc.NeighborAllreduce(2, np.float64, comm=g, backup=1 if n_in > 1 else 0, max_gap=2)
    for k in range(3 + (rank == 0)):
        req = coll.post(np.zeros(2))
        if k < 3:
            req.wait(timeout=30)
    coll.close(timeout=30)
    if rank == 0:
        expect_raises(pc.StateError, req.wait, match="dropped by close")
    g.Free()


def test_shrink_rules(comm):
    """on_failure: a bad value, or one rank's differing from the others', raises
    ArgumentError on every rank; where the MPI cannot shrink (Open MPI without
    --with-ft ulfm) "shrink" does, naming what is missing. Where it can: skip(), a device
    or list buffer, a second post before the wait raise, and without a failure the
    results are the plain neighbour means (partialcoll.rc.on_failure gives the mode)."""
    asked("errors")
    rank, size = comm.rank, comm.size
    g = pc.ring_graph(comm)
    E = pc.ArgumentError
    expect_raises(E, pc.NeighborAllreduce, 4, np.float64, comm=g, on_failure="bogus", match="on_failure")
    if size > 1:
        expect_raises(E, pc.NeighborAllreduce, 4, np.float64, comm=g,
                      on_failure="shrink" if rank == size - 1 else "raise", match="on_failure" if rank == size - 1
                      else f"rank {size - 1}")
    missing = pc.info()["shrink"]["missing"]
    if missing:
        expect_raises(E, pc.NeighborAllreduce, 4, np.float64, comm=g, on_failure="shrink", match=missing[:30])
        g.Free()
        return
    pc.rc.on_failure = "shrink"
    try:
        coll = pc.NeighborAllreduce(4, np.float64, comm=g)
    finally:
        pc.rc.on_failure = "raise"
    assert coll._shrink is not None and coll.failed == () and coll.recoveries == []
    expect_raises(pc.StateError, coll.skip, 1, match="skip() with on_failure='shrink'")
    expect_raises(pc.InvalidBufferError, coll.post, [0.0] * 4, match="NumPy")
    sources = g.Get_dist_neighbors()[0]
    for k in range(3):
        req = coll.post(np.full(4, val(rank, k)))
        if k == 0:
            expect_raises(pc.StateError, coll.post, np.zeros(4), match="wait for the previous post")
        res = req.wait(timeout=30)
        ranks = sorted({rank, *sources})
        want = sum(val(r, k) for r in ranks) / len(ranks)
        assert res.iteration == k and res.active == tuple(ranks) and np.all(res.data == want), (res, want)
    coll.close()
    g.Free()


def expected_mean(coll, rank: int, k: int) -> float:
    """Standard mode, SUM, weights="mean": iteration k's exact result at rank."""
    return (val(rank, k) + sum(val(src, k) for src in coll.sources)) / (1 + len(coll.sources))


@pytest.mark.parametrize("kind", GRAPHS)
def test_engine_progress(comm, kind):
    asked("engine")
    rank = comm.rank
    g = topology.graph(comm, kind)
    with pc.NeighborAllreduce(5, np.float64, comm=g) as coll:
        # several requests outstanding: depth posts before the first wait, waited in order
        for rounds in range(3):
            base = rounds * coll.depth
            reqs = [coll.post(np.full(5, val(rank, base + k))) for k in range(coll.depth)]
            for k, req in enumerate(reqs):
                res = req.wait(timeout=60)
                assert res.iteration == base + k and res.updates == tuple((s, base + k) for s in coll.sources), res
                np.testing.assert_array_equal(res.data, expected_mean(coll, rank, base + k))
        # a neighbour's update is combined while this rank computes: after every rank has
        # posted (the barrier), this rank makes no library call until its out buffer holds
        # the result; the engine alone can have put it there
        for k in range(coll.iteration + 1, coll.iteration + 4):
            out = np.full(5, np.nan)
            req = coll.post(np.full(5, val(rank, k)), out=out)
            comm.Barrier()
            want = expected_mean(coll, rank, k)
            t_end = time.monotonic() + 60               # a hang guard, not a timing threshold
            while not np.all(out == want) and time.monotonic() < t_end:
                time.sleep(0.001)                       # "compute": no library call
            assert np.all(out == want), (k, out, want)
            res = req.wait(timeout=60)
            assert res.early and np.shares_memory(res.data, out), res    # complete before wait() asked
        stats = coll.stats
        assert stats["early"] >= 3 and stats["completed"] == coll.iteration + 1, stats
        assert stats["used"] == stats["received"] == len(coll.sources) * (coll.iteration + 1), stats
    g.Free()


def test_waits_on_other_threads(comm):
    """The requests may be waited for on other threads while the maker posts (as
    PartialAllreduce's): two threads wait for alternate iterations at once, and each result
    reports its own iteration's updates and data. close() never runs under such a wait:
    while another thread waits for a request, close() raises StateError, and closes once
    that wait is over."""
    asked("engine")
    import threading
    rank = comm.rank
    g = pc.ring_graph(comm)
    coll = pc.NeighborAllreduce(5, np.float64, comm=g)
    wrong = []

    def waiter(reqs):
        for k, req in reqs:
            res = req.wait(timeout=60)
            if res.iteration != k or res.updates != tuple((s, k) for s in coll.sources) or \
                    not np.all(res.data == expected_mean(coll, rank, k)):
                wrong.append((k, res))

    for _ in range(40):
        reqs = []
        for _ in range(coll.depth):
            k = coll.iteration + 1
            reqs.append((k, coll.post(np.full(5, val(rank, k)))))
        threads = [threading.Thread(target=waiter, args=(reqs[i::2],)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not wrong, wrong[:3]
    # rank 0 waits on another thread for an iteration the others enter only after its
    # close() has been refused
    k = coll.iteration + 1
    req = coll.post(np.full(5, val(rank, k))) if rank == 0 else None
    got: list = []
    if rank == 0 and comm.size > 1:
        t = threading.Thread(target=lambda: got.append(req.wait(timeout=60)))
        t.start()
        time.sleep(0.2)
        expect_raises(pc.StateError, coll.close, match="another thread waits")
    comm.Barrier()
    if rank != 0:
        req = coll.post(np.full(5, val(rank, k)))
    if rank == 0 and comm.size > 1:
        t.join()
        res = got[0]
    else:
        res = req.wait(timeout=60)
    assert res.updates == tuple((s, k) for s in coll.sources) and np.all(res.data == expected_mean(coll, rank, k))
    coll.close(timeout=60)
    g.Free()


def test_close_keeps_pending_outs(comm):
    """close() drops the requests never waited for, but their out arrays stay referenced
    until the engine has stopped completing iterations (pc_hop_close_begin): until then
    the progress thread may still write a result into one. A proxy of the engine's
    library looks at a dropped request's out array when close_begin is called."""
    asked("engine")
    from partialcoll import _engine
    real_lib, alive = _engine.lib, []

    class Proxy:
        def __getattr__(self, name):
            return getattr(real_lib, name)

        def pc_hop_close_begin(self, *args):
            alive.append([r() is not None for r in out_refs])
            return real_lib.pc_hop_close_begin(*args)

    g = pc.ring_graph(comm)
    coll = pc.NeighborAllreduce(4, np.float64, comm=g)
    reqs = [coll.post(np.full(4, 1.0)) for _ in range(min(coll.depth, 2))]
    out_refs = [weakref.ref(req._out) for req in reqs]
    del reqs                             # never waited for: close() drops them
    _engine.lib = Proxy()
    try:
        coll.close(timeout=60)
    finally:
        _engine.lib = real_lib
    assert alive == [[True] * len(out_refs)], alive
    assert all(r() is None for r in out_refs)    # and let go once close() returned
    g.Free()


if __name__ == "__main__":
    run_module(__file__)
