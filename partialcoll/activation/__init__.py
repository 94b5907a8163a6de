"""Activation broadcasts: how a round starts, linked in front of an allreduce schedule.

Each builder adds its ops to a schedule and returns the op after which this rank is
activated (joins the round). The engine's trigger op fires on a local post when the
mode makes this rank eligible for round n (see ``candidates``):

=========  =================  ==========================================
mode       builder            who may start round n
=========  =================  ==========================================
solo       flood              every rank
majority   flood              the one rank candidates(seed, n, p, 1)
probe(q)   flood              the first of candidates(seed, n, p, q)
quorum(k)  quorum[_network]    the leader, once k ranks have posted
full       full               nobody: each rank's own post starts its part
=========  =================  ==========================================

Quorum has two builders that start the round at the same moment, the k-th post:
``quorum`` (rank 0 hears a notification from every rank: p - 1 receives, one hop) and
``quorum_network`` (a sorting network in boxes: at most 3 ceil(log2 p) receives per
rank up to p = 4096, a hop per box). ``quorum_network.choose`` takes the one the
model predicts sooner.
"""
from __future__ import annotations

from typing import Callable, Dict

from . import flood, full, quorum, quorum_network
from .candidates import candidates


def quorum_activation(s, trigger, *, k: int):
    """The quorum activation the model chooses for (p, k): the leader's or the network's."""
    build = quorum_network.activation if quorum_network.choose(s.size, k) == "network" else quorum.activation
    return build(s, trigger, k=k)


BUILDERS: Dict[str, Callable] = {
    "solo": flood.activation,
    "majority": flood.activation,
    "probe": flood.activation,
    "quorum": quorum_activation,
    "full": full.activation,
}

__all__ = ["BUILDERS", "candidates"]
