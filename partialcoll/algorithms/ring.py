"""Ring allreduce (reduce-scatter, then allgather), for any p and any count.

How it works. The vector is cut into p segments, as even as possible: segment i has
count // p elements, plus one for the first count % p segments (so some are empty
when count < p). Each rank sends to its right neighbour and receives from its left.

Reduce-scatter, p - 1 steps: in step t, rank r sends segment r - t and receives
segment r - t - 1 into tmp, then ``seg = tmp (op) seg``. After it, rank r holds the
full reduction of segment r + 1.
Allgather, p - 1 steps: in step t, rank r sends segment r + 1 - t and receives
segment r - t straight into place.

Rounds: 2(p - 1), each moving count / p elements: bandwidth-optimal, for large
messages. Scratch memory: two segments (tmp, double-buffered so the next receive can
be posted while the previous segment is reduced). Every rank ends with the same bits:
each segment is reduced on one path and then copied.

Worked example, p = 3, count = 7: segments [0:3) [3:5) [5:7).

    reduce-scatter  t=0: 0 sends seg0, gets seg2    1 sends seg1, gets seg0   2 sends seg2, gets seg1
                    t=1: 0 sends seg2, gets seg1    1 sends seg0, gets seg2   2 sends seg1, gets seg0
                    now 0 owns seg1, 1 owns seg2, 2 owns seg0 (fully reduced)
    allgather       t=0: 0 sends seg1, gets seg0    1 sends seg2, gets seg1   2 sends seg0, gets seg2
                    t=1: 0 sends seg0, gets seg2    1 sends seg1, gets seg0   2 sends seg2, gets seg1
"""
from __future__ import annotations

from typing import List, Optional

from .._buffers import BufRef
from ..schedule import ScheduleOp, Schedule
from ._alone import alone


def segments(count: int, p: int) -> List[int]:
    """Segment boundaries: segment i is [bounds[i], bounds[i + 1])."""
    base, extra = divmod(count, p)
    return [i * base + min(i, extra) for i in range(p + 1)]


def allreduce(s: Schedule, buf: BufRef, op: int, *, after: Optional[ScheduleOp] = None,
              divisor: float = 1.0) -> ScheduleOp:
    """Add a ring allreduce of buf (in place) to s; returns its last op.
    divisor: the result divided by it, in the last reduce-scatter step (each rank divides
    the segment it owns, which the allgather then copies: no pass of its own)."""
    p, rank = s.size, s.rank
    if p == 1 or buf.count == 0:
        return alone(s, buf, after, divisor)
    bounds = segments(buf.count, p)

    def seg(i: int) -> BufRef:
        i %= p
        return buf.segment(bounds[i], bounds[i + 1])

    right, left = (rank + 1) % p, (rank - 1) % p
    biggest = bounds[1] - bounds[0]
    tmps = [s.scratch(biggest, buf.dtype), s.scratch(biggest, buf.dtype)]

    # Reduce-scatter.
    rs_sends: List[ScheduleOp] = []
    reduced: List[ScheduleOp] = []          # reduced[t]: the compute of step t (frees tmps[t % 2])
    last: Optional[ScheduleOp] = after
    for t in range(p - 1):
        out, into = seg(rank - t), seg(rank - t - 1)
        tmp = tmps[t % 2].segment(0, into.count)
        rs_sends.append(s.send(out, right, after=last, label=f"reduce-scatter {t}: send seg {(rank - t) % p}"))
        got = s.recv(tmp, left, after=reduced[t - 2] if t >= 2 else None,
                     label=f"reduce-scatter {t}: recv seg {(rank - t - 1) % p}")
        last = s.compute(op, tmp, into, out=into, after=[got, last] if last else [got],
                         label="seg = tmp (op) seg", divisor=divisor if t == p - 2 else 1.0)
        reduced.append(last)

    # Allgather: rank owns seg(rank + 1).
    # A receive may overwrite segment rank - t once reduce-scatter step t has sent it.
    ag_sends: List[ScheduleOp] = []
    for t in range(p - 1):
        out, into = seg(rank + 1 - t), seg(rank - t)
        ag_sends.append(s.send(out, right, after=last, label=f"allgather {t}: send seg {(rank + 1 - t) % p}"))
        last = s.recv(into, left, after=[rs_sends[t], reduced[-1]],
                      label=f"allgather {t}: recv seg {(rank - t) % p}")
    assert last is not None               # p >= 2: at least one step above
    return s.nop(after=ag_sends + [last], label="allreduce complete")
