"""Quorum activation without a hot spot: the k-th post found by a comparator network.

How it works. Read each rank's notification as a time: the moment it fires (on the
rank's post, or once the rank is activated). A comparator between the ranks of wires
i < j is two ops and at most two empty messages: wire i's rank fires ``min`` on the
first of the two signals (need 1 of 2), wire j's rank fires ``max`` on both (2 of 2).
Messages carry no counts: the engine's k-of-n dependencies do the arithmetic on
arrival times, so ``min`` and ``max`` are the earlier and the later arrival. Batcher's
odd-even merge sort over the wires of ranks 1..p-1 (wire w is rank w + 1) therefore
puts the time of the j-th earliest of their posts on wire j - 1. The leader (rank 0)
hears wires k - 2 and k - 1 and starts the round on 2 of {its own post, wire k - 2,
wire k - 1}: either it posted and k - 1 others did, or k others did. That is the k-th
post of all p ranks, exactly: never before it (a comparator's output fires only once
as many of its inputs have), and as soon as it (plus the network's depth in hops).
It then broadcasts the activation down the binomial tree, as the leader's quorum does.

Only the comparators whose outputs lead to wires k - 2 and k - 1 are built (the cone),
and a comparator only one of whose outputs is needed sends one message, not two.

Cost. A rank receives at most one message per layer of the network it takes part in,
plus one activation: ceil(log2 p)(ceil(log2 p) + 1) / 2 + 1 at most (79 at p = 4096),
where the leader's quorum makes rank 0 receive p - 1. The price is latency: the k-th
post reaches the leader after up to that many hops, where the leader's quorum takes
one. ``choose()`` takes the network where the model predicts it faster.

Worked example, p = 6, k = 3 (wires 0..4 are ranks 1..5; the leader hears wires 1, 2).
Ranks 2, 4 and 5 post in that order. The network sorts their times onto wires 0, 1, 2:
wire 1 fires at rank 4's post, wire 2 at rank 5's; the leader's 2-of-3 fires on
wire 2 (rank 0 has not posted) and activates everyone. Had rank 0 posted first, wire 1
(the second post among the others) would have been the third post of all.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Dict, List, Tuple

import numpy as np

from ..schedule import ScheduleOp, Schedule
from .quorum import LEADER, binomial_tree

Comparator = Tuple[int, int, bool, bool]      # (wire i < wire j, min needed at i, max needed at j)


def odd_even_merge_sort(n: int) -> List[List[Tuple[int, int]]]:
    """Batcher's network for n = 2^m wires, layer by layer: comparators (i, j), i < j,
    the smaller value to i."""
    layers, p = [], 1
    while p < n:
        k = p
        while k >= 1:
            layer = []
            for j in range(k % p, n - k, 2 * k):
                for i in range(min(k, n - j - k)):
                    if (i + j) // (2 * p) == (i + j + k) // (2 * p):
                        layer.append((i + j, i + j + k))
            layers.append(layer)
            k //= 2
        p *= 2
    return layers


@lru_cache(maxsize=16)
def cone(wires: int, outs: Tuple[int, ...]) -> Tuple[Comparator, ...]:
    """The comparators of the network on `wires` wires that lead to the wires `outs`, in
    order. Wires past `wires` (up to the next power of two) would hold "never": a
    comparator with one keeps its lower value, so they are left out."""
    n = 1 << max(wires - 1, 0).bit_length()
    flat = [c for layer in odd_even_merge_sort(n) for c in layer if c[1] < wires]
    needed, kept = set(outs), []
    for i, j in reversed(flat):
        lo, hi = i in needed, j in needed
        if lo or hi:
            kept.append((i, j, lo, hi))
            needed |= {i, j}
    return tuple(reversed(kept))


def outputs(size: int, k: int) -> Tuple[int, ...]:
    """The wires the leader hears: k - 2 (k - 1 other posts) and k - 1 (k other posts)."""
    return tuple(w for w in (k - 2, k - 1) if 0 <= w < size - 1)


def receives(size: int, k: int) -> Dict[int, int]:
    """Messages each rank receives per round (network and activation), counted on the
    comparators alone: what the dry-built schedules must show."""
    got = {r: (0 if r == LEADER else 1) for r in range(size)}
    got[LEADER] += len(outputs(size, k))
    for i, j, lo, hi in cone(size - 1, outputs(size, k)):
        got[i + 1] += lo
        got[j + 1] += hi
    return got


def depth(size: int, k: int) -> int:
    """Comparator hops on the longest path from a post to the leader's wires."""
    level: Dict[int, int] = {}
    for i, j, _, _ in cone(size - 1, outputs(size, k)):
        level[i] = level[j] = max(level.get(i, 0), level.get(j, 0)) + 1
    return max([level.get(w, 0) for w in outputs(size, k)] or [0])


def choose(size: int, k: int) -> str:
    """"network" where the model (its default parameters: a builder stays a pure function
    of its arguments) predicts the network's k-th post at the leader sooner than the
    leader's p - 1 notifications, else "leader"."""
    from ..algorithms import model
    if size <= 2:
        return "leader"
    net = model.quorum("network", size, depth(size, k))
    return "network" if net < model.quorum("leader", size) else "leader"


def activation(s: Schedule, trigger: ScheduleOp, *, k: int) -> ScheduleOp:
    """Add the network quorum to s; returns the op after which this rank is activated."""
    flag = s.scratch(1, np.uint8).segment(0, 0)          # the messages carry no data
    parent, children = binomial_tree(s.rank, s.size)
    outs = outputs(s.size, k)
    if s.rank == LEADER:
        heard = [s.recv(flag, w + 1, label=f"wire {w}: the {w + 1}-th post among the others") for w in outs]
        need = 1 if k == 1 else 2
        active = s.nop(after=[trigger] + heard, need=need, label=f"the {k}-th post of all")
    else:
        assert parent is not None
        active = s.recv(flag, parent, label="activation from my parent")
    # the activation's sends come first, so that between two ranks they are the first
    # messages of the pair in op order on both sides (the network's follow)
    for child in children:
        s.send(flag, child, after=active, label="pass the activation down")
    if s.rank == LEADER:
        return active
    wire = s.rank - 1
    signal = s.nop(after=[trigger, active], need="any", label="notify: my post, or activated")
    for i, j, lo, hi in cone(s.size - 1, outs):
        if wire not in (i, j):
            continue
        low = wire == i                                # this rank takes the min, else the max
        other, tell, hear = (j + 1, hi, lo) if low else (i + 1, lo, hi)
        if tell:                                       # the other side's output is needed
            s.send(flag, other, after=signal, label=f"comparator ({i}, {j}): my time to rank {other}")
        if hear:                                       # this side's output is needed
            got = s.recv(flag, other, label=f"comparator ({i}, {j}): rank {other}'s time")
            signal = s.nop(after=[signal, got], need="any" if low else "all",
                           label=f"wire {wire} = {'min' if low else 'max'}")
    if wire in outs:
        s.send(flag, LEADER, after=signal, label=f"wire {wire} to the leader")
    return active
