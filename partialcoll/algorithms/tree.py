"""Topology-aware tree allreduce (RAT), for any p, any regions and any number of levels.

How it works. ``groups`` gives each rank's region, one list per level, innermost first
(hosts, then racks, ...). Each level has three steps, run for the regions' *aggregators*:

  reduce     every member of a region sends its vector to the region's aggregator,
             which reduces them into its own (``buf = tmp (op) buf``, one tmp per member);
  up         the aggregators take part in the next level, grouped by their own region
             at that level; after the last level the aggregators of all top regions
             run an allreduce among themselves (recursive doubling or ring, by size);
  broadcast  going back down, each aggregator sends the result to its members, which
             receive it straight into place.

So only aggregators cross a region boundary: for two regions, one vector each way.
A slow or blocked member delays its own region's reduce, not a ring of all p ranks.

Chunks ("multiple trees"). The vector is cut into ``chunks`` pieces and each piece gets
its own tree: chunk c of region g (members m_0 < m_1 < ... < m_{k-1}, at the level in
question) is aggregated by m_{(c + seed + g) mod k}. With as many chunks as the largest
region has members, every member aggregates its share and every link carries traffic
in both directions, as in a ring; the chunks run concurrently (nothing orders them).
By default a vector is cut only where each chunk keeps at least ``CHUNK_BYTES``.

Rotation. RAT rotates the aggregator from round to round. The builder takes a rotation
index r and gives chunk c of region g to member m_{(c + r * chunks + seed + g) mod k}:
variant r hands the next ``chunks`` members the aggregation. A partial allreduce builds
R = rotations(...) = ceil(k_max / chunks) variants of its round schedule (k_max: the
largest region), and the engine runs round n on variant n mod R (every rank knows n,
so all agree on the variant; the version n in the tags keeps rounds apart). Over R
consecutive rounds every member of the largest region aggregates (and every member of
a smaller region too, since R * chunks >= k_max >= k). With chunks == k_max (vectors of
k_max * CHUNK_BYTES and more) R = 1: the chunks already spread the work in every round.
Recursive doubling and ring have R = 1. R is at most MAX_ROTATIONS.

What R costs: each variant is a whole round schedule with its own scratch, held for
the collective's lifetime. A rank's scratch in variant r is the k - 1 chunks of each
chunk it aggregates there; over the R variants a member aggregates one or two chunks
per level, so it holds at most 2 (k - 1) chunks of scratch per level in all (a chunk is
under 2 * CHUNK_BYTES whenever R > 1, so < 4 (k - 1) CHUNK_BYTES), plus the top
allreduce's scratch in the variants where it is a top aggregator, and R op tables.
With one variant the same scratch sits on fewer ranks; rotation spreads it.

Rounds: per level, one reduce step and one broadcast step (each aggregator exchanges
with its k - 1 members concurrently), plus the top allreduce among the G top regions'
aggregators (log2 G or 2(G - 1) rounds). Scratch memory: an aggregator of a chunk
receives each member's chunk into its own tmp, so k - 1 chunks per region it
aggregates: about one vector per level when the vector is cut into k chunks
((k - 1) vectors when it is not), plus the top allreduce's scratch.
Every rank ends with the same bits: each chunk is reduced at one place, then copied.

Worked example, p = 7, groups = [0, 0, 0, 1, 1, 1, 1] (regions of 3 and 4), one chunk,
seed 0, rotation 0: region 0 is aggregated by its member (0 + 0 + 0) mod 3 = 0, i.e. rank
0; region 1 by its member (0 + 0 + 1) mod 4 = 1, i.e. rank 4.

    reduce     1 -> 0, 2 -> 0            3 -> 4, 5 -> 4, 6 -> 4
    top        0 <-> 4                   (recursive doubling between the 2 aggregators)
    broadcast  0 -> 1, 0 -> 2            4 -> 3, 4 -> 5, 4 -> 6

With chunks = 4 (count 8, chunks [0:2) [2:4) [4:6) [6:8)) chunk c is aggregated by
rank c mod 3 in region 0 and by rank 3 + (c + 1) mod 4 in region 1: (0, 4), (1, 5),
(2, 6), (0, 3). Cross-region traffic is still one vector each way, now spread over
all seven ranks' links.

Rotating the one-chunk tree: R = ceil(4 / 1) = 4 variants; in variant r region 0 is
aggregated by rank r mod 3 and region 1 by rank 3 + (r + 1) mod 4: rounds 0, 1, 2, 3,
4, ... run on variants 0, 1, 2, 3, 0, ... with aggregators (0, 4), (1, 5), (2, 6),
(0, 3), (0, 4), ...

Two levels, groups = [[0, 0, 1, 1, 2, 2, 3], [0, 0, 0, 0, 1, 1, 1]] (hosts of 2, 2,
2, 1 ranks in racks of 4 and 3): the host aggregators 0, 3, 4, 6 meet at level 1 in
racks {0, 3} and {4, 6}, whose aggregators 0 and 6 run the top allreduce.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

from .._buffers import BufRef
from .._errors import ArgumentError
from ..schedule import Schedule, ScheduleOp

# Below this many bytes per chunk the vector is not cut (one tree).
CHUNK_BYTES = 64 * 1024
# At most this many rotated variants of a round schedule (see "What R costs").
MAX_ROTATIONS = 64

Levels = Tuple[Tuple[int, ...], ...]


def normalize_groups(groups, size: int) -> Levels:
    """groups= as one tuple of region indices (0, 1, ... in order of first appearance)
    per level. Takes one list (one level) or a list of lists (innermost level first)."""
    if groups is None:
        return ((0,) * size,)
    try:
        levels = list(groups)
        if levels and (isinstance(levels[0], (str, bytes)) or not hasattr(levels[0], "__len__")):
            levels = [levels]            # one level: a region name per rank
        levels = [list(level) for level in levels]
    except TypeError:
        raise ArgumentError(f"groups= must be a list of each rank's region (or a list of such lists, "
                            f"one per level), not {groups!r}") from None
    if not levels:
        raise ArgumentError("groups= must give at least one level")
    out = []
    for depth, level in enumerate(levels):
        if len(level) != size:
            raise ArgumentError(f"groups= level {depth} gives {len(level)} regions, "
                                f"but the communicator has {size} ranks (one entry per rank)")
        index: Dict = {}
        try:
            out.append(tuple(index.setdefault(_key(g), len(index)) for g in level))
        except TypeError:
            raise ArgumentError(f"groups= level {depth}: region names must be hashable "
                                f"(ints or strings), got {level!r}") from None
    return tuple(out)


def _key(g):
    """A region name as a dict key (NumPy integers and Python ints are the same region)."""
    if hasattr(g, "item") and callable(g.item):
        g = g.item()
    hash(g)
    return g


def host_groups(comm) -> Levels:
    """One region per shared-memory node of comm (collective): Split_type(COMM_TYPE_SHARED),
    named by the node's lowest rank, gathered so that every rank holds the same list."""
    from mpi4py import MPI
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        leader = node.allreduce(comm.Get_rank(), op=MPI.MIN)
    finally:
        node.Free()
    return normalize_groups(comm.allgather(leader), comm.Get_size())


def default_chunks(count: int, itemsize: int, levels: Levels) -> int:
    """As many chunks as the largest region has members, each of at least CHUNK_BYTES."""
    biggest = max(max(level.count(g) for g in set(level)) for level in levels)
    return max(1, min(biggest, count * itemsize // CHUNK_BYTES, count))


def rotations(count: int, itemsize: int, levels: Levels, chunks: Optional[int] = None) -> int:
    """R: how many rotated variants of the round schedule it takes for every member of the
    largest region to aggregate once, ceil(k_max / chunks) (at most MAX_ROTATIONS); 1 where
    there is nothing to rotate (no data, one rank, or every region of one rank)."""
    size = len(levels[0])
    biggest = max(max(level.count(g) for g in set(level)) for level in levels)
    if size <= 1 or count == 0 or biggest <= 1:
        return 1
    n = default_chunks(count, itemsize, levels) if chunks is None else max(1, min(int(chunks), count))
    return max(1, min(MAX_ROTATIONS, -(-biggest // n)))


class Plan:
    """One chunk's tree, the same on every rank: who sends to whom at each level.
    rotation r of a vector in `chunks` pieces: chunk c of region g goes to member
    (c + r * chunks + seed + g) mod k."""

    def __init__(self, levels: Levels, chunk: int, seed: int, rotation: int = 0, chunks: int = 1) -> None:
        size = len(levels[0])
        self.parent: List[Dict[int, int]] = []       # per level: member -> its aggregator
        self.members: List[Dict[int, List[int]]] = []  # per level: aggregator -> its members
        alive = list(range(size))                     # the ranks taking part at this level
        for level in levels:
            regions: Dict[int, List[int]] = {}
            for r in alive:
                regions.setdefault(level[r], []).append(r)
            parent, members = {}, {}
            for g, ranks in regions.items():
                agg = ranks[(chunk + rotation * chunks + seed + g) % len(ranks)]
                members[agg] = [r for r in ranks if r != agg]
                for r in members[agg]:
                    parent[r] = agg
            self.parent.append(parent)
            self.members.append(members)
            alive = sorted(members)
        self.top = alive                               # the top regions' aggregators


class _Among:
    """The schedule s as seen by `ranks` alone: rank i of the view is ranks[i]. Lets the
    flat builders (recursive doubling, ring) run among the aggregators."""

    def __init__(self, s: Schedule, ranks: Sequence[int]) -> None:
        self._s, self._ranks = s, list(ranks)
        self.size, self.rank = len(self._ranks), self._ranks.index(s.rank)

    def send(self, buf, dest: int, **kw) -> ScheduleOp:
        return self._s.send(buf, self._ranks[dest], **kw)

    def recv(self, buf, source: int, **kw) -> ScheduleOp:
        return self._s.recv(buf, self._ranks[source], **kw)

    def __getattr__(self, name):            # compute, copy, nop, scratch
        return getattr(self._s, name)


def allreduce(s: Schedule, buf: BufRef, op: int, *, after: Optional[ScheduleOp] = None,
              groups=None, seed: int = 0, chunks: Optional[int] = None, rotation: int = 0,
              divisor: float = 1.0) -> ScheduleOp:
    """Add a tree allreduce of buf (in place) to s; returns its last op.

    groups: each rank's region (one list per level, innermost first; None: one region).
    seed: moves the aggregators. chunks: trees over pieces of the vector (default: see
    default_chunks). rotation: which rotated variant r (0 <= r < rotations(...)); the
    partial allreduce runs round n on variant n mod R. divisor: the result divided by it
    where a chunk's sum is made (the top aggregators' allreduce, or the one top
    aggregator's last reduction), before it is broadcast down."""
    from . import choose, ALGORITHMS
    from ._alone import alone
    from .ring import segments
    p, rank = s.size, s.rank
    if p == 1 or buf.count == 0:
        return alone(s, buf, after, divisor)
    levels = normalize_groups(groups, p)
    nchunks = default_chunks(buf.count, buf.dtype.itemsize, levels) if chunks is None else chunks
    nchunks = max(1, min(int(nchunks), buf.count))
    bounds = segments(buf.count, nchunks)
    finals: List[ScheduleOp] = []
    for c in range(nchunks):
        plan = Plan(levels, c, seed, rotation, nchunks)
        seg = buf.segment(bounds[c], bounds[c + 1])
        last = after
        sent_at: Optional[Tuple[int, ScheduleOp]] = None     # (level, send) where I handed my chunk up
        # the one top aggregator makes the chunk's sum in its last reduction: divide there
        last_level = None
        if plan.top == [rank] and divisor != 1.0:
            last_level = max((lv for lv in range(len(levels)) if plan.members[lv].get(rank)), default=None)

        # Reduce, level by level, while I am an aggregator.
        for lv in range(len(levels)):
            if rank in plan.parent[lv]:
                agg = plan.parent[lv][rank]
                sent_at = (lv, s.send(seg, agg, after=last, label=f"chunk {c} level {lv}: my part up to {agg}"))
                break
            members = plan.members[lv][rank]
            for i, m in enumerate(members):
                tmp = s.scratch(seg.count, seg.dtype)
                got = s.recv(tmp, m, label=f"chunk {c} level {lv}: member {m}'s part")
                final = lv == last_level and i == len(members) - 1
                last = s.compute(op, tmp, seg, out=seg, after=[got, last] if last else [got],
                                 label="seg = tmp (op) seg", divisor=divisor if final else 1.0)

        # Allreduce among the top aggregators.
        if sent_at is None and len(plan.top) > 1:
            top = choose("auto", seg.nbytes, len(plan.top))
            last = ALGORITHMS[top](_Among(s, plan.top), seg, op, after=last, divisor=divisor)

        # Broadcast back down.
        for lv in reversed(range(len(levels))):
            if sent_at is not None and sent_at[0] == lv:
                agg = plan.parent[lv][rank]
                last = s.recv(seg, agg, after=sent_at[1], label=f"chunk {c} level {lv}: result from {agg}")
            elif sent_at is None or lv < sent_at[0]:
                for m in plan.members[lv][rank]:
                    finals.append(s.send(seg, m, after=last, label=f"chunk {c} level {lv}: result to {m}"))
        if last is not None:
            finals.append(last)
    return s.nop(after=finals, label="allreduce complete")
