"""speed_groups under mpiexec: python speed_groups_checks.py (any P; at P = 8 every check
runs on the first 6, the first 7 and all 8 ranks in turn, the others waiting).

Each case gives every rank a step time and the group it must get; the rule's answer must
be the same on every rank (each rank also reports the groups it saw for the others
through an allgather of its own answer)."""
from __future__ import annotations

import math

import pytest

import partialcoll as pc
from _util import communicators, expect_raises, run_module


def cases(p):
    """name -> (times, expected groups), built for P ranks."""
    half = p // 2
    out = {"all equal": ([0.02] * p, [0] * p)}
    if p >= 2:
        out["two clusters"] = ([0.01 + 0.001 * r for r in range(half)] + [0.05 + 0.001 * r for r in range(p - half)],
                               [0] * half + [1] * (p - half))
        out["reversed order"] = ([0.05 + 0.001 * r for r in range(p - half)] + [0.01 + 0.001 * r for r in range(half)],
                                 [1] * (p - half) + [0] * half)
        out["lone slow rank"] = ([0.01] * (p - 1) + [0.01 * (p + 3)], [0] * (p - 1) + [1])
    if p >= 3:
        out["three decades"] = ([[0.001, 0.01, 0.1][r % 3] for r in range(p)], [r % 3 for r in range(p)])
    return out


def each_size(world):
    """world; at P = 8 its first 6, first 7 and all 8 ranks in turn (P = 6 and 7 without
    launches of their own)."""
    return communicators(world, [6, 7, 8] if world.size == 8 else [])


@pytest.mark.parametrize("case", ["all equal", "two clusters", "reversed order", "lone slow rank", "three decades"])
def test_cases(comm, case):
    if case not in cases(comm.size):                  # every case is there from P = 3 on
        pytest.skip(f"{case!r} needs more ranks")
    for sub in each_size(comm):
        times, expected = cases(sub.size)[case]
        g = pc.speed_groups(times[sub.rank], comm=sub)
        assert isinstance(g, int)
        assert sub.allgather(g) == expected, (sub.size, case)


def test_repeatable(comm):
    """The same times give the same groups, call after call, with numpy scalars too."""
    import numpy as np
    for sub in each_size(comm):
        t = np.float64(0.01 if sub.rank % 2 else 0.08)
        first = pc.speed_groups(t, comm=sub)
        assert all(pc.speed_groups(t, comm=sub) == first for _ in range(3))


@pytest.mark.parametrize("bad", [0.0, -0.5, math.nan, math.inf, "fast", None, True])
def test_bad_step_time_everywhere(comm, bad):
    """A bad step time on the last rank raises ArgumentError on every rank, naming it."""
    for sub in each_size(comm):
        t = bad if sub.rank == sub.size - 1 else 0.01
        exc = expect_raises(pc.ArgumentError, pc.speed_groups, t, comm=sub, match="step_time")
        if sub.rank != sub.size - 1:
            assert f"rank {sub.size - 1}" in str(exc)
        assert pc.speed_groups(0.01, comm=sub) == 0      # the communicator is still usable


def test_bad_comm(comm):
    expect_raises(pc.ArgumentError, pc.speed_groups, 0.1, comm="world", match="comm")


if __name__ == "__main__":
    run_module(__file__)
