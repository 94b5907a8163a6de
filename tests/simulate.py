"""A pure-Python executor of dry-built schedules, one per rank: it checks the
algorithms for many process counts without MPI. Messages match per (sender,
receiver) pair in creation (op) order, as the engine's tags make them, whatever order
they fire in; ops fire when `need` of their dependencies have completed, at most once;
a deadlock is reported. held: (rank, op index) pairs that never fire (a partial round's
trigger at a rank that does not post) and need not complete."""
from __future__ import annotations

from collections import defaultdict, deque
from typing import Iterable, List, Tuple

import numpy as np

from partialcoll._buffers import SLOT_SCRATCH
from partialcoll.schedule import COMPUTE, RECV, SEND, Schedule

_NUMPY = {0: np.add, 1: np.multiply, 2: np.minimum, 3: np.maximum, 8: np.bitwise_or, 7: np.bitwise_and,
          9: np.bitwise_xor}


def view(ref, sched) -> np.ndarray:
    if ref.slot == SLOT_SCRATCH:           # the schedule's scratch: memory of the simulator's own
        if not hasattr(sched, "_dry_scratch"):
            sched._dry_scratch = np.zeros(sched._scratch_bytes + 1, np.uint8)
        return sched._dry_scratch[ref.offset:ref.offset + ref.nbytes].view(ref.dtype)
    start = ref.offset // ref.dtype.itemsize
    return ref.array.reshape(-1).view(ref.dtype)[start:start + ref.count]


def run(scheds: List[Schedule], held: Iterable[Tuple[int, int]] = ()) -> None:
    p = len(scheds)
    got = [[0] * len(s.ops) for s in scheds]
    done = [[False] * len(s.ops) for s in scheds]
    fired = [[False] * len(s.ops) for s in scheds]
    succ = [defaultdict(list) for _ in scheds]
    for r, s in enumerate(scheds):
        for op in s.ops:
            for d in op.deps:
                succ[r][d].append(op.index)
    seq = [[0] * len(s.ops) for s in scheds]   # k: the k-th message of its (src, dst) pair, in op order
    counted = defaultdict(int)
    for r, s in enumerate(scheds):
        for op in s.ops:
            if op.kind in (SEND, RECV):
                pair = (r, op.peer) if op.kind == SEND else (op.peer, r)
                seq[r][op.index] = counted[pair, op.kind]
                counted[pair, op.kind] += 1
    channel = {}                        # (src, dst, k) -> the payload sent
    posted = {}                         # (src, dst, k) -> the (rank, op) receive posted
    held = set(held)
    ready = deque((r, op.index) for r, s in enumerate(scheds) for op in s.ops
                  if op.need == 0 and (r, op.index) not in held)

    def complete(r, i):
        done[r][i] = True
        for j in succ[r][i]:
            got[r][j] += 1
            if got[r][j] == scheds[r].ops[j].need and not fired[r][j]:
                ready.append((r, j))

    def match(key):
        if key in channel and key in posted:
            data = channel.pop(key)
            rr, i = posted.pop(key)
            buf = view(scheds[rr].ops[i].bufs[0], scheds[rr])
            assert buf.nbytes == data.nbytes, "message size mismatch"
            buf[...] = data.view(buf.dtype)
            complete(rr, i)

    while ready:
        r, i = ready.popleft()
        if fired[r][i]:
            continue
        fired[r][i] = True
        op = scheds[r].ops[i]
        if op.kind == SEND:
            channel[r, op.peer, seq[r][i]] = view(op.bufs[0], scheds[r]).copy().view(np.uint8)
            complete(r, i)          # eager in the simulator; buffers are copied
            match((r, op.peer, seq[r][i]))
        elif op.kind == RECV:
            posted[op.peer, r, seq[r][i]] = (r, i)
            match((op.peer, r, seq[r][i]))
        elif op.kind == COMPUTE:
            a, b, out = (view(x, scheds[r]) for x in op.bufs)
            res = a if op.redop == 10 else _NUMPY[op.redop](a, b)
            out[...] = res / op.divisor if op.divisor != 1 else res
            complete(r, i)
        else:
            complete(r, i)
    stuck = [(r, i) for r in range(p) for i, d in enumerate(done[r]) if not d and (r, i) not in held]
    assert not stuck, f"deadlock: ops never completed: {stuck[:10]}"
    assert not channel, f"messages sent that no receive matched: {sorted(channel)[:10]}"
