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

from typing import List, Optional, Sequence, Tuple

import numpy as np

from .._buffers import BufRef
from ..schedule import ScheduleOp, Schedule
from ._alone import alone


def allreduce(s: Schedule, buf: BufRef, op: int, *, after: Optional[ScheduleOp] = None,
              divisor: float = 1.0) -> ScheduleOp:
    """Add a recursive-doubling allreduce of buf (in place) to s; returns its last op.
    divisor: the result divided by it, in the last exchange's reduction (no pass of its own)."""
    p, rank = s.size, s.rank
    if p == 1 or buf.count == 0:
        return alone(s, buf, after, divisor)
    tmp = s.scratch(buf.count, buf.dtype)
    pof2 = 1 << (p.bit_length() - 1)
    rem = p - pof2
    last: Optional[ScheduleOp] = after

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
        mask <<= 1
        last = s.compute(op, tmp, buf, out=buf, after=[sent, got],    # sent follows the previous compute
                         label="buf = tmp (op) buf", divisor=divisor if mask == pof2 else 1.0)
        pending_tmp = last

    # Fold out: give the extra rank its result.
    assert last is not None               # p >= 2: at least one exchange above
    if rank < 2 * rem:
        return s.send(buf, rank - 1, after=last, label="fold out: the result to the extra rank")
    return last


def allreduce_packed(s: Schedule, parts: Sequence[Tuple[BufRef, int, float]], *,
                     after: Optional[ScheduleOp] = None) -> ScheduleOp:
    """Recursive doubling of several buffers at once, each with its own op and divisor (as
    allreduce's; 1.0: none), with one message per step: every message carries all the
    parts, packed into scratch.

    For small vectors a message costs its latency, not its bytes, so a partial
    collective's round (its data with the op, its rank bitmasks with BOR) sends as many
    messages as one allreduce. The steps are those of allreduce() above; each send is
    ``pack = parts`` (a copy per part) then send pack, each receive lands in a second
    pack and is reduced part by part: ``part = unpack (op) part``. Scratch memory: two
    packs of the parts' total size (each part 8-byte aligned).
    """
    p, rank = s.size, s.rank
    parts = [part for part in parts if part[0].count > 0]
    if p == 1 or not parts:
        return s.nop(after=[alone(s, b, after, d) for b, _, d in parts] or after, label="allreduce done")
    offsets, total = [], 0
    for b, _, _ in parts:
        total = -(-total // 8) * 8
        offsets.append(total)
        total += b.nbytes
    out_pack, in_pack = s.scratch(total, np.uint8), s.scratch(total, np.uint8)

    def view(pack: BufRef, i: int) -> BufRef:
        b = parts[i][0]
        return BufRef(None, pack.slot, pack.offset + offsets[i], b.count, b.dtype)

    def pack(deps) -> List[ScheduleOp]:
        return [s.copy(b, view(out_pack, i), after=deps, label="pack = part") for i, (b, _, _) in enumerate(parts)]

    def reduce(deps, final: bool) -> List[ScheduleOp]:
        return [s.compute(op, view(in_pack, i), b, out=b, after=deps, label="part = unpack (op) part",
                          divisor=d if final else 1.0)
                for i, (b, op, d) in enumerate(parts)]

    pof2 = 1 << (p.bit_length() - 1)
    rem = p - pof2
    last: Optional[List[ScheduleOp]] = [after] if after is not None else None

    # Fold in the extra ranks.
    if rank < 2 * rem:
        if rank % 2 == 0:
            sent = s.send(out_pack, rank + 1, after=pack(last), label="fold in: hand my parts to my partner")
            got = s.recv(in_pack, rank + 1, label="fold out: the result comes back")
            back = [s.copy(view(in_pack, i), b, after=[got, sent], label="part = unpack")
                    for i, (b, _, _) in enumerate(parts)]
            return s.nop(after=back, label="allreduce done")
        got = s.recv(in_pack, rank - 1, label="fold in: the extra rank's parts")
        last = reduce([got] + (last or []), False)
        newrank = rank // 2
    else:
        newrank = rank - rem

    # log2(p') rounds of pairwise exchange.
    mask = 1
    in_free = last if rank < 2 * rem else None       # in_pack is free once the last reduce read it
    while mask < pof2:
        newpeer = newrank ^ mask
        peer = newpeer * 2 + 1 if newpeer < rem else newpeer + rem
        step = mask.bit_length() - 1
        sent = s.send(out_pack, peer, after=pack(last), label=f"round {step}: my parts")
        got = s.recv(in_pack, peer, after=in_free, label=f"round {step}: peer's parts")
        mask <<= 1
        last = reduce([sent, got], mask == pof2)     # sent: out_pack is free for the next pack
        in_free = last

    # Fold out: give the extra rank its result.
    if rank < 2 * rem:
        return s.send(out_pack, rank - 1, after=pack(last), label="fold out: the result to the extra rank")
    return s.nop(after=last, label="allreduce done")
