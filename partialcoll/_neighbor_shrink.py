"""on_failure="shrink" for NeighborAllreduce: the dead neighbour dropped, the graph closed
over it, the iteration in flight completed or run again.

A neighbour allreduce has no round that all ranks share: iteration k's result at a rank
combines its own update of k with its in-neighbours' updates of k (standard; with backup
workers and staleness, those the engine took). So the survivors do not agree on a result,
but on where to start again. After a peer failed (every survivor's next call fails: the
neighbours of the dead see it, ULFM's revoke or the failing rank's report reaches the
others), on every survivor:

1. salvage: the iteration in flight (one outstanding request per rank) either completed
   here before the failure (its result, with whatever it holds of the dead rank's
   update, is kept and returned) or not; d = the iterations whose result this rank has,
   p = its posts;
2. agree: the failed set, with _shrink.Shrinker's agreement (ULFM: revoke, shrink,
   agree; MPICH: the failing rank's report, then MPI_Comm_create_group over the others);
   over the survivors' communicator every rank tells (p, d, the oldest post it still
   keeps a copy of); L = the smallest d;
3. rebuild: the graph over the survivors, topology.bridged (each edge u -> f -> v through
   a failed rank f becomes u -> v: a ring closes over the gap), and a new engine on it
   whose iteration 0 is iteration L of every rank (iteration numbers go on);
4. run again: every survivor posts again its kept updates of iterations L .. p - 1. Where
   the iteration had not completed here (the one in flight), its request takes the new
   engine's result: whole, over the new graph, with weights="mean" dividing by the
   updates that went in (the survivors'). Where it had completed here, the re-run only
   serves the neighbours that lag, and its result is dropped. So an iteration is applied
   at a rank once, wholly over the old graph or wholly over the new one, never half.

A further failure during step 4 starts again at step 1. Steps 1-4 run in the process's
one pass over all its shrink collectives, in creation order (_shrink's module
docstring), whichever of them met the failure. The copies: each rank keeps its
last R x (diameter + 1) updates (R = depth, the diameter of the graph, as the token and
memory bounds limit how far ranks drift apart); where a rank no longer holds a post it
must run again, every survivor raises PeerError saying so.
"""
from __future__ import annotations

import time
from typing import Dict, List, Tuple

import numpy as np
from mpi4py import MPI

from . import _engine, _shrink, topology
from ._errors import InvalidBufferError, PeerError, StateError
from ._rc import rc


class _Agreement(_shrink.Shrinker):
    """PartialAllreduce's agreement on the failed set (Shrinker's _shrink, _reported and
    _create_group), with the neighbour collective's plan in place of the rounds'."""

    def __init__(self, owner: "HopShrinker") -> None:     # none of Shrinker's round state
        self.owner = owner
        self.ulfm = owner.ulfm

    @property
    def alive(self) -> List[int]:        # type: ignore[override]
        return self.owner.alive

    def _plan(self, coll, new, *state):
        return self.owner.plan(new, *state)


class HopShrinker(_shrink.Recovering):
    """A NeighborAllreduce's state for on_failure="shrink": one of the process's shrink
    collectives, recovered in the one pass over all of them (_shrink's module docstring)."""

    def __init__(self, coll) -> None:
        assert coll._comm is not None
        self.group = coll._comm.Get_group()      # the original ranks: numbering of results
        self.alive: List[int] = list(range(coll.size))
        self.failed: Tuple[int, ...] = ()
        self.recoveries: List[dict] = []
        self.kept: Dict[int, np.ndarray] = {}     # iteration -> this rank's update (a copy)
        self.keep = self._keep(coll)
        self.posted = 0                           # posts made (iterations 0 .. posted - 1)
        self.open = None                          # the outstanding request (one at most)
        self.discards: List[Tuple[int, np.ndarray]] = []   # re-runs whose result nobody takes
        self.comm = None                          # the latest survivors' communicator
        self.ulfm = _shrink.support()["ulfm"]
        self.agreement = _Agreement(self)
        self._join(coll)

    @staticmethod
    def _keep(coll) -> int:
        """Updates kept: R x (diameter + 1) (the drift between ranks the bounds allow)."""
        d = topology.distances({r: coll._graph[r] for r in coll._graph})
        finite = [x for row in d for x in row if x != float("inf")]
        return coll.depth * (int(max(finite, default=0)) + 1)

    # -- the calls of NeighborAllreduce in shrink mode ------------------------------------
    def post(self, coll, x, out):
        from .neighbor import NeighborRequest
        if type(x) is not np.ndarray or (out is not None and type(out) is not np.ndarray):
            raise InvalidBufferError("on_failure='shrink' keeps a copy of each update: post host (NumPy) arrays")
        if self.open is not None and self.open._result is None and not self.open._cancelled:
            raise StateError("on_failure='shrink': wait for the previous post's request before posting again "
                             "(one outstanding request per rank, so that a re-run iteration keeps its update)")
        x, res, _ = coll._host_buffers(x, out)
        with _shrink._LOCK:                  # not inside another thread's pass
            k = self.posted
            req = NeighborRequest(coll, k, res if res.ndim == 1 else res.reshape(-1))
            self.kept[k] = np.array(x, copy=True)
            self.kept.pop(k - self.keep, None)
            self.posted, self.open = k + 1, req
            coll._pending[k] = req
            try:
                self._take_discards(coll, k - coll.depth)
                coll._enter(x, req._out)
            except _shrink.FAILURES as exc:
                self.recover(coll, exc, self.generation)     # posts iteration k again, among the survivors
        return req

    def take(self, coll, req, timeout) -> None:
        while req._result is None:
            generation = self.generation
            try:
                coll._take_engine(req, timeout)
            except _shrink.FAILURES + (StateError,) as exc:     # StateError: a pass on another thread
                self.recover(coll, exc, generation)             # dropped the engine (the request re-posted)
                continue
            if timeout == 0.0:               # a test: one look
                break
        if req._result is not None and self.open is req:
            self.open = None

    # -- recovery (Recovering.recover begins the pass) ----------------------------------
    def _reported(self, coll, cause) -> List[int]:
        return self.agreement._reported(coll, cause)

    def _recover(self, coll, cause, pending_post, reported) -> None:
        """Every survivor, once its pass reaches this collective: salvage, agree, rebuild,
        run again (again from the salvage where another rank fails meanwhile). reported
        (without ULFM): the failed ranks where another collective's report named them."""
        started, tries, causes = time.monotonic(), 0, []
        while True:
            causes.append(type(cause).__name__ if cause is not None else "pass")
            done = self._salvage(coll)
            state = (self.posted, done, min(self.kept, default=self.posted))
            try:
                new, plan, n = _shrink.agree_after_failure(self.agreement, coll, cause, reported, *state)
            except PeerError:
                coll._abandon()
                raise
            reported = None                  # a further failure: this collective's own report
            tries += n
            survivors = MPI.Group.Translate_ranks(new.Get_group(), list(range(new.Get_size())), self.group)
            self.failed = tuple(sorted(set(range(self.group.Get_size())) - set(survivors)))
            if plan[0] == "error":
                raise PeerError(plan[1], self.failed[0] if self.failed else -1, "failed", plan[1])
            self.comm = new
            try:
                reposted = self._rebuild(coll, new, list(survivors), plan[1], done)
                break
            except _shrink.FAILURES as exc:      # another failure while running again
                cause = exc
        self.recoveries.append({"failed": self.failed, "seconds": time.monotonic() - started,
                                "iteration": plan[1], "reposted": reposted, "tries": tries, "cause": causes[0],
                                "held": {"posted": self.posted, "done": done}})

    def _salvage(self, coll) -> int:
        """How many iterations have their result here: the one in flight may have completed
        before the failure (its result taken now, from the stopped engine)."""
        req = self.open
        if req is None or req._result is not None:
            return self.posted
        if coll._h is not None and not req._cancelled:
            ffi = _engine.ffi
            upd = ffi.new("int64_t[]", 3 * max(len(coll.sources), 1))
            info, done = ffi.new("int64_t[4]"), ffi.new("int *")
            _engine.lib.pc_hop_salvage(coll._h, req.iteration - coll._base, upd, info, done)
            if done[0]:
                coll._taken(req, upd, info)
                self.open = None
                return self.posted
        return self.posted - 1

    def plan(self, new, posted, done, oldest):
        """Over the survivors: where to start again, L = the smallest iterations done;
        ("rerun", L) or ("error", why). Raises MPI.Exception where another rank failed."""
        rows = new.allgather((posted, done, oldest))
        start = min(r[1] for r in rows)
        ranks = MPI.Group.Translate_ranks(new.Get_group(), list(range(len(rows))), self.group)
        short = [ranks[i] for i, (p, _, lo) in enumerate(rows) if p > start and lo > start]
        if short:
            return ("error", f"rank(s) {short} no longer keep their updates from iteration {start} on (each keeps "
                             f"its last {self.keep}): the survivors cannot run those iterations again")
        return ("rerun", start)

    def _rebuild(self, coll, new, survivors: List[int], start: int, done: int) -> int:
        """The engine over the survivors' graph, its iteration 0 the user's `start`; the
        kept updates of iterations start .. posted - 1 posted again. Returns how many."""
        graph = topology.bridged(coll._graph, self.failed)
        self.alive = survivors
        coll._rebuild(new, survivors, graph, start)
        _shrink.rebuilt(self, new)
        self.discards = []
        pending = coll._pending
        for k in range(start, self.posted):
            self._take_discards(coll, k - coll.depth)
            req = pending.get(k)
            if k < done or req is None or req._cancelled:   # done here: for the neighbours only
                out = np.empty(coll.count, coll.dtype)
                coll._enter(self.kept[k], out)
                self.discards.append((k, out))
            else:                                # in flight here: its request takes this result
                coll._enter(self.kept[k], req._out)
        return self.posted - start

    def _take_discards(self, coll, upto: int) -> None:
        """Take (and drop) the re-runs of iterations <= upto: their slots are needed."""
        ffi, lib = _engine.ffi, _engine.lib
        while self.discards and self.discards[0][0] <= upto:
            k, _ = self.discards[0]
            upd = ffi.new("int64_t[]", 3 * max(len(coll.sources), 1))
            info = ffi.new("int64_t[4]")
            h = coll._h
            coll._wait(lambda seconds: lib.pc_hop_wait(h, k - coll._base, seconds, upd, info), rc.timeout,
                       f"NeighborAllreduce: the re-run of iteration {k} at rank {coll.rank}")
            self.discards.pop(0)
