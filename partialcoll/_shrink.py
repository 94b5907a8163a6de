"""on_failure="shrink": a dead rank is the last straggler, left out while the others go on.

When a peer fails (killed, exited, raised), every survivor's next call on the collective
fails with an MPI error; the survivor that sees it first revokes the communicators of its
shrink collectives, so that every other survivor's calls fail too and all of them come
here (with several collectives, in one pass over all of them: see the end). Then, on
every survivor, for each collective:

1. salvage: what this rank holds of the stopped collective (native coll_salvage): rounds
   completed here, its posts, which of them are inside completed rounds, the pending
   result;
2. shrink: MPIX_Comm_shrink gives the same communicator of survivors everywhere (ULFM:
   the failed set is agreed); over it every survivor tells the others its rounds
   completed and whether it holds the last round's data alone;
3. the round in flight: a round that completed at some survivors (they hold its result,
   the dead rank's data inside) is completed at the others with that result, sent by the
   first survivor holding it; a round that completed nowhere is re-run: each survivor
   posts again what it had posted and no completed round read. So a round is applied
   everywhere or nowhere;
4. agree: MPIX_Comm_agree on "every step above worked here"; if another rank died during
   steps 2-4, the survivors revoke, shrink again and redo them;
5. rebuild: a new engine collective (the round schedules built for the survivors) on the
   shrunk communicator; results keep the original communicator's rank numbers, and round
   numbers go on from the last completed round. ULFM: an agreement after it, so that no
   survivor leaves before all have rebuilt.

Without ULFM (MPICH: its MPIX_Comm_shrink aborts, mpi4py maps Shrink to Dup) only a
failure that reports survives: the failing rank's report (the first one every survivor
hears) is the agreement, the ranks the MPI shows gone with it are added, and
MPI_Comm_create_group over the others (collective over them only) stands in for the
shrink; a failure nobody reported raises PeerError.

One request may be outstanding per rank (post, then wait, before the next post: the
training-loop pattern), so that re-posting keeps each post's round; this rank keeps a
copy of each post until a result shows it inside a completed round.

Several collectives (a training step's buckets): one order of recovery everywhere. Each
recovery above is collective over the survivors, and a survivor meets the failure in
whichever collective it is using (one in bucket 2's post, another in bucket 1's wait): if
each recovered the collective it met it in, each would wait in its own one for the other.
So a process recovers all its live shrink collectives at once, in the order they were
created, whichever one met the failure (one pass, under a process-wide lock; ULFM: the
pass first revokes every one's communicator, so that every survivor's next call on any of
them fails and starts its own pass; without ULFM the report on every collective does that).
Why this cannot deadlock: construction is collective (it returns only once every member
has entered it), so a rank that makes X before Y enters Y after every member entered X:
creation order is one order T on all collectives, and each process's pass follows it.
Take, while survivors are in passes, the first collective X in T that some surviving member
has not finished recovering: every surviving member has finished all its collectives before
X (they come before X in T), holds no lock another process needs and blocks on nothing
else, so it is in X's recovery or about to enter it; a recovery that all surviving members
enter completes. A second death during the pass: ULFM, inside X's recovery, fails X's
shrink, plan or agreement at every survivor alike (they shrink and agree again, as for
one collective); before X, the collectives already recovered keep the dead rank and fail
at their next use, which starts a second pass over all of them, by the same argument.
Without ULFM two failures cannot be told apart from disagreement: the recovery raises
PeerError within AGREE_SECONDS and the pass stops, the collectives it did not reach
raising the same error at their next failed call.
"""
from __future__ import annotations

import os
import threading
import time
import weakref
from typing import Any, List, Optional, Tuple

import numpy as np
from mpi4py import MPI

from . import _engine, _propagate
from ._info import _first_line
from ._errors import ArgumentError, InvalidBufferError, MPIError, PeerError, StateError
from ._status import check
from ._types import UFUNCS, op_code

ON_FAILURE = ("raise", "shrink")
FAILURES = (MPIError, PeerError)    # what a dead peer makes the engine raise
_TAG = 0x5A1                        # MPI_Comm_create_group's tag (the survivors of one collective)
AGREE_SECONDS = 10.0                # without ULFM: how long survivors may take to build their communicator

# this process's shrink collectives, in the order they were made (module docstring: one
# recovery order everywhere); a pass over them, and every post, holds the lock
_LOCK = threading.RLock()
_LIVE: List["weakref.ref"] = []


def support() -> dict:
    """What on_failure="shrink" can survive with this MPI (partialcoll.info()["shrink"]):
    works, ulfm (revoke, shrink, agree), survives, cannot (what raises PeerError), missing
    (why it cannot work at all: construction raises ArgumentError)."""
    library = _first_line(MPI.Get_library_version())
    openmpi = library.startswith("Open MPI")
    enabled = os.environ.get("OMPI_MCA_mpi_ft_enable", "").strip() not in ("", "0", "false")
    if openmpi and enabled and all(hasattr(MPI.Comm, m) for m in ("Revoke", "Shrink", "Agree")):
        return {"works": True, "ulfm": True,
                "survives": "a rank killed, exiting or raising (ULFM: revoke, shrink, agree)",
                "cannot": "a failure during the rebuild of the collective (a few ms after the agreement)",
                "missing": None}
    if openmpi:
        return {"works": False, "ulfm": False, "survives": None, "cannot": None,
                "missing": "ULFM is not enabled in this job: launch it with `mpiexec --with-ft ulfm`"}
    # MPICH exports MPIX_Comm_shrink, but it aborts on an assertion (ch4_comm.c), and mpi4py
    # maps MPICH's Shrink to Dup and Agree to an allreduce: the failed rank's report is the
    # agreement, MPI_Comm_create_group (collective over the survivors only) the shrink
    return {"works": True, "ulfm": False,
            "survives": "a rank that raises or exits with collectives open (its report names it to every "
                        "survivor; MPI_Comm_create_group over the others), under `mpiexec -disable-auto-cleanup`",
            "cannot": f"a rank that fails without a report (SIGKILL, a crash, os._exit): {library} has no working "
                      f"ULFM, and its launcher ends every rank of a node where one dies of a signal",
            "missing": None}


def check_support(on_failure: str) -> None:
    """At construction (every rank alike): on_failure's value, and "shrink" only where it works."""
    if on_failure not in ON_FAILURE:
        raise ArgumentError(f"on_failure must be 'raise' or 'shrink', not {on_failure!r}")
    if on_failure == "shrink":
        missing = support()["missing"]
        if missing:
            raise ArgumentError(f"on_failure='shrink' cannot work here: {missing}")


class Shrinker:
    """A PartialAllreduce's state for on_failure="shrink" (only the owner's thread uses it)."""

    def __init__(self, coll) -> None:
        assert coll._comm is not None
        self.group = coll._comm.Get_group()        # the original ranks: numbering of results
        self.alive: List[int] = list(range(coll.size))   # current rank -> original rank
        self.failed: Tuple[int, ...] = ()
        self.round_base = 0                  # the user's round number of the engine's round 0
        self.kept: List[Tuple[int, np.ndarray]] = []     # (engine post index, copy): not yet known inside
        self.posts = 0                       # posts the engine of this epoch counted
        self.open = None                     # the outstanding request (one at most)
        self.last: Optional[tuple] = None    # (round, data, active, nap, posts, closing) of the last single round
        self.carry: Optional[tuple] = None   # fold: a pending fold of the old engine, for the next result
        self.recoveries: List[dict] = []     # per failure: failed ranks, seconds, how the round in flight ended
        self.fold = getattr(np, UFUNCS[op_code(coll.op)])   # fold mode: a pending fold carried across a rebuild
        self.comm: Optional[MPI.Comm] = None   # the latest shrunk communicator
        self.ulfm = support()["ulfm"]
        self.generation = 0                  # recoveries begun: a thread whose call failed sees if one ran meanwhile
        self.broken: Optional[BaseException] = None     # a recovery failed: raised by every later one
        _propagate.leave_without_abort()     # a failing rank reports and leaves: the others go on
        with _LOCK:
            _LIVE[:] = [ref for ref in _LIVE if _live(ref())]
            _LIVE.append(weakref.ref(coll))

    # -- the calls of PartialAllreduce and PartialRequest in shrink mode ------------------
    def post(self, coll, x, out):
        if type(x) is not np.ndarray or (out is not None and type(out) is not np.ndarray):
            raise InvalidBufferError("on_failure='shrink' keeps a copy of each post: post host (NumPy) arrays")
        if self.open is not None and self.open._result is None:
            raise StateError("on_failure='shrink': wait for the previous post's request before posting again "
                             "(one outstanding request per rank, so that a re-run round keeps each post's round)")
        x = coll._check_input(x, "post buffer", writable=False)
        with _LOCK:                          # not inside another thread's recovery of this collective
            while True:
                index = self.posts
                self.kept.append((index, np.array(x, copy=True)))
                try:
                    req = coll._post(x, out)
                except FAILURES as exc:
                    moved = self.recover(coll, exc, self.generation, pending_post=index)
                    if moved is None:        # the engine had not counted it: post on the new one
                        continue
                    req = moved
                else:
                    self.posts = req.index + 1
                self.open = req
                return req

    def wait(self, req, timeout):
        while True:
            if req._result is not None:
                return req._result
            generation, alive, base = self.generation, self.alive, self.round_base
            try:
                res = req._wait(timeout)
            except FAILURES + (StateError,) as exc:     # StateError: another thread's pass dropped the engine
                self.recover(req._coll, exc, generation)
                continue
            with _LOCK:
                if self.generation == generation:
                    return self.seen(req, res)
            # another thread's pass salvaged the engine just after this round completed
            # here (it counted the round): the old engine's numbering, nothing carried
            return self.mapped(res, alive, base)

    def test(self, req) -> bool:
        while True:
            if req._result is not None:
                return True
            generation = self.generation
            try:
                return req._test()
            except FAILURES + (StateError,) as exc:
                self.recover(req._coll, exc, generation)

    def close(self, coll, timeout):
        while True:
            generation = self.generation
            try:
                res = coll._close(timeout, FAILURES)
            except FAILURES as exc:
                coll._closing = False
                self.recover(coll, exc, generation)
                continue
            with _LOCK:
                _LIVE[:] = [ref for ref in _LIVE if ref() is not coll and _live(ref())]
            return self.mapped(res)

    # -- results ------------------------------------------------------------------------
    def seen(self, req, res):
        """A result the engine gave: original rank numbers, the user's round numbers; keep
        what a later failure needs."""
        self.mapped(res)
        if res.contributed:          # this post and every earlier one are inside completed rounds
            self.kept = [k for k in self.kept if k[0] > req.index]
        if res.rounds == 1:
            self.last = (res.round, np.array(res.data, copy=True), res.active, res.nap, res.posts, res.closing)
        if self.open is req:
            self.open = None
        return res

    def mapped(self, res, alive: Optional[List[int]] = None, base: int = 0):
        """The engine's result in the user's numbering (once per result), with a carried fold
        (alive, base: an engine's before the latest recovery; then nothing is carried)."""
        carry = None
        if alive is None:
            alive, base = self.alive, self.round_base
            carry, self.carry = self.carry, None
        res.round += base
        res.active = tuple(alive[r] for r in res.active)
        res.closing = tuple(alive[r] for r in res.closing)
        if carry is not None:        # fold: rounds the old engine completed here and no wait returned
            data, rounds, nap, posts, active = carry
            res.data[...] = self.fold(data, res.data)
            res.rounds += rounds
            res.nap += nap
            res.posts += posts
            res.active = tuple(sorted(set(res.active) | set(active)))
        return res

    # -- recovery -------------------------------------------------------------------------
    def recover(self, coll, cause: BaseException, generation: int, pending_post: Optional[int] = None):
        """A call on coll failed (begun at this generation): recover every live shrink
        collective of this process, in creation order (module docstring), unless another
        thread's pass did meanwhile. Returns what _recover_one returns for coll."""
        with _LOCK:
            if self.broken is not None:
                raise self.broken
            if self.generation != generation:    # recovered meanwhile: the caller tries again
                return None
            if isinstance(cause, StateError):    # not a failure, nor a pass under it
                raise cause
            return _recover_all(coll, cause, pending_post)

    def _recover_one(self, coll, cause: Optional[BaseException], pending_post: Optional[int] = None,
                     reported: Optional[List[int]] = None):
        """Every survivor, once its pass reaches this collective: agree, shrink, complete or
        re-run the round in flight, rebuild. reported (without ULFM): the failed ranks, in
        this collective's current numbering, where another collective's report named them.
        Returns the request of pending_post where the old engine had counted that post (it
        is posted again on the new one), else None."""
        try:
            return self._recover(coll, cause, pending_post, reported)
        except BaseException as exc:
            self.broken = exc
            raise
        finally:
            self.generation += 1

    def _recover(self, coll, cause, pending_post, reported):
        started = time.monotonic()
        ffi, lib = _engine.ffi, _engine.lib
        st = ffi.new("int64_t[5]")
        data = np.empty(coll.count, coll.dtype)
        mask = ffi.new("uint64_t[]", coll._mask_len)
        info = ffi.new("pc_result *")
        check(lib.pc_coll_salvage(coll._coll, st, ffi.from_buffer(data), mask, info))
        done, posts, inside, pending, taken = (int(v) for v in st)
        words = coll._mask_words
        active, closing = coll._ranks_of(tuple(mask[0:2 * words]))
        salvaged = (int(info.round), data, active, int(info.nap), int(info.posts), closing, int(info.post_lo),
                    int(info.post_hi))
        old = coll._comm
        if self.ulfm:
            try:
                old.Revoke()             # every survivor's calls on it fail now: all come here
            except MPI.Exception:
                pass
            coll._abandon()
            new, plan, tries = self._shrink(coll, old, done, pending, salvaged, taken, inside)
        else:
            if reported is None:
                reported = self._reported(coll, cause)     # raises PeerError where nobody reported
            coll._abandon()
            new, plan, tries = self._create_group(coll, old, reported, done, pending, salvaged, taken, inside)
        self.comm = new
        survivors = MPI.Group.Translate_ranks(new.Get_group(), list(range(new.Get_size())), self.group)
        self.failed = tuple(sorted(set(range(self.group.Get_size())) - set(survivors)))
        if plan[0] == "error":
            raise PeerError(plan[1], self.failed[0] if self.failed else -1, "failed", plan[1])
        kind, M, result, agreed_inside = plan
        # the outstanding request: its round completed (here or via the donor), or it is posted again
        req, moved = self.open, None
        repost = [(i, x) for i, x in self.kept if agreed_inside <= i < posts]
        if req is not None and req._result is None and req.index < posts and req.index < M - self.round_base:
            if result is not None:
                req._result = self._result_for(coll, req, result)
                self.open = None
                result = None            # taken: no fold carries it
        self.carry = None
        if result is not None and coll.late == "fold" and result[7] > 0:
            self.carry = (result[1], result[7], result[3], result[4], result[2])
        # rebuild on the survivors
        self.alive = list(survivors)
        self.round_base = M
        coll._rebuild(new)
        if self.ulfm:
            # no survivor leaves this recovery before every one has rebuilt (Dup and an
            # allreduce over new): a second failure's pass revokes the rebuilt collective's
            # communicator, which must not cut a slower survivor's rebuild short. A failure
            # now shows at the collective's next use (another pass)
            try:
                new.Agree(1)
            except MPI.Exception:
                pass
        self.kept, self.posts = [], 0
        for i, x in repost:
            r = coll._post(x, None)
            self.kept.append((r.index, x))
            self.posts = r.index + 1
            if req is not None and req._result is None and i == req.index:
                req.index, req.late = r.index, r.late
            if pending_post is not None and i == pending_post:
                moved = r
        if pending_post is not None and moved is None and pending_post < posts:
            moved = req                  # counted and inside a completed round: nothing to re-post
        self.recoveries.append({"failed": self.failed, "seconds": time.monotonic() - started, "round": kind,
                                "reposted": len(repost), "tries": tries,
                                "cause": type(cause).__name__ if cause is not None else "pass",
                                "held": {"completed": done, "posts": posts, "inside": inside, "taken": taken,
                                         "agreed": M}})
        return moved

    def _shrink(self, coll, old, *state):
        """ULFM: shrink, plan, agree; again while another rank fails meanwhile."""
        comm, tries = old, 0
        while True:
            tries += 1
            new = comm.Shrink()
            new.Set_errhandler(MPI.ERRORS_RETURN)
            ok, plan = 1, None
            try:
                plan = self._plan(coll, new, *state)
            except MPI.Exception:
                ok = 0
                try:
                    new.Revoke()
                except MPI.Exception:
                    pass
            try:
                ok = new.Agree(ok)
            except MPI.Exception:
                ok = 0
            if ok and plan is not None:
                break
            comm = new                   # another failure during the agreement: again
        return new, plan, tries

    def _reported(self, coll, cause) -> List[int]:
        """Without ULFM: the rank whose report said it failed (the agreement: every survivor
        hears the same first report). A failure nobody reported cannot be survived."""
        rank = cause.rank if isinstance(cause, PeerError) else -1
        deadline = time.monotonic() + 1.0           # a report waits at most a second to leave
        while rank < 0 and time.monotonic() < deadline:
            try:
                rank = coll._peers.peer_error()[0]
            except Exception:                       # noqa: BLE001 - no report yet
                rank = -1
            if rank < 0:
                time.sleep(0.01)
        if rank >= 0:
            # the reporter leaves at once: once the MPI shows it gone, the ranks it shows
            # gone with it (two failing together: each survivor hears one first report)
            failed = {rank}
            deadline = time.monotonic() + 2.0
            while time.monotonic() < deadline:
                gone = _failed_ranks(coll._comm)
                if gone is None or rank in gone:
                    failed |= set(gone or ())
                    break
                time.sleep(0.01)
            return sorted(failed)
        ranks = tuple(self.alive[r] for r in getattr(cause, "ranks", ()))
        raise PeerError(f"rank(s) {ranks} failed without a report (killed by a signal, a crash, os._exit): "
                        f"on_failure='shrink' cannot survive that here: {support()['cannot']} ({cause})",
                        ranks[0] if ranks else -1, "failed", str(cause))

    def _create_group(self, coll, old, reported, *state):
        """Without ULFM: a communicator over the others (collective over them only), plan.
        Survivors that name different failed ranks (two failing together) would wait in
        MPI_Comm_create_group for ever: it runs on a helper thread, and after
        AGREE_SECONDS this rank raises PeerError instead."""
        got: list = []

        def run():
            try:
                new = old.Create_group(old.Get_group().Excl(reported), tag=_TAG)
                new.Set_errhandler(MPI.ERRORS_RETURN)
                plan = self._plan(coll, new, *state)
                new.allreduce(1, op=MPI.MIN)
                got.append((new, plan))
            except BaseException as exc:             # noqa: BLE001 - raised below, on the caller's thread
                got.append(exc)
        helper = threading.Thread(target=run, name="partialcoll-shrink", daemon=True)
        helper.start()
        helper.join(AGREE_SECONDS)
        named = tuple(self.alive[r] for r in reported)
        if not got or isinstance(got[0], BaseException):
            why = f"({got[0]})" if got else f"(no agreement within {AGREE_SECONDS} s: the survivors name different " \
                                            f"failed ranks, as when two fail together)"
            raise PeerError(f"rank(s) {named} failed and the survivors could not agree on the failed set without "
                            f"ULFM: on_failure='shrink' cannot survive that here {why}", named[0], "failed", why)
        new, plan = got[0]
        return new, plan, 1

    def _plan(self, coll, new, done, pending, salvaged, taken, inside):
        """Steps 2-3 over the shrunk communicator: ("completed" | "rerun", M, result, inside)
        or ("error", message). Raises MPI.Exception where another rank failed meanwhile."""
        base = self.round_base
        holds, engine_holds = -1, False
        if done > 0 and salvaged[0] == done - 1 and (coll.late == "latest" or pending == 1):
            holds, engine_holds = base + done - 1, True     # the engine's pending result is that round alone
        elif self.last is not None:
            holds = self.last[0]
        rows = new.allgather((base + done, holds))
        M, m = max(r[0] for r in rows), min(r[0] for r in rows)
        mine = None
        if done > 0:
            rnd, data, active, nap, posts, closing, lo, hi = salvaged
            mine = (base + rnd, data, tuple(self.alive[r] for r in active), nap, posts,
                    tuple(self.alive[r] for r in closing), (lo, hi), pending if coll.late == "fold" else 1)
        if M == m:                       # the round in flight completed nowhere: re-run
            return ("rerun", M, mine, inside)
        if M - m > 1:
            return ("error", f"rounds completed differ by {M - m} among the survivors: cannot shrink")
        donor = next((i for i, r in enumerate(rows) if r[0] == M and r[1] == M - 1), None)
        if donor is None:
            return ("error", f"round {M - 1} completed at some survivors, but none holds its data alone: "
                             f"cannot complete it at the others")
        me = new.Get_rank()
        if me == donor:
            if engine_holds:
                src = mine
            else:
                rnd, dat, act, nap, pst, clo = self.last
                src = (rnd, dat, act, nap, pst, clo, (0, 0), 1)
            meta = (src[2], src[3], src[4], src[5])
            buf = np.ascontiguousarray(src[1])
        else:
            meta, buf = None, np.empty(coll.count, coll.dtype)
        meta = new.bcast(meta, root=donor)
        err = new.Bcast(buf, root=donor)
        if err not in (None, MPI.SUCCESS):
            raise MPI.Exception(err)
        if rows[me][0] == M:
            return ("completed", M, mine, inside)
        # this rank lagged: the round in flight here completes with the donor's result; the
        # posts it took are inside it
        got = (M - 1, buf, meta[0], meta[1], meta[2], meta[3], (inside, taken), 1)
        if coll.late == "fold" and pending > 0 and mine is not None:
            got = (M - 1, self.fold(mine[1], buf), tuple(sorted(set(mine[2]) | set(meta[0]))),
                   mine[3] + meta[1], mine[4] + meta[2], meta[3], (mine[6][0], taken), mine[7] + 1)
        return ("completed", M, got, taken)

    def _result_for(self, coll, req, result):
        from ._partial import Result
        rnd, data, active, nap, posts, closing, (lo, hi), rounds = result
        out = req._out if req._out is not None else np.empty(coll.count, coll.dtype)
        out[...] = data
        res = Result(data=out, round=rnd, active=active, nap=nap, posts=posts,
                     contributed=lo <= req.index < hi, rounds=rounds, closing=closing)
        if rounds == 1:
            self.last = (rnd, np.array(data, copy=True), active, nap, posts, closing)
        return res


def _live(coll) -> bool:
    """A shrink collective this process still uses (not closed, dropped or given up)."""
    return coll is not None and coll._shrink is not None and coll._shrink.broken is None and not coll._closed


def _recover_all(coll, cause: BaseException, pending_post: Optional[int]):
    """One pass (under _LOCK): every live shrink collective of this process recovers, in the
    order they were made; coll (whose call failed) with its cause and pending post. ULFM:
    every one's communicator is revoked first, so every survivor's next call on any of
    them fails and brings it to its own pass. Without ULFM: coll's report names the failed
    ranks; each other collective recovers from the same ranks (by their COMM_WORLD rank)
    where its communicator holds one of them, and is left alone where it holds none."""
    world = MPI.COMM_WORLD.Get_group()
    colls: list = [c for c in (ref() for ref in _LIVE) if _live(c)]
    if coll not in colls:
        colls.append(coll)
    failed_world: set = set()
    if coll._shrink.ulfm:
        for c in colls:
            try:
                c._comm.Revoke()
            except MPI.Exception:
                pass
    else:
        try:
            mine = coll._shrink._reported(coll, cause)
        except BaseException as exc:
            coll._shrink.broken = exc
            raise
        failed_world = set(MPI.Group.Translate_ranks(coll._comm.Get_group(), mine, world))
    moved = None
    for i, c in enumerate(colls):
        reported = None
        if not c._shrink.ulfm:
            group = c._comm.Get_group()
            ranks = MPI.Group.Translate_ranks(group, list(range(group.Get_size())), world)
            reported = [r for r, w in enumerate(ranks) if w in failed_world]
            if not reported:             # the failure is not in its communicator
                continue
        try:
            got = c._shrink._recover_one(c, cause if c is coll else None, pending_post if c is coll else None,
                                         reported)
        except BaseException as exc:
            for later in colls[i + 1:]:  # the pass stopped: those it did not reach raise the same
                later._shrink.broken = exc
            raise
        if c is coll:
            moved = got
    return moved


def _failed_ranks(comm) -> Optional[set]:
    """The ranks of comm the MPI reports as failed (MPIX_Comm_get_failed); None: it cannot tell."""
    ffi = _engine.ffi
    ranks, n = ffi.new("int[]", 64), ffi.new("int *")
    check(_engine.lib.pc_comm_failed(_engine.comm_handle(comm), ranks, 64, n))
    return None if n[0] < 0 else set(ranks[0:n[0]])


def refuse(on_failure: Optional[str], who: str, why: str) -> str:
    """At construction of a collective that cannot shrink (every rank alike, inside its
    argument agreement): on_failure (None: partialcoll.rc.on_failure) must be "raise";
    "shrink" raises ArgumentError naming why. Returns the value."""
    from ._rc import rc
    value = rc.on_failure if on_failure is None else on_failure
    if value not in ON_FAILURE:
        raise ArgumentError(f"on_failure must be 'raise' or 'shrink', not {value!r}")
    if value == "shrink":
        source = "" if on_failure is not None else " (partialcoll.rc.on_failure is 'shrink')"
        raise ArgumentError(f"{who} has no on_failure='shrink'{source}: {why}; make it with on_failure='raise'")
    return value


def agree_after_failure(shrinker, coll, cause: BaseException, *state):
    """The agreement of a failed collective, for any shrinker with ulfm, _shrink,
    _reported and _create_group (their plan gets state): revoke (ULFM) or hear the report,
    drop coll's engine, and agree; (survivors' communicator, plan, tries). Raises
    PeerError where the failure cannot be survived (coll is then left as it is)."""
    old = coll._comm
    if shrinker.ulfm:
        try:
            old.Revoke()                 # every survivor's calls on it fail now: all come here
        except MPI.Exception:
            pass
        coll._abandon()
        return shrinker._shrink(coll, old, *state)
    reported = shrinker._reported(coll, cause)     # PeerError where nobody reported
    coll._abandon()
    return shrinker._create_group(coll, old, reported, *state)


class Shrinkable:
    """What a collective with on_failure="shrink" shows (its shrinker in self._shrink)."""

    _shrink: Any

    @property
    def failed(self) -> Tuple[int, ...]:
        """on_failure="shrink": the ranks that failed, in the numbering of the communicator
        the collective was created on (ascending; empty while none has)."""
        return self._shrink.failed if self._shrink is not None else ()
