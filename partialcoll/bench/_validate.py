"""-c: what every result of a benchmark run must contain (pure functions, no MPI).

Rank r's post #j carries known values: element r counts the post (1), elements 0..P-1
other than r are 0, and element P+e carries base(r, e) * weight(j). A rank's accumulator
is read in post order, so the posts of rank r that a round read are a contiguous range
[lo, hi) of its post indices. From a result's first P elements the checker therefore
knows, for every rank, how many posts the round read, and:

* the counts are consistent with the result's active set and posts: a rank is active
  exactly when the round(s) read at least one of its posts (its post #n, or leftovers of
  earlier late posts), and the posts counted add up to the result's `posts`; a rank
  whose post #n was read (active with its count after round n at n+1) is never behind;
* every value element equals sum over r of base(r, e) * sum_{j=lo_r}^{hi_r-1} weight(j):
  the reduction of exactly the contributions those counts imply, nothing else;
* the rounds a rank receives (late="fold" folds missed ones) cover 0, 1, 2, ... once each,
  and after close() every rank's count equals the number of posts it made: nothing lost;
* all ranks see the same counts after the same round (gathered and compared by the caller
  with `disagreement`).

For MPI_Allreduce (and mode full) every result is one round in which every rank is active.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np


def weight(post: int) -> int:
    """The factor of post #post: varies with the post, so a reused stale buffer shows."""
    return post % 7 + 1


def _base(size: int, nvalues: int) -> np.ndarray:
    """base[r, e]: rank r's value at value element e (differs per rank and per element)."""
    return (np.arange(nvalues)[None, :] % 97 + np.arange(size)[:, None] + 1).astype(np.float64)


def min_count(size: int) -> int:
    """Elements a validated message needs: one count per rank and one value element."""
    return size + 1


def post_values(rank: int, size: int, count: int, post: int, dtype) -> np.ndarray:
    """What rank `rank` posts as its post #post in a validated run."""
    x = np.zeros(count, dtype)
    x[rank] = 1
    x[size:] = _base(size, count - size)[rank] * weight(post)
    return x


class Outcome:
    """One result as the checker sees it: what round(s), who was active, the data.

    closing: the result of close() (its counts must reach every rank's post total)."""

    __slots__ = ("round", "rounds", "active", "data", "closing", "posts")

    def __init__(self, round: int, rounds: int, active: Sequence[int], data: np.ndarray,
                 closing: bool = False, posts: Optional[int] = None) -> None:
        self.round, self.rounds, self.active = round, rounds, tuple(active)
        self.data, self.closing, self.posts = np.array(data, np.float64), closing, posts


def check(outcomes: Sequence[Outcome], size: int, posts: Sequence[int], rank: int,
          weight_of=weight) -> Tuple[List[str], Dict[int, Tuple[int, ...]]]:
    """Check one rank's results in the order it received them.

    posts[r]: how many posts rank r made in all. Returns (errors, counts after each round
    a result ended on), the latter for `disagreement` across ranks.
    """
    errors: List[str] = []
    seen: Dict[int, Tuple[int, ...]] = {}
    counts = np.zeros(size, np.int64)
    next_round = 0
    for k, res in enumerate(outcomes):
        where = f"result {k} (round {res.round}, rounds {res.rounds}; this is rank {rank})"
        if len(errors) >= 5:
            break
        if res.rounds == 0:
            if np.any(res.data != 0):
                errors.append(f"{where}: covers no round but holds data {res.data[:size + 1]}")
            continue
        first = res.round - res.rounds + 1
        if not res.closing and first != next_round:
            errors.append(f"{where}: covers rounds {first}..{res.round}, expected to start at round {next_round}")
        raw = res.data[:size]
        got = np.rint(raw).astype(np.int64)
        if np.any(np.abs(raw - got) > 1e-6) or np.any(got < 0):
            errors.append(f"{where}: the per-rank post counts {raw} are not counts")
            break
        new = counts + got
        if res.posts is not None and res.posts != int(got.sum()):
            errors.append(f"{where}: posts is {res.posts}, but the data holds {int(got.sum())} posts ({got})")
        if not res.closing:
            for r in range(size):
                if (r in res.active) != (got[r] > 0):
                    errors.append(f"{where}: rank {r} is {'' if r in res.active else 'not '}active, yet the "
                                  f"data holds {got[r]} of its posts")
                elif new[r] > res.round + 1:
                    errors.append(f"{where}: the data counts {new[r]} posts of rank {r} by round {res.round}")
        else:
            for r in range(size):
                if new[r] != posts[r]:
                    errors.append(f"{where}: after close() rank {r}'s posts counted {new[r]} times, "
                                  f"it posted {posts[r]} times (lost or duplicated data)")
        nvalues = len(res.data) - size
        expect = np.zeros(nvalues)
        base = _base(size, nvalues)
        for r in range(size):
            expect += base[r] * sum(weight_of(j) for j in range(counts[r], new[r]))
        bad = np.flatnonzero(~np.isclose(res.data[size:], expect, rtol=1e-6, atol=0))
        if bad.size:
            e = int(bad[0])
            errors.append(f"{where}: element {size + e} is {res.data[size + e]}, the reduction of the "
                          f"contributions its counts imply is {expect[e]}")
        counts = new
        next_round = res.round + 1
        seen[res.round] = tuple(int(c) for c in counts)
    return errors, seen


def disagreement(per_rank: Sequence[Dict[int, Tuple[int, ...]]]) -> Optional[str]:
    """The first round after which two ranks saw different counts, or None."""
    first: Dict[int, Tuple[int, Tuple[int, ...]]] = {}
    for rank, seen in enumerate(per_rank):
        for rnd, counts in seen.items():
            if rnd in first and first[rnd][1] != counts:
                other, theirs = first[rnd]
                return (f"after round {rnd} rank {other} saw post counts {list(theirs)}, "
                        f"rank {rank} saw {list(counts)}")
            first.setdefault(rnd, (rank, counts))
    return None
