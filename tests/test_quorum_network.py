"""Quorum's comparator network, without MPI: the dry-built schedules of every rank run in
a timed event simulation written here (ops fire at the time their need-th dependency
completed; a message arrives a latency after its send fires; the k-th send of a pair
matches its k-th receive), against the k-th smallest post time from NumPy.
The MPI checks run in tests/test_rabenseifner_mpi.py's 9-rank job (quorum_network_checks.py)."""
from __future__ import annotations

import heapq
import itertools
import math
from collections import defaultdict

import numpy as np
import pytest

from partialcoll.activation import BUILDERS, quorum, quorum_network
from partialcoll.algorithms import model
from partialcoll.schedule import RECV, SEND, TRIGGER, Schedule

NEVER = math.inf
C_RECEIVES = 3        # receives per rank and round <= C_RECEIVES * ceil(log2 p), p <= 4096


def build(p, k, builder=quorum_network.activation):
    scheds, active = [], []
    for r in range(p):
        s = Schedule(rank=r, size=p)
        active.append(builder(s, s._trigger(), k=k).index)
        scheds.append(s)
    return scheds, active


def simulate(scheds, posts, latency):
    """When each op completes (NEVER: it does not): posts[r] is rank r's post time,
    latency(src, dst, seq) a message's time on the wire."""
    done = [[NEVER] * len(s.ops) for s in scheds]
    got = [[0] * len(s.ops) for s in scheds]
    succ = [defaultdict(list) for _ in scheds]
    match = {}                                   # (src, send index) -> (dst, recv index)
    for r, s in enumerate(scheds):
        for op in s.ops:
            for d in op.deps:
                succ[r][d].append(op.index)
    sends, recvs = defaultdict(list), defaultdict(list)
    for r, s in enumerate(scheds):
        for op in s.ops:
            if op.kind == SEND:
                sends[(r, op.peer)].append(op.index)
            elif op.kind == RECV:
                recvs[(op.peer, r)].append(op.index)
    for pair in set(sends) | set(recvs):
        assert len(sends[pair]) == len(recvs[pair]), f"unmatched messages between {pair}"
        for seq, (a, b) in enumerate(zip(sends[pair], recvs[pair])):
            match[(pair[0], a)] = (pair[1], b, latency(pair[0], pair[1], seq))
    heap = []
    for r, s in enumerate(scheds):
        for op in s.ops:
            if op.kind == TRIGGER and posts[r] < NEVER:
                heapq.heappush(heap, (posts[r], r, op.index))
            elif op.kind not in (TRIGGER, RECV) and not op.deps:
                heapq.heappush(heap, (0.0, r, op.index))
    while heap:
        t, r, i = heapq.heappop(heap)
        if done[r][i] < NEVER:
            continue                             # consumable: fires once
        done[r][i] = t
        op = scheds[r].ops[i]
        if op.kind == SEND:
            dst, j, lat = match[(r, i)]
            heapq.heappush(heap, (t + lat, dst, j))
        for nxt in succ[r][i]:
            got[r][nxt] += 1
            if got[r][nxt] == scheds[r].ops[nxt].need:
                heapq.heappush(heap, (t, r, nxt))
    return done


def kth(posts, k):
    return float(np.sort(np.asarray(posts, float))[k - 1])


SIZES = [1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 13, 16]


@pytest.mark.parametrize("p", SIZES)
def test_starts_at_the_kth_post_exactly(p):
    """No latency on the wire: the leader starts the round at the k-th post's time, not a
    moment earlier or later, for every k, random post orders, and ranks that never post;
    every op completes once the round has started (the schedule finishes)."""
    rng = np.random.default_rng(p)
    for k in range(1, p + 1):
        scheds, active = build(p, k)
        for _trial in range(12):
            posts = list(rng.permutation(p) + rng.uniform(0, 0.5, p))
            posters = int(rng.integers(0, p + 1))
            for r in rng.permutation(p)[posters:]:
                posts[r] = NEVER                 # these ranks never post
            done = simulate(scheds, posts, lambda *_: 0.0)
            start = done[0][active[0]]
            if posters < k:
                assert all(done[r][active[r]] == NEVER for r in range(p)), (p, k, posts)
                continue
            assert start == kth(posts, k), (p, k, posts, start)
            for r, s in enumerate(scheds):
                assert done[r][active[r]] == start
                left = [op.index for op in s.ops if op.kind != TRIGGER and done[r][op.index] == NEVER]
                assert not left, (p, k, r, left)


@pytest.mark.parametrize("p", [5, 8, 13])
def test_never_before_the_kth_post_with_slow_links(p):
    """Random latencies per message: the round starts after the k-th post, within the
    network's depth + 1 hops of it, and with fewer than k posts it never starts."""
    rng = np.random.default_rng(100 + p)
    for k in range(1, p + 1):
        scheds, active = build(p, k)
        hops = quorum_network.depth(p, k) + 1
        for _trial in range(8):
            posts = list(rng.uniform(0, 3, p))
            lat = {}

            def latency(a, b, seq):
                return lat.setdefault((a, b, seq), float(rng.uniform(0.1, 1.0)))
            done = simulate(scheds, posts, latency)
            start = done[0][active[0]]
            assert kth(posts, k) <= start <= kth(posts, k) + hops * 1.0 + 1e-9, (p, k, posts, start)
            less = [x if i != int(np.argsort(posts)[k - 1]) else NEVER for i, x in enumerate(posts)]
            less = [NEVER if x >= kth(posts, k) else x for x in less]      # only the first k - 1 post
            assert simulate(scheds, less, latency)[0][active[0]] == NEVER, (p, k)


def test_bitonic_sorts():
    """The layers the boxes are cut from sort: 1-40 values padded with +inf to a power of
    two come out in NumPy's order."""
    rng = np.random.default_rng(0)
    for wires in range(1, 41):
        n = 1 << max(wires - 1, 0).bit_length()
        for _ in range(10):
            x = list(rng.uniform(0, 1, wires)) + [math.inf] * (n - wires)
            for s, d in quorum_network.bitonic(n):
                for i in range(n):
                    j = i | 1 << d
                    if not i >> d & 1:
                        lo, hi = min(x[i], x[j]), max(x[i], x[j])
                        x[i], x[j] = (lo, hi) if not i >> s & 1 else (hi, lo)
            assert x[:wires] == sorted(x[:wires]), (wires, x)


def evaluate(net, posts, flip=None):
    """The plan's outputs on post times, its gates run in order (flip: one gate's min and
    max swapped)."""
    val = dict(enumerate(posts))
    for box in net.boxes:
        for out, x, y, hi in box.gates:
            hi = hi != (out == flip)
            val[out] = max(val[x], val[y]) if hi else min(val[x], val[y])
    return [val[x] for x, _ in net.outs]


def test_broken_plan_is_caught():
    """A gate whose min and max are swapped: some post order makes the output wrong (the
    check that the simulation's exact start rests on)."""
    net = quorum_network.plan(9, 4)
    rng = np.random.default_rng(1)
    orders = [list(rng.permutation(8).astype(float)) for _ in range(200)]
    assert all(evaluate(net, o) == [2.0, 3.0] for o in orders)
    gates = [g[0] for box in net.boxes for g in box.gates]
    caught = sum(any(evaluate(net, o, flip=g) != [2.0, 3.0] for o in orders) for g in gates)
    assert caught == len(gates), (caught, len(gates))


@pytest.mark.parametrize("p", [16, 64, 100, 256, 1024, 3000, 4096])
def test_receives_per_rank(p):
    """Counted on the dry-built schedules (every rank up to 64; at larger P the ranks the
    plan says receive most, and a sample): at most C_RECEIVES * ceil(log2 p) receives per
    rank and round (and at most the segments + one box + the activation), where the
    leader's quorum gives rank 0 p - 1."""
    L = math.ceil(math.log2(p))
    for k in sorted({1, 2, (p + 1) // 2, p - 1, p}):
        net = quorum_network.plan(p, k)
        counted = quorum_network.receives(p, k)
        ranks = range(p) if p <= 64 else sorted(set(
            sorted(counted, key=counted.get)[-4:] + [0, 1, p // 2, p - 1]))
        for r in ranks:
            s = Schedule(rank=r, size=p)
            quorum_network.activation(s, s._trigger(), k=k)
            n = sum(op.kind == RECV for op in s.ops)
            assert n == counted[r], (p, k, r, n, counted[r])
        most = max(counted.values())
        assert most <= C_RECEIVES * L, (p, k, most)
        assert most <= net.segments + (1 << net.dims) + 1, (p, k, most)
    lead = Schedule(rank=0, size=p)
    quorum.activation(lead, lead._trigger(), k=p // 2)
    assert sum(op.kind == RECV for op in lead.ops) == p - 1


def test_choice_follows_the_model():
    """The builder "quorum" takes the network exactly where model.quorum predicts it
    sooner (with the defaults), and builds what it chose."""
    for p in (2, 3, 8, 64, 1024, 4096):
        k = (p + 1) // 2
        net = model.quorum("network", p, quorum_network.depth(p, k), 1 << quorum_network.box_dims(p))
        want = "network" if p > 2 and net < model.quorum("leader", p) else "leader"
        assert quorum_network.choose(p, k) == want, p
        s = Schedule(rank=0, size=p)
        BUILDERS["quorum"](s, s._trigger(), k=k)
        recvs = sum(op.kind == RECV for op in s.ops)
        assert (recvs == p - 1) == (want == "leader") or p <= 2, (p, recvs, want)
    assert quorum_network.choose(4096, 2048) == "network"
    assert quorum_network.choose(8, 4) == "leader"


def test_leader_quorum_in_the_same_simulation():
    """The reference simulation on the leader's quorum (zero latency: the k-th post too),
    so that the simulation itself is not what makes the network pass."""
    for p, k in itertools.product((3, 5, 8), (1, 2, 3)):
        scheds, active = build(p, k, quorum.activation)
        posts = [float(x) for x in np.random.default_rng(p * 10 + k).permutation(p)]
        assert simulate(scheds, posts, lambda *_: 0.0)[0][active[0]] == kth(posts, k)
