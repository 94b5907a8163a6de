"""-c: what every result of a benchmark run must contain (pure functions, no MPI).

Rank r's post #j carries known values that differ per rank, per element and per post:
value element e holds base(r, e) * weight(j). Two layouts:

* counted (count >= P + 1): element r also counts the post (1), elements 0..P-1 other
  than r are 0, and the value elements follow. A rank's accumulator is read in post
  order, so the posts of rank r that a round read are a contiguous range [lo, hi) of its
  post indices, and from a result's first P elements the checker knows, for every rank,
  how many posts the round read. Then:
  - the counts are consistent with the result's active set and posts: a rank is active
    exactly when the round(s) read at least one of its posts (its post #n, or leftovers
    of earlier late posts), the posts counted add up to the result's `posts`, and no
    rank has more than n+1 posts read by round n;
  - every value element equals sum over r of base(r, e) * sum_{j=lo_r}^{hi_r-1} weight(j):
    the reduction of exactly the contributions those counts imply, nothing else;
  - the rounds a rank receives (late="fold" folds missed ones) cover 0, 1, 2, ... once
    each, and after close() every rank's count equals the number of posts it made;
  - all ranks see the same counts after the same round (gathered and compared by the
    caller with `disagreement`).
* uncounted (fewer elements): only value elements. A result in which every rank is active
  read each rank's posts up to #round (MPI_Allreduce and mode full: every result) when
  its `posts` says so (or it carries none), so the counts are implied; after a result with a rank not active they are not known, and the
  checker stops (`unchecked`).

Values are small integers chosen for the element type (`Values`): a sum within the type's
exact range (2^(mantissa bits + 1) for floats, the maximum for integers) must be exact;
integer sums beyond it wrap, as MPI_SUM's do, and are compared with the wrapped value; a
float sum beyond it may round, by at most (terms x epsilon) of its value.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from .._types import dtype_name

MAX_WEIGHT = 7
MAX_ERRORS = 5          # messages kept per rank (every wrong element is counted)


def weight(post: int) -> int:
    """The factor of post #post: varies with the post, so a reused stale buffer shows."""
    return post % MAX_WEIGHT + 1


def min_count(size: int) -> int:
    """Elements the counted layout needs: one count per rank and one value element."""
    return size + 1


def _finfo(dt: np.dtype):
    if dtype_name(dt) == "bfloat16":
        import ml_dtypes
        return ml_dtypes.finfo(dt)
    return np.finfo(dt)


def exact_limit(dt: np.dtype) -> float:
    """The largest L such that every integer in 0..L is exact in dt (and does not overflow)."""
    if dt.kind in "iu":
        return float(np.iinfo(dt).max)
    return float(2 ** (_finfo(dt).nmant + 1))


class Values:
    """What every rank posts in a validated run of `count` elements of `dtype` on `size` ranks."""

    def __init__(self, size: int, count: int, dtype) -> None:
        self.size, self.count, self.dtype = size, count, np.dtype(dtype)
        self.counted = count >= min_count(size)
        self.first = size if self.counted else 0          # the first value element
        self.limit = exact_limit(self.dtype)
        # base values 1..M: a round with one post of every rank at the largest weight stays exact
        top = int(max(1, min(97, self.limit // (MAX_WEIGHT * size))))
        e, r = np.arange(count - self.first), np.arange(size)
        self.base = ((e[None, :] + r[:, None]) % top + 1).astype(np.float64)     # [rank, element]
        self.phase = 1 + 1j if self.dtype.kind == "c" else 1.0     # complex: the same value in both parts

    def post(self, rank: int, post: int) -> np.ndarray:
        """What rank `rank` posts as its post #post."""
        x = np.zeros(self.count, self.dtype)
        if self.counted:
            x[rank] = 1
        x[self.first:] = self.base[rank] * weight(post) * self.phase
        return x

    def wrong(self, got: np.ndarray, expect: np.ndarray, terms: int) -> np.ndarray:
        """Which value elements of a result (raw, of dtype) differ from expect (exact float64
        sums of `terms` contributions)."""
        if self.dtype.kind in "iu":
            want = expect.astype(np.int64).astype(self.dtype)            # MPI_SUM wraps
            return got != want
        tol = np.where(expect <= self.limit, 0.0, max(1, terms) * float(_finfo(self.dtype).eps) * expect)
        got = got.astype(np.complex128 if self.dtype.kind == "c" else np.float64)
        bad = ~(np.abs(got.real - expect) <= tol)                          # NaN is wrong too
        if self.dtype.kind == "c":
            bad |= ~(np.abs(got.imag - expect) <= tol)
        return bad


class Checker:
    """One rank's results, in the order it received them: add() each, then read `wrong`
    (wrong elements and rounds out of order), `errors` (the first few, in words), `seen`
    (counts after each round, for `disagreement`), `checked` and `unchecked` (results).

    posts[r]: how many posts rank r makes in all (what close() must have flushed)."""

    def __init__(self, values: Values, rank: int, posts: Sequence[int], weight_of=weight) -> None:
        self.values, self.rank, self.posts, self.weight_of = values, rank, list(posts), weight_of
        self.counts = np.zeros(values.size, np.int64)
        self.next_round = 0
        self.wrong = 0
        self.checked = self.unchecked = 0
        self.errors: List[str] = []
        self.seen: Dict[int, Tuple[int, ...]] = {}
        self.lost = False                 # uncounted layout: counts no longer known

    def _error(self, text: str, wrong: int = 1) -> None:
        self.wrong += wrong
        if len(self.errors) < MAX_ERRORS:
            self.errors.append(text)

    def add(self, round: int, rounds: int, active: Sequence[int], data, closing: bool = False,
            posts: Optional[int] = None) -> None:
        """One result; posts: the result's `posts` (None: an MPI_Allreduce, which reports none)."""
        v, size = self.values, self.values.size
        raw = np.asarray(data)
        where = f"result of round {round} (rounds {rounds}; this is rank {self.rank})"
        if self.lost:
            self.unchecked += 1
            return
        if rounds == 0:
            self.checked += 1
            nonzero = int(np.count_nonzero(raw))
            if nonzero:
                self._error(f"{where}: covers no round but holds data {raw[:size + 1]}", nonzero)
            return
        first = round - rounds + 1
        if not closing and first != self.next_round:
            self._error(f"{where}: covers rounds {first}..{round}, expected to start at round {self.next_round}")
        new = self._counts_after(round, active, raw, closing, posts, where)
        if new is None:
            return
        self.checked += 1
        expect = np.zeros(len(v.base[0]))
        for r in range(size):
            expect += v.base[r] * sum(self.weight_of(j) for j in range(self.counts[r], new[r]))
        bad = v.wrong(raw[v.first:], expect, int((new - self.counts).sum()))
        if bad.any():
            e = int(np.flatnonzero(bad)[0])
            self._error(f"{where}: element {v.first + e} is {raw[v.first + e]}, the reduction of the "
                        f"contributions its counts imply is {expect[e] * v.phase}"
                        + (f" ({int(bad.sum())} wrong elements)" if bad.sum() > 1 else ""), int(bad.sum()))
        self.counts = new
        self.next_round = round + 1
        self.seen[round] = tuple(int(c) for c in new)

    def _counts_after(self, round: int, active: Sequence[int], raw: np.ndarray, closing: bool,
                      posts: Optional[int], where: str) -> Optional[np.ndarray]:
        """Every rank's post count after this result: carried (counted) or implied; None
        where the result cannot be checked."""
        size = self.values.size
        if not self.values.counted:
            if closing:
                return np.array(self.posts, np.int64)
            implied = np.full(size, round + 1, np.int64)
            if len(set(active)) == size and (posts is None or posts == int((implied - self.counts).sum())):
                return implied
            self.lost = True              # a rank's posts were read without being counted
            self.unchecked += 1
            return None
        carried = raw[:size].astype(np.complex128 if raw.dtype.kind == "c" else np.float64).real
        got = np.rint(carried).astype(np.int64)
        if np.any(np.abs(carried - got) > 1e-6) or np.any(got < 0):
            self._error(f"{where}: the per-rank post counts {raw[:size]} are not counts", size)
            self.checked += 1
            return None
        new = self.counts + got
        if posts is not None and posts != int(got.sum()):
            self._error(f"{where}: posts is {posts}, but the data holds {int(got.sum())} posts ({got})")
        for r in range(size):
            if closing:
                if new[r] != self.posts[r]:
                    self._error(f"{where}: after close() rank {r}'s posts counted {new[r]} times, "
                                f"it posted {self.posts[r]} times (lost or duplicated data)")
            elif (r in active) != (got[r] > 0):
                self._error(f"{where}: rank {r} is {'' if r in active else 'not '}active, yet the "
                            f"data holds {got[r]} of its posts")
            elif new[r] > round + 1:
                self._error(f"{where}: the data counts {new[r]} posts of rank {r} by round {round}")
        return new


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
