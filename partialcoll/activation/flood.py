"""Flood activation (solo, majority, probe): the initiator's post reaches every rank.

How it works. Rank r's neighbours are the ranks r XOR 2^d (for each bit d) that exist
(< p). Rank r is activated by whichever comes first: its own eligible post (the
trigger) or an activation message from any neighbour (an OR dependency). Once
activated, it sends one activation message to every neighbour. Every rank thus sends
and receives exactly one message per neighbour per round, whatever the number of
simultaneous initiators, so all messages match within the round's version and the
op that joins the round fires exactly once (consumable ops).

This is eager-SGD's union of binomial trees over a hypercube, made correct for any p:
from any initiator, clearing differing bits and then setting them reaches every rank
through ranks < p, so the activation arrives within ceil(log2 p) hops.

Worked example, p = 6 (neighbours): 0:{1,2,4} 1:{0,3,5} 2:{3,0} 3:{2,1} 4:{5,0} 5:{4,1}.
Rank 3 posts first: 3 -> {2, 1}; then 1 -> {0, 5} and 2 -> {0}; then 0 -> {4}.

Data that carries the activation. Where a neighbour q's first message of the round's
data phase is sent as soon as q has taken its input (no message before it on its
dependency chain) and this rank's receive of it is posted when the round is armed (no
dependency), that message can stand for q's activation message: it leaves q at the
same moment, right after q was activated, and arrives here at the same moment. The
edge q -> r then carries no empty message; r's OR joins that receive instead
(``carried`` finds such edges, ``activation`` leaves out their messages, ``hear``
joins the receives once the data phase is built). Every edge still carries exactly one
message per round, sent when its sender was activated, so the argument above holds.
Small rounds (a recursive-doubling round up to 8 KiB) use it: at P = 2 both directions
are carried, and a round is the one exchange of MPI_Allreduce instead of an empty
message and then the data. (Large messages would hold the activation back for a whole
transfer, so they keep the empty messages.)

Worked example, p = 3, recursive doubling (0 folds into 1, then 1 <-> 2): 0's first
data message goes to 1 at once, and 1 receives it without waiting: edge 0 -> 1 is
carried. 1's first message to 0 is the fold-out (after every exchange) and 2's first
message to 0 does not exist: edges 1 -> 0, 0 <-> 2 keep their empty messages.
"""
from __future__ import annotations

from typing import Callable, Dict, FrozenSet, List, NamedTuple, Set, Tuple

import numpy as np

from ..schedule import RECV, SEND, ScheduleOp, Schedule


def neighbours(rank: int, size: int) -> List[int]:
    """The hypercube neighbours of rank among 0..size-1."""
    return [rank ^ (1 << d) for d in range(max(size - 1, 1).bit_length()) if (rank ^ (1 << d)) < size]


class Carried(NamedTuple):
    """The flood edges of one rank whose activation the data phase's first message carries."""
    out: FrozenSet[int] = frozenset()     # neighbours my first data message activates: no empty message to them
    into: FrozenSet[int] = frozenset()    # neighbours whose first data message activates me: none from them


NOTHING_CARRIED = Carried()

DataPhase = Callable[[Schedule, ScheduleOp], object]   # data(s, after): add the data phase after op `after`


def _first_messages(rank: int, size: int, data: DataPhase) -> Tuple[Set[int], Set[int]]:
    """Rank's data phase, dry-built: (the peers whose first message from rank leaves as soon
    as rank's input is taken, the peers whose first message to rank has its receive posted
    at arming)."""
    s = Schedule(rank=rank, size=size)
    taken = s.nop(label="the input is taken")
    data(s, taken)
    prompt = {taken.index}        # ops that follow the take through local ops only
    sends: Dict[int, ScheduleOp] = {}
    recvs: Dict[int, ScheduleOp] = {}
    for op in s.ops[taken.index + 1:]:
        if op.kind not in (SEND, RECV) and op.deps and all(d in prompt for d in op.deps):
            prompt.add(op.index)
        if op.kind == SEND:
            sends.setdefault(op.peer, op)
        elif op.kind == RECV:
            recvs.setdefault(op.peer, op)
    at_once = {q for q, op in sends.items() if op.deps and all(d in prompt for d in op.deps)}
    armed = {q for q, op in recvs.items() if not op.deps}
    return at_once, armed


def carried(rank: int, size: int, data: DataPhase) -> Carried:
    """The flood edges at rank that data (the round's data phase, a pure builder: see
    DataPhase) carries: a -> b where b is a's neighbour, a's first message to b leaves as
    soon as a has taken its input, and b's receive of it is posted when the round is armed.
    Both ends of an edge compute the same answer (from both ranks' dry-built data phases)."""
    mine = _first_messages(rank, size, data)
    out: Set[int] = set()
    into: Set[int] = set()
    for q in neighbours(rank, size):
        theirs = _first_messages(q, size, data)
        if q in mine[0] and rank in theirs[1]:
            out.add(q)
        if rank in theirs[0] and q in mine[1]:
            into.add(q)
    return Carried(frozenset(out), frozenset(into))


def activation(s: Schedule, trigger: ScheduleOp, carry: Carried = NOTHING_CARRIED) -> ScheduleOp:
    """Add the flood to s; returns the op after which this rank is activated. carry: edges
    whose activation the data phase carries (``carried``): no empty message on them, and
    ``hear`` must join their receives once the data phase is built."""
    flag = s.scratch(1, np.uint8).segment(0, 0)          # activation messages carry no data
    peers = neighbours(s.rank, s.size)
    heard = [s.recv(flag, peer, label="activation from a neighbour") for peer in peers if peer not in carry.into]
    active = s.nop(after=[trigger] + heard, need="any", label="activated: my post or a neighbour's message")
    for peer in peers:
        if peer not in carry.out:
            s.send(flag, peer, after=active, label="pass the activation on")
    return active


def hear(s: Schedule, active: ScheduleOp, carry: Carried) -> None:
    """After the data phase: the first data receive from each neighbour in carry.into also
    activates this rank (joins active's OR)."""
    for peer in sorted(carry.into):
        first = next(op for op in s.ops if op.kind == RECV and op.peer == peer)
        assert not first.deps, first            # posted at arming (carried's condition)
        s._also_after(active, first)
        first.label += " (also its activation)"
