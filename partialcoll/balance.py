"""Load-aware owners for algorithm "ps" (PSLD: Chen et al., SoCC 2020).

The vector is cut into blocks, each reduced by its owner (algorithms/ps.py). The engine
times every owner (its span per round, from the first block sent to it to the last
result from it, per block: coll.c "Owners") and sums the times over ranks inside the
rounds themselves, so every rank holds the same numbers. Every `rebalance_every` rounds
(an epoch) a thread of each rank turns epoch e's times into a new assignment with the
pure functions below -- every rank alike, from the same numbers, the collective's seed
and e -- builds the round schedules for it and hands them to the engine. Each round's
masks also say how many decisions every rank has handed in, so every rank sees the
same first epoch boundary, at round (e + 2) * rebalance_every or later, by which every
rank had decision e: the rounds switch there, on every rank. No round mixes two
assignments, a rank whose decision comes late (a throttled CPU, a busy GIL) delays the
switch, not the rounds (until decisions lag three epochs behind), and a switch moves no
data (owners only aggregate), so nothing posted is lost across one.

balance=
  "static"        round-robin over the servers, never changed
  "proportional"  PSLD's strawman: blocks in proportion to each owner's measured speed
  "psld"          PSLD's method: predicted per-block times (a moving average of the
                  measurements; an owner without blocks keeps its last prediction, and
                  its next measurement replaces it, as does a fixed delay JUMP times
                  off), then
                  with probability 1 - epsilon *exploit*: the assignment of least
                  predicted round time (blocks handed one by one to the owner that would
                  finish them first, so slow owners fall out of the set of effective
                  servers and come back when the set cannot keep up), if it saves GAIN
                  of what an assignment can change (else the current one), and with
                  probability epsilon *explore*: one block moved to a random server left
                  without blocks (none: nothing to explore), so a server that recovered
                  is measured again and wins its blocks back. Each exploration that
                  found a server still slow halves the chance of exploring it (down to
                  2 ** -MAX_TRIES of epsilon's; an exploration that measured it fast on
                  its one block does not reset that, a later measurement does), so a
                  server that stays slow costs a few explored epochs, not epsilon's
                  share of all of them; a server whose blocks came from exploration
                  wins its share back in measured steps (at most twice the blocks it
                  was last measured on: one fast block says little of a share).
                  Noise is weighed as the measurements show it (their deviations
                  from the predictions): servers predicted within it
                  of each other count as equally fast, and a switch must gain more than
                  it; the first epoch is not used. A rank late to the rounds (the
                  telemetry's arrivals, carried in the same rows: a worker starved of CPU
                  posts late, and every owner's first result waits for its blocks, so the
                  owners' times cannot single it out) is predicted that much later as an
                  owner once a test says it is late beyond chance (LateTest, over the
                  last W, 2W and 4W epochs), and for as long as it stays later than a
                  typical rank. A rank starved of CPU (its threads' run delay per CPU
                  second, its stretch: run delay and CPU time carried in the same rows)
                  is predicted later by what it waits beyond a typical rank's stretch
                  once a test says it is starved beyond chance (StarveTest, over the
                  fewest epochs that can say so), and for as long as it stays so.
                  Hysteresis: a switch the owners' times alone call for is made once a
                  second decision in a row names the same owner to relieve.
"""
from __future__ import annotations

import heapq
import math
import statistics
import threading
import weakref
from collections import Counter
from typing import List, Optional, Sequence

import numpy as np

from ._errors import ArgumentError
from ._types import integer
from .algorithms import OWNED
from .algorithms.ps import BLOCK_BYTES

BALANCES = ("static", "proportional", "psld")
FIELDS = 7                   # PC_TIME_FIELDS: the engine's sums per rank (OwnerTimes)
ALPHA = 0.25                 # psld's prediction: est = ALPHA * measured + (1 - ALPHA) * est
                             # (0.5 chased noise: with measurements 30 % off at random, equal
                             # servers' blocks moved and rounds took 1.17x the balanced ones in
                             # the model of tests/test_ps.py; 0.25: 1.08x)
JUMP = 4.0                   # a fixed delay that moves the first block's time by this factor
                             # is a change (a starved owner recovered, or one starved): it
                             # replaces the prediction. Not for the marginal cost: a
                             # difference of two times over a few blocks, it is off by 4x
                             # now and then with nothing changed (bench/psld.py none)
GAIN = 0.10                  # psld exploits only to save this much of what an assignment can
                             # change (the predicted round time beyond the least fixed delay,
                             # which every owner's first result waits for), and more than the
                             # noise (NOISE, _psld_counts)
WARMUP = 1                   # psld's first epochs, not used: the collective's first rounds
                             # (connections, first touches of the scratch blocks) put one
                             # equal server at 3 - 7x another's marginal cost on emulated hosts
NOISE = 0.5                  # how much an owner's measurements are taken to vary from epoch to
                             # epoch, relative to their value, before they show it: a prior
                             # that counts as one measured deviation (TCP starts its RTT
                             # variation at half the first RTT, RFC 6298). Measured exactly,
                             # an owner 4x slow loses blocks at the first or second decision
                             # made (after WARMUP), 2.5 - 3x at the second, 2x at the first to
                             # third, 1.5x at the fifth
LATE_ALPHA = 1e-4            # LateTest: the chance, per decision, that a rank nobody delays is
                             # found late, where the ranks' lateness is exchangeable within an
                             # epoch and independent across epochs (what oversubscribed ranks
                             # on shared cores show: who is descheduled is chance). A run of D
                             # decisions finds one by chance with probability <= D x LATE_ALPHA
                             # (at 1e-3, 2 of 10 runs of 30 decisions at P = 5 and 8 in the
                             # model of tests/test_ps.py found one, as the bound allows)
LATE_WINDOW = 8              # LateTest's epochs (at least; more where one epoch's order says
                             # less: late_window, 10 at P = 4, 17 at P = 2). Under load here a
                             # CPU-starved rank's lateness stood out of the others' in 8
                             # epochs (P x p 0.0002 - 0.02), not in 5 (0.004 - 0.3)
LATE_SPANS = 3               # LateTest also tests the last 2W and 4W epochs (Bonferroni over
                             # the windows it tests): a rank late by a little every epoch, whose
                             # W epochs never say so at LATE_ALPHA, is found once enough have
                             # (a CPU-starved rank at P = 4 here: P x p ~ 0.03 over 10 epochs,
                             # ~1e-3 over 20, ~2e-5 over 40)
STARVE_ALPHA = 1e-4          # StarveTest: the chance, per decision, that a rank nobody starves is
                             # found starved (its run delay exchangeable with the others' within
                             # an epoch); a rank is found late or starved by chance with
                             # probability <= LATE_ALPHA + STARVE_ALPHA per decision
EXACT = 1 << 16              # LateTest, StarveTest: the most sums per half of the window that a
                             # p-value is counted from exactly (_exact_tail: 2 x 64 Ki sums,
                             # ~1 ms); past it, drawn (Monte Carlo)
LATE_KEEP = 0.5              # a rank found late stays late until its p-value (x P) rises above
                             # this: hysteresis (with fewer blocks it serves less and may look
                             # less late, not on time)
MAX_TRIES = 3                # explorations in vain that halve a server's chance of the next:
                             # at most 8x less likely (a server found slow 3 times is still
                             # explored now and then, so it wins its blocks back once it
                             # recovers; in the model of tests/test_ps.py an 8x-slow server
                             # held a block in 18 % of the epochs at epsilon 0.2, now ~4 %)


def _ranks(name: str, ranks, size: int) -> List[int]:
    """servers= or workers=: a non-empty list of ranks of the communicator, sorted."""
    try:
        out = sorted({integer(s, "a rank", 0, size - 1) for s in ranks})
    except ArgumentError:
        raise ArgumentError(f"{name}= must be ranks of the communicator (0 .. {size - 1}), "
                            f"not {ranks!r}") from None
    except TypeError:
        raise ArgumentError(f"{name}= must be a list of ranks, not {ranks!r}") from None
    if not out:
        raise ArgumentError(f"{name}= is empty: at least one rank must "
                            f"{'own blocks' if name == 'servers' else 'contribute'}")
    return out


def validate(algorithm: str, size: int, block_bytes, servers, balance, epsilon, rebalance_every,
             workers=None) -> dict:
    """The owner options (block_bytes=, servers=, workers=, balance=, ...) checked against
    the algorithm and the communicator's size; the normalized values."""
    owned = algorithm in OWNED
    for name, value in (("block_bytes", block_bytes), ("servers", servers), ("workers", workers),
                        ("balance", balance)):
        if value is not None and algorithm == "tree" and name == "balance":
            raise ArgumentError("balance= does not fit the tree: its aggregators rotate with the round "
                                "(RAT), and a member's time to its aggregator includes every level above "
                                "it; use algorithm='ps' with servers= (see the PSLD page)")
        if value is not None and not owned:
            raise ArgumentError(f"{name}= is for an algorithm whose blocks have owners "
                                f"({', '.join(repr(a) for a in OWNED)}); {algorithm!r} has none")
    if not owned:
        return {}
    block_bytes = BLOCK_BYTES if block_bytes is None else integer(block_bytes, "block_bytes", 1)
    servers = list(range(size)) if servers is None else _ranks("servers", servers, size)
    workers = None if workers is None else _ranks("workers", workers, size)
    balance = "static" if balance is None else balance
    if balance not in BALANCES:
        raise ArgumentError(f"balance must be one of {', '.join(BALANCES)}, not {balance!r}")
    try:
        eps = float(epsilon)
    except (TypeError, ValueError):
        eps = NAN
    if not 0.0 <= eps <= 1.0:
        raise ArgumentError(f"epsilon must be a number in [0, 1], not {epsilon!r}")
    epsilon = eps
    rebalance_every = integer(rebalance_every, "rebalance_every", 1)
    return {"block_bytes": block_bytes, "servers": servers, "workers": workers, "balance": balance,
            "epsilon": epsilon, "rebalance_every": rebalance_every}


NAN = float("nan")


def _max0(x: float) -> float:
    """max(x, 0), NaN kept (np.maximum(x, 0.0))."""
    return x if x != x or x > 0.0 else 0.0


def _maxn(a: float, b: float) -> float:
    """max(a, b), NaN if either is (np.maximum)."""
    return a if a != a else b if b != b else (a if a >= b else b)


def _nanmin(xs: List[float]) -> float:
    known = [x for x in xs if x == x]
    return min(known) if known else NAN


def _nanmean(xs: List[float]) -> float:
    known = [x for x in xs if x == x]
    return sum(known) / len(known) if known else NAN


def _div(a: float, b: float) -> float:
    """a / b as NumPy divides floats: +-inf for x / 0, NaN for 0 / 0 and NaN."""
    if b != 0.0 or a != a or b != b:
        return a / b if b != 0.0 else NAN
    return NAN if a == 0.0 else math.copysign(math.inf, a) * math.copysign(1.0, b)


def _floats(x) -> List[float]:
    return np.asarray(x, np.float64).tolist()


class OwnerTimes:
    """An epoch's times per owner, from the engine's sums over ranks and rounds (spans,
    first results' latencies, blocks, samples: pc_coll_stats). NaN where an owner served
    no block.

    per_block  span / blocks: the mean service time per block (seconds; owner_times())
    marginal   what one more block costs the owner: (span - first latency) / (blocks - 1),
               averaged (an owner that served one block at a time: its block's latency
               beyond the others' least fixed delay, at least their mean marginal cost)
    fixed      what its first block costs beyond that: first latency - marginal (waiting
               for the slowest sender, common to every owner, plus the owner's own delay
               in starting: a CPU-starved owner answers late, then quickly)
    held       the blocks it held per round (what it was measured on)
    late       per rank: how late it arrives to the rounds (seconds per round behind the
               rank that waited most: the telemetry's arrivals)
    starved    per rank: how long its threads were runnable but not running (seconds per
               round: the scheduler's run delay, CPU starvation)
    cpu        per rank: how long its threads ran (seconds per round); starved / cpu is
               its stretch, the run delay per CPU second: how many times its own work
               it waits, whatever work its blocks give it
    psld predicts an owner's span for n blocks as fixed + n * marginal.
    """

    def __init__(self, sums: Sequence[int], rounds: int = 1) -> None:
        v = [float(x) for x in sums]
        p = len(v) // FIELDS
        span, first = [x / 1e9 for x in v[:p]], [x / 1e9 for x in v[p:2 * p]]
        blocks, samples = v[2 * p:3 * p], v[3 * p:]
        per_block = [t / n if n > 0 else NAN for t, n in zip(span, blocks)]
        several = [n - k > 0 for n, k in zip(blocks, samples)]
        marginal = [(t - f) / (n - k) if sv else NAN for t, f, n, k, sv in zip(span, first, blocks, samples, several)]
        latency = [f / k if k > 0 else NAN for f, k in zip(first, samples)]
        # one block at a time: its marginal cost is unmeasured; take what its block
        # took beyond the least fixed delay the others show (what every owner's first
        # result waits for), at least the others' mean marginal cost: an owner 8x slow
        # that holds one block is not predicted to take more at the others' pace
        one = [k > 0 and not sv for k, sv in zip(samples, several)]
        if any(several):
            shared = _nanmin([_max0(x - m) for x, m, sv in zip(latency, marginal, several) if sv])
            mean = _nanmean([m for m, sv in zip(marginal, several) if sv])
            marginal = [_maxn(mean, x - shared) if o else m for x, m, o in zip(latency, marginal, one)]
        else:
            marginal = [x if o else m for x, m, o in zip(latency, marginal, one)]
        self.per_block = np.array(per_block)
        self.marginal = np.array(marginal)
        self.direct = np.array(several, bool)       # the marginal cost measured (not the others')
        self.held = np.array([n / k if k > 0 else NAN for n, k in zip(blocks, samples)])    # blocks per round
        self.fixed = np.array([_max0(x - m) for x, m in zip(latency, marginal)])
        arrival = [x / 1e9 / max(rounds, 1) for x in v[4 * p:5 * p]]
        self.late = np.array([max(arrival) - a for a in arrival]) if p else np.zeros(0)
        self.starved = np.array([x / 1e9 / max(rounds, 1) for x in v[5 * p:6 * p]])
        self.cpu = np.array([x / 1e9 / max(rounds, 1) for x in v[6 * p:7 * p]])


def _fill(t, servers: Sequence[int]) -> List[float]:
    """Times of the servers, unknown ones (NaN) as the mean of the known (1 if none).
    Plain floats: a decision runs on every rank's balancer thread, holding the GIL that
    the rank's application thread needs to return from its wait, so the functions here
    keep to a few microseconds (NumPy costs that per call on arrays this small)."""
    ts = [float(t[s]) for s in servers]
    mean = _nanmean(ts)
    mean = 1.0 if mean != mean else mean
    return [max(v if v == v else mean, 1e-12) for v in ts]


def _place(counts: Sequence[int], servers: Sequence[int], current: Sequence[int]) -> List[int]:
    """An assignment giving servers[i] counts[i] blocks, keeping each block with its
    current owner where that owner still has room (fewest blocks change owner)."""
    room = {s: int(k) for s, k in zip(servers, counts)}
    out = [-1] * len(current)
    for b, o in enumerate(current):
        if room.get(o, 0) > 0:
            out[b] = o
            room[o] -= 1
    spare = [s for s in servers for _ in range(room[s])]
    for b in range(len(out)):
        if out[b] < 0:
            out[b] = spare.pop(0)
    return out


def proportional(times: Sequence[float], servers: Sequence[int], current: Sequence[int]) -> List[int]:
    """PSLD's strawman: blocks in proportion to speed (1 / per-block time), largest
    remainders rounded up."""
    n = len(current)
    speed = 1.0 / np.array(_fill(times, servers))
    share = n * speed / speed.sum()
    counts = np.floor(share).astype(int)
    for i in np.argsort(-(share - counts), kind="stable")[:n - counts.sum()]:
        counts[i] += 1
    return _place(counts, servers, current)


def _round_time(counts: Sequence[int], t: Sequence[float], fixed: Sequence[float]) -> float:
    """Predicted round time: the longest span fixed + n t over the servers holding n > 0."""
    return max((f + n * x for n, x, f in zip(counts, t, fixed) if n > 0), default=0.0)


def _least_counts(t: Sequence[float], f: Sequence[float], nblocks: int, cap=None) -> List[int]:
    """least_time's greedy on filled times: each block to the server that would finish
    it first (the lowest index among equals, as np.argmin); cap (per server, None: no
    limit): the most blocks a server may take (the others take the rest, past their
    best, where all are full)."""
    counts = [0] * len(t)
    heap = [(f[i] + t[i], i) for i in range(len(t))]
    heapq.heapify(heap)
    full: List[tuple] = []
    for _ in range(nblocks):
        if not heap:                 # every server at its cap: the rest as if there were none
            heap, full = full, []
            heapq.heapify(heap)
            cap = None
        _, i = heapq.heappop(heap)
        counts[i] += 1
        item = (f[i] + (counts[i] + 1) * t[i], i)
        if cap is not None and cap[i] is not None and counts[i] >= cap[i]:
            full.append(item)
        else:
            heapq.heappush(heap, item)
    return counts


def _fixed(fixed, servers: Sequence[int]) -> List[float]:
    """The fixed delays of the servers, filled as the times are (0 where not given)."""
    return [0.0] * len(servers) if fixed is None else _fill(fixed, servers)


def least_time(times: np.ndarray, servers: Sequence[int], nblocks: int,
               fixed: Optional[np.ndarray] = None) -> np.ndarray:
    """Blocks per server minimizing the predicted round time max(fixed_s + n_s t_s) (fixed:
    0 where not given): each block to the server that would finish it first (optimal for
    equal blocks). Servers slower than the resulting round time get none."""
    return np.array(_least_counts(_fill(times, servers), _fixed(fixed, servers), nblocks), int)


def psld(times: np.ndarray, servers: Sequence[int], current: Sequence[int], *, seed: int, epoch: int,
         epsilon: float, fixed: Optional[np.ndarray] = None, tries: Optional[Sequence[int]] = None,
         spread: Optional[tuple] = None, explored: Optional[Sequence[bool]] = None) -> List[int]:
    """PSLD's prediction-guided exploitation and exploration (times: the predicted
    marginal per-block time of every rank, fixed: its predicted fixed delay, NaN
    unknown). Exploration is drawn from (seed, epoch), so every rank makes the same
    choice; it gives one block to a server left without blocks (the only ones whose
    prediction no measurement refreshes): with none, there is nothing to explore.
    tries (per server, as servers): explorations that found it slow; the chance of
    exploring a server is epsilon * 2 ** -tries. spread: (marginal, fixed) arrays like
    times, how much each owner's measurements vary from epoch to epoch (None: not at
    all); explored (per server): it holds blocks only because exploration gave them."""
    return _place(_psld_counts(times, servers, current, seed, epoch, epsilon, fixed, tries, spread, explored),
                  servers, current)


def _last(counts: Sequence[int], t, f) -> int:
    """The owner that finishes last (predicted: fixed + n t; -1: none holds blocks)."""
    spans = [(x + n * y, i) for i, (n, y, x) in enumerate(zip(counts, t, f)) if n > 0]
    return max(spans)[1] if spans else -1


def _pool(values: Sequence[float], devs: Sequence[float], base=None, apart=None) -> List[float]:
    """Values that lie within their deviations of each other taken as equal (their mean),
    relative to value + base: from the least up, a value joins the group of the least one
    not yet grouped if the log of their ratio is within the sum of their relative
    deviations (a server 8x slow stays apart however noisy its measurements). Those
    apart (an owner measured one block at a time: its marginal cost inferred) keep theirs."""
    base = base or [0.0] * len(values)
    v = [max(x + b, 1e-12) for x, b in zip(values, base)]
    rel = [d / x for d, x in zip(devs, v)]
    order = sorted((i for i in range(len(values)) if not (apart and apart[i])), key=lambda i: v[i])
    out = list(values)
    k = 0
    while k < len(order):
        first, group = order[k], [order[k]]
        while k + len(group) < len(order):
            j = order[k + len(group)]
            if math.log(v[j] / v[first]) > rel[j] + rel[first]:
                break
            group.append(j)
        mean = sum(values[i] for i in group) / len(group)
        for i in group:
            out[i] = mean
        k += len(group)
    return out


def _draws(x: np.ndarray, rng, n: int) -> np.ndarray:
    """n sums of one value drawn at random from each epoch's (rows of x): a rank's sum
    under the permutation tests' null (LateTest, StarveTest)."""
    out = np.zeros(n, np.int64)
    for row in x:
        out += row[rng.integers(0, len(row), n)]
    return out


class _Seeded:
    """A generator seeded by (epoch, salt), made at its first draw: most decisions draw
    nothing, and making one costs more than the rest of their tests."""

    def __init__(self, epoch: int, salt: int) -> None:
        self.seed = [epoch & 0xFFFFFFFF, salt]
        self.rng: Optional[np.random.Generator] = None

    def integers(self, low: int, high: int, n: int) -> np.ndarray:
        if self.rng is None:
            self.rng = np.random.default_rng(self.seed)
        return self.rng.integers(low, high, n)


def _exact_tail(x: np.ndarray, s: int, most: int = EXACT) -> Optional[float]:
    """The share of the P ** W ways to take one value from each of the W epochs (rows of
    x, integers) whose sum is s or more, counted exactly (meet in the middle: the
    P ** (W/2) sums of each half, one half sorted and searched for the other's
    complements); None where a half would have more than `most` sums."""
    w, p = x.shape
    half = w // 2
    if p ** (w - half) > most:
        return None
    a, b = np.zeros(1, np.int64), np.zeros(1, np.int64)
    for row in x[:half]:
        a = (a[:, None] + row[None, :]).ravel()
    for row in x[half:]:
        b = (b[:, None] + row[None, :]).ravel()
    b.sort()
    count = int((len(b) - np.searchsorted(b, s - a, side="left")).sum())
    return count / float(p) ** w


def _p_value(x: np.ndarray, s: int, rng, n: int, most: int = EXACT) -> float:
    """The permutation tests' p-value of the sum s over the epochs x: exact where countable
    (_exact_tail, at most `most` sums per half), else the share of n random draws at or
    above s, counting s itself ((1 + above) / (n + 1))."""
    exact = _exact_tail(x, s, most)
    if exact is not None:
        return exact
    return (1 + int(np.count_nonzero(_draws(x, rng, n) >= s))) / (n + 1)


def _tail_floor(x, r: int, size: int = 1) -> float:
    """A lower bound of the tail at rank r's sum, without drawing: draws that reach r's
    sum over each chunk of `size` consecutive epochs reach it over all, so the product
    of the chunks' exact tails (_exact_tail) bounds it from below (0 where a chunk
    cannot be counted). size 1, in O(W P) and no array: the product over the epochs of
    the share of the values at or above r's. Where P x this exceeds the test's level,
    the exact p-value does too: the test cannot pass, and nothing need be counted or
    drawn (most decisions)."""
    out = 1.0
    if size == 1:
        for e in x:
            v = e[r]
            out *= sum(1 for y in e if y >= v) / len(e)
        return out
    for i in range(0, len(x), size):
        c = x[i:i + size]
        t = _exact_tail(c, int(c[:, r].sum()))
        if t is None:
            return 0.0
        out *= t
    return out


def late_window(size: int) -> int:
    """LateTest's window for `size` ranks: LATE_WINDOW epochs, or enough that a rank
    latest in all but two of them can pass LATE_ALPHA (a rank latest in every one of W
    epochs has p = size ** -W at least)."""
    need = math.ceil(math.log(max(size, 2) / LATE_ALPHA) / math.log(max(size, 2)))
    return max(LATE_WINDOW, need + 2)


class LateTest:
    """Which ranks are late to the rounds beyond chance (psld's lateness; pure: every
    rank feeds it the same epochs and gets the same answer).

    Each epoch brings every rank's lateness (OwnerTimes.late: seconds per round behind
    the rank that waited most). Over the last W epochs (late_window), and the last 2W and
    4W once there are that many (LATE_SPANS windows), a rank's statistic is the sum of its
    lateness. The null hypothesis: nobody is late, who is late in an
    epoch is chance (the ranks' values exchangeable within an epoch, epochs
    independent). Under it, a rank's sum is distributed as the sum of one value drawn
    at random from each epoch's P values -- a permutation test, which needs no model of
    the noise (a descheduled rank's 100 ms in one epoch is one value among its epoch's,
    whoever it falls to). p = the share of the P ** W draws at or above the rank's sum,
    counted exactly where they can be (_exact_tail; the values in whole microseconds, so
    the sums are exact), else the share of N = 2 P / LATE_ALPHA random ones (from a seed
    fixed by the epoch: every rank draws alike); nothing is counted or drawn where a
    floor of p (_tail_floor) already says the test cannot pass. The ranks
    share one null distribution, so only the latest sum is tested; it is late when
    K x P x p <= LATE_ALPHA in one of the K windows tested (Bonferroni over the ranks and
    the windows): per decision, a false finding has probability <= LATE_ALPHA. A rank
    found late stays late (hysteresis) while P x p <= LATE_KEEP over as many epochs as
    it was found on, and it is later than the others' median there on average. What it
    is late by: its mean, over those epochs, beyond the median of the others'."""

    def __init__(self, size: int) -> None:
        self.size, self.window = size, late_window(size)
        self.epochs: List[List[int]] = []          # the last `window` epochs, microseconds per rank
        self.late = [False] * size                 # found late (and still)
        self.p = [1.0] * size                      # the latest P x p of the ranks found late
        self.span = [0] * size                     # ... over the last this many epochs (where found)
        self.skip = [False] * size                 # not tested in the latest epoch

    def observe(self, late: Sequence[float], epoch: int, skip: Optional[Sequence[bool]] = None) -> List[float]:
        """Feed an epoch's lateness (seconds per rank; NaN: none measured, skipped);
        return each rank's lateness beyond the others' (seconds per round, 0 unless
        found late). skip: ranks not tested (found starved of CPU: their lateness is
        their starvation's, which StarveTest weighs and keeps; testing them cost the
        decisions 1 - 3 ms of draws an epoch, on the rank whose CPU it least has)."""
        p = self.size
        self.skip = [bool(x) for x in skip] if skip is not None else [False] * p
        if p < 2 or len(late) != p or any(x != x for x in late):
            return [0.0] * p
        self.epochs = (self.epochs + [[int(round(max(x, 0.0) * 1e6)) for x in late]])[-self.window * 2 ** (LATE_SPANS - 1):]
        if len(self.epochs) < self.window:
            return [0.0] * p
        spans = [self.window * 2 ** k for k in range(LATE_SPANS) if self.window * 2 ** k <= len(self.epochs)]
        rng = _Seeded(epoch, 0x1a7e)
        self.p, beyond = [1.0] * p, {}
        for r in range(p):       # 1000 draws: enough to keep or let go of a rank found late (LATE_KEEP)
            if self.skip[r]:
                self.late[r] = False
            if self.late[r]:
                rows = self.epochs[-self.span[r]:]
                x = np.array(rows, np.int64)
                self.p[r], beyond[r] = min(1.0, p * self._tail(x, r, rng, LATE_KEEP / p)), self._beyond(x, r)
                self.late[r] = self.p[r] <= LATE_KEEP and beyond[r] > 0
        found = self._find(spans, rng)
        if found is not None:
            r, span = found
            b = self._beyond(np.array(self.epochs[-span:], np.int64), r)
            if b > 0:
                self.late[r], self.span[r], beyond[r] = True, span, b
        return [max(beyond[r], 0.0) if self.late[r] else 0.0 for r in range(p)]

    @staticmethod
    def _tail(x: np.ndarray, r: int, rng, level: float) -> float:
        """The p-value of rank r's sum over the epochs x: exact where countable, else
        from 1000 draws (enough to keep or let go of a rank found late: LATE_KEEP); above
        level by the floor alone (_tail_floor), that floor."""
        floor = _tail_floor(x.tolist(), r)
        if floor > level:
            return floor
        return _p_value(x, int(x[:, r].sum()), rng, 1000)

    @staticmethod
    def _beyond(x: np.ndarray, r: int) -> float:
        """Rank r's mean lateness beyond the others' median over the epochs x (seconds)."""
        return float(np.mean(x[:, r] - np.median(np.delete(x, r, axis=1), axis=1))) / 1e6

    def _find(self, spans: Sequence[int], rng) -> Optional[tuple]:
        """(rank, span): the latest rank over the last `span` epochs, the first of spans
        where it is late beyond chance: K x P x p <= LATE_ALPHA, K = len(spans); else None."""
        p, k = self.size, len(spans)
        n = int(math.ceil(2 * p * k / LATE_ALPHA))
        for span in spans:
            rows = self.epochs[-span:]
            sums = [sum(e[r] for e in rows) for r in range(p)]
            top = max(range(p), key=lambda r: (not self.skip[r], sums[r], -r))
            if self.late[top] or self.skip[top]:       # found already (or not tested)
                continue
            # no rank two null deviations above the null mean: none can pass (p there is
            # some 0.02 or more), no draws (a decision holds the GIL: see _fill). In
            # integers, exact on every rank: P x (sum - mean) against P x the deviation
            excess = p * sums[top] - sum(sums)
            var = sum(p * sum(v * v for v in e) - sum(e) ** 2 for e in rows)         # P^2 x the variance
            if excess <= 0 or excess * excess <= 4 * var:
                continue
            if p * k * _tail_floor(rows, top) > LATE_ALPHA:           # cannot pass: nothing counted
                continue
            x = np.array(rows, np.int64)
            exact = _exact_tail(x, sums[top])
            if exact is not None:
                if p * k * exact <= LATE_ALPHA:
                    return top, span
                continue
            if p * k * _tail_floor(x, top, self.window) > LATE_ALPHA:     # 2W, 4W: per W epochs
                continue
            # past EXACT: 1000 draws first, then 20000 at a time while the count of draws
            # at or above its sum can still be small enough (the count only grows: the
            # answer of drawing all N, and a test that fails stops early; one that passes
            # draws N)
            above, done = 0, 0
            while done < n and (1 + above) * p * k <= LATE_ALPHA * (n + 1):
                m = min(n - done, 1000 if done == 0 else 20000)
                above += int(np.count_nonzero(_draws(x, rng, m) >= sums[top]))
                done += m
            if done == n and (1 + above) * p * k <= LATE_ALPHA * (n + 1):
                return top, span
        return None


def starve_window(size: int) -> int:
    """StarveTest's window for `size` ranks: the fewest epochs in which a rank can pass
    STARVE_ALPHA (one whose run delay tops every epoch's: p = size ** -W)."""
    p = max(size, 2)
    return math.ceil(math.log(p / STARVE_ALPHA) / math.log(p) - 1e-9)


class StarveTest:
    """Which ranks are CPU-starved beyond chance (psld's starvation; pure: every rank feeds
    it the same epochs and gets the same answer).

    Each epoch brings every rank's run delay and CPU time (OwnerTimes.starved, .cpu:
    seconds per round its threads were runnable but not running, and running, as the
    scheduler counts them). The statistic is the rank's stretch, run delay / CPU time: how
    many times its own work it waited for a CPU. A rank that shares its CPU with busy
    processes waits several times its work whatever work it has, so its stretch tops
    every epoch, before and after its blocks are taken away (bench/psld.py one, P = 4:
    6 - 9 against the others' 2 - 4 in every epoch; its run delay alone topped 93 % of the
    epochs, and fell to the others' once it held no blocks: less work, less waiting).
    The test is LateTest's permutation test on the stretches of the last W =
    starve_window epochs (one window), with the p-value computed exactly where the P ** W
    draws can be counted (_exact_tail; else N = 2 P / STARVE_ALPHA draws), and neither
    where its floor (_tail_floor) rules the rank out: the top sum is starved when P x p <= STARVE_ALPHA, so a decision
    finds a rank nobody starves with probability <= STARVE_ALPHA. A rank found stays so
    while P x p <= LATE_KEEP and it waits beyond the others (_beyond)."""

    EXACT = EXACT                # the most sums per half counted exactly
    CAP = 1000000                # the largest stretch counted, in thousandths (1000 x its CPU time)

    def __init__(self, size: int) -> None:
        self.size, self.window = size, starve_window(size)
        self.epochs: List[List[int]] = []          # the last `window` epochs: stretch per rank, thousandths
        self.delay: List[List[float]] = []         # ... and the run delays and CPU times (s per round)
        self.cpu: List[List[float]] = []
        self.starved = [False] * size

    @classmethod
    def stretch(cls, delay: Sequence[float], cpu: Sequence[float]) -> List[int]:
        """Run delay / CPU time per rank, in integer thousandths (exact sums on every rank),
        at most CAP."""
        return [min(cls.CAP, int(round(1000.0 * max(d, 0.0) / c))) for d, c in zip(delay, cpu)]

    def observe(self, delay: Sequence[float], cpu: Sequence[float], epoch: int) -> List[float]:
        """Feed an epoch's run delays and CPU times (seconds per rank and round; NaN, or
        a CPU time of 0: none measured, the epoch skipped); return each starved rank's
        wait beyond the others' stretch (seconds per round, over the window; 0 for the
        others)."""
        p = self.size
        if (p < 2 or len(delay) != p or len(cpu) != p or any(x != x for x in delay)
                or not all(c > 0 for c in cpu)):
            return self._beyond()
        w = self.window
        self.epochs = (self.epochs + [self.stretch(delay, cpu)])[-w:]
        self.delay = (self.delay + [[float(x) for x in delay]])[-w:]
        self.cpu = (self.cpu + [[float(x) for x in cpu]])[-w:]
        if len(self.epochs) < w:
            return self._beyond()
        sums = [sum(c) for c in zip(*self.epochs)]
        rng = _Seeded(epoch, 0x57a4)
        tail = lambda r: self._tail(np.array(self.epochs, np.int64), sums[r], rng)      # noqa: E731
        for r in range(p):
            if self.starved[r]:     # P x the floor above the level: the exact p-value too
                self.starved[r] = p * _tail_floor(self.epochs, r) <= LATE_KEEP and p * tail(r) <= LATE_KEEP
        top = max(range(p), key=lambda r: (sums[r], -r))
        if not self.starved[top] and p * _tail_floor(self.epochs, top) <= STARVE_ALPHA and p * tail(top) <= STARVE_ALPHA:
            self.starved[top] = True
        return self._beyond()

    def _beyond(self) -> List[float]:
        """Each starved rank's wait beyond what its work would wait at the others' median
        stretch: the mean over the window of run delay - CPU time x that median (seconds
        per round; 0 for the others, and for a starved rank that waits no more: not
        starved). The wait its blocks would add as an owner, predicted from what it
        waits now (a rank emptied of blocks still waits that much per CPU second)."""
        out = [0.0] * self.size
        if len(self.epochs) < self.window:
            return out
        for r in range(self.size):
            if self.starved[r]:
                extra = [d[r] - c[r] * statistics.median(s[j] for j in range(self.size) if j != r) / 1000.0
                         for d, c, s in zip(self.delay, self.cpu, self.epochs)]
                out[r] = max(sum(extra) / len(extra), 0.0)
                self.starved[r] = out[r] > 0
        return out

    def _tail(self, x: np.ndarray, s: int, rng) -> float:
        """P(a sum of one value drawn from each epoch's >= s): exact where countable
        (_exact_tail), else from N = 2 P / STARVE_ALPHA draws."""
        return _p_value(x, s, rng, int(math.ceil(2 * x.shape[1] / STARVE_ALPHA)), self.EXACT)


def _psld_counts(times, servers, current, seed, epoch, epsilon, fixed, tries, spread=None, explored=None,
                 late=None, cap=None, confirm=None):
    """psld's blocks per server. tries: a list, or a function of the exploitation's
    counts alone (before the switch test and the exploration: whom the predictions find
    fast enough) that returns it (decide: the outcome of an exploration counts at once).

    With spread -- (marginal, fixed) deviations of each owner's measurements, and
    optionally which owners to keep apart -- the noise is weighed: owners whose
    predictions lie within it of each other count as equally fast (so that noise does not
    split blocks unevenly between equal servers), and a switch must gain more than the
    round times it compares vary (the root of the sum of squares of their last owners'
    deviations; where those two owners count as equally fast, the gain is in the counts
    alone and must beat only the marginal cost's deviation times the blocks it moves).
    Exploration's outcome counts at once: blocks exploration gave a server the
    predictions now leave out go back, and one they now give blocks gets the share its
    pessimistic prediction (plus its deviations) earns, on GAIN alone.

    late -- seconds per round each rank is late to the rounds beyond the others, where
    LateTest found it so (0 elsewhere) -- makes such a rank a slow owner: the others
    already wait for it every round, and what it serves adds to that, so its lateness is
    added to its fixed delay. That is a difference the test has weighed already: where
    the two owners the switch test compares have equal times, the gain is in the counts
    and the lateness, and need beat only the counts' noise. Such a rank is not explored.

    cap -- per server, the most blocks the predictions may give it (None: no limit):
    a server whose blocks came from exploration grows in measured steps (Predictor.caps).
    confirm -- a function of the owner a switch the exploitation calls for would relieve
    (None: no switch wanted, or one exempt) that says whether to make it (decide:
    hysteresis)."""
    n = len(current)
    t, f = _fill(times, servers), _fixed(fixed, servers)
    dt = df = [0.0] * len(servers)
    if spread is not None:
        dt, df = _fill(spread[0], servers), _fill(spread[1], servers)
        apart = [bool(spread[2][s]) for s in servers] if len(spread) > 2 else None
        t = _pool(t, dt, None, apart)
        f = _pool(f, df, t, apart)
    times = f                    # the fixed delays the owners' times show (the switch test)
    if late is not None:
        f = [x + float(late[s]) for x, s in zip(f, servers)]
    exploit = _least_counts(t, f, n)
    if callable(tries):
        tries = tries(exploit)
    held = Counter(current)
    now = [held[s] for s in servers]
    # no straggler worth a switch: keep the assignment. GAIN is of what an assignment can
    # change: the round time beyond the least fixed delay (the wait for the slowest
    # sender, which every owner's first result includes)
    rt = _round_time(now, t, f)
    gain = rt - _round_time(exploit, t, f)
    floor = min((f[i] for i in range(len(f)) if now[i] or exploit[i]), default=0.0)
    a, b = _last(now, t, f), _last(exploit, t, f)
    if a < 0 or b < 0:
        noise = 0.0
    elif (t[a], times[a]) == (t[b], times[b]):
        noise = abs(now[a] - exploit[b]) * dt[a]
    else:                        # each span varies by its fixed delay's deviation + n x its marginal cost's
        noise = ((df[a] + now[a] * dt[a]) ** 2 + (df[b] + exploit[b] * dt[b]) ** 2) ** 0.5
    vain = any(x and h > 0 and k == 0 for x, h, k in zip(explored or (), now, exploit))
    counts = list(exploit) if gain > GAIN * (rt - floor) and (vain or gain > noise) else now
    # hysteresis: a switch is made once a second decision in a row calls for one that
    # relieves the same owner (the one predicted to finish last now: a straggler is that
    # one in every epoch, noise among equal owners picks one at random); decide: one the
    # tests' findings call for, at once. Blocks an exploration gave in vain go back at once,
    # and a server exploration measured fast wins its share (in capped steps) at once
    if confirm is not None:
        up = any(x and k > h for x, k, h in zip(explored or (), exploit, now))
        if counts is now or vain or up:
            confirm(None)
        elif not confirm(servers[a]):
            counts = now
    steps = (t, f)
    if counts is now and explored:
        # an explored server the predictions give blocks: the share its pessimistic
        # prediction (+ its deviations) earns, on GAIN alone
        up = [i for i, (x, k) in enumerate(zip(explored, exploit)) if x and k > now[i]]
        if up:
            t2 = [y + (dt[i] if i in up else 0.0) for i, y in enumerate(t)]
            f2 = [x + (df[i] if i in up else 0.0) for i, x in enumerate(f)]
            won = _least_counts(t2, f2, n)
            if any(won[i] > now[i] for i in up) and rt - _round_time(won, t, f) > GAIN * (rt - floor):
                counts, steps = won, (t2, f2)    # its steps (cap) on the same pessimistic prediction
    # a switch judged on the whole target, made in steps where a server is capped (a step
    # from 1 block to 2 may shorten no predicted round: judged alone, it would never run)
    if counts is not now and cap is not None and any(c is not None and k > c for k, c in zip(counts, cap)):
        counts = _least_counts(*steps, n, [max(c, k) if c is not None else None for c, k in zip(cap, now)])
    # a rank found late or starved is not explored: what exploration measures (its owner
    # times) cannot clear it, its lateness or run delay can (and lets it go); each explored
    # block of a starved rank cost a round as slow as with its whole share
    idle = [i for i in range(len(servers)) if counts[i] == 0 and not (late is not None and late[servers[i]] > 0)]
    if idle and n > 1 and epsilon > 0:
        rng = np.random.default_rng([seed & 0xFFFFFFFF, seed >> 32 & 0xFFFFFFFF, epoch, 0x9d1])
        if rng.random() < epsilon:
            pick = int(rng.choice(idle))
            if not tries or rng.random() < 2.0 ** -tries[pick]:
                spans = [f[i] + c * t[i] if c > 0 else 0.0 for i, c in enumerate(counts)]
                counts = list(counts)
                counts[spans.index(max(spans))] -= 1     # from the owner that finishes last
                counts[pick] += 1
    return counts


class Predictor:
    """psld's per-owner prediction: moving averages of the measured marginal and fixed
    times, and of how far each measurement was from them (the deviations, started from
    the NOISE prior). An owner that served nothing keeps its last prediction; when it is
    measured again after such a gap (exploration gave it a block), the new measurement
    replaces the stale prediction instead of being averaged with it, so that a server
    that recovered is predicted fast at once (its deviation then taken as its peers'
    until it has its own); so does a fixed delay that puts the first block JUMP times
    off its prediction (an owner starved, or recovered while it held its explored
    block). Every rank feeds it the same epochs, so every rank predicts the same."""

    def __init__(self, size: int) -> None:
        # plain lists, one entry per rank (a decision holds the GIL: see _fill)
        self.est = [NAN] * size                  # marginal seconds per block
        self.fixed = [NAN] * size
        self.dev = [NAN] * size                  # mean deviations of the measurements from
        self.fixed_dev = [NAN] * size            # est and fixed (NaN: no series yet)
        self.devs = [0] * size                   # ... and how many deviations each averages
        self.fixed_devs = [0] * size
        self.direct = [True] * size              # its latest measurement had its marginal cost
        self.merit = [True] * size               # the latest exploitation gave it blocks (else
                                                 # blocks it holds came from exploration)
        self.fresh = [False] * size              # measured in the latest epoch
        self.probed = [False] * size             # ... after an epoch without blocks (explored)
        self.tries = [0] * size                  # explorations that found it slow, since it last
                                                 # held blocks on its predicted merit
        self.load = [NAN] * size                 # the blocks per round it held when last measured
        self.want = [0] * size                   # the blocks the latest exploitation gave it
        self.probation = [False] * size          # its blocks came from exploration, and no
                                                 # measurement on the share the predictions give
                                                 # it has confirmed it since (caps)
        self.late_test = LateTest(size)          # ranks late to the rounds beyond chance
        self.starve_test = StarveTest(size)      # ranks CPU-starved beyond chance (and by how much)
        self.late = [0.0] * size                 # late, or starved, by how much (seconds per round)
        self.found = [False] * size              # ... which were, at the decision before
        self.proposed: Optional[int] = None      # the owner a switch it held back would relieve (confirm)

    def _average(self, est: List[float], dev: List[float], count: List[int], measured: List[float],
                 same: List[bool], base: Sequence[float], jump: Optional[float] = None,
                 jumpy: Optional[Sequence[bool]] = None) -> None:
        """est <- measured, averaged into a continuing series (measured last epoch, and of
        the same kind: same) unless, with jump given, (measured + base) is off (est + base)
        by that factor or more, relative to what the epoch did to every owner (its median
        ratio: a whole epoch faster is no owner's change), where jumpy (None: everywhere;
        base: what the quantity adds to in a prediction, so that a fixed delay near 0 is
        not jumpy). dev: the series' mean deviation from est (TCP's RTT variation): the
        mean of the NOISE prior and the deviations while they are fewer than 1 / ALPHA,
        then averaged as est is; count: how many deviations it holds (a new series: none,
        dev NaN). Updated in place."""
        p = len(est)
        new = [m == m for m in measured]
        keep = [new[i] and self.fresh[i] and est[i] == est[i] and same[i] for i in range(p)]
        if jump is not None:
            ratio = [_div(measured[i] + base[i], est[i] + base[i]) for i in range(p)]
            steady = [r for r, k in zip(ratio, keep) if k and math.isfinite(r)]
            middle = statistics.median(steady) if len(steady) > 2 else 1.0
            for i in range(p):
                r = _div(ratio[i], middle)
                if keep[i] and not (r < jump and r > 1 / jump) and (jumpy is None or jumpy[i]):
                    keep[i] = False
        for i in range(p):
            if keep[i]:
                prior = NOISE * (est[i] + base[i])
                count[i] += 1
                weight = max(ALPHA, 1.0 / (count[i] + 1))
                dev[i] = weight * abs(measured[i] - est[i]) + (1 - weight) * (prior if dev[i] != dev[i] else dev[i])
                est[i] = ALPHA * measured[i] + (1 - ALPHA) * est[i]
            elif new[i]:
                est[i], dev[i], count[i] = measured[i], NAN, 0

    def update(self, measured: "OwnerTimes", epoch: int = 0):
        """(marginal, fixed) predictions after epoch's measurements (lists); self.late:
        the ranks found late to the rounds (LateTest), by how much, or starved of CPU
        (StarveTest), by how late they were when found, as long as they stay so."""
        p = len(self.est)
        # every rank's lateness and run delay are measured in every epoch, blocks or not
        late = _floats(measured.late) if len(measured.late) == p else [NAN] * p
        starved = self.starve(measured, epoch)         # first: a starved rank is not tested for lateness
        self.late = [max(x, y) for x, y in zip(self.late_test.observe(late, epoch, self.starve_test.starved), starved)]
        marginal = [0.0 if x != x else x for x in self.est]       # what a fixed delay adds to
        known = [x == x for x in self.est]
        # a measurement of another kind than the series' (one block at a time, its
        # marginal cost inferred, against several, measured) starts a new series
        direct = [bool(d) for d in np.asarray(measured.direct, bool).tolist()]
        same = [d == o for d, o in zip(direct, self.direct)]
        m, f = _floats(measured.marginal), _floats(measured.fixed)
        # one block at a time, the marginal cost is a latency, as steady as the fixed
        # delay: a JUMP times off is a change too
        self._average(self.est, self.dev, self.devs, m, same, [0.0] * p, JUMP, [not d for d in direct])
        self._average(self.fixed, self.fixed_dev, self.fixed_devs, f, same, marginal, JUMP)
        fresh = [x == x for x in m]
        held = _floats(getattr(measured, "held", [NAN] * p))
        self.load = [h if fr and h == h else o for h, fr, o in zip(held, fresh, self.load)]
        # measured on at least the share the latest exploitation gave it: confirmed (found
        # slow there, the next exploitation leaves it out, and judged() puts it back)
        self.probation = [pr and not (fr and w > 0 and ld >= w)
                          for pr, fr, w, ld in zip(self.probation, fresh, self.want, self.load)]
        self.direct = [d if fr else o for d, fr, o in zip(direct, fresh, self.direct)]
        self.probed = [fr and not was and k for fr, was, k in zip(fresh, self.fresh, known)]
        self.fresh = fresh
        return list(self.est), list(self.fixed)

    def starve(self, measured: "OwnerTimes", epoch: int) -> List[float]:
        """Feed epoch's run delays and CPU times to the starvation test (from the first
        epoch on: the warm-up's owner times mislead, a CPU-starved rank's stretch does
        not); each starved rank's wait beyond the others' stretch (seconds per round)."""
        p, delay, cpu = len(self.est), getattr(measured, "starved", ()), getattr(measured, "cpu", ())
        if len(delay) != p or len(cpu) != p:
            return self.starve_test.observe([NAN] * p, [NAN] * p, epoch)
        return self.starve_test.observe(_floats(delay), _floats(cpu), epoch)

    def spread(self):
        """(marginal, fixed) mean deviations to expect of each owner's measurements: its
        own where it has a series of them, else the owners' typical deviation relative to
        their predictions (NOISE before any owner has one): a server measured again after
        a time without blocks is taken to vary as much as its peers do."""
        out = []
        fixed_est = [f + (0.0 if e != e else e) for f, e in zip(self.fixed, self.est)]
        for dev, est in ((self.dev, self.est), (self.fixed_dev, fixed_est)):
            rel = [_div(d, e) for d, e in zip(dev, est)]
            known = [r for r in rel if math.isfinite(r)]
            typical = statistics.median(known) if known else NOISE
            out.append([typical * e if d != d else d for d, e in zip(dev, est)])
        return tuple(out) + ([not d for d in self.direct],)

    def caps(self, servers: Sequence[int]) -> List[Optional[int]]:
        """The most blocks the predictions may give each of servers (None: no limit): a
        server on probation (its blocks came from exploration) at most twice the blocks it
        was last measured on (one where it never was), so that a share it wins back is
        measured in steps (1, 2, 4...): a server whose CPU is shared with busy processes
        serves one block at once and a share at a fraction of the speed, and given its
        whole share on one fast block it held it for two epochs before the measurement
        came back (the decisions' delay) and lost it again, by turns."""
        return [(max(1, int(2 * self.load[s])) if self.load[s] == self.load[s] else 1)
                if self.probation[s] else None for s in servers]

    def confirm(self, owner: Optional[int]) -> bool:
        """Hysteresis (psld's switches): whether to make a switch the exploitation calls
        for that relieves owner (the one predicted to finish last; None: no switch
        called for). At once where the ranks found late or starved changed since the
        decision before (a test has weighed that evidence); else once the decision before
        called for one that relieves the same owner: the owners' times of one epoch vary
        (equal owners' fixed delays 10 - 50 % apart from epoch to epoch on shared cores),
        and switches that noise made left rounds slower than none (bench/psld.py none)."""
        found = [x > 0 for x in self.late]
        go = owner is not None and (found != self.found or owner == self.proposed)
        self.proposed = None if go else owner
        self.found = found
        return go

    def judged(self, servers: Sequence[int], exploit: Sequence[int]) -> List[int]:
        """The tries of servers (psld's), given whom the predictions give blocks: such a
        server is not slow (tries 0) once a measurement of a continuing series on the share
        they give it says so (a server measured on the block exploration gave it, or on a
        step toward its share, keeps its tries: a light load can look fast where its share
        does not); one just measured again that they still leave out was explored in vain
        (tries + 1, at most MAX_TRIES), and is on probation until a measurement on the
        share they give it confirms it (caps)."""
        for s, n in zip(servers, exploit):
            self.merit[s] = n > 0
            self.want[s] = int(n)
            if n == 0:
                self.probation[s] = True
            if n > 0:
                if self.fresh[s] and not self.probed[s] and not self.probation[s]:
                    self.tries[s] = 0
            elif self.probed[s]:
                self.tries[s] = min(self.tries[s] + 1, MAX_TRIES)
        return [int(self.tries[s]) for s in servers]


def decide(balance: str, measured: OwnerTimes, predictor: Predictor, servers: Sequence[int],
           current: Sequence[int], seed: int, epoch: int, epsilon: float) -> List[int]:
    """Epoch e's new assignment from its measured times (pure but for the predictor's
    history, which every rank builds alike): proportional to the measured per-block
    times, psld from the predicted marginal ones."""
    if balance == "static":
        return list(current)
    if balance == "proportional":
        for i, t in enumerate(_floats(measured.per_block)):
            if t == t:
                predictor.est[i] = t                             # the last measurement of each owner
        return proportional(predictor.est, servers, current)
    if epoch < WARMUP:
        predictor.starve(measured, epoch)
        return list(current)
    marginal, fixed = predictor.update(measured, epoch)
    judge = lambda exploit: predictor.judged(servers, exploit)    # noqa: E731  (an exploration's outcome counts at once)
    explored = [not predictor.merit[s] or predictor.probation[s] for s in servers]   # before judge() updates it
    return _place(_psld_counts(marginal, servers, current, seed, epoch, epsilon, fixed, judge, predictor.spread(),
                               explored, predictor.late, predictor.caps(servers), predictor.confirm), servers, current)


class Balancer:
    """The thread of one rank that makes a collective's decisions (see the module doc).

    Threads: it reads the engine's snapshots (pc_coll_stats, which waits without the GIL
    and without the collective's lock), builds schedules in Python and hands them to
    the engine (pc_coll_switch, under the collective's lock). It holds the collective
    weakly, so a collective dropped without close() is still abandoned; close() and
    abandonment stop it (stop, then join) and settle the history before the engine
    frees anything it uses. history and the current assignment are written by it and
    read by the application thread (a list append and a reference swap, atomic under
    the GIL); an entry's first round is filled in by whichever thread asks the engine
    first (pc_coll_switched: the same answer for both, never revised)."""

    SLICE = 5.0      # seconds; the engine wakes it at every epoch's end, the collective's
                     # end and stop(): the slice is a fallback (at 50 ms its timed wake-ups
                     # cost the progress threads 1.5 - 2.5 ms of CPU a round where ranks
                     # share cores: docs/results.md)

    def __init__(self, coll, native, balance: str, servers: Sequence[int], assignment: Sequence[int],
                 seed: int, epsilon: float, every: int) -> None:
        from . import _engine
        from ._status import check
        self._check = check                  # kept: stop() may run at interpreter shutdown
        self._coll = weakref.ref(coll)
        self._native = native
        self.balance, self.servers, self.seed, self.epsilon, self.every = balance, list(servers), seed, epsilon, every
        self.current = list(assignment)
        # [first round, assignment]: the initial one, then each decision that changed it,
        # in order; first round None until the engine applied it (pc_coll_switched(k): the
        # k-th of those decisions), for good if it never will (trim)
        self.history: list = [[0, list(assignment)]]
        self._settled = False
        self.predictor = Predictor(coll.size)
        self.error: Optional[BaseException] = None
        self._stop = False
        self._lib, self._ffi = _engine.lib, _engine.ffi
        self.thread = threading.Thread(target=self._run, name="partialcoll-balance", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        from ._status import check, TIMEOUT_CODE
        lib, ffi = self._lib, self._ffi
        p = len(self.predictor.est)
        sums, got = ffi.new("int64_t[]", lib.PC_TIME_FIELDS * p), ffi.new("int *")
        epoch = 0
        try:
            while not self._stop:
                rc = lib.pc_coll_stats(self._native, epoch, self.SLICE, sums, got)
                if self._stop or rc == TIMEOUT_CODE:
                    continue
                check(rc)
                if not got[0]:
                    return                           # the collective finished
                measured = OwnerTimes(list(sums), self.every)
                new = decide(self.balance, measured, self.predictor, self.servers, self.current, self.seed,
                             epoch, self.epsilon)
                s0 = s1 = ffi.NULL
                if new != self.current:
                    coll = self._coll()
                    if coll is None or self._stop:
                        return
                    s0, s1 = coll._native_rounds(new)
                    del coll                         # may run its __del__ here: abandoned, stopped
                    if self._stop:
                        lib.pc_sched_discard(s0)     # not handed over (pc_coll_switch owns what it gets)
                        lib.pc_sched_discard(s1)
                        return
                    # published before the engine may run it: a round's wait can return
                    # before this thread is back from the switch
                    self.history.append([None, new])
                    self.current = new
                check(lib.pc_coll_switch(self._native, epoch, s0, s1))
                epoch += 1
        except BaseException as exc:    # noqa: BLE001 - reported to the peers, raised by assignment()
            self.error = exc
            coll = self._coll()
            if coll is not None and not self._stop:
                # rounds that need this decision would wait for it for good: the collective
                # fails here and the peers hear of it (their calls raise PeerError)
                coll._balancer_failed(exc)

    def stop(self) -> None:
        """Stop the thread and wait for it (not from the thread itself), then learn the
        first round of every decision the engine applied: the last time it is asked."""
        self._stop = True
        if threading.current_thread() is not self.thread:
            if self.thread.is_alive() and self._lib is not None:
                self._check(self._lib.pc_coll_stop_stats(self._native))     # its wait ends now
            self.thread.join()
        self._resolve()
        self._settled = True

    def _resolve(self) -> None:
        """Fill in the first rounds the engine has applied since the last call."""
        if self._settled:
            return
        out = self._ffi.new("int64_t *")
        history = list(self.history)
        for k in range(1, len(history)):
            if history[k][0] is None:
                self._check(self._lib.pc_coll_switched(self._native, k - 1, out))
                if out[0] < 0:
                    return
                history[k][0] = int(out[0])

    def trim(self, last_round: int) -> None:
        """After stop(): forget decisions that no round up to last_round ran (made after
        the final round, or applied by none)."""
        self.history = [h for h in self.history if h[0] is not None and h[0] <= last_round]
        self.current = self.history[-1][1]

    def assignment_of(self, round: int) -> List[int]:
        """The assignment round `round` ran with (a round not run yet: the one the
        rounds run with now)."""
        self._resolve()
        current = self.history[0][1]
        for first, a in list(self.history):
            if first is None or first > round:
                break
            current = a
        return current


def shares(assignment: Sequence[int], size: int) -> np.ndarray:
    """The fraction of the blocks each rank owns."""
    a = np.asarray(assignment, int)
    return np.bincount(a, minlength=size) / max(len(a), 1) if len(a) else np.zeros(size)


