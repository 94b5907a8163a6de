"""Quorum activation without a hot spot: the k-th post found by a sorting network whose
comparators are packed into boxes, each box computed on one rank.

How it works. Read each rank's notification as a time: the moment it fires (on the
rank's post, or once the rank is activated). On times, an op with need 1 of 2 fires at
the earlier of its inputs (a min) and one with need 2 of 2 at the later (a max), so a
comparator network runs on post times with empty messages: the engine's k-of-n
dependencies do the arithmetic. Bitonic sort over the wires of ranks 1..p-1 (wire w is
rank w + 1's notification; the wires up to the next power of two hold "never", which a
min drops and a max keeps, so they cost nothing) puts the j-th earliest of their posts
on wire j - 1. The leader (rank 0) hears wires k - 2 and k - 1 and starts the round on
2 of {its own post, wire k - 2, wire k - 1}: either it posted and k - 1 others did, or k
others did. That is the k-th post of all p ranks, exactly: never before it, and as soon
as it plus the network's hops. It then broadcasts the activation down the binomial tree,
as the leader's quorum does.

Boxes. Each layer of bitonic sort compares along one bit (dimension) of the wire index.
Consecutive layers that use at most b dimensions form a segment; within a segment the
wires that differ only in those b bits (a subcube of 2^b wires) touch nobody else, so
the segment's comparators on them are a box: a function of the box's 2^b input times
alone. One rank computes the whole box: it receives the box's inputs held elsewhere
(at most 2^b messages) and runs its comparators as local nops; the outputs stay
there until a later box or the leader needs them. Messages are one per box input, not
one per comparator, and a box is one hop, not b. The host is the rank with the fewest
receives so far among the inputs' holders and the least loaded rank; the leader hosts
nothing. Only the comparators leading to wires k - 2 and k - 1 are built (the cone).

Cost. With b = ceil(log2 L), L = ceil(log2 p) (boxes of at most 2L wires), the segments
number about L(L + 1)/(2b), a rank receives about one box's inputs per segment averaged
over the ranks, and the balancing bounds each rank by the segments plus one box plus its
activation: at p = 4096, 32 receives per rank and round (17 at 1024), where the leader's
quorum makes rank 0 receive p - 1 and comparators one to a message 68. That grows as
L^2 / (2 log2 L) + 2L, not as L: an O(log p) bound with exact k-of-p needs a selection
network of O(p log p) comparators whose wires take part in O(log p) of them each, which
only the expander constructions (AKS) give, with constants far above p at these sizes.
The price is latency: the k-th post reaches the leader after ``depth`` box hops (18 at
p = 4096), where the leader's quorum takes one. ``choose()`` takes the network where
the model predicts it sooner.

Worked example, p = 6, k = 3 (wires 0..4 are ranks 1..5, padded to 8; the leader hears
wires 1 and 2). Ranks 2, 4 and 5 post in that order. The network sorts their times onto
wires 0, 1, 2: wire 1 fires at rank 4's post, wire 2 at rank 5's; the leader's 2-of-3
fires on wire 2 (rank 0 has not posted) and activates everyone. Had rank 0 posted first,
wire 1 (the second post among the others) would have been the third post of all.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from functools import lru_cache
from typing import Dict, List, Tuple

import numpy as np

from ..schedule import ScheduleOp, Schedule
from .quorum import LEADER, binomial_tree

NEVER = -1                  # a wire that holds no post (padding)


@dataclass(frozen=True)
class Box:
    """One box: its host, the signals it receives (signal, holder) in order, and its gates
    (output signal, input a, input b, is max) in order."""
    host: int
    inputs: Tuple[Tuple[int, int], ...]
    gates: Tuple[Tuple[int, int, int, bool], ...]


@dataclass(frozen=True)
class Plan:
    """The network of one (p, k): signals 0..p-2 are the notifications of ranks 1..p-1."""
    boxes: Tuple[Box, ...]
    outs: Tuple[Tuple[int, int], ...]    # (signal, holder) of wires k - 2 and k - 1
    receives: Tuple[int, ...]             # per rank and round, the activation included
    depth: int                            # box hops from a post to the holder of an output
    segments: int
    dims: int                             # b: a box spans at most 2^b wires


def box_dims(size: int) -> int:
    """b = ceil(log2 L), L = ceil(log2 p): boxes of at most 2L wires (at least 2)."""
    lg = max(size - 1, 1).bit_length()
    return max(1, (lg - 1).bit_length())


def bitonic(n: int) -> List[Tuple[int, int]]:
    """Bitonic sort's layers on n = 2^m wires, as (s, d): compare wire i (bit d clear)
    with i + 2^d, the smaller to i where bit s of i is clear (ascending), else to i + 2^d."""
    m = n.bit_length() - 1
    return [(s, d) for s in range(1, m + 1) for d in range(s - 1, -1, -1)]


def outputs(size: int, k: int) -> Tuple[int, ...]:
    """The wires the leader hears: k - 2 (k - 1 other posts) and k - 1 (k other posts)."""
    return tuple(w for w in (k - 2, k - 1) if 0 <= w < size - 1)


@lru_cache(maxsize=16)
def plan(size: int, k: int) -> Plan:
    """The boxes of (p, k), in the order every rank builds them."""
    wires, b = size - 1, box_dims(size)
    n = 1 << max(wires - 1, 0).bit_length()
    val = list(range(wires)) + [NEVER] * (n - wires)
    gates: List[Tuple[int, int, int, int, int, bool]] = []    # (segment, wire, out, a, b, max)
    masks: List[int] = []
    nsig = wires
    for s, d in bitonic(n) if wires > 1 else []:
        if not masks or bin(masks[-1] | 1 << d).count("1") > b:
            masks.append(0)
        masks[-1] |= 1 << d
        seg = len(masks) - 1
        for i in range(n):
            if i >> d & 1:
                continue
            j = i | 1 << d
            x, y = val[i], val[j]
            if x == NEVER or y == NEVER:
                lo, hi = (y if x == NEVER else x), NEVER
            else:
                lo, hi = nsig, nsig + 1
                nsig += 2
                gates += [(seg, i, lo, x, y, False), (seg, i, hi, x, y, True)]
            val[i], val[j] = (lo, hi) if not i >> s & 1 else (hi, lo)
    outs = [val[w] for w in outputs(size, k)]
    needed = set(outs)
    for g in reversed(gates):
        if g[2] in needed:
            needed |= {g[3], g[4]}
    grouped: Dict[Tuple[int, int], List[Tuple[int, int, int, bool]]] = {}
    for seg, wire, out, x, y, hi in gates:
        if out in needed:
            grouped.setdefault((seg, wire & ~masks[seg]), []).append((out, x, y, hi))
    holder = {w: w + 1 for w in range(wires)}
    hop = {w: 0 for w in range(wires)}
    load = [0] + [1] * (size - 1)                             # the activation
    heap = [(1, r) for r in range(1, size)]
    boxes = []
    for key in sorted(grouped):
        made = {g[0] for g in grouped[key]}
        ins = list(dict.fromkeys(x for g in grouped[key] for x in g[1:3] if x not in made))
        while heap[0][0] != load[heap[0][1]]:
            heapq.heappop(heap)                               # stale entries
        host = min({holder[x] for x in ins} | {heap[0][1]},
                   key=lambda r: (load[r] + sum(holder[x] != r for x in ins), r))
        got = tuple((x, holder[x]) for x in ins if holder[x] != host)
        load[host] += len(got)
        heapq.heappush(heap, (load[host], host))
        for x in ins:
            hop[x] += holder[x] != host
        for out, x, y, _ in grouped[key]:
            hop[out], holder[out] = max(hop[x], hop[y]), host
        boxes.append(Box(host, got, tuple(grouped[key])))
    load[LEADER] += len(outs)
    return Plan(tuple(boxes), tuple((x, holder[x]) for x in outs), tuple(load),
                max([hop[x] for x in outs] or [0]), len(masks), b)


def receives(size: int, k: int) -> Dict[int, int]:
    """Messages each rank receives per round (network and activation), from the plan:
    what the dry-built schedules must show."""
    return dict(enumerate(plan(size, k).receives))


def depth(size: int, k: int) -> int:
    """Box hops on the longest path from a post to the holder of a leader's wire."""
    return plan(size, k).depth


def choose(size: int, k: int) -> str:
    """"network" where the model (its default parameters: a builder stays a pure function
    of its arguments) predicts the network's k-th post at the leader sooner than the
    leader's p - 1 notifications, else "leader"."""
    from ..algorithms import model
    if size <= 2:
        return "leader"
    net = model.quorum("network", size, depth(size, k), 1 << box_dims(size))
    return "network" if net < model.quorum("leader", size) else "leader"


def activation(s: Schedule, trigger: ScheduleOp, *, k: int) -> ScheduleOp:
    """Add the network quorum to s; returns the op after which this rank is activated."""
    flag = s.scratch(1, np.uint8).segment(0, 0)          # the messages carry no data
    parent, children = binomial_tree(s.rank, s.size)
    net = plan(s.size, k)
    if s.rank == LEADER:
        heard = [s.recv(flag, src, label=f"wire {w}: the {w + 1}-th post among the others")
                 for w, (_, src) in zip(outputs(s.size, k), net.outs)]
        active = s.nop(after=[trigger] + heard, need=1 if k == 1 else 2, label=f"the {k}-th post of all")
    else:
        assert parent is not None
        active = s.recv(flag, parent, label="activation from my parent")
    # the activation's sends come first, so that between two ranks they are the first
    # messages of the pair in op order on both sides (the network's follow)
    for child in children:
        s.send(flag, child, after=active, label="pass the activation down")
    if s.rank == LEADER:
        return active
    mine: Dict[int, ScheduleOp] = {
        s.rank - 1: s.nop(after=[trigger, active], need="any", label="notify: my post, or activated")}
    for n, box in enumerate(net.boxes):                  # every rank walks the boxes in one order
        for x, src in box.inputs:
            if src == s.rank:
                s.send(flag, box.host, after=mine[x], label=f"box {n}: time {x} to rank {box.host}")
            elif box.host == s.rank:
                mine[x] = s.recv(flag, src, label=f"box {n}: time {x} from rank {src}")
        if box.host == s.rank:
            for out, x, y, hi in box.gates:
                mine[out] = s.nop(after=[mine[x], mine[y]], need="all" if hi else "any",
                                  label=f"box {n}: {out} = {'max' if hi else 'min'}({x}, {y})")
    for x, src in net.outs:
        if src == s.rank:
            s.send(flag, LEADER, after=mine[x], label=f"time {x} to the leader")
    return active
