"""pc.candidates (each round's designated ranks in majority and probe) against a reference
written here from its definition (tests/mpi/_reference.py), and its properties: q distinct
ranks in range, a different choice for another seed or round, each rank chosen about q/P of
the time (fixed seeds, a binomial bound)."""
import math

import pytest

import partialcoll as pc
from mpi._reference import candidates as reference

SIZES = [1, 2, 3, 4, 5, 8, 13]


@pytest.mark.parametrize("size", SIZES)
def test_same_as_the_reference(size):
    for q in sorted({1, 2, size} & set(range(1, size + 1))):
        for seed in (0, 7, 11, 2**63 + 5, 2**64 - 1):
            for n in (0, 1, 2, 99, 2**31 + 1, -1):
                assert pc.candidates(seed, n, size, q) == reference(seed, n, size, q), (seed, n, size, q)


@pytest.mark.parametrize("size", [2, 3, 5, 8])
def test_distinct_in_range_and_uniform(size):
    """Over N rounds each rank is a candidate about N q / P times: within 5 standard
    deviations of the binomial count (fixed seeds: the same counts every run)."""
    n_rounds = 3000
    for q in sorted({1, 2} & set(range(1, size))):
        for seed in (3, 12345):
            hits, first = [0] * size, [0] * size
            for n in range(n_rounds):
                c = pc.candidates(seed, n, size, q)
                assert len(c) == q and len(set(c)) == q and all(0 <= r < size for r in c), (seed, n, c)
                first[c[0]] += 1
                for r in c:
                    hits[r] += 1
            for counts, p in ((hits, q / size), (first, 1 / size)):
                mean, sd = n_rounds * p, math.sqrt(n_rounds * p * (1 - p))
                assert all(abs(h - mean) <= 5 * sd for h in counts), (size, q, seed, counts, mean, sd)


@pytest.mark.parametrize("size", [3, 5, 8])
def test_changes_with_seed_and_round(size):
    """Another seed gives another sequence of choices, and consecutive rounds pick the same
    first candidate about 1/P of the time (not always: the round is an input)."""
    rounds = range(400)
    a = [pc.candidates(7, n, size, 1)[0] for n in rounds]
    b = [pc.candidates(8, n, size, 1)[0] for n in rounds]
    same = sum(x == y for x, y in zip(a, b))
    repeats = sum(x == y for x, y in zip(a, a[1:]))
    p, n = 1 / size, len(a)
    bound = n * p + 5 * math.sqrt(n * p * (1 - p))
    assert same <= bound and repeats <= bound, (same, repeats, bound)
    assert len(set(a)) == size
