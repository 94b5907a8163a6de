"""Rabenseifner's allreduce: reduce-scatter by recursive halving, then allgather by
recursive doubling (MPICH's reduce_scatter_allgather, Gloo's halving_doubling), for any
p and any count.

How it works. Let p' be the largest power of two <= p and rem = p - p'. The vector is
cut into p' blocks, as even as possible (block i has count // p' elements, plus one for
the first count % p' blocks; some are empty when count < p').

  fold in        as in recursive doubling: among the ranks r < 2 rem each even r sends
                 its whole vector to r + 1, which reduces it (``buf = tmp (op) buf``)
                 and stands for both; the p' remaining ranks take new ranks 0..p'-1.
  reduce-scatter log2 p' steps of recursive halving. In step k (mask = 2^k) a rank
                 pairs with the rank whose new rank differs in bit k; of the blocks it
                 still holds, the half on the lower new rank's side is kept by the
                 lower one, the other half by the higher one; each sends the half it
                 gives away and reduces the half it keeps: ``keep = tmp (op) keep``.
                 After the last step a rank holds one block, fully reduced (its
                 ``owned`` block: the block whose index is its new rank with the bits
                 reversed).
  allgather      the same steps in reverse: a rank sends what it holds and receives the
                 half it gave away in that step, straight into place.
  fold out       every odd r < 2 rem sends the result back to r - 1.

Rounds: 2 log2 p' (+ 2 when p is not a power of two); a rank sends and receives
(1 - 1/p') count elements in each phase, 2 (p' - 1) / p' of the vector in all, as ring,
with 2 log2 p' steps instead of 2 (p - 1). The first step moves the most data and pairs
the nearest new ranks (mask 1), so on consecutive placements it stays inside a node.
Scratch memory: (1 - 1/p') count elements (a step's receive into its own piece of tmp,
so every receive can be posted at once), plus count for a rank that folds in an extra
rank. Steps that would move an empty block range send nothing (count < p'). Every rank
ends with bitwise the same result: each block is reduced on one path, then copied.

Worked example, p = 7 (p' = 4, rem = 3), count = 9: blocks [0:3) [3:5) [5:7) [7:9).

    fold in          0 -> 1, 2 -> 3, 4 -> 5        new ranks: 1->0, 3->1, 5->2, 6->3
    reduce-scatter   mask 1: 1 <-> 3, 5 <-> 6      new 0, 2 keep blocks 0-1, new 1, 3 keep 2-3
                     mask 2: 1 <-> 5, 3 <-> 6      new 0 keeps 0, 2 keeps 1, 1 keeps 2, 3 keeps 3
    allgather        mask 2: 1 <-> 5, 3 <-> 6      (reverse order)
                     mask 1: 1 <-> 3, 5 <-> 6      every new rank holds blocks 0-3
    fold out         1 -> 0, 3 -> 2, 5 -> 4

The halves are usable on their own: ``reduce_scatter`` leaves each new rank its owned
block (and returns the Halves that ``allgather`` takes); ``allgather`` with ``halves``
None takes every owned block as given (the caller put it there) and gathers them.
"""
from __future__ import annotations

from typing import List, NamedTuple, Optional, Tuple

from .._buffers import BufRef
from ..schedule import ScheduleOp, Schedule
from ._alone import alone

Range = Tuple[int, int]          # elements [lo, hi) of the vector


class Step(NamedTuple):
    peer: int                    # the partner's rank (in the communicator)
    keep: Range                  # what this rank keeps (and reduces) in this step
    give: Range                  # what it hands to the partner


class Plan:
    """Who exchanges which elements with whom: the same arithmetic on every rank.

    role: "extra" (an even rank < 2 rem: it folds into rank + 1 and sits out), "proxy"
    (an odd rank < 2 rem: it stands for itself and rank - 1) or "plain". newrank: the
    rank among the p' (None for an extra). steps: the reduce-scatter's, in order (the
    allgather runs them in reverse). owned: the block held at the end of the reduce-scatter."""

    def __init__(self, rank: int, size: int, count: int) -> None:
        self.pof2 = 1 << (size.bit_length() - 1)
        self.rem = size - self.pof2
        base, extra = divmod(count, self.pof2)
        self.bounds = [i * base + min(i, extra) for i in range(self.pof2 + 1)]   # block i: bounds[i:i+2]
        self.steps: List[Step] = []
        self.owned: Optional[Range] = None
        self.newrank: Optional[int] = None
        if rank < 2 * self.rem:
            self.role = "extra" if rank % 2 == 0 else "proxy"
            if self.role == "extra":
                return
            self.newrank = rank // 2
        else:
            self.role, self.newrank = "plain", rank - self.rem
        lo, hi = 0, self.pof2                  # the blocks this rank still holds
        mask = 1
        while mask < self.pof2:
            newpeer = self.newrank ^ mask
            mid = (lo + hi) // 2
            lower, upper = (lo, mid), (mid, hi)
            keep, give = (lower, upper) if self.newrank < newpeer else (upper, lower)
            self.steps.append(Step(self.rank_of(newpeer), self.elements(keep), self.elements(give)))
            lo, hi = keep
            mask <<= 1
        self.owned = self.elements((lo, hi))

    def rank_of(self, newrank: int) -> int:
        """The communicator's rank of a new rank."""
        return newrank * 2 + 1 if newrank < self.rem else newrank + self.rem

    def elements(self, blocks: Range) -> Range:
        return self.bounds[blocks[0]], self.bounds[blocks[1]]


class Halves:
    """What reduce_scatter leaves for allgather: its plan, the op after which the owned
    block is final, and each step's send (a later receive into that range waits for it)."""

    def __init__(self, plan: Plan, done: Optional[ScheduleOp], sends: List[Optional[ScheduleOp]],
                 handed: Optional[ScheduleOp] = None) -> None:
        self.plan, self.done, self.sends, self.handed = plan, done, sends, handed


def _part(buf: BufRef, r: Range) -> BufRef:
    return buf.segment(r[0], r[1])


def _deps(*ops: Optional[ScheduleOp]) -> List[ScheduleOp]:
    return [op for op in ops if op is not None]


def reduce_scatter(s: Schedule, buf: BufRef, op: int, *, after: Optional[ScheduleOp] = None,
                   divisor: float = 1.0) -> Halves:
    """Fold in and reduce-scatter buf (in place): afterwards each of the p' new ranks holds
    its owned block of the reduction (divided by divisor) in buf; the rest of buf is
    partial sums. Returns the Halves for allgather."""
    p, rank = s.size, s.rank
    plan = Plan(rank, p, buf.count)
    if plan.role == "extra":               # hand my vector to my partner, who stands for both
        sent = s.send(buf, rank + 1, after=after, label="fold in: hand my vector to my partner")
        return Halves(plan, None, [], handed=sent)
    last: Optional[ScheduleOp] = after
    if plan.role == "proxy":
        tmp = s.scratch(buf.count, buf.dtype)
        got = s.recv(tmp, rank - 1, label="fold in: the extra rank's vector")
        last = s.compute(op, tmp, buf, out=buf, after=_deps(got, last), label="buf = tmp (op) buf")
    # every step receives into its own piece of scratch: (1 - 1/p') count in all
    kept = sum(st.keep[1] - st.keep[0] for st in plan.steps)
    tmp_all = s.scratch(kept, buf.dtype)
    offset = 0
    sends: List[Optional[ScheduleOp]] = []
    for k, st in enumerate(plan.steps):
        give, keep = _part(buf, st.give), _part(buf, st.keep)
        sends.append(s.send(give, st.peer, after=last, label=f"reduce-scatter {k}: the half I give away")
                     if give.count else None)
        if keep.count:
            tmp = tmp_all.segment(offset, offset + keep.count)
            offset += keep.count
            got = s.recv(tmp, st.peer, label=f"reduce-scatter {k}: the peer's part of the half I keep")
            last = s.compute(op, tmp, keep, out=keep, after=_deps(got, last), label="keep = tmp (op) keep",
                             divisor=divisor if k == len(plan.steps) - 1 else 1.0)
        # (keep empty: nothing left to reduce here; only empty blocks remain below)
    return Halves(plan, last, sends)


def allgather(s: Schedule, buf: BufRef, halves: Optional[Halves] = None, *,
              after: Optional[ScheduleOp] = None) -> ScheduleOp:
    """Allgather by recursive doubling, then fold out: every rank ends with the whole of
    buf. halves: reduce_scatter's (None: each new rank's owned block is already in place
    after `after`, Plan(rank, size, count).owned). Returns the last op."""
    p, rank = s.size, s.rank
    if halves is None:
        halves = Halves(Plan(rank, p, buf.count), after, [])
    plan = halves.plan
    if plan.role == "extra":               # the result comes back from my partner
        return s.recv(buf, rank + 1, after=_deps(halves.handed, after), label="fold out: the result comes back")
    last = halves.done if halves.done is not None else after
    sends = halves.sends or [None] * len(plan.steps)
    outs: List[ScheduleOp] = []
    for k in reversed(range(len(plan.steps))):
        st = plan.steps[k]
        have, missing = _part(buf, st.keep), _part(buf, st.give)
        if have.count:
            outs.append(s.send(have, st.peer, after=last, label=f"allgather {k}: what I hold"))
        if missing.count:                  # overwrite only what reduce-scatter step k has sent
            last = s.recv(missing, st.peer, after=_deps(sends[k], last),
                          label=f"allgather {k}: the half I gave away, reduced")
    if plan.role == "proxy":
        outs.append(s.send(buf, rank - 1, after=last, label="fold out: the result to the extra rank"))
    return s.nop(after=_deps(*outs, last), label="allreduce complete")


def allreduce(s: Schedule, buf: BufRef, op: int, *, after: Optional[ScheduleOp] = None,
              divisor: float = 1.0) -> ScheduleOp:
    """Add Rabenseifner's allreduce of buf (in place) to s; returns its last op.
    divisor: the result divided by it, in each block's last reduction (no pass of its own)."""
    if s.size == 1 or buf.count == 0:
        return alone(s, buf, after, divisor)
    halves = reduce_scatter(s, buf, op, after=after, divisor=divisor)
    return allgather(s, buf, halves, after=after)
