"""No activation (full rounds): this rank joins the round on its own post.

The allreduce itself then waits for every rank, as MPI_Allreduce does. Full rounds
also serve max_staleness (every s-th round) and the rounds after a rank has started
to close.
"""
from __future__ import annotations

from ..schedule import ScheduleOp, Schedule


def activation(s: Schedule, trigger: ScheduleOp) -> ScheduleOp:
    """Returns the trigger itself: a rank is active in a full round only by posting."""
    return trigger
