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
quorum(k)  quorum             the leader, once k ranks have posted
full       full               nobody: each rank's own post starts its part
=========  =================  ==========================================
"""
from __future__ import annotations

from typing import Callable, Dict

from . import flood, full, quorum
from .candidates import candidates

BUILDERS: Dict[str, Callable] = {
    "solo": flood.activation,
    "majority": flood.activation,
    "probe": flood.activation,
    "quorum": quorum.activation,
    "full": full.activation,
}

__all__ = ["BUILDERS", "candidates"]
