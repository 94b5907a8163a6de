"""Quorum activation: round n starts once k ranks have posted (guaranteed, not on average).

How it works. Rank 0 is the leader; its engine counts passively, so a slow leader
application does not delay the round. Every other rank sends the leader one
notification per round: on its post (the trigger), or, if it is activated before
posting, right after activation. The leader's start op is a k-of-p threshold over
its own trigger and the p - 1 notifications; it then broadcasts the activation down
a binomial tree (ceil(log2 p) hops). Notifications sent after activation cannot
count: the first activation happens only after k real ones.

Worked example, p = 5, k = 3: ranks 2 and 4 post, then rank 1. The leader's
threshold fires on the third notification; the tree 0 -> {4, 2, 1}, 1 -> {3}
activates everyone; ranks 0 and 3 then notify with stale data (active: 1, 2, 4).
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import numpy as np

from ..schedule import ScheduleOp, Schedule

LEADER = 0


def binomial_tree(rank: int, size: int) -> Tuple[Optional[int], List[int]]:
    """(parent, children) of rank in the binomial tree rooted at LEADER (rank 0)."""
    parent, mask = None, 1
    while mask < size:
        if rank & mask:
            parent = rank - mask
            break
        mask <<= 1
    children = []
    mask >>= 1
    while mask > 0:
        if rank + mask < size:
            children.append(rank + mask)
        mask >>= 1
    return parent, children


def activation(s: Schedule, trigger: ScheduleOp, *, k: int) -> ScheduleOp:
    """Add the quorum activation to s; returns the op after which this rank is activated."""
    flag = s.scratch(1, np.uint8).segment(0, 0)
    parent, children = binomial_tree(s.rank, s.size)
    if s.rank == LEADER:
        notes = [s.recv(flag, r, label="notification: rank posted") for r in range(s.size) if r != LEADER]
        active = s.nop(after=[trigger] + notes, need=k, label=f"{k} ranks have posted")
    else:
        assert parent is not None         # every rank but the leader has one
        active = s.recv(flag, parent, label="activation from my parent")
        s.send(flag, LEADER, after=[trigger, active], need="any", label="notify the leader")
    for child in children:
        s.send(flag, child, after=active, label="pass the activation down")
    return active
