"""RNA's speed groups: processes grouped by their iteration time (Yang et al., Middleware 2020).

Let zeta be the difference between the slowest and the fastest step time of a set of
processes and v their mean. If zeta > v, the set splits into the processes slower than v
and the others, and the rule applies again inside each part, until zeta <= v in every
group. Groups are numbered along the time axis from the fastest (0).

Example (7 ranks, seconds): [0.010, 0.012, 0.011, 0.050, 0.013, 0.052, 0.2] has mean
0.0497 and spread 0.19 > v: {0.050, 0.052, 0.2} (slower than v) splits off. Inside it the
mean is 0.1007, the spread 0.15 > v: {0.2} splits from {0.050, 0.052}. The fast part
(spread 0.003, mean 0.0115) stays whole: groups 0 = ranks 0, 1, 2, 4; 1 = ranks 3, 5;
2 = rank 6.

``split_by_speed`` is the pure rule (no MPI); ``speed_groups`` is the collective: one
allgather of the step times, then every rank applies the rule to the same list, so all
ranks agree on every rank's group without further messages.
"""
from __future__ import annotations

import math
import numbers
from typing import List, Sequence

import numpy as np
from mpi4py import MPI

from ._agree import agree, as_problem
from ._errors import ArgumentError
from ._types import check_comm


def check_step_time(step_time, what: str = "step_time") -> float:
    """step_time as a float: a real, positive, finite number of seconds (never a bool)."""
    if not isinstance(step_time, numbers.Real) or isinstance(step_time, (bool, np.bool_)):
        raise ArgumentError(f"{what} must be a positive number of seconds, not {step_time!r}")
    value = float(step_time)
    if not (math.isfinite(value) and value > 0.0):
        raise ArgumentError(f"{what} must be a positive, finite number of seconds, not {step_time!r}")
    return value


def split_by_speed(times: Sequence[float]) -> List[int]:
    """RNA's grouping rule on a list of step times (one per rank): each rank's group,
    0 for the fastest group. Pure and deterministic."""
    times = [check_step_time(t, f"step time of rank {r}") for r, t in enumerate(times)]
    groups: List[List[int]] = []          # finished groups, each a list of ranks

    def split(members: List[int]) -> None:
        ts = [times[r] for r in members]
        mean = math.fsum(ts) / len(ts)
        if max(ts) - min(ts) <= mean:
            groups.append(members)
            return
        # zeta > v: the ranks slower than the mean, and the others (both non-empty: the
        # slowest is above the mean and the fastest is not, as the times differ)
        split([r for r in members if times[r] <= mean])
        split([r for r in members if times[r] > mean])

    if times:
        split(list(range(len(times))))
    # the parts of a split lie on either side of a threshold: ordering the groups by their
    # fastest member orders them along the time axis
    groups.sort(key=lambda g: min(times[r] for r in g))
    out = [0] * len(times)
    for number, members in enumerate(groups):
        for r in members:
            out[r] = number
    return out


def all_speed_groups(step_time: float, comm: MPI.Comm, who: str = "speed_groups") -> List[int]:
    """Collective (one allgather): every rank's group, from every rank's step time."""
    check_comm(comm, who)
    problem = None
    try:
        value = check_step_time(step_time)
    except Exception as exc:             # noqa: BLE001 - reported on every rank below
        problem, value = as_problem(exc, who), None
    return split_by_speed(agree(comm, who, problem, {}, value))


def speed_groups(step_time: float, comm: MPI.Comm = MPI.COMM_WORLD) -> int:
    """Collective: RNA's speed group of this rank from every rank's step time (seconds);
    0 is the fastest group, and every rank computes the same grouping.

    Makes one allgather on comm. A step time that is not a positive finite number on any
    rank raises ArgumentError on every rank.
    """
    return all_speed_groups(step_time, comm)[comm.Get_rank()]
