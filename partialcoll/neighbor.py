"""Neighbour allreduce with Hop's mechanisms (Luo et al., ASPLOS 2019).

    g = pc.ring_based_graph(MPI.COMM_WORLD)
    coll = pc.NeighborAllreduce(n, np.float32, comm=g, backup=1, max_gap=4)
    res = coll.post(x).wait()      # res.data: mean of x and the in-neighbours' updates
    res.iteration, res.updates     # k, ((rank, iteration), ...) of the updates that went in
    coll.skip(coll.lag)            # a deterministically slow rank jumps forward (Hop §5)
    coll.close()

What it computes. A rank sends to its out-neighbours (the graph communicator's
destinations) and combines from its in-neighbours (sources), itself always included. Its
k-th post is its update of iteration k; iteration k's result combines it with:

  standard             the update of iteration k of every in-neighbour
  backup=b             those of at least n_in - b in-neighbours (Hop §4.3: k of n)
  max_staleness=s      each in-neighbour's newest update of an iteration in [k - s, k]
                       (Hop §3.5), waiting while one has none (with backup: n_in - b)

Late updates are dropped, never delivered to a later iteration (every message carries
its iteration in a header, checked on arrival). Tokens (Hop §4.2, max_gap=g): entering
an iteration takes a token from every out-neighbour and grants one to every
in-neighbour, so Iter(i) - Iter(j) <= g x len(path i -> j) (Theorem 2). skip(J) enters
up to J iterations without computing them, sending "skip" updates (Hop §5).
weights="mean" divides the SUM by the updates used, "staleness" weights an update of
iteration m in iteration k by 1 / (1 + k - m); None reduces with `op` alone.

How it runs: in the engine (native/hop.c, docs/hop.md), progressed by the progress
thread, on one duplicate of the graph communicator: it keeps or drops each update,
counts and grants tokens, and completes iteration k once enough in-neighbours are ready,
reducing into the request's result while the application computes. This module agrees
on the arguments, enters iterations (post, skip), takes results (wait) and runs close()
(fillers for receives posted beyond what was sent; every channel drained). Up to
R = depth = 1 + s + g requests may be outstanding (g = max_gap, else 1, or 3 with backup
workers; s = max_staleness or 0), with R receive slots per in-neighbour. A rank that
fails with it open tells every rank of the graph: their calls raise PeerError, unless
on_failure="shrink" (docs/faults.md): the survivors agree on the failed ranks, the graph
closes over them (topology.bridged: each edge through a dead rank becomes the edge it
bridged, so a ring closes over the gap), weights="mean" then divides by the survivors
whose updates went in, and the iteration in flight completes or runs again
(_neighbor_shrink.py).

Device buffers (CuPy, and what CuPy views): x is copied to pinned memory at post(); a
result whose out= is on the device, or that has no out= and x there, lands in a pinned
box and reaches the device in wait().

Threads (as PartialAllreduce's): the collective belongs to the thread that posts to it,
skips and closes it; its requests may be waited for (or tested) on other threads, several
at once (each wait has its own scratch for the updates it reports). close() never runs
under such a wait: while another thread is inside wait() or test(), close() raises
StateError (it would free what that wait reads), and a wait that starts once close() has
begun raises StateError.
"""
from __future__ import annotations

import os
import threading
import time
from typing import Dict, List, Optional, Tuple, cast

import numpy as np
from mpi4py import MPI

from . import _device, _engine, _neighbor_shrink, _propagate, _shrink, _stats
from ._agree import agree
from ._buffers import as_buffer
from ._errors import ArgumentError, MPIError, PartialcollError, PeerError, StateError, Timeout, as_timeout
from ._status import TIMEOUT_CODE, Peers, check, peer_error_of, wait_in_slices
from ._rc import rc
from ._typing import Buffer, DTypeLike, ReduceOp
from ._types import OP_NAMES, check_comm, check_op_dtype, dtype_code, integer, op_code

_WEIGHTS = {"mean": "PC_HOP_MEAN", "staleness": "PC_HOP_STALENESS", None: "PC_HOP_WEIGHTS_NONE"}
_STATS = ("received", "used", "dropped", "skip_updates", "max_buffered", "buffers", "skipped", "completed", "early")


class NeighborResult:
    """What an iteration gives back at this rank.

    Attributes:
        data: the combination of this rank's update and the in-neighbour updates used
        iteration: k (this rank's k-th post)
        updates: ((rank, iteration), ...) of the in-neighbour updates in data, by rank; the
            iteration is k in standard and backup modes, in [k - s, k] with staleness
        active: sorted ranks whose update is in data, this rank included
        nap: len(active): what weights="mean" divides by
        contributed: always True (this rank's own update is always in)
        rounds: 1 (the vocabulary of PartialAllreduce's Result)
        completed_ns: when the engine completed the iteration (ns, ``time.monotonic_ns``)
        early: whether it completed before this rank's first wait() or test() for it
    """

    __slots__ = ("data", "iteration", "updates", "active", "nap", "completed_ns", "early")

    def __init__(self, data, iteration: int, updates: Tuple[Tuple[int, int], ...], active: Tuple[int, ...],
                 completed_ns: int = 0, early: bool = False) -> None:
        self.data, self.iteration, self.updates, self.active = data, iteration, updates, active
        self.nap = len(active)
        self.completed_ns, self.early = completed_ns, early

    @property
    def round(self) -> int:
        return self.iteration

    @property
    def contributed(self) -> bool:
        return True

    @property
    def rounds(self) -> int:
        return 1

    def __repr__(self) -> str:
        return f"NeighborResult(iteration={self.iteration}, updates={self.updates}, nap={self.nap}, data={self.data!r})"


class NeighborRequest:
    """The request of one post: ``wait(timeout=None)`` -> NeighborResult, ``test()`` -> bool."""

    def __init__(self, coll: "NeighborAllreduce", iteration: int, out: np.ndarray, device=None) -> None:
        self._coll = coll
        self.iteration = iteration
        self._out = out                  # written by the engine (progress thread) until taken
        self._device = device            # (backend, device out or None, like): where the result goes
        self._result: Optional[NeighborResult] = None
        self._cancelled = False

    def test(self) -> bool:
        """True once iteration k completed here (the result is then ready)."""
        if self._result is None:
            self._coll._take(self, 0.0)
        return self._result is not None

    def wait(self, timeout: Optional[float] = None) -> NeighborResult:
        """Block until iteration k completed here; raises partialcoll.Timeout."""
        if self._result is None:
            self._coll._take(self, rc.timeout if timeout is None else timeout)
        assert self._result is not None
        return self._result

    Wait = wait
    Test = test


class NeighborAllreduce(_shrink.Shrinkable, _propagate.Reporting):
    """A persistent neighbour allreduce over a distributed-graph communicator (collective)."""

    def __init__(self, count: int, dtype: DTypeLike = np.float32, op: ReduceOp = MPI.SUM,
                 comm: Optional[MPI.Comm] = None, *, backup: int = 0, max_staleness: Optional[int] = None,
                 max_gap: Optional[int] = None, weights: Optional[str] = "mean",
                 on_failure: Optional[str] = None) -> None:
        """on_failure: "raise" (a failed peer makes every survivor's calls raise) or
        "shrink": the survivors agree on the failed ranks, drop them from the graph
        (topology.bridged: the graph closes over them), re-run the iteration in flight
        where it had not completed, and go on; one outstanding request per rank, NumPy
        buffers, no skip(); default partialcoll.rc.on_failure (docs/faults.md)."""
        if comm is None:
            raise ArgumentError("NeighborAllreduce needs comm=, a distributed-graph communicator: "
                                "comm.Create_dist_graph_adjacent(sources, destinations), or "
                                "pc.ring_graph(MPI.COMM_WORLD) and its siblings")
        check_comm(comm, "NeighborAllreduce")
        if comm.Get_topology() != MPI.DIST_GRAPH:
            kind = {MPI.CART: "a Cartesian", MPI.GRAPH: "an MPI_Graph_create"}.get(comm.Get_topology(),
                                                                                     "a plain")
            raise ArgumentError(f"NeighborAllreduce: comm is {kind} communicator, not a distributed-graph one; "
                                "make one with comm.Create_dist_graph_adjacent(sources, destinations) or "
                                "pc.ring_graph(comm) (this is rank %d)" % comm.Get_rank())
        size, rank = comm.Get_size(), comm.Get_rank()
        srcs, dsts, _ = cast(MPI.Distgraphcomm, comm).Get_dist_neighbors()   # its topology checked above
        problem, params = None, None
        try:
            sources = self._neighbours(srcs, "sources", rank)
            destinations = self._neighbours(dsts, "destinations", rank)
            params = self._validate(count, dtype, op, backup, max_staleness, max_gap, weights, len(sources))
            params["on_failure"] = on_failure = rc.on_failure if on_failure is None else on_failure
            _shrink.check_support(on_failure)
        except PartialcollError as exc:
            problem = exc
            sources, destinations = [], []
        # rank 0's random number: the collective's identity in its peer-error reports
        graph = agree(comm, "NeighborAllreduce", problem, params,
                      (sources, destinations, int.from_bytes(os.urandom(8), "little")))
        assert params is not None                    # agree() raised on every rank otherwise
        self._ident: int = graph[0][2]
        for r, (s_r, d_r, _) in enumerate(graph):   # every edge listed at both ends
            bad = ([(d, "sends to", "sources") for d in d_r if r not in graph[d][0]]
                   + [(s, "receives from", "destinations") for s in s_r if r not in graph[s][1]])
            if bad:
                (peer, verb, lists), = bad[:1]
                raise ArgumentError(f"NeighborAllreduce: the graph is inconsistent: rank {r} {verb} rank {peer}, "
                                    f"but rank {peer} does not list {r} among its {lists} (this is rank {rank})")
        self.count, self.dtype, self.op = params["count"], np.dtype(params["dtype"]), op
        self.backup, self.max_staleness, self.max_gap = params["backup"], params["max_staleness"], params["max_gap"]
        self.weights = weights
        self.rank, self.size = rank, size
        self.sources, self.destinations = tuple(sources), tuple(destinations)
        self.need = len(sources) - self.backup
        self._params = params
        self._graph = {r: (list(s_r), list(d_r)) for r, (s_r, d_r, _) in enumerate(graph)}
        # on_failure="shrink": engine rank -> rank of comm (the survivors), and the user's
        # iteration of the engine's iteration 0 (identity and 0 until a rank fails)
        self._alive: List[int] = list(range(size))
        self._base = 0
        self._shrink: Optional[_neighbor_shrink.HopShrinker] = None
        s = self.max_staleness or 0
        g = self.max_gap if self.max_gap is not None else (3 if self.backup else 1)
        self.depth = 1 + s + g                     # R: slots per in-neighbour, requests outstanding
        self.trace: Optional[list] = None          # set to [] to record (iteration, monotonic time, spare) entries
        self._closed, self._abandoned = True, False
        # threads inside wait()/test() (one entry each), and whether close() has begun:
        # each side writes its own before it reads the other's (module docstring: threads)
        self._waiting: list = []
        self._closing = False
        self._held = None                # the native object, held by _free for threads in _waiting
        self._inbox: Optional[np.ndarray] = None          # pinned: a device post's update
        self._outboxes: Dict[int, np.ndarray] = {}         # pinned: device results, by k mod depth
        self._comm: Optional[MPI.Comm] = None
        self._h = None
        self._iter = -1
        self._pending: Dict[int, NeighborRequest] = {}    # posted, not yet taken; their out buffers
        self._build(comm, params)
        self._closed = False
        if params["on_failure"] == "shrink":
            self._shrink = _neighbor_shrink.HopShrinker(self)
        self._thread = threading.get_ident()     # its maker: threading.excepthook reports on it
        _propagate.register(self)

    # -- validation --------------------------------------------------------------------
    @staticmethod
    def _neighbours(ranks, what: str, rank: int) -> List[int]:
        seen = [r for r in ranks if r != rank]      # the self-loop is always included, once
        if len(set(seen)) != len(seen):
            raise ArgumentError(f"NeighborAllreduce: the graph lists a neighbour twice in its {what} "
                                f"({list(ranks)}; this is rank {rank}); use each edge once")
        return sorted(seen)

    @staticmethod
    def _validate(count, dtype, op, backup, max_staleness, max_gap, weights, n_in) -> dict:
        count = integer(count, "count", 0)
        dt = np.dtype(dtype)
        dtype_code(dt)
        code = op_code(op)
        check_op_dtype(code, dt)
        backup = integer(backup, "backup", 0)
        if n_in and backup >= n_in:
            raise ArgumentError(f"backup must leave at least one in-neighbour to wait for: 0 <= backup < {n_in} "
                                f"(this rank has {n_in} in-neighbours), not {backup}")
        if not n_in and backup:
            raise ArgumentError(f"backup={backup}, but this rank has no in-neighbours")
        if max_staleness is not None:
            max_staleness = integer(max_staleness, "max_staleness", 0)
        if max_gap is not None:
            max_gap = integer(max_gap, "max_gap (tokens per edge)", 1)
        if weights not in _WEIGHTS:
            raise ArgumentError(f"weights must be 'mean', 'staleness' or None, not {weights!r}")
        if weights is not None and code != 0:
            raise ArgumentError(f"weights={weights!r} averages a SUM; with MPI.{OP_NAMES[code]} pass weights=None")
        if weights is not None and dt.kind not in "fc" and dt.name != "bfloat16":
            raise ArgumentError(f"weights={weights!r} needs a floating dtype, not {dt}; weights=None gives the "
                                "plain sum")
        return {"count": count, "dtype": dt.str, "op": code, "backup": backup, "max_staleness": max_staleness,
                "max_gap": max_gap, "weights": weights}

    # -- construction ------------------------------------------------------------------
    def _build(self, comm: MPI.Comm, params: dict) -> None:
        _engine.ensure_started()
        ffi, lib = _engine.ffi, _engine.lib
        n_in, n_out = len(self.sources), len(self.destinations)
        index = {r: i for i, r in enumerate(self._alive)}      # rank of comm -> the engine's
        self._c_sources = ffi.new("int[]", [index[r] for r in self.sources] or [0])
        self._c_dests = ffi.new("int[]", [index[r] for r in self.destinations] or [0])
        spec = ffi.new("pc_hopspec *")
        spec.n_in, spec.n_out, spec.sources, spec.destinations = n_in, n_out, self._c_sources, self._c_dests
        spec.backup = min(self.backup, max(n_in - 1, 0))      # fewer in-neighbours after a shrink
        spec.max_staleness, spec.max_gap = self.max_staleness or 0, self.max_gap or 0
        spec.depth, spec.weights = self.depth, getattr(lib, _WEIGHTS[self.weights])
        spec.dtype, spec.redop, spec.count = dtype_code(self.dtype), params["op"], self.count
        spec.ident = self._ident
        self._c_entry = ffi.new("int64_t[3]")      # post's entry (the owner thread's)
        self._comm = comm.Dup()                    # the collective's one communicator
        self._comm.Set_errhandler(MPI.ERRORS_RETURN)
        handle = _engine.comm_handle(self._comm)
        out = ffi.new("pc_hop **")
        code = lib.pc_hop_create(spec, handle, out)
        self._h = out[0] if out[0] != ffi.NULL else None
        self._peers = Peers(handle, comm.Get_rank(), lambda: ("", ()), peer_error_of(lib.pc_hop_peer_error, self._h))
        if code:
            self._abandon()
            check(code)

    # -- the public surface ----------------------------------------------------------
    @property
    def iteration(self) -> int:
        """The last iteration this rank entered (-1 before the first post)."""
        return self._iter

    def _state(self):
        ffi, lib = _engine.ffi, _engine.lib
        stats = ffi.new("int64_t[]", lib.PC_HOP_STATS)
        tokens = ffi.new("int64_t[]", max(len(self.destinations), 1))
        granted = ffi.new("int64_t[]", max(len(self.sources), 1))
        newest = ffi.new("int64_t[]", max(len(self.sources), 1))
        pos = ffi.new("int64_t[2]")
        check(lib.pc_hop_state(self._h, stats, tokens, granted, newest, pos))
        return stats, tokens, granted, newest

    @property
    def stats(self) -> Dict[str, object]:
        """Counters: updates received, used, dropped unused (late, or superseded with
        staleness), skip updates received; max_buffered (most updates held at once) and
        buffers (receive slots: ``R x |N_in|``); iterations skipped; iterations completed,
        and how many of them the engine completed before this rank asked (early); tokens
        received from each out-neighbour and granted to each in-neighbour (max_gap); who is
        slow, as this rank saw its in-neighbours (rounds, late, stale_iterations,
        stragglers, lateness_s, waited_for_s: docs/who-is-slow.md)."""
        self._check_open()
        stats, tokens, granted, _ = self._state()
        out: Dict[str, object] = {name: int(stats[i]) for i, name in enumerate(_STATS)}
        tk = self.max_gap is not None
        out["tokens_received"] = {d: int(tokens[i]) for i, d in enumerate(self.destinations)} if tk else {}
        out["tokens_granted"] = {s: int(granted[j]) for j, s in enumerate(self.sources)} if tk else {}
        out.update(_stats.hop_fields(self))         # who is slow, as this rank saw its in-neighbours
        return out

    @property
    def lag(self) -> int:
        """How many iterations the newest update received from an in-neighbour is ahead of
        this rank's last iteration (0 when none is): how far skip() could usefully jump."""
        self._check_open()
        newest = self._state()[3]
        ahead = max((int(newest[j]) + self._base for j in range(len(self.sources))), default=-1) - self._iter
        return max(ahead, 0)

    def post(self, x: Buffer, out: Optional[Buffer] = None) -> NeighborRequest:
        """Enter the next iteration with update x: send it to the out-neighbours; returns a request.

        out: optional array that receives the result (the engine writes it; read it after
        wait()). Up to ``depth`` requests may be outstanding. Blocks only where Hop does:
        for a token from every out-neighbour (max_gap), or for this rank's sends of
        iteration k - R to have been received (the memory bound)."""
        self._check_open()
        if self._shrink is not None:
            return self._shrink.post(self, x, out)
        x, res, device = self._host_buffers(x, out)
        req = NeighborRequest(self, self._iter + 1, res if res.ndim == 1 else res.reshape(-1), device)
        self._enter(x, req._out)
        self._pending[self._iter] = req
        return req

    def _enter(self, x: np.ndarray, out: np.ndarray) -> None:
        """The engine's post: enter the next iteration with update x, its result into out."""
        ffi, lib = _engine.ffi, _engine.lib
        xp, op_, e = ffi.cast("void *", x.ctypes.data), ffi.cast("void *", out.ctypes.data), self._c_entry
        self._wait(lambda seconds: lib.pc_hop_post(self._h, xp, op_, seconds, e), rc.timeout,
                   f"NeighborAllreduce.post() at rank {self.rank}")
        self._entered(e, 1)

    def _host_buffers(self, x: Buffer, out: Optional[Buffer]):
        """(x, out, device) in host memory for the engine: a device x is copied into a
        pinned box now (the post copies it into the engine's send slot); a device result
        (out on the device, or no out and x there) lands in a pinned box of its own
        (iteration k's: k mod depth, free since k - depth was taken) and reaches the
        device at wait(): device = (backend, the device out or None, a device array like it)."""
        who, n, dt = "NeighborAllreduce", self.count, self.dtype
        bx, bo = _device.backend_of(x), None if out is None else _device.backend_of(out)
        device = None
        if bx is not None:
            arr = _device.device_buffer(bx, x, dt, n, what="post buffer", who=who)
            if self._inbox is None:
                self._inbox = bx.pinned(n, dt)
            _device.copy_in(bx, arr, self._inbox)
            x, device = self._inbox, (bx, None, arr) if out is None else None
        else:
            x = as_buffer(x, dt, n, writable=False, what="post buffer", who=who)
        if bo is not None:
            dev_out = _device.device_buffer(bo, out, dt, n, what="out buffer", who=who)
            device, out = (bo, dev_out, dev_out), None
        if device is not None:
            slot = (self._iter + 1) % self.depth
            box = self._outboxes.get(slot)
            if box is None:
                box = self._outboxes[slot] = device[0].pinned(n, dt)
            return x, box, device
        return x, (np.empty(n, dt) if out is None else
                   as_buffer(out, dt, n, writable=True, what="out buffer", who=who)), None

    def skip(self, iterations: int) -> int:
        """Jump forward by up to `iterations` iterations without computing them (Hop §5);
        returns how many were skipped (fewer where tokens do not allow them now)."""
        self._check_open()
        if self._shrink is not None:
            raise StateError("skip() with on_failure='shrink': a skipped iteration has no update that a re-run "
                             "could post again; make this collective with on_failure='raise' to skip")
        j = integer(iterations, "iterations", 0)
        if self._pending:
            raise StateError(f"wait() for iteration {min(self._pending)} before skip() (rank {self.rank})")
        ffi = _engine.ffi
        done, entries = ffi.new("int64_t *"), ffi.new("int64_t[]", 3 * max(j, 1))
        timeout = -1.0 if rc.timeout is None else float(rc.timeout)
        code = _engine.lib.pc_hop_skip(self._h, j, timeout, done, entries)
        self._entered(entries, int(done[0]))
        self._check(code, f"NeighborAllreduce.skip() at rank {self.rank}")
        return int(done[0])

    def _wait(self, call, timeout: Optional[float], what: str) -> None:
        # on_failure="shrink": a peer the MPI reports as failed ends the wait (MPIError),
        # also where backup workers could go on without it, so that the survivors leave it out
        peers = self._peers if self._shrink is not None else None
        self._check(None, what, lambda: wait_in_slices(call, timeout, what=what, peers=peers))

    def _check(self, code: Optional[int], what: str, run=None) -> None:
        """check(code), or run(): a peer's report raises PeerError with its exception type;
        where it fails otherwise, a peer the MPI reports as failed is an MPIError naming it
        (only then: backup workers may carry on without a dead peer)."""
        try:
            run() if run is not None else check(cast(int, code))
        except PeerError:
            self._peers.raise_peer_error(what)
            raise
        except (Timeout, MPIError):
            self._peers.check_failed(what)
            raise

    def _entered(self, entries, n: int) -> None:
        for i in range(n):
            self._iter = int(entries[3 * i]) + self._base
            if self.trace is not None:      # (iteration, time, tokens to spare after this entry)
                spare = int(entries[3 * i + 2]) if self.max_gap is not None and self.destinations else None
                self.trace.append((self._iter, entries[3 * i + 1] * 1e-9, spare))

    def _take(self, req: NeighborRequest, timeout: Optional[float]) -> None:
        if self._shrink is not None:
            self._shrink.take(self, req, timeout)
        else:
            self._take_engine(req, timeout)

    def _take_engine(self, req: NeighborRequest, timeout: Optional[float]) -> None:
        if req._cancelled:
            raise StateError(f"iteration {req.iteration} was dropped by close() (rank {self.rank})")
        self._waiting.append(None)       # close() waits for no wait (module docstring: threads)
        try:
            h = self._h                  # held for this thread by _free, where it drops h now
            if self._closing or self._closed or h is None:
                raise StateError(f"this NeighborAllreduce is closed (close() began before this wait for iteration "
                                 f"{req.iteration}; rank {self.rank})")
            self._take_now(h, req, timeout)
        finally:
            self._waiting.pop()
            if self._held is not None:
                self._let_go()

    def _take_now(self, h, req: NeighborRequest, timeout: Optional[float]) -> None:
        ffi, lib, k = _engine.ffi, _engine.lib, req.iteration - self._base
        upd = ffi.new("int64_t[]", 3 * max(len(self.sources), 1))     # (rank, iteration, arrival ns) per update
        info = ffi.new("int64_t[4]")                                    # updates, completed ns, early, entered ns
        what = f"NeighborAllreduce iteration {k} at rank {self.rank}"
        if timeout == 0.0:                                     # a test: one look
            code = lib.pc_hop_wait(h, k, 0.0, upd, info)
            if code == TIMEOUT_CODE:
                return
            self._check(code, what)
        else:
            self._wait(lambda seconds: lib.pc_hop_wait(h, k, seconds, upd, info), timeout, what)
        self._taken(req, upd, info)

    def _taken(self, req: NeighborRequest, upd, info) -> None:
        """req's result from what the engine gave (updates in the engine's numbering:
        (rank, iteration, arrival ns) each; info: pc_hop_wait's)."""
        alive, base, k = self._alive, self._base, req.iteration
        updates = tuple((alive[int(upd[3 * u])], int(upd[3 * u + 1]) + base) for u in range(int(info[0])))
        active = tuple(sorted([self.rank] + [src for src, _ in updates]))
        data = req._out
        if req._device is not None:      # the result's way to the device
            backend, out, like = req._device
            data = _device.copy_out(backend, data, out, like)
        req._result = NeighborResult(data, k, updates, active, int(info[1]), bool(info[2]))
        _stats.note_hop(self, k, updates, [int(upd[3 * u + 2]) for u in range(len(updates))], int(info[3]),
                        int(info[1]))              # who is slow: this rank's in-neighbours
        del self._pending[k]

    def close(self, timeout: Optional[float] = None) -> None:
        """Collective over the graph: drain every channel (with fillers for receives posted
        beyond what was sent) and free the communicator. Pending requests are dropped."""
        self._check_open()
        timeout = as_timeout(rc.close_timeout if timeout is None else timeout, "close() timeout")
        self._closing = True             # no wait() starts from now on (module docstring) ...
        if self._waiting:                # ... and none may be under way
            self._closing = False
            raise StateError("close() while another thread waits for a request of this NeighborAllreduce: close it "
                             "once that wait is over (the thread that waits owns the request until then)")
        # The pending requests' out arrays stay referenced until the engine has stopped
        # completing iterations (pc_hop_close_begin, or the free of an abandon): until then
        # the progress thread may still write a result into one.
        pending, self._pending = self._pending, {}
        for req in pending.values():
            req._cancelled = True
        while True:
            try:
                self._close(timeout)
                break
            except _shrink.FAILURES as exc:
                if self._shrink is None:
                    self._close_failed(exc)
                    raise
                self._shrink.recover(self, exc, self._shrink.generation)     # and close() again, among the survivors
            except PartialcollError as exc:
                self._close_failed(exc)
                raise
        self._free()
        del pending

    def _close_failed(self, exc: PartialcollError) -> None:
        """close() cannot complete here: drop the collective (after a peer's error at once;
        a Timeout tells the peers)."""
        if isinstance(exc, Timeout):
            self._report("Timeout", _propagate.describe(exc), _propagate.REPORT_SECONDS)
        self._abandon()

    def _close(self, timeout: Optional[float]) -> None:
        deadline = time.monotonic() + timeout if timeout is not None else None
        assert self._comm is not None
        ffi, lib, P = _engine.ffi, _engine.lib, self._comm.Get_size()
        last = ffi.new("int64_t *")
        self._check(lib.pc_hop_close_begin(self._h, last), f"NeighborAllreduce.close() at rank {self.rank}")
        every_last = self._exchange(np.array([last[0]], np.int64), deadline)[:, 0].copy()
        posted = np.full(2 * P, -1, np.int64)                     # receives, then tokens, per rank
        check(lib.pc_hop_freeze(self._h, ffi.cast("int64_t *", every_last.ctypes.data),
                                ffi.cast("int64_t *", posted.ctypes.data)))
        every = np.ascontiguousarray(self._exchange(posted, deadline))
        left = -1.0 if deadline is None else max(deadline - time.monotonic(), 0.0)
        code = lib.pc_hop_drain(self._h, ffi.cast("int64_t *", every.ctypes.data), left)
        self._check(code, f"NeighborAllreduce.close() at rank {self.rank}")

    def _exchange(self, vec: np.ndarray, deadline: Optional[float]) -> np.ndarray:
        """Allgather vec over the graph's ranks (close()); the engine serves the neighbours
        meanwhile (inline progress: in pc_hop_serve)."""
        assert self._comm is not None
        out = np.empty((self._comm.Get_size(), vec.size), np.int64)
        what = f"NeighborAllreduce.close() at rank {self.rank}"
        try:
            req = self._comm.Iallgather(vec, out)
            pause = 0.0002
            while not req.Test():
                if deadline is not None and time.monotonic() > deadline:
                    self._peers.check_failed(what)
                    raise Timeout(f"NeighborAllreduce.close(): not every rank has called close() (rank {self.rank})")
                check(_engine.lib.pc_hop_serve(self._h, pause))
                pause = min(2 * pause, 0.01)
        except MPI.Exception as exc:     # a peer failed (ULFM: PROC_FAILED, REVOKED): an MPIError, as the engine's
            self._peers.check_failed(what)
            raise MPIError(f"{what}: the allgather of close() failed: {exc.Get_error_string()}") from exc
        return out

    # -- on_failure="shrink" (and failed, from _shrink.Shrinkable) ---------------------
    @property
    def recoveries(self) -> List[dict]:
        """on_failure="shrink": one entry per failure survived: "failed" (the ranks),
        "seconds" (this rank's time from the failed call to the rebuilt collective),
        "iteration" (where the survivors started again: the smallest iteration whose
        result some survivor lacked), "reposted" (this rank's updates posted again),
        "tries" (agreements), "cause" (the exception that started it), "held" (this
        rank's posts and the iterations whose result it had)."""
        return list(self._shrink.recoveries) if self._shrink is not None else []

    @property
    def alive(self) -> Tuple[int, ...]:
        """The ranks still in the collective (all of them while none has failed)."""
        return tuple(self._alive)

    def _rebuild(self, comm: MPI.Comm, alive: List[int], graph, base: int) -> None:
        """on_failure="shrink": the engine again, over comm (the survivors: alive, in comm's
        order), on graph (topology.bridged), its iteration 0 the user's iteration base.
        Ranks, sources and destinations keep the original communicator's numbering."""
        self._alive = list(alive)
        self.sources, self.destinations = tuple(graph[self.rank][0]), tuple(graph[self.rank][1])
        self.need = len(self.sources) - min(self.backup, max(len(self.sources) - 1, 0))
        self._base, self._iter = base, base - 1
        self._abandoned, self._h = False, None
        self._build(comm, self._params)
        self._closed = False
        _propagate.register(self)

    # -- lifetime ----------------------------------------------------------------------
    def _free(self) -> None:
        """After close() (drained: freed now), or dropped without it (this rank only: the
        engine withdraws what runs and frees it once drained; the communicator lives until
        then, or until finalize)."""
        closing, self._closed = not self._closed, True
        _propagate.forget(self)
        if getattr(_engine, "lib", None) is None:
            return
        deferred = _engine.ffi.new("int *")
        h, self._h = getattr(self, "_h", None), None
        if h is not None:
            # a thread inside wait() or test() keeps h (the engine wakes it with StateError)
            _propagate.hold_for_waiters(self, h, _engine.lib.pc_hop_hold)
            _engine.lib.pc_hop_free(h, deferred)
            if self._held is not None:
                self._let_go()
        comm, self._comm = getattr(self, "_comm", None), None
        if comm is None:
            return
        if closing and not self._abandoned and not deferred[0]:
            comm.Free()                      # drained: nothing more arrives on it
        else:                                # dropped: the neighbours' messages may still arrive
            _engine.keep_until_finalize(comm)    # (and a freed context id goes to a later comm)

    def _abandon(self) -> None:
        self._abandoned = True
        self._free()

    def _let_go(self) -> None:
        _propagate.let_go(self, _engine.lib.pc_hop_release)

    def _abort(self, exc_type: bytes, message: bytes, seconds: float) -> None:
        if getattr(_engine, "lib", None) is not None:       # not at interpreter shutdown
            check(_engine.lib.pc_hop_abort(self._h, exc_type, message, seconds))

    def _check_open(self) -> None:
        if self._closed:
            raise StateError("this NeighborAllreduce is closed")

    def __repr__(self) -> str:
        return (f"NeighborAllreduce(count={self.count}, dtype={self.dtype}, sources={self.sources}, "
                f"destinations={self.destinations}, backup={self.backup}, max_staleness={self.max_staleness}, "
                f"max_gap={self.max_gap}, weights={self.weights!r}, depth={self.depth})")
