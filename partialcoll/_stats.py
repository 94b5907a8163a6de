"""Who is slow: what a collective's rounds say about each rank (docs/who-is-slow.md).

The engine records, in the rounds themselves and without a message of its own
(native/telemetry.c), on each rank and on that rank's clock only:

- its lateness: how long after round n's TAKE (its view of the round's start: when the
  round read its input) its post #n came; 0 when the post came first;
- in a full round, its wait: from its post to the round's completion here;
- from the round masks (reduced in every round, the same on every rank): which ranks'
  data each round holds.

``coll.stats()`` is collective: one allgather of every rank's record, on the
collective's own communicator, so that every rank returns the same ``Stats``. A full
round's arrivals come from the waits, durations each measured on one clock: a rank that
waited ``w_i`` arrived ``max(w) - w_i`` after the first one (the round's communication after
the last arrival is common to all and cancels). The ranks' waiting is attributed to the
last arrivals: between the k-th and the (k+1)-th arrival, k ranks wait, and that is blamed
on the (k+1)-th. ``coll.stats(local=True)`` asks nobody: this rank's lateness and waits,
and every rank's missed rounds.
"""
import collections
import json
import math
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from ._rc import rc

_RING_FIELDS = ("round", "post_us", "take_us", "done_us", "late_us", "wait_us", "flags")
_COMPLETED, _FULL, _INSIDE = 1, 2, 4
LATENESS_DTYPE = np.dtype([("mean", np.float64), ("p50", np.float64), ("p99", np.float64)])
HOP_WINDOW = 1024            # NeighborAllreduce: the last iterations' lateness kept per in-neighbour
NAN = float("nan")


class Stats:
    """Who is slow in a collective: per-rank telemetry of its rounds (``coll.stats()``).

    - ``rounds``: rounds counted (closing rounds are not); ``full``: how many were full.
    - ``late[r]``: rounds rank r joined late or missed: the more of its posts that came
      after their round read its input and of the rounds without any data of it, plus
      the full rounds it was the last to arrive at.
    - ``lateness_s[r]``: mean, p50 and p99 of how late r's posts were, in seconds (a
      structured array: ``lateness_s["p99"][r]``), over the last rounds kept (``window``).
    - ``waited_for_s[r]``: seconds the other ranks spent waiting for r in full rounds.
    - ``lateness[r, i]``: r's lateness in the window's i-th round (NaN: not recorded).
    - ``gathered``: True when every rank holds this same view (``coll.stats()``); False
      for one rank's own view (``stats(local=True)``), where other ranks' lateness is NaN.
    """

    def __init__(self, size: int, rounds: int, full: int, late: np.ndarray, lateness: np.ndarray,
                 window_rounds: np.ndarray, waited_for_s: np.ndarray, gathered: bool, rank: Optional[int] = None,
                 what: str = "", unattributed: int = 0) -> None:
        self.size = int(size)
        self.rounds = int(rounds)
        self.full = int(full)
        self.late = np.asarray(late, np.int64)
        self.lateness = np.asarray(lateness, np.float64).reshape(self.size, -1)
        self.window = np.asarray(window_rounds, np.int64)
        self.waited_for_s = np.asarray(waited_for_s, np.float64)
        self.gathered = bool(gathered)
        self.rank = rank
        self.what = what
        self.unattributed = int(unattributed)
        lat = np.full(self.size, np.nan, LATENESS_DTYPE)
        for r in range(self.size):
            row = self.lateness[r][~np.isnan(self.lateness[r])]
            if row.size:
                lat[r] = (row.mean(), np.percentile(row, 50), np.percentile(row, 99))
        self.lateness_s = lat

    def blame(self) -> np.ndarray:
        """Per rank, what it is blamed for: waited_for_s where there were full rounds,
        else its mean lateness (seconds)."""
        if self.waited_for_s.sum() > 0:
            return self.waited_for_s.copy()
        return np.nan_to_num(self.lateness_s["mean"], nan=0.0)

    def stragglers(self) -> List[int]:
        """Ranks by waited_for_s, then late, then mean lateness: highest first."""
        mean = np.nan_to_num(self.lateness_s["mean"], nan=0.0)
        return sorted(range(self.size), key=lambda r: (-self.waited_for_s[r], -self.late[r], -mean[r], r))

    def to_dict(self) -> Dict[str, Any]:
        """JSON-ready: every field, lateness in seconds (None where not recorded)."""
        def fl(a):
            return [None if (x is None or math.isnan(x)) else float(x) for x in np.ravel(a)]
        return {"what": self.what, "size": self.size, "rounds": self.rounds, "full": self.full,
                "gathered": self.gathered, "rank": self.rank, "late": [int(x) for x in self.late],
                "waited_for_s": fl(self.waited_for_s), "unattributed": self.unattributed,
                "window": [int(x) for x in self.window],
                "lateness": [fl(row) for row in self.lateness],
                "stragglers": self.stragglers()}

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "Stats":
        """The inverse of to_dict (what ``partialcoll-bench report`` reads)."""
        size = int(d["size"])
        lat = np.array([[np.nan if x is None else x for x in row] for row in d["lateness"]], np.float64)
        if lat.size == 0:
            lat = np.zeros((size, 0))
        wf = np.array([0.0 if x is None else x for x in d["waited_for_s"]], np.float64)
        return cls(size, d["rounds"], d.get("full", 0), np.array(d["late"], np.int64), lat,
                   np.array(d.get("window", []), np.int64), wf, d.get("gathered", True), d.get("rank"),
                   d.get("what", ""), d.get("unattributed", 0))

    def __str__(self) -> str:
        return self.table()

    def table(self, top: Optional[int] = None) -> str:
        """The per-rank table, slowest first (``top``: only that many ranks)."""
        view = "the same on every rank" if self.gathered else f"rank {self.rank}'s own view"
        head = (f"who is slow{' in ' + self.what if self.what else ''}: {self.rounds} rounds "
                f"({self.full} full) at P = {self.size}, {view}")
        total = self.waited_for_s.sum()
        rows = [head, f"{'rank':>4} {'late':>6} {'lateness mean':>13} {'p50':>9} {'p99':>9} "
                      f"{'waited for':>11} {'share':>6}"]
        order = self.stragglers()
        for r in order[:top] if top else order:
            lat = self.lateness_s[r]
            share = f"{100 * self.waited_for_s[r] / total:5.1f}%" if total > 0 else "    - "
            rows.append(f"{r:>4} {self.late[r]:>6} {_dur(lat['mean']):>13} {_dur(lat['p50']):>9} "
                        f"{_dur(lat['p99']):>9} {_dur(self.waited_for_s[r]):>11} {share:>6}")
        if self.unattributed:
            rows.append(f"({self.unattributed} full rounds left the telemetry ring before stats(): "
                        "not in 'waited for')")
        return "\n".join(rows)

    def summary(self) -> str:
        """One line, in the table's words: the slowest rank and what it cost."""
        if self.size == 0 or self.rounds == 0:
            return "who is slow: no rounds yet"
        r = self.stragglers()[0]
        return (f"who is slow: rank {r} (late {self.late[r]} of {self.rounds} rounds, lateness mean "
                f"{_dur(self.lateness_s['mean'][r])}, waited for {_dur(self.waited_for_s[r])})")

    def plot(self, path: str) -> None:
        """A picture: rank x round heatmap of lateness, and a bar per rank of waited_for_s."""
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(11, 0.35 * self.size + 2.5),
                                       gridspec_kw={"width_ratios": [3, 1]})
        lat = np.ma.masked_invalid(self.lateness * 1e3)
        ext = [self.window[0] - 0.5 if self.window.size else -0.5,
               self.window[-1] + 0.5 if self.window.size else 0.5, self.size - 0.5, -0.5]
        im = ax0.imshow(lat, aspect="auto", interpolation="nearest", cmap="magma_r", extent=ext)
        fig.colorbar(im, ax=ax0, label="lateness (ms)")
        ax0.set_xlabel("round")
        ax0.set_ylabel("rank")
        ax0.set_title("how late each rank's post was")
        ax1.barh(range(self.size), self.waited_for_s, color="tab:red")
        ax1.set_ylim(self.size - 0.5, -0.5)
        ax1.set_xlabel("others waited for it (s)")
        ax1.set_title(f"{self.rounds} rounds ({self.full} full)")
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)

    def __repr__(self) -> str:
        return f"Stats(size={self.size}, rounds={self.rounds}, stragglers={self.stragglers()[:3]})"


def _dur(s: float) -> str:
    if s is None or math.isnan(s):
        return "-"
    if s >= 1:
        return f"{s:.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.1f} ms"
    return f"{s * 1e6:.0f} us"


# ------------------------------------------------------------------ the engine's record

def switch_on(coll, comm) -> None:
    """At creation: keep the last rc.telemetry_rounds rounds (when rc.telemetry); comm is
    the user's communicator, which stats() after close() gathers on."""
    from . import _engine
    from ._status import check
    coll._stats_comm = comm
    if rc.telemetry:
        rounds = rc.telemetry_rounds
        if not isinstance(rounds, int) or isinstance(rounds, bool) or rounds < 1:
            from ._errors import ArgumentError
            raise ArgumentError(f"partialcoll.rc.telemetry_rounds must be an integer >= 1, not {rounds!r}")
        check(_engine.lib.pc_coll_telemetry_on(coll._coll, rounds))


def read(c, size: int, rank: int) -> Dict[str, Any]:
    """This rank's record: totals, missed rounds per rank, ring (oldest first)."""
    from . import _engine
    from ._status import check
    ffi, lib = _engine.ffi, _engine.lib
    totals = np.zeros(lib.PC_TELE_TOTALS, np.float64)
    missed = np.zeros(max(size, 1), np.int64)
    cap = int(rc.telemetry_rounds) + 1
    ring = np.zeros((cap, lib.PC_TELE_FIELDS), np.float64)
    n = ffi.new("int *")
    check(lib.pc_coll_telemetry(c, ffi.cast("double *", totals.ctypes.data), ffi.cast("int64_t *", missed.ctypes.data),
                                ffi.cast("double *", ring.ctypes.data), cap, n))
    return {"rank": rank, "totals": totals, "missed": missed[:size], "ring": ring[:n[0]].copy()}


class Books:
    """A collective's running attribution of full rounds' waiting, carried from one
    stats() to the next (the rings hold the last rounds only)."""

    def __init__(self, size: int) -> None:
        self.upto = -1
        self.waited = np.zeros(size)
        self.last = np.zeros(size, np.int64)
        self.attributed = 0


def build(records: Sequence[Dict[str, Any]], size: int, books: Books, gathered: bool, rank: int,
          what: str = "") -> Stats:
    """Stats from the ranks' records (all of them, or this rank's alone)."""
    by_rank = {int(rec["rank"]): rec for rec in records}
    totals = max(records, key=lambda rec: rec["totals"][0])
    rounds, full = int(totals["totals"][0]), int(totals["totals"][1])
    late = np.array(totals["missed"], np.int64)
    for r, rec in by_rank.items():     # joined late: its post came after the round read its input
        late[r] = max(late[r], int(rec["totals"][3]))
    # the window: the rounds every record holds, completed everywhere
    sets = []
    for rec in records:
        ring = rec["ring"]
        done = ring[(ring[:, 6].astype(np.int64) & _COMPLETED) != 0] if len(ring) else ring
        sets.append({int(x) for x in done[:, 0]} if len(done) else set())
    common = sorted(set.intersection(*sets)) if sets else []
    index = {n: i for i, n in enumerate(common)}
    lat = np.full((size, len(common)), np.nan)
    waits = np.full((size, len(common)), np.nan)
    fullr = np.zeros(len(common), bool)
    for r, rec in by_rank.items():
        for row in rec["ring"]:
            i = index.get(int(row[0]))
            if i is None:
                continue
            flags = int(row[6])
            fullr[i] |= bool(flags & _FULL)
            if row[1] > 0:             # posted: its lateness; not yet (a rank far behind): unknown
                lat[r, i] = row[4] * 1e-6
            if flags & _FULL and row[1] > 0:
                waits[r, i] = row[5] * 1e-6
    for i, n in enumerate(common):
        if not fullr[i]:
            continue
        w = waits[:, i]
        if np.isnan(w).any():          # a rank's wait missing (this rank's own view): nothing to attribute
            continue
        arrival = w.max() - w          # seconds after the first arrival, each from one clock
        lat[:, i] = arrival
        if n > books.upto:
            order = np.argsort(arrival, kind="stable")
            for k in range(1, size):
                books.waited[order[k]] += k * (arrival[order[k]] - arrival[order[k - 1]])
            if size > 1 and arrival[order[-1]] > 0:
                books.last[order[-1]] += 1
            books.attributed += 1
    if gathered and common:
        books.upto = max(books.upto, common[-1])
    late = late + books.last
    return Stats(size, rounds, full, late, lat, np.array(common, np.int64), books.waited.copy(), gathered,
                 rank, what, max(0, full - books.attributed) if gathered else 0)


def gather(coll, comm, what: str = "", mine: Optional[Dict[str, Any]] = None) -> Stats:
    """Collective: every rank's record, one allgather on comm; the same Stats everywhere."""
    if mine is None:
        mine = read(coll._native_coll(), coll.size, coll.rank)
    records = comm.allgather(mine)
    return build(records, coll.size, books_of(coll), True, coll.rank, what)


def local(coll, what: str = "", mine: Optional[Dict[str, Any]] = None) -> Stats:
    """This rank's own view: asks nobody."""
    if mine is None:
        mine = read(coll._native_coll(), coll.size, coll.rank)
    return build([mine], coll.size, Books(coll.size), False, coll.rank, what)


def _what(coll) -> str:
    mode = getattr(coll, "mode", None)
    return f"{type(coll).__name__}" + (f" mode={mode}" if mode else "")


def books_of(coll) -> Books:
    books = coll.__dict__.get("_stats_books")
    if books is None:
        books = coll.__dict__["_stats_books"] = Books(coll.size)
    return books


def of(coll, local_only: bool = False) -> Stats:
    """coll.stats(): before close(), gathered on the collective's own communicator; after
    it, from the record close() kept, gathered on the user's communicator."""
    kept = coll.__dict__.get("_stats_record")
    if kept is None and getattr(coll, "_closed", False):
        from ._errors import StateError
        raise StateError("stats() of a collective dropped without close(): its record is gone")
    if local_only:
        return local(coll, _what(coll), kept)
    return gather(coll, coll._stats_comm if kept is not None else coll._comm, _what(coll), kept)


def at_close(coll) -> None:
    """close(), before the native object goes: keep this rank's record (no message: a
    peer that failed cannot hang close()), so that stats() works after close()."""
    coll._stats_record = read(coll._native_coll(), coll.size, coll.rank)


def merge(parts: Sequence[Stats], what: str = "") -> Stats:
    """Several collectives of one job as one table (a DDP model's buckets: one round per
    bucket and step): rounds, full and late the most of any part, waited_for_s summed,
    the lateness windows side by side."""
    if not parts:
        return Stats(0, 0, 0, np.zeros(0, np.int64), np.zeros((0, 0)), np.zeros(0, np.int64), np.zeros(0), True,
                     None, what)
    size = parts[0].size
    lat = np.hstack([p.lateness for p in parts]) if parts else np.zeros((size, 0))
    return Stats(size, max(p.rounds for p in parts), max(p.full for p in parts),
                 np.max([p.late for p in parts], axis=0), lat, np.hstack([p.window for p in parts]),
                 np.sum([p.waited_for_s for p in parts], axis=0), all(p.gathered for p in parts), parts[0].rank,
                 what, sum(p.unattributed for p in parts))


def ordered(colls) -> list:
    """Collectives in the order every rank agrees on (their identity, rank 0's random
    number), so that their stats() allgathers run in one order everywhere."""
    return sorted(colls, key=lambda c: c._ident)


def check_every(value, what: str = "report_every") -> Optional[int]:
    """None, or an integer >= 1."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        from ._errors import ArgumentError
        raise ArgumentError(f"{what} must be None or an integer >= 1, not {value!r}")
    return int(value)


def report(stats: Stats, step: int) -> None:
    """The table through logging (logger "partialcoll", INFO), after step `step`."""
    import logging
    logging.getLogger("partialcoll").info("partialcoll: after step %d, %s", step, stats.table())


def note_hop(coll, k: int, updates, arrivals=(), entered: int = 0, done: int = 0) -> None:
    """A NeighborAllreduce iteration k taken here: an in-neighbour whose update is missing
    or older than k was late (this rank's view; Hop has no rounds that all ranks share).
    arrivals: when each update came (ns), entered / done: when this rank entered k and k
    completed (ns; all this rank's clock): an update's lateness is how long after the
    entry it came (0 if before; a missing or older one: at least till k completed), and
    this rank's wait from its entry to the last update's arrival is blamed on the updates
    in the order they came (between two arrivals, on the later: what it waited for)."""
    d = coll.__dict__
    if "_hop_late" not in d:
        d["_hop_late"] = np.zeros(coll.size, np.int64)
        d["_hop_stale"] = np.zeros(coll.size, np.int64)
        d["_hop_iterations"] = 0
        d["_hop_lateness"] = [collections.deque(maxlen=HOP_WINDOW) for _ in range(coll.size)]
        d["_hop_waited"] = np.zeros(coll.size)
    d["_hop_iterations"] += 1
    got = dict(updates)
    came = {src: t for (src, _), t in zip(updates, arrivals)}
    for src in coll.sources:
        it = got.get(src)
        if it is None or it < k:
            d["_hop_late"][src] += 1
            d["_hop_stale"][src] += k - it if it is not None else 1
        if entered:
            at = came[src] if it == k else done
            d["_hop_lateness"][src].append(max(at - entered, 0) / 1e9)
    since = entered
    for t, src in sorted((t, src) for src, t in came.items()):
        if entered and t > since:
            d["_hop_waited"][src] += (t - since) / 1e9
            since = t


def hop_fields(coll) -> Dict[str, Any]:
    """NeighborAllreduce.stats' who-is-slow keys: per rank (every rank of the communicator;
    0, or NaN for lateness, for those that are not in-neighbours) as this rank saw them."""
    d = coll.__dict__
    late = d.get("_hop_late", np.zeros(coll.size, np.int64))
    stale = d.get("_hop_stale", np.zeros(coll.size, np.int64))
    order = sorted(range(coll.size), key=lambda r: (-int(late[r]), -int(stale[r]), r))
    kept = d.get("_hop_lateness", [()] * coll.size)
    lateness = {"mean": [float(np.mean(v)) if len(v) else NAN for v in kept],
                "p50": [float(np.percentile(v, 50)) if len(v) else NAN for v in kept],
                "p99": [float(np.percentile(v, 99)) if len(v) else NAN for v in kept]}
    return {"rounds": int(d.get("_hop_iterations", 0)), "late": [int(x) for x in late],
            "stale_iterations": [int(x) for x in stale],
            "stragglers": [r for r in order if late[r] > 0],
            "lateness_s": lateness,
            "waited_for_s": [float(x) for x in d.get("_hop_waited", np.zeros(coll.size))]}


def save(stats: Stats, path: str) -> None:
    with open(path, "w") as f:
        json.dump(stats.to_dict(), f)


def load(path: str) -> List[Stats]:
    """A saved report: one Stats, a list of them, or a bench JSON with "stats" entries."""
    with open(path) as f:
        data = json.load(f)
    found: List[Stats] = []

    def walk(x):
        if isinstance(x, dict):
            if "lateness" in x and "waited_for_s" in x and "size" in x:
                found.append(Stats.from_dict(x))
                return
            for v in x.values():
                walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)
    walk(data)
    return found
