"""RNA's speed groups: the rule on hand-made cases (no MPI), and the collective at P = 1-8
(tests/mpi/speed_groups_checks.py): every rank gets the expected group, bad input raises
on every rank."""
import math

import pytest

from conftest import run_shared

from partialcoll import ArgumentError
from partialcoll.speed_groups import split_by_speed


def rule_holds(times, groups):
    """Every group satisfies zeta <= v; groups are numbered along the time axis."""
    by = {}
    for t, g in zip(times, groups):
        by.setdefault(g, []).append(t)
    assert sorted(by) == list(range(len(by)))
    for g, ts in by.items():
        assert max(ts) - min(ts) <= sum(ts) / len(ts)
        if g + 1 in by:
            assert max(ts) < min(by[g + 1])


@pytest.mark.parametrize("times, expected", [
    ([0.1], [0]),
    ([0.02] * 5, [0] * 5),                                           # all equal
    ([0.01, 0.011, 0.012, 0.05, 0.052, 0.051], [0, 0, 0, 1, 1, 1]),  # two clusters
    ([0.05, 0.052, 0.051, 0.01, 0.011, 0.012], [1, 1, 1, 0, 0, 0]),  # reversed rank order
    ([0.01, 0.01, 0.01, 0.01, 0.01, 0.01, 0.5], [0, 0, 0, 0, 0, 0, 1]),  # a lone slow rank
    ([0.5, 0.01, 0.01], [1, 0, 0]),
    ([0.010, 0.012, 0.011, 0.050, 0.013, 0.052, 0.2], [0, 0, 0, 1, 0, 1, 2]),   # the module's example
    ([1.0, 1.9], [0, 0]),                                            # spread 0.9 <= mean 1.45
    ([1.0, 4.0], [0, 1]),                                            # spread 3 > mean 2.5
    ([0.001, 0.01, 0.1, 1.0], [0, 1, 2, 3]),                         # a decade apart: each alone
])
def test_hand_made(times, expected):
    assert split_by_speed(times) == expected
    rule_holds(times, expected)


def test_rule_on_random_lists():
    import random
    rng = random.Random(5)
    for _ in range(300):
        n = rng.randint(1, 16)
        times = [rng.choice([0.01, 0.05, 0.3]) * rng.uniform(0.5, 1.5) for _ in range(n)]
        groups = split_by_speed(times)
        rule_holds(times, groups)
        assert split_by_speed(list(reversed(times))) == list(reversed(groups))


@pytest.mark.parametrize("bad", [0, -1.0, math.nan, math.inf, "0.1", None, True])
def test_bad_time(bad):
    with pytest.raises(ArgumentError, match="step time of rank 1"):
        split_by_speed([0.1, bad])


@pytest.mark.mpiexec
@pytest.mark.shared_job("speed_groups_checks.py")
@pytest.mark.parametrize("nprocs", [1, 2, 3, 4, 5, 8])
def test_speed_groups_collective(mpirun, request, nprocs):
    """Hand-made cases at P = 1-8 (6 and 7 on the first ranks of the job at 8): every rank's
    group as expected; bad input everywhere."""
    run_shared(mpirun, request, nprocs)
