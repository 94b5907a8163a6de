"""Parameter-server allreduce (PSLD's aggregation): blocks reduced by their owners.

How it works. The vector is cut into blocks of `block_bytes` (the last one shorter).
Block b has an owner, assignment[b]. Every other rank sends its block b to the owner,
which reduces the blocks as they arrive (``blk = tmp (op) blk``, in peer order, so every
element is reduced on one path and every rank ends with the same bits) and sends the
result back: reduce to the owners, then broadcast from the owners. An owner receives
from every peer in parallel into two scratch blocks per peer (double-buffered across the
blocks it owns), so its scratch is at most 2 (p - 1) blocks whatever it owns.

Messages: a non-owner sends and receives each block once; an owner of k blocks receives
and sends k (p - 1) blocks. With workers= (PSLD's layout: workers and servers apart),
only the workers' blocks travel: a dedicated server (not a worker) receives the
workers' blocks it owns, reduces them starting from the first worker's (a copy: its own
buf, which it never posts to, is never read) and sends the results to the workers, and
nothing else; a server left without blocks is off the data path altogether. The owners
set the speed: a slow or overloaded owner makes its blocks late, which is what
balancing (partialcoll/balance.py) moves blocks away from.

Worked example, p = 3, count = 5 elements, blocks of 2 elements, owners [0, 1, 0]:

    block 0 [0:2)  ranks 1, 2 send it to 0; 0 reduces, sends the result to 1 and 2
    block 1 [2:4)  ranks 0, 2 send it to 1; 1 reduces, sends it back
    block 2 [4:5)  ranks 1, 2 send it to 0 (into 0's second scratch block per peer); ...

In flight: at most WINDOW of this rank's blocks away (the send of a block and the
receive of its result), and at most WINDOW results an owner sends to one peer: the
send of the next waits for the one WINDOW blocks earlier. Every such wait is for an
earlier block, so no cycle can form; and MPI tests every message in flight on every
pass, so thousands posted at once cost rounds quadratic in the blocks (1 MiB in 1024
blocks at P = 4: 42 ms without the window, 7.3 ms with it; MPI_Allreduce: 0.6 ms). Up
to WINDOW blocks the schedule has no such wait.

Timers: for each block this rank sends to another owner, (send op, receive op, owner):
the engine measures the owner's service time from the send to the result's arrival.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

from .._buffers import BufRef
from ..schedule import ScheduleOp, Schedule
from ._alone import alone

BLOCK_BYTES = 4 << 20        # PSLD's block size
WINDOW = 64                  # blocks in flight per rank (and results per owner and peer)


def block_count(count: int, itemsize: int, block_bytes: int = BLOCK_BYTES) -> int:
    """How many blocks a vector of count elements of itemsize bytes is cut into."""
    per = max(1, block_bytes // itemsize)
    return -(-count // per)


def round_robin(nblocks: int, servers: Sequence[int]) -> List[int]:
    """The static assignment: block b to servers[b mod len(servers)]."""
    return [servers[b % len(servers)] for b in range(nblocks)]


def allreduce(s: Schedule, buf: BufRef, op: int, *, after: Optional[ScheduleOp] = None, divisor: float = 1.0,
              block_bytes: int = BLOCK_BYTES, assignment: Optional[Sequence[int]] = None,
              servers: Optional[Sequence[int]] = None, workers: Optional[Sequence[int]] = None,
              timers: Optional[List[Tuple[int, int, int]]] = None) -> ScheduleOp:
    """Add a parameter-server allreduce of buf (in place) to s; returns its last op.

    assignment: the owner of each block (default: round-robin over servers, default all
    ranks). workers: the ranks whose buf is reduced and who get the result (default all);
    any other rank is a dedicated server: it sends and receives nothing but the blocks it
    owns, whose reduction starts from a copy of the first worker's block (its own buf is
    written before it is read: the engine need not fill it). divisor: the owner divides
    in its last reduction. timers: if given, gets (send op index, receive
    op index, owner) of every block this rank sends away."""
    p, rank = s.size, s.rank
    if p == 1 or buf.count == 0:
        return alone(s, buf, after, divisor)
    per = max(1, block_bytes // buf.dtype.itemsize)
    nblocks = -(-buf.count // per)
    owners = list(assignment) if assignment is not None else round_robin(nblocks, list(servers or range(p)))
    assert len(owners) == nblocks and all(0 <= o < p for o in owners), (nblocks, owners)
    working = set(range(p) if workers is None else workers)
    mine = [b for b in range(nblocks) if owners[b] == rank]
    peers = [j for j in range(p) if j != rank and j in working]    # whose blocks I reduce, who gets results
    if rank not in working and not mine:
        return s.nop(after=after, label="allreduce: a dedicated server without blocks")
    nbuf = min(2, len(mine))
    tmp = {j: [s.scratch(per, buf.dtype) for _ in range(nbuf)] for j in peers} if mine else {}
    reduced: dict = {j: [] for j in peers}        # per peer: the computes that read its scratch blocks
    ends: List[ScheduleOp] = []
    away: List[ScheduleOp] = []                   # the result receives of the blocks this rank sends away
    results: dict = {j: [] for j in peers}        # per peer: the results this owner sent it

    def windowed(first: Optional[ScheduleOp], earlier: List[ScheduleOp]) -> list:
        """The next op's dependencies: first (if any), and the op WINDOW back in earlier
        (if there is one)."""
        deps = [] if first is None else [first]
        return deps + [earlier[-WINDOW]] if len(earlier) >= WINDOW else deps

    for b in range(nblocks):
        blk = buf.segment(b * per, min((b + 1) * per, buf.count))
        o = owners[b]
        if o != rank:
            if rank not in working:
                continue                            # a dedicated server: not its block
            sent = s.send(blk, o, after=windowed(after, away) or None, label=f"block {b}: send to owner {o}")
            got = s.recv(blk, o, after=sent, label=f"block {b}: result from owner {o}")
            if timers is not None:
                timers.append((sent.index, got.index, o))
            away.append(got)
            ends.append(got)
            continue
        k = mine.index(b)                           # this is the k-th block this rank owns
        last = after
        if not peers:                               # the only worker: its block is the result
            ends.append(alone(s, blk, after, divisor))
            continue
        for i, j in enumerate(peers):
            t = tmp[j][k % nbuf].segment(0, blk.count)
            got = s.recv(t, j, after=reduced[j][k - 2] if k >= 2 else None,
                         label=f"block {b}: recv from {j}")
            deps = [got, last] if last is not None else [got]
            d = divisor if i == len(peers) - 1 else 1.0
            if i == 0 and rank not in working:      # a dedicated server: its blk holds nothing
                last = s.copy(t, blk, after=deps, label=f"block {b}: blk = tmp", divisor=d)
            else:
                last = s.compute(op, t, blk, out=blk, after=deps, label=f"block {b}: blk = tmp (op) blk", divisor=d)
            reduced[j].append(last)
        for j in peers:
            results[j].append(s.send(blk, j, after=windowed(last, results[j]), label=f"block {b}: result to {j}"))
            ends.append(results[j][-1])
    return s.nop(after=ends, label="allreduce complete")
