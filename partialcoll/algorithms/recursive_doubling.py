"""Recursive-doubling allreduce, for any number of processes.

How it works. Let p' be the largest power of two <= p and rem = p - p'. First the
rem *extra* ranks fold in: among the ranks r < 2*rem, each even r sends its vector to
r + 1, which reduces it into its own (``buf = tmp (op) buf``) and stands for both;
the even rank sits out. The p' remaining ranks take new ranks 0..p'-1 and run
log2(p') rounds: in round k a rank exchanges its whole vector with the rank whose new
rank differs in bit k and reduces (``buf = tmp (op) buf``). Last, every odd r < 2*rem
sends the result back to r - 1.

Rounds: ceil(log2 p) + 2 when p is not a power of two (log2 p when it is); each moves
the whole vector, so it suits small messages. Scratch memory: one vector (tmp).
Every rank ends with bitwise the same result: each exchange reduces the same two
partial results on both sides, and our ops are exactly commutative.

Worked example, p = 7 (p' = 4, rem = 3):

    fold in:   0 -> 1, 2 -> 3, 4 -> 5           new ranks: 1->0, 3->1, 5->2, 6->3
    round 0:   1 <-> 3, 5 <-> 6                 (new 0 <-> 1, 2 <-> 3)
    round 1:   1 <-> 5, 3 <-> 6                 (new 0 <-> 2, 1 <-> 3)
    fold out:  1 -> 0, 3 -> 2, 5 -> 4

(fflib2's recursive doubling skips the fold and is wrong for such p.)
"""
from __future__ import annotations

from typing import Optional

from .._buffers import BufRef
from ..schedule import ScheduleOp, Schedule


def allreduce(s: Schedule, buf: BufRef, op: int, *, after: Optional[ScheduleOp] = None) -> ScheduleOp:
    """Add a recursive-doubling allreduce of buf (in place) to s; returns its last op."""
    p, rank = s.size, s.rank
    if p == 1 or buf.count == 0:
        return s.nop(after=after, label="allreduce: nothing to exchange")
    tmp = s.scratch(buf.count, buf.dtype)
    pof2 = 1 << (p.bit_length() - 1)
    rem = p - pof2
    last = after

    # Fold in the extra ranks.
    if rank < 2 * rem:
        if rank % 2 == 0:
            sent = s.send(buf, rank + 1, after=last, label="fold in: hand my vector to my partner")
            return s.recv(buf, rank + 1, after=sent, label="fold out: the result comes back")
        got = s.recv(tmp, rank - 1, label="fold in: the extra rank's vector")
        last = s.compute(op, tmp, buf, out=buf, after=[got] + ([last] if last else []),
                         label="buf = tmp (op) buf")
        newrank = rank // 2
    else:
        newrank = rank - rem

    # log2(p') rounds of pairwise exchange.
    mask = 1
    pending_tmp = last if rank < 2 * rem else None   # tmp is free once the last compute read it
    while mask < pof2:
        newpeer = newrank ^ mask
        peer = newpeer * 2 + 1 if newpeer < rem else newpeer + rem
        sent = s.send(buf, peer, after=last, label=f"round {mask.bit_length() - 1}: my vector")
        got = s.recv(tmp, peer, after=pending_tmp, label=f"round {mask.bit_length() - 1}: peer's vector")
        last = s.compute(op, tmp, buf, out=buf, after=[sent, got],    # sent follows the previous compute
                         label="buf = tmp (op) buf")
        pending_tmp = last
        mask <<= 1

    # Fold out: give the extra rank its result.
    if rank < 2 * rem:
        return s.send(buf, rank - 1, after=last, label="fold out: the result to the extra rank")
    return last
