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
"""
from __future__ import annotations

from typing import List

import numpy as np

from ..schedule import ScheduleOp, Schedule


def neighbours(rank: int, size: int) -> List[int]:
    """The hypercube neighbours of rank among 0..size-1."""
    return [rank ^ (1 << d) for d in range(max(size - 1, 1).bit_length()) if (rank ^ (1 << d)) < size]


def activation(s: Schedule, trigger: ScheduleOp) -> ScheduleOp:
    """Add the flood to s; returns the op after which this rank is activated."""
    flag = s.scratch(1, np.uint8).segment(0, 0)          # activation messages carry no data
    peers = neighbours(s.rank, s.size)
    heard = [s.recv(flag, peer, label="activation from a neighbour") for peer in peers]
    active = s.nop(after=[trigger] + heard, need="any", label="activated: my post or a neighbour's message")
    for peer in peers:
        s.send(flag, peer, after=active, label="pass the activation on")
    return active
