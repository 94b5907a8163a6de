"""RNA's hierarchical synchronization: partial allreduces inside speed groups, and the
groups' models averaged asynchronously through a server rank.

    h = pc.HierarchicalAllreduce(count, np.float32, comm, regroup_every=50)
    res = h.post(grad).wait()        # the group's partial allreduce (probe(2) by default)
    params[:] = h.average(params)    # every k steps: the mean of every group's latest model

How it works (Yang et al., Middleware 2020, section 4):

- Groups. Ranks are grouped by speed (``speed_groups``: RNA's rule on each rank's step
  time); each group gets its own communicator (``comm.Split``) and its own
  ``PartialAllreduce`` (any mode; RNA's is probe(2)), so a fast group's rounds never wait
  for a slow group's ranks.
- Averaging between groups. ``average(params)`` is collective over the group: one member
  (the pusher, rotating over the group's ranks call after call) pushes its parameters to
  an ``AsyncAverager`` under the group's number, receives the mean of every group's
  latest push, and broadcasts it in the group. A slow group never holds up a fast one:
  the server answers each push at once with the other groups' latest models.
- Regrouping. Each rank keeps a window of its step times (the time from its previous
  wait to its post: how fast it computes, waits excluded; or what
  ``post(x, step_time=...)`` says). Every ``regroup_every``-th post is a regrouping
  point, collective over ``comm``: the ranks allgather the medians of their windows and
  apply RNA's rule; a new grouping is adopted only when the rule has given it at
  ``hysteresis`` points in a row (every rank decides alike: they see the same list).
  Adopting it closes the group's collective, whose final result (everything posted and
  not yet returned, folded) is added to this rank's next result, so nothing posted is
  lost; the averager starts afresh with the new groups' numbers.

Costs: a regrouping point is one allgather over ``comm`` (fast ranks wait there for the
slowest once per ``regroup_every`` steps); adopting a grouping is a ``Split``, a
``PartialAllreduce`` and an ``AsyncAverager`` construction.
"""
from __future__ import annotations

import statistics
import time
from collections import deque
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
from mpi4py import MPI

from . import _device, _shrink
from ._agree import agree, as_problem
from ._buffers import as_buffer
from ._errors import ArgumentError, PartialcollError, StateError
from ._partial import PartialAllreduce, PartialRequest, Result
from ._typing import Buffer, DTypeLike, ReduceOp
from ._types import check_comm, integer
from .averager import AsyncAverager, _wait_collective
from .speed_groups import check_step_time, split_by_speed

# why on_failure="shrink" is refused (docs/faults.md)
NO_SHRINK = ("average() goes through an AsyncAverager's server, which a dead server takes every group's latest "
             "model with, and the regrouping points are collectives over every rank; on_failure='shrink' on a "
             "PartialAllreduce per group goes on without a dead rank")


def _partition(groups) -> Tuple[Tuple[int, ...], ...]:
    """A grouping as its sets of ranks (group numbers aside)."""
    by: dict = {}
    for r, g in enumerate(groups):
        by.setdefault(g, []).append(r)
    return tuple(tuple(by[g]) for g in sorted(by))


def group_args(args: Dict[str, Any], comm: MPI.Comm, world: MPI.Comm) -> Dict[str, Any]:
    """A speed group's PartialAllreduce arguments (comm: the group's communicator) from the
    hierarchy's (over world): quorum k waits for k of the group's ranks, or all of them
    where the group is smaller (as probe's q: a group of q ranks or fewer runs solo); the
    group's size changes at every regrouping. Over all of world nothing changes, so a k
    beyond world's size is the collective's error on every rank."""
    k, size = args.get("quorum"), comm.Get_size()
    return args if k is None or k <= size or size >= world.Get_size() else {**args, "quorum": size}


class SpeedGrouping:
    """The grouping machinery shared by HierarchicalAllreduce and the torch integration:
    step-time window, regrouping points with hysteresis, the group communicator and the
    averager between groups. Collective methods are marked so."""

    def __init__(self, comm: MPI.Comm, *, server: int = 0, window: int = 8, hysteresis: int = 2,
                 regroup_every: Optional[int] = None, groups: Optional[List[int]] = None,
                 regroup_points: Optional[int] = None) -> None:
        self.comm = comm
        self.regroup_points = regroup_points
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.server, self.hysteresis, self.regroup_every = server, hysteresis, regroup_every
        self.times: deque = deque(maxlen=window)
        self._pending: Optional[tuple] = None     # (partition, points seen in a row)
        self.regroupings = 0
        self.group_comm: MPI.Comm = MPI.COMM_NULL
        self.averager: Optional[AsyncAverager] = None
        self._count = 0
        self._dtype: Any = None
        self._pushes = 0
        self.proposed: List[int] = []
        self.adopt(groups if groups is not None else [0] * self.size)

    def adopt(self, groups: List[int]) -> None:
        """Collective over comm: split into the groups (numbered from the fastest)."""
        self.groups = tuple(groups)
        self.group = groups[self.rank]
        if self.group_comm != MPI.COMM_NULL:
            self.group_comm.Free()
        self.group_comm = self.comm.Split(self.group, self.rank)
        self._pushes = 0
        if self.averager is not None:
            self.averager.close()
            self.averager = AsyncAverager(self._count, self._dtype, comm=self.comm, server=self.server,
                                          on_failure="raise")

    def averaging(self, count: int, dtype: Any) -> None:
        """Collective over comm: the averager between groups, for vectors of count dtype."""
        self._count, self._dtype = count, dtype
        self.averager = AsyncAverager(count, dtype, comm=self.comm, server=self.server, on_failure="raise")

    def note(self, step_time: float) -> None:
        self.times.append(check_step_time(step_time))

    def point(self, step: int) -> bool:
        """Is post #step a regrouping point (the same answer on every rank)?"""
        every = self.regroup_every
        return (every is not None and every > 0 and step > 0 and step % every == 0
                and (self.regroup_points is None or step // every <= self.regroup_points))

    def decide(self) -> bool:
        """Collective over comm: one allgather of the window medians (a Timeout after
        rc.timeout where a rank does not reach it); True when a new grouping is due (seen
        at `hysteresis` points in a row); self.proposed is it."""
        median = statistics.median(self.times) if self.times else 1.0    # each checked by note()
        mine, medians = np.array([median]), np.empty(self.size)
        _wait_collective(self.comm.Iallgather(mine, medians), "the regrouping's allgather of step times",
                         keep=(mine, medians), comm=self.comm)
        proposed = split_by_speed(medians.tolist())
        part = _partition(proposed)
        if part == _partition(self.groups):
            self._pending = None
            return False
        seen = self._pending[1] + 1 if self._pending and self._pending[0] == part else 1
        self._pending = (part, seen)
        self.proposed = proposed
        return seen >= self.hysteresis

    def average(self, params: np.ndarray, timeout: Optional[float] = None) -> np.ndarray:
        """Collective over the group: the pusher pushes params under the group's number;
        every member gets the mean of every group's latest push."""
        gc, averager = self.group_comm, self.averager
        if averager is None:
            raise StateError("average() before averaging() (or after free())")
        # every member learns whether one passed a bad buffer (one allgather), so all raise
        # at once: the pusher's would leave the others in the broadcast, another's would
        # receive the mean into the wrong memory
        problem: Optional[PartialcollError] = None
        try:
            params = as_buffer(params, averager.dtype, averager.count, writable=False, what="average()'s params",
                               who="hierarchy's averager")
        except PartialcollError as exc:
            problem = exc
        mine, every = np.array([self.rank if problem else -1], np.int64), np.empty(gc.Get_size(), np.int64)
        _wait_collective(gc.Iallgather(mine, every), "average()'s check of the members' buffers", timeout,
                         (mine, every), comm=gc)
        if problem is not None:
            raise problem
        bad = [int(q) for q in every if q >= 0]
        if bad:
            raise ArgumentError(f"average(): rank {bad[0]} passed a buffer that is not {averager.count} elements of "
                                f"{averager.dtype} (this is rank {self.rank})")
        pusher = self._pushes % gc.Get_size()
        self._pushes += 1
        if gc.Get_rank() == pusher:
            mean = averager.push(params, key=self.group).wait(timeout)
        else:
            mean = np.empty_like(params)
        _wait_collective(gc.Ibcast(mean, root=pusher), "the broadcast of the groups' average", timeout, (mean,),
                         comm=gc)
        return mean

    def free(self) -> None:
        """Collective over comm."""
        if self.averager is not None:
            self.averager.close()
            self.averager = None
        if self.group_comm != MPI.COMM_NULL:
            self.group_comm.Free()
            self.group_comm = MPI.COMM_NULL


def _fold(res: Result, carry: Optional[Result], op_add) -> Result:
    """res with carry (a closed group's final result) folded in: data and counts added."""
    if carry is None or carry.rounds == 0:
        return res
    return Result(data=op_add(res.data, carry.data), round=res.round,
                  active=tuple(sorted(set(res.active) | set(carry.active))), contributed=res.contributed,
                  rounds=res.rounds + carry.rounds, closing=res.closing, nap=res.nap + carry.nap,
                  posts=res.posts + carry.posts)


class HierarchicalRequest:
    """The request of one post: ``wait(timeout=None)`` -> Result, ``test()`` -> bool.

    The result is the group's round; after a regrouping, the first result also holds the
    old group's final round (its data added, its counts summed)."""

    def __init__(self, owner: "HierarchicalAllreduce", request: PartialRequest) -> None:
        self._owner, self._request = owner, request
        self._result: Optional[Result] = None
        if owner._regroups:
            owner._pending.append(self)

    def test(self) -> bool:
        """True once the group's round of this post has completed here."""
        return self._result is not None or self._request.test()

    def wait(self, timeout: Optional[float] = None) -> Result:
        """Block until the group's round completed here; the Result."""
        if self._result is None:
            res = self._request.wait(timeout)
            owner = self._owner
            owner._last = time.perf_counter()     # the next step's compute starts here
            carry, owner._carry = owner._carry, None
            self._result = _fold(res, carry, owner._add)
            if self in owner._pending:
                owner._pending.remove(self)
        return self._result

    Wait = wait
    Test = test


class HierarchicalAllreduce:
    """RNA's hierarchical synchronization over comm (created collectively): a partial
    allreduce inside each speed group, models averaged between groups through a server.

    step_time: this rank's step time (seconds) for the first grouping, or None (one
    group, until a regrouping point splits it). mode, candidates, quorum, seed, late,
    max_staleness, accumulate, algorithm: those of each group's PartialAllreduce (RNA:
    probe(2); late="fold" keeps every rank's sum of results equal to its group's posts);
    quorum k (1 <= k <= comm's size) waits for k of the group's ranks, or for all of a
    smaller group's. server: the averager's server rank in comm. regroup_every: posts
    between regrouping points (None: never regroup); regroup_points: how many points
    there are (None: no bound; every rank must reach every point); window: step times per
    rank taken into the median; hysteresis: points in a row a new grouping must be seen
    at before it is adopted.

    on_failure: "raise" only (default partialcoll.rc.on_failure): a failed peer raises
    PeerError or MPIError. "shrink" raises ArgumentError on every rank: average() goes
    through an AsyncAverager's server (which cannot shrink) and the regrouping points are
    collectives over every rank; a PartialAllreduce per group with on_failure="shrink"
    is the way to go on without a dead rank (docs/faults.md).

    Threads: as PartialAllreduce; post() and average() belong to one thread.
    """

    def __init__(self, count: int, dtype: DTypeLike = np.float32, op: ReduceOp = MPI.SUM,
                 comm: MPI.Comm = MPI.COMM_WORLD, *, mode: str = "probe", candidates: Optional[int] = None,
                 quorum: Optional[int] = None, seed: int = 0, late: str = "fold",
                 max_staleness: Optional[int] = None, accumulate: str = "sum", algorithm: str = "auto",
                 server: int = 0, step_time: Optional[float] = None, regroup_every: Optional[int] = None,
                 window: int = 8, hysteresis: int = 2, regroup_points: Optional[int] = None,
                 on_failure: Optional[str] = None) -> None:
        check_comm(comm, "HierarchicalAllreduce")
        problem = params = None
        try:
            if regroup_every is not None:
                regroup_every = integer(regroup_every, "regroup_every", 1)
            window = integer(window, "window", 1)
            hysteresis = integer(hysteresis, "hysteresis", 1)
            if regroup_points is not None:
                regroup_points = integer(regroup_points, "regroup_points", 0)
            if quorum is not None:       # the groups' collectives check the rest of the arguments
                quorum = integer(quorum, "quorum", 1, comm.Get_size())
            server = integer(server, "server", 0)
            if server >= comm.Get_size():
                raise ArgumentError(f"server {server} is outside the communicator (size {comm.Get_size()})")
            if step_time is not None:
                step_time = check_step_time(step_time)
            if regroup_every is not None and op != MPI.SUM:
                raise ArgumentError("regrouping adds the closed group's final round to the next result: "
                                    "regroup_every needs op MPI.SUM")
            params = {"regroup_every": regroup_every, "window": window, "hysteresis": hysteresis,
                      "regroup_points": regroup_points, "server": server, "initial": step_time is not None,
                      "on_failure": _shrink.refuse(on_failure, "HierarchicalAllreduce", NO_SHRINK)}
        except Exception as exc:         # noqa: BLE001 - reported on every rank below
            problem = as_problem(exc, "HierarchicalAllreduce")
        times = agree(comm, "HierarchicalAllreduce", problem, params, step_time,
                      "the same regroup_every, window, hysteresis and server, and step_time on all or none")
        groups = split_by_speed(times) if step_time is not None else None
        self.count, self.op = count, op
        self._coll_args: Dict[str, Any] = dict(mode=mode, candidates=candidates, quorum=quorum, seed=seed, late=late,
                                               max_staleness=max_staleness, accumulate=accumulate,
                                               algorithm=algorithm, on_failure="raise")
        self.grouping = SpeedGrouping(comm, server=server, window=window, hysteresis=hysteresis,
                                      regroup_every=regroup_every, groups=groups, regroup_points=regroup_points)
        self._coll = self._group_coll(dtype)
        self.dtype = self._coll.dtype
        self.grouping.averaging(count, self.dtype)
        self._add = np.add if op == MPI.SUM else None
        self._carry: Optional[Result] = None
        # requests of the group's collective not waited for yet (a pipelined loop: post k,
        # then wait k - 1): a regrouping takes their results before it closes the collective
        self._pending: List[HierarchicalRequest] = []
        self._regroups = regroup_every is not None
        self._posts = 0
        self._last: Optional[float] = None
        self._closed = False

    def _group_coll(self, dtype) -> PartialAllreduce:
        """This rank's group's collective (collective over the group)."""
        comm = self.grouping.group_comm
        return PartialAllreduce(self.count, dtype, self.op, comm, **group_args(self._coll_args, comm, self.grouping.comm))

    @property
    def group(self) -> int:
        """This rank's speed group (0: the fastest)."""
        return self.grouping.group

    @property
    def groups(self) -> Tuple[int, ...]:
        """Every rank's group, in rank order."""
        return self.grouping.groups

    @property
    def group_comm(self) -> MPI.Comm:
        """The communicator of this rank's group (rank order kept)."""
        return self.grouping.group_comm

    @property
    def regroupings(self) -> int:
        """How many new groupings were adopted since creation."""
        return self.grouping.regroupings

    def post(self, x: Buffer, out: Optional[Buffer] = None, step_time: Optional[float] = None) -> HierarchicalRequest:
        """Post x to the group's partial allreduce; at a regrouping point, first take part
        in the regrouping (collective over comm). step_time: this step's time (default:
        the time since this rank's previous wait returned, or since its previous post:
        the compute time, without the waits)."""
        if self._closed:
            raise StateError("this HierarchicalAllreduce is closed")
        if step_time is not None:
            self.grouping.note(step_time)
        elif self._last is not None:
            self.grouping.note(max(time.perf_counter() - self._last, 1e-9))
        if self.grouping.point(self._posts) and self.grouping.decide():
            self._regroup()
        self._posts += 1
        req = HierarchicalRequest(self, self._coll.post(x, out))
        self._last = time.perf_counter()       # a regrouping's wait is not part of the next step
        return req

    def _regroup(self) -> None:
        """Collective over comm: close the group's collective (its final result is carried
        into the next result), adopt the proposed grouping, build the new collective.

        Requests of the old collective still outstanding (a pipelined loop) get their
        results first: every rank has made the same number of posts at a regrouping point,
        so their rounds complete (a rank's own posts are in, and the others' too); a wait
        after close() would have nothing left to take."""
        for req in list(self._pending):
            req.wait()
        self._pending.clear()
        final = self._coll.close()
        self._carry = final if self._carry is None else _fold(final, self._carry, self._add)
        self.grouping.adopt(self.grouping.proposed)
        self.grouping.regroupings += 1
        self._coll = self._group_coll(self.dtype)

    def average(self, params: Buffer, timeout: Optional[float] = None) -> np.ndarray:
        """Collective over the group: the mean of every group's latest parameters (this
        group's pushed by one member), as a new array on every member (on the device where
        params is a device array: staged through host memory)."""
        if self._closed:
            raise StateError("this HierarchicalAllreduce is closed")
        backend = _device.backend_of(params)
        if backend is None:
            return self.grouping.average(np.ascontiguousarray(params, dtype=self.dtype).reshape(-1), timeout)
        arr = _device.device_array(backend, params, what="average()'s params")
        host = np.empty(arr.size, arr.dtype)
        _device.copy_in(backend, arr, host)
        mean = self.grouping.average(np.ascontiguousarray(host, dtype=self.dtype), timeout)
        return _device.copy_out(backend, mean, None, arr)

    def stats(self, local: bool = False):
        """Who is slow in this rank's speed group since its last regrouping: the group's
        PartialAllreduce.stats() (collective over group_comm; ranks are the group's)."""
        return self._coll.stats(local)

    def close(self) -> Result:
        """Collective over comm: close the group's collective (its final result, with any
        carried one) and the averager."""
        if self._closed:
            raise StateError("this HierarchicalAllreduce is closed")
        final = self._coll.close()
        self._pending.clear()            # close() folded their rounds into final
        carry, self._carry = self._carry, None
        self.grouping.free()
        self._closed = True
        return _fold(final, carry, self._add)

    def __repr__(self) -> str:
        return (f"HierarchicalAllreduce(count={self.count}, dtype={self.dtype}, groups={self.groups}, "
                f"mode={self._coll.mode!r})")
