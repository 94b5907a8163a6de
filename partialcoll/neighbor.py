"""Neighbour allreduce with Hop's mechanisms (Luo et al., ASPLOS 2019).

    g = pc.ring_based_graph(MPI.COMM_WORLD)
    coll = pc.NeighborAllreduce(n, np.float32, comm=g, backup=1, max_gap=4)
    res = coll.post(x).wait()      # res.data: mean of x and the in-neighbours' updates
    res.iteration, res.updates     # k, ((rank, iteration), ...) of the updates that went in
    coll.skip(coll.lag)            # a deterministically slow rank jumps forward (Hop §5)
    coll.close()

What it computes. The graph is the distributed-graph communicator's: a rank sends to its
out-neighbours (destinations) and combines from its in-neighbours (sources), itself always
included. A rank's k-th post is its update of iteration k. Iteration k's result combines
this rank's update with in-neighbour updates, chosen by the mode:

  standard             the update of iteration k of every in-neighbour
  backup=b             of at least n_in - b in-neighbours (Hop §4.3): a k-of-n wait;
                       whatever else has arrived by then goes in too
  max_staleness=s      each in-neighbour's newest update whose iteration is in
                       [k - s, k] (Hop §3.5, the local bound), waiting while one has none
                       (combined with backup: n_in - b of them)

An update of an iteration this rank has finished (or that is older than k - s) is late:
it is dropped, never delivered to a later iteration. Every message carries its iteration
in a 32-byte header and every receive slot knows which iteration it was posted for, so
the two are checked against each other on arrival. weights="mean" divides the SUM by the
number of updates used (BlueFog's default average); "staleness" weights an update of
iteration m used in iteration k by 1 / (1 + k - m) (itself: 1) and normalises; None
reduces with `op` and nothing else (the only choice for ops other than SUM).

Token queues (Hop §4.2), max_gap=g: entering an iteration (0 included) takes a token
from every out-neighbour, and grants one to every in-neighbour. Tokens are zero-byte
messages; every queue starts with g of them (implicitly: they are never sent). So rank i
enters k only once every out-neighbour j has entered k - g: the queue i <- j holds
g + Iter(j) - Iter(i) >= 0 tokens (the token invariant), and along a path
Iter(i) - Iter(j) <= g x len(path i -> j) (Theorem 2). In standard mode
Iter(i) - Iter(j) <= len(path j -> i) (Theorem 1); with staleness s, (s + 1) x that.

Skipping (Hop §5): after a result, skip(J) moves the rank J iterations forward without
computing them (fewer if tokens would not allow them now). Each skipped iteration m is
entered as usual: one token consumed from every out-neighbour, one granted to every
in-neighbour, and a "skip" update sent to the out-neighbours that carries the rank's last
posted data, so that nobody waits for an iteration that will never be computed.
`lag` says how far the newest update received from an in-neighbour is ahead.

How it runs on the engine (one algorithm, the nouns of the variables below). Each
directed edge is a set of *channels*: one-op persistent schedules, a send at one end and
the matching receive at the other, one per *slot*. Iteration m of edge j -> i travels on
slot m mod R, so slot r's e-th execution carries iteration e R + r at both ends (the
engine's per-execution versions keep executions apart). Slot r of every edge lives on
the r-th of R duplicates of the graph communicator, so that one (sender, receiver) pair
appears in one schedule per communicator and tags never collide; tokens have R duplicates
of their own. Python starts executions when a rank enters an iteration (its sends) and
when a receive slot is freed (the next receive); the engine moves every message, and
`pc_sched_wait_some` (native/waitsome.c) blocks until k of n channels completed: the
backup workers' k-of-n wait, one wake-up per iteration where nothing else is pending.

    post(x), iteration k:
      wait for a token from every out-neighbour         (max_gap: k < g + tokens[j])
      wait for slot k mod R's previous sends            (flow control, see memory)
      tx[k mod R] = header(k) + x; start its send to every out-neighbour
      grant a token to every in-neighbour                (max_gap)
    wait():
      until n_in - b in-neighbours are ready            (a ready update in [k - s, k]):
        block in pc_sched_wait_some(receives in flight, need)
        on each arrival: check its header; keep it, or drop it if late; repost its slot
      data = x (op) ... (op) updates, weighted

Rounds: one message per edge and iteration (plus one zero-byte token per edge with
max_gap); a rank's iteration waits for its in-neighbours only: O(1) rounds, no global
synchronisation at all.

Memory: R = 1 + s + g slots per in-neighbour (g = max_gap, or 1 without tokens; s =
max_staleness, or 0), each one message (the update plus a 32-byte header, padded to 64
bytes), and R send slots: (1 + g) x |N_in| buffered updates with tokens alone, Hop's
bound. A rank reuses send slot k mod R once its sends of iteration k - R have completed.
With tokens, the token bound keeps every sender within the receivers' slots. Without
them (backup workers alone: Hop's unbounded queue), how far a rank runs ahead of an
out-neighbour is not bounded by the protocol: messages above the MPI's eager limit wait
for a slot (so the sender stops about 2R iterations ahead), smaller ones complete into
the MPI's unexpected-message queue, which grows like Hop's. Use max_gap for a bound;
without it R is 1 + s + 3 with backup workers, 1 + s + 1 otherwise.

Worked example, P = 5, ring (rank 2's in- and out-neighbours: 1 and 3), backup=1,
max_gap=2, so R = 3 slots per in-neighbour. Rank 3 stalls inside iteration 0. Rank 2
finishes iteration 0 (all updates), enters 1 (the queue from rank 3 held 2 tokens, plus
the one rank 3 granted entering 0), finishes it with rank 1's update alone (need 2 - 1 =
1), enters 2 (the last token) and blocks entering 3: Iter(2) - Iter(3) = 2 = g. Rank 3
resumes, enters 1 and 2 (granting a token each) and sends its updates of iterations 1
and 2; they land in rank 2's slots 1 and 2, their headers say iterations 1 and 2, rank 2
has finished both: dropped, and the slots are reposted for iterations 4 and 5. Rank 2
then enters 3.

Closing: close() is collective over the graph. The ranks exchange how far they got
(last iteration, receives posted), send "filler" messages for every receive a neighbour
posted beyond what was sent, drain every channel, and free them: nothing stays posted.
"""
from __future__ import annotations

import time
from typing import Any, Dict, List, Optional, Tuple, cast

import numpy as np
from mpi4py import MPI

from . import _engine
from ._buffers import as_array
from ._agree import agree
from ._errors import (TIMEOUT_CODE, ArgumentError, InvalidBufferError, MPIError, PartialcollError, Peers, StateError,
                      Timeout, check)
from ._rc import rc
from ._typing import Buffer, DTypeLike, ReduceOp
from ._types import OP_NAMES, UFUNCS, check_comm, check_op_dtype, dtype_code, integer, op_code
from .schedule import Schedule, _create_native

_HDR = 32                       # header: int64 iteration, data iteration, flags, sender
_SKIP, _FILLER = 1, 2           # header flags
_EMPTY, _POSTED, _FULL = 0, 1, 2   # receive slot states
_WEIGHTS = ("mean", "staleness", None)
_SLICE = 0.25                   # seconds a blocking engine call lasts before Python looks again
_UFUNCS = {op: getattr(np, name) for op, name in UFUNCS.items()}

# channel kinds
_RX, _TX, _TRX, _TTX = 0, 1, 2, 3     # data receive, data send, token receive, token send


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
    """

    __slots__ = ("data", "iteration", "updates", "active", "nap")

    def __init__(self, data, iteration: int, updates: Tuple[Tuple[int, int], ...], active: Tuple[int, ...]) -> None:
        self.data, self.iteration, self.updates, self.active = data, iteration, updates, active
        self.nap = len(active)

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

    def __init__(self, coll: "NeighborAllreduce", iteration: int, out: Optional[np.ndarray]) -> None:
        self._coll = coll
        self.iteration = iteration
        self._out = out
        self._result: Optional[NeighborResult] = None
        self._cancelled = False

    def test(self) -> bool:
        """True once iteration k can complete here (the result is then ready)."""
        if self._result is None:
            self._coll._progress(self, block=False, timeout=0.0)
        return self._result is not None

    def wait(self, timeout: Optional[float] = None) -> NeighborResult:
        """Block until iteration k completed here; raises partialcoll.Timeout."""
        if self._result is None:
            self._coll._progress(self, block=True, timeout=rc.timeout if timeout is None else timeout)
        assert self._result is not None
        return self._result

    Wait = wait
    Test = test


class _Channels:
    """Every channel of one collective: natives, executions started and completed, and
    the flat arrays pc_sched_wait_some reads (one C call tests them all)."""

    def __init__(self) -> None:
        self.natives: list = []
        self.kind: List[int] = []
        self.peer: List[int] = []      # index into sources (RX, TTX) or destinations (TX, TRX)
        self.slot: List[int] = []
        self.started: List[int] = []
        self.completed: List[int] = []
        self.dry: List[Schedule] = []
        self.c_natives: Any = None        # cffi arrays, made by freeze()
        self.c_execs: Any = None
        self.c_done: Any = None

    def add(self, native, kind: int, peer: int, slot: int, dry: Schedule) -> int:
        self.natives.append(native)
        self.kind.append(kind)
        self.peer.append(peer)
        self.slot.append(slot)
        self.started.append(0)
        self.completed.append(0)
        self.dry.append(dry)
        return len(self.natives) - 1

    def freeze(self) -> None:
        ffi = _engine.ffi
        n = max(len(self.natives), 1)
        self.c_natives = ffi.new("pc_sched *[]", n)
        for i, nat in enumerate(self.natives):
            self.c_natives[i] = nat
        self.c_execs = ffi.new("int64_t[]", n)
        for i in range(n):
            self.c_execs[i] = -1          # execution -1 has "completed" before anything starts
        self.c_done = ffi.new("int[]", n)

    def idle(self, c: int) -> bool:
        return self.started[c] == self.completed[c]

    def start(self, c: int) -> None:
        out = _engine.ffi.new("int64_t *")
        check(_engine.lib.pc_sched_start(self.natives[c], out))
        assert out[0] == self.started[c], "channel executions out of step"
        self.c_execs[c] = self.started[c]
        self.started[c] += 1

    def poll(self) -> List[int]:
        """Channels whose running execution completed since the last poll."""
        n = len(self.natives)
        if n == 0:
            return []
        rc_ = _engine.lib.pc_sched_wait_some(n, self.c_natives, self.c_execs, 0, 0.0, self.c_done)
        check(rc_)
        done = self.c_done
        fresh = [c for c in range(n) if self.started[c] != self.completed[c] and done[c]]
        for c in fresh:
            self.completed[c] = self.started[c]
        return fresh

    def block(self, watch: List[int], need: int, seconds: float) -> None:
        """Sleep in the engine until `need` of the watched channels completed (or seconds)."""
        ffi, lib = _engine.ffi, _engine.lib
        n = len(watch)
        nat = ffi.new("pc_sched *[]", n)
        ex = ffi.new("int64_t[]", n)
        done = ffi.new("int[]", n)
        for i, c in enumerate(watch):
            nat[i] = self.natives[c]
            ex[i] = self.started[c] - 1
        code = lib.pc_sched_wait_some(n, nat, ex, min(need, n), seconds, done)
        if code != TIMEOUT_CODE:
            check(code)


class NeighborAllreduce:
    """A persistent neighbour allreduce over a distributed-graph communicator (collective)."""

    def __init__(self, count: int, dtype: DTypeLike = np.float32, op: ReduceOp = MPI.SUM,
                 comm: Optional[MPI.Comm] = None, *, backup: int = 0, max_staleness: Optional[int] = None,
                 max_gap: Optional[int] = None, weights: Optional[str] = "mean") -> None:
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
        except PartialcollError as exc:
            problem = exc
            sources, destinations = [], []
        graph = agree(comm, "NeighborAllreduce", problem, params, (sources, destinations))
        assert params is not None                    # agree() raised on every rank otherwise
        everyone = [(None, None, s_r, d_r) for s_r, d_r in graph]
        for r, (_, _, s_r, d_r) in enumerate(everyone):
            for d in d_r:
                if r not in everyone[d][2]:
                    raise ArgumentError(f"NeighborAllreduce: the graph is inconsistent: rank {r} sends to rank {d}, "
                                        f"but rank {d} does not list {r} among its sources (this is rank {rank})")
            for s in s_r:
                if r not in everyone[s][3]:
                    raise ArgumentError(f"NeighborAllreduce: the graph is inconsistent: rank {r} receives from "
                                        f"rank {s}, but rank {s} does not list {r} among its destinations "
                                        f"(this is rank {rank})")
        self.count, self.dtype, self.op = params["count"], np.dtype(params["dtype"]), op
        self.backup, self.max_staleness, self.max_gap = params["backup"], params["max_staleness"], params["max_gap"]
        self.weights = weights
        self.rank, self.size = rank, size
        self.sources, self.destinations = tuple(sources), tuple(destinations)
        self.need = len(sources) - self.backup
        s = self.max_staleness or 0
        g = self.max_gap if self.max_gap is not None else (3 if self.backup else 1)
        self.depth = 1 + s + g                     # R: slots per in-neighbour
        self._redop = params["op"]
        self._ufunc = _UFUNCS[self._redop]
        self._nbytes = self.count * self.dtype.itemsize
        self._msg = -(-(_HDR + self._nbytes) // 64) * 64
        self._closed = True
        self._comms: List[MPI.Comm] = []
        self._ch = _Channels()
        self.trace: Optional[list] = None          # set to [] to record (iteration, monotonic time) entries
        self._build(comm)
        self._closed = False

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
        if weights is not None and dt.kind not in "fc":
            raise ArgumentError(f"weights={weights!r} needs a floating dtype, not {dt}; weights=None gives the "
                                "plain sum")
        return {"count": count, "dtype": dt.str, "op": code, "backup": backup, "max_staleness": max_staleness,
                "max_gap": max_gap, "weights": weights}

    # -- construction ------------------------------------------------------------------
    def _build(self, comm: MPI.Comm) -> None:
        _engine.ensure_started()
        R, ch = self.depth, self._ch
        n_in, n_out = len(self.sources), len(self.destinations)
        tokens = self.max_gap is not None
        self._rx = np.zeros((n_in, R, self._msg), np.uint8)
        self._tx = np.zeros((R, self._msg), np.uint8)
        self._token = np.zeros(0, np.uint8)
        try:
            for _ in range(2 * R if tokens else R):
                dup = comm.Dup()
                dup.Set_errhandler(MPI.ERRORS_RETURN)
                self._comms.append(dup)
            self._rx_ch = [[0] * R for _ in range(n_in)]
            self._tx_ch = [[0] * R for _ in range(n_out)]
            self._trx_ch = [[0] * R for _ in range(n_out)]
            self._ttx_ch = [[0] * R for _ in range(n_in)]
            for r in range(R):
                data, tok = self._comms[r], (self._comms[R + r] if tokens else None)
                for j, src in enumerate(self.sources):
                    s = Schedule(rank=self.rank, size=self.size)
                    s.recv(self._rx[j, r], source=src, label=f"update of iteration = {r} mod {R}")
                    self._rx_ch[j][r] = ch.add(_create_native(s, data, None, 1), _RX, j, r, s)
                for i, dst in enumerate(self.destinations):
                    s = Schedule(rank=self.rank, size=self.size)
                    s.send(self._tx[r], dest=dst, label=f"update of iteration = {r} mod {R}")
                    self._tx_ch[i][r] = ch.add(_create_native(s, data, None, 1), _TX, i, r, s)
                if tok is not None:
                    for i, dst in enumerate(self.destinations):      # tokens come from out-neighbours
                        s = Schedule(rank=self.rank, size=self.size)
                        s.recv(self._token, source=dst, label=f"token = {r + 1} mod {R}")
                        self._trx_ch[i][r] = ch.add(_create_native(s, tok, None, 1), _TRX, i, r, s)
                    for j, src in enumerate(self.sources):           # ... and go to in-neighbours
                        s = Schedule(rank=self.rank, size=self.size)
                        s.send(self._token, dest=src, label=f"token = {r + 1} mod {R}")
                        self._ttx_ch[j][r] = ch.add(_create_native(s, tok, None, 1), _TTX, j, r, s)
            ch.freeze()
        except BaseException:
            self._abandon()
            raise
        # receive slots
        self._rx_iter = [[-1] * R for _ in range(n_in)]
        self._rx_state = [[_EMPTY] * R for _ in range(n_in)]
        self._rx_used = [[False] * R for _ in range(n_in)]
        self._next_post = [0] * n_in          # next iteration to post a receive for, per in-neighbour
        self._post_limit: Optional[List[int]] = None   # close(): post no receive beyond these
        self._newest = [-1] * n_in            # newest iteration received, per in-neighbour
        # sends and tokens
        self._sent = [0] * n_out              # messages sent to each out-neighbour
        self._tokens = [0] * n_out            # tokens received from each out-neighbour
        self._tk_next = [1] * n_out           # next token number to post a receive for
        self._tk_limit: Optional[List[int]] = None
        self._granted = [0] * n_in            # tokens sent to each in-neighbour
        self._owed = 0                        # tokens owed to every in-neighbour
        self._owed_close: Optional[List[int]] = None
        self._closing = False
        self._iter = -1                       # the last iteration entered
        self._done_iter = -1                  # the last iteration completed (or skipped)
        self._pending: Optional[NeighborRequest] = None
        self._stats: Dict[str, int] = {"received": 0, "used": 0, "dropped": 0, "skip_updates": 0,
                                       "max_buffered": 0, "buffers": n_in * R, "skipped": 0}
        for j in range(n_in):
            self._post_rx(j)
        for i in range(len(self.destinations) if tokens else 0):
            self._post_tokens(i)

    # -- the public surface ----------------------------------------------------------
    @property
    def iteration(self) -> int:
        """The last iteration this rank entered (-1 before the first post)."""
        return self._iter

    @property
    def stats(self) -> Dict[str, object]:
        """Counters: updates received, used, dropped unused (late, or superseded with
        staleness), skip updates received; max_buffered (most updates held at once) and
        buffers (receive slots: ``R x |N_in|``); iterations skipped; tokens received from each
        out-neighbour and granted to each in-neighbour (max_gap)."""
        out: Dict[str, object] = dict(self._stats)
        out["tokens_received"] = dict(zip(self.destinations, self._tokens)) if self.max_gap is not None else {}
        out["tokens_granted"] = dict(zip(self.sources, self._granted)) if self.max_gap is not None else {}
        return out

    @property
    def lag(self) -> int:
        """How many iterations the newest update received from an in-neighbour is ahead of
        this rank's last iteration (0 when none is): how far skip() could usefully jump."""
        self._check_open()
        self._pump()
        ahead = max(self._newest, default=-1) - self._iter
        return max(ahead, 0)

    def post(self, x: Buffer, out: Optional[Buffer] = None) -> NeighborRequest:
        """Enter the next iteration with update x: send it to the out-neighbours; returns a request.

        out: optional array that receives the result. Blocks only where Hop does: for a
        token from every out-neighbour (max_gap), or for this rank's sends of iteration
        k - R to have been received (the memory bound)."""
        self._check_open()
        if self._pending is not None:
            raise StateError(f"iteration {self._pending.iteration} is still pending at rank {self.rank}: "
                             "wait() for it before the next post()")
        x = self._check_input(x, "post buffer", writable=False)
        if out is not None:
            out = self._check_input(out, "out buffer", writable=True)
        k = self._iter + 1
        deadline = time.monotonic() + rc.timeout if rc.timeout is not None else None
        self._enter(k, deadline)
        r = k % self.depth
        hdr = self._tx[r, :_HDR].view(np.int64)
        hdr[:] = (k, k, 0, self.rank)
        self._tx[r, _HDR:_HDR + self._nbytes].view(self.dtype)[:] = x
        self._send_slot(r)
        req = NeighborRequest(self, k, out)
        self._pending = req
        self._grant(k)
        self._pump()
        return req

    def skip(self, iterations: int) -> int:
        """Jump forward by up to `iterations` iterations without computing them (Hop §5);
        returns how many were skipped (fewer where tokens do not allow them now)."""
        self._check_open()
        j = integer(iterations, "iterations", 0)
        if self._pending is not None:
            raise StateError(f"wait() for iteration {self._pending.iteration} before skip() (rank {self.rank})")
        if self._iter < 0:
            raise StateError("skip() needs a first post(): there is no update to stand for skipped iterations")
        self._pump()
        if self.max_gap is not None and self.destinations:
            j = min(j, self.max_gap + min(self._tokens) - 1 - self._iter)
        j = max(j, 0)
        data_iter = self._iter
        deadline = time.monotonic() + rc.timeout if rc.timeout is not None else None
        for _ in range(j):
            k = self._iter + 1
            prev, r = (k - 1) % self.depth, k % self.depth
            self._enter(k, deadline)
            self._done_iter = k
            if r != prev:
                self._tx[r, _HDR:] = self._tx[prev, _HDR:]
            self._tx[r, :_HDR].view(np.int64)[:] = (k, data_iter, _SKIP, self.rank)
            self._send_slot(r)
            self._grant(k)
        self._stats["skipped"] += j
        self._recycle_all()
        return j

    def close(self, timeout: Optional[float] = None) -> None:
        """Collective over the graph: drain every channel (with fillers for receives posted
        beyond what was sent) and free the communicators. A pending request is dropped."""
        self._check_open()
        timeout = rc.timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout if timeout is not None else None
        if self._pending is not None:
            self._pending._cancelled = True
            self._pending = None
        self._closing = True                  # nothing arriving from now on is used
        tokens, P = self.max_gap is not None, self.size
        # 1. announce the last iteration, serving the neighbours until every rank has
        last = self._exchange(np.array([self._iter], np.int64), deadline)[:, 0]
        # 2. freeze: post no receive beyond what a neighbour sent or what is posted now
        posted = np.full(2 * P, -1, np.int64)
        self._post_limit = []
        for j, src in enumerate(self.sources):
            posted[src] = self._next_post[j] - 1
            self._post_limit.append(max(int(last[src]), int(posted[src])))
        if tokens:
            self._tk_limit = []
            for i, dst in enumerate(self.destinations):
                posted[P + dst] = self._tk_next[i] - 1
                self._tk_limit.append(max(int(last[dst]) + 1, int(posted[P + dst])))
        # 3. tell the senders; each sends fillers up to what its receivers posted
        every = self._exchange(posted, deadline)
        send_to = [max(self._iter, int(every[dst, self.rank])) for dst in self.destinations]
        grant_to = ([max(self._iter + 1, int(every[src, P + self.rank])) for src in self.sources] if tokens
                    else [0] * len(self.sources))
        self._owed_close = grant_to
        self._recycle_all()
        while True:
            self._pump()
            for j in range(len(self.sources)):
                self._post_rx(j)
            # fillers, in iteration order; slot r's buffer is rewritten only once all its sends are done
            while True:
                behind = [self._sent[i] for i in range(len(self.destinations)) if self._sent[i] <= send_to[i]]
                if not behind:
                    break
                m = min(behind)
                r = m % self.depth
                if not all(self._ch.idle(self._tx_ch[i][r]) for i in range(len(self.destinations))):
                    break
                self._tx[r, :_HDR].view(np.int64)[:] = (m, -1, _FILLER, self.rank)
                for i in range(len(self.destinations)):
                    if self._sent[i] == m and send_to[i] >= m:
                        self._ch.start(self._tx_ch[i][r])
                        self._sent[i] += 1
            self._flush_tokens()
            if self._close_done(send_to, grant_to):
                break
            self._block(None, deadline, "close(): channels did not drain", everything=True)
        self._free()

    def _exchange(self, vec: np.ndarray, deadline: Optional[float]) -> np.ndarray:
        """Allgather vec over the graph's ranks while serving the neighbours (close())."""
        out = np.empty((self.size, vec.size), np.int64)
        req = self._comms[0].Iallgather(vec, out)
        pause = 0.0002
        while not req.Test():
            self._pump()
            for j in range(len(self.sources)):
                self._post_rx(j)
            self._flush_tokens()
            if deadline is not None and time.monotonic() > deadline:
                self._raise_if_failed("close()")
                raise Timeout(f"NeighborAllreduce.close(): not every rank has called close() (rank {self.rank})")
            if any(not self._ch.idle(c) for c in range(len(self._ch.natives))):
                self._block(None, None, "close()", everything=True, seconds=pause)
            else:
                time.sleep(pause)
            pause = min(2 * pause, 0.01)
        return out

    # -- iteration entry, sends, tokens -------------------------------------------------
    def _enter(self, k: int, deadline: Optional[float]) -> None:
        """Wait for the tokens and the send slot of iteration k, then record the entry."""
        r = k % self.depth
        while True:
            self._pump()
            short = self._short_tokens(k)
            busy = [self._tx_ch[i][r] for i in range(len(self.destinations)) if not self._ch.idle(self._tx_ch[i][r])]
            if short is None and not busy:
                break
            watch = busy + ([c for c in self._trx_ch[short] if not self._ch.idle(c)] if short is not None else [])
            watch += self._others_watch()
            what = (f"no token from rank {self.destinations[short]} for iteration {k} (this is rank {self.rank}, "
                    f"max_gap={self.max_gap})" if short is not None else
                    f"the sends of iteration {k - self.depth} from rank {self.rank} were not received")
            self._block(watch, deadline, what)
        self._iter = k
        self._recycle_all()
        if self.trace is not None:      # (iteration, time, tokens left after this entry: g + tokens[j] - (k + 1))
            spare = (min(self.max_gap + t for t in self._tokens) - 1 - k
                     if self.max_gap is not None and self._tokens else None)
            self.trace.append((k, time.monotonic(), spare))

    def _short_tokens(self, k: int) -> Optional[int]:
        """An out-neighbour whose token iteration k still lacks (index), or None."""
        if self.max_gap is None:
            return None
        for i, t in enumerate(self._tokens):
            if k > self.max_gap + t - 1:
                return i
        return None

    def _send_slot(self, r: int) -> None:
        for i in range(len(self.destinations)):
            self._ch.start(self._tx_ch[i][r])
            self._sent[i] += 1

    def _grant(self, k: int) -> None:
        if self.max_gap is not None:
            self._owed = k + 1                # one token per iteration entered, 0 included
            self._flush_tokens()

    def _flush_tokens(self) -> None:
        if self.max_gap is None:
            return
        owed = self._owed_close
        R = self.depth
        for j in range(len(self.sources)):
            target = owed[j] if owed is not None else self._owed
            while self._granted[j] < target:
                c = self._ttx_ch[j][self._granted[j] % R]
                if not self._ch.idle(c):
                    break
                self._ch.start(c)
                self._granted[j] += 1

    def _post_tokens(self, i: int) -> None:
        R = self.depth
        while True:
            t = self._tk_next[i]
            if self._tk_limit is not None and t > self._tk_limit[i]:
                return
            c = self._trx_ch[i][(t - 1) % R]
            if not self._ch.idle(c):
                return
            self._ch.start(c)
            self._tk_next[i] += 1

    # -- receives ------------------------------------------------------------------------
    def _kcur(self) -> int:
        """The lowest iteration this rank may still compute."""
        return self._done_iter + 1

    def _post_rx(self, j: int) -> None:
        R = self.depth
        while True:
            m = self._next_post[j]
            if self._post_limit is not None and m > self._post_limit[j]:
                return
            r = m % R
            if self._rx_state[j][r] != _EMPTY:
                return
            self._rx_iter[j][r] = m
            self._rx_state[j][r] = _POSTED
            self._rx_used[j][r] = False
            self._ch.start(self._rx_ch[j][r])
            self._next_post[j] += 1

    def _arrived(self, j: int, r: int) -> None:
        m = self._rx_iter[j][r]
        hdr = self._rx[j, r, :_HDR].view(np.int64)
        it, _, flags, sender = (int(v) for v in hdr)
        if it != m or sender != self.sources[j]:
            raise PartialcollError(f"NeighborAllreduce: the receive for iteration {m} from rank {self.sources[j]} "
                                   f"got iteration {it} from rank {sender} (this is rank {self.rank}): "
                                   "channels out of step")
        self._rx_state[j][r] = _FULL
        if flags & _FILLER:
            self._drop(j, r)
            return
        self._stats["received"] += 1
        if flags & _SKIP:
            self._stats["skip_updates"] += 1
        self._newest[j] = max(self._newest[j], m)

    def _drop(self, j: int, r: int) -> None:
        if self._rx_state[j][r] == _FULL and not self._rx_used[j][r] and not self._closing:
            hdr = self._rx[j, r, :_HDR].view(np.int64)
            if not (hdr[2] & _FILLER):
                self._stats["dropped"] += 1
        self._rx_state[j][r] = _EMPTY

    def _recycle(self, j: int) -> None:
        """Drop what this rank can no longer use from in-neighbour j; repost the slots."""
        closing = self._closing
        kcur, s = self._kcur(), self.max_staleness or 0
        best, best_r = -1, -1
        for r in range(self.depth):
            if self._rx_state[j][r] != _FULL:
                continue
            m = self._rx_iter[j][r]
            if closing or m < kcur - s:
                self._drop(j, r)
            elif m <= kcur:
                if m > best:
                    if best_r >= 0:
                        self._drop(j, best_r)
                    best, best_r = m, r
                else:
                    self._drop(j, r)
        self._post_rx(j)

    def _recycle_all(self) -> None:
        for j in range(len(self.sources)):
            self._recycle(j)
        held = sum(st == _FULL for row in self._rx_state for st in row)
        if held > self._stats["max_buffered"]:
            self._stats["max_buffered"] = held

    def _pump(self) -> None:
        """Handle every channel completion; recycle, repost, flush tokens."""
        fresh = self._ch.poll()
        if not fresh:
            return
        ch = self._ch
        for c in fresh:
            kind = ch.kind[c]
            if kind == _RX:
                self._arrived(ch.peer[c], ch.slot[c])
            elif kind == _TRX:
                self._tokens[ch.peer[c]] += 1
        self._recycle_all()
        for i in range(len(self._tk_next) if self.max_gap is not None else 0):
            self._post_tokens(i)
        self._flush_tokens()

    # -- completion ----------------------------------------------------------------------
    def _ready(self, k: int) -> List[Tuple[int, int]]:
        """(in-neighbour index, slot) of the update each ready in-neighbour gives iteration k."""
        s = self.max_staleness or 0
        got = []
        for j in range(len(self.sources)):
            best, best_r = -1, -1
            for r in range(self.depth):
                if self._rx_state[j][r] == _FULL:
                    m = self._rx_iter[j][r]
                    if k - s <= m <= k and m > best:
                        best, best_r = m, r
            if best_r >= 0:
                got.append((j, best_r))
        return got

    def _progress(self, req: NeighborRequest, *, block: bool, timeout: Optional[float]) -> None:
        if req._cancelled:
            raise StateError(f"iteration {req.iteration} was dropped by close() (rank {self.rank})")
        self._check_open()
        k = req.iteration
        deadline = time.monotonic() + timeout if timeout is not None else None
        while True:
            self._pump()
            ready = self._ready(k)
            if len(ready) >= self.need:
                self._complete(req, ready)
                return
            if not block:
                return
            self._wait_watch(k, ready, deadline)

    def _wait_watch(self, k: int, ready, deadline: Optional[float]) -> None:
        """Block until an arrival can make iteration k ready, or one that another rank needs
        handled (a late update, which frees its sender's slot; a token owed)."""
        s = self.max_staleness or 0
        have = {j for j, _ in ready}
        current = []
        for j in range(len(self.sources)):
            if j in have:
                continue
            for r in range(self.depth):
                c = self._rx_ch[j][r]
                if self._rx_state[j][r] == _POSTED and not self._ch.idle(c) and k - s <= self._rx_iter[j][r] <= k:
                    current.append(c)
        other = self._others_watch()
        # the k-of-n wait: need the missing in-neighbours' updates of iteration k, all at once
        need = self.need - len(ready) if (s == 0 and not other) else 1
        what = (f"iteration {k} at rank {self.rank} has {len(ready)} of the {self.need} in-neighbour updates "
                f"it needs; missing: {sorted(set(self.sources) - {self.sources[j] for j in have})}")
        self._block(current + other, deadline, what, need=need)

    def _others_watch(self) -> List[int]:
        """Channels whose completion another rank may be waiting for us to handle: receives
        of late updates (handling one reposts its slot, which lets its sender's next send
        through) and token sends while tokens are owed."""
        s, kcur = self.max_staleness or 0, self._kcur()
        late = [self._rx_ch[j][r] for j in range(len(self.sources)) for r in range(self.depth)
                if self._rx_state[j][r] == _POSTED and self._rx_iter[j][r] < kcur - s
                and not self._ch.idle(self._rx_ch[j][r])]
        if self.max_gap is not None:
            target = self._owed_close if self._owed_close is not None else [self._owed] * len(self.sources)
            for j in range(len(self.sources)):
                if self._granted[j] < target[j]:
                    late += [c for c in self._ttx_ch[j] if not self._ch.idle(c)]
        return late

    def _block(self, watch: Optional[List[int]], deadline: Optional[float], what: str, need: int = 1,
               everything: bool = False, seconds: float = _SLICE) -> None:
        if everything or not watch:
            watch = [c for c in range(len(self._ch.natives)) if not self._ch.idle(c)]
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            self._raise_if_failed(what)
            raise Timeout(f"NeighborAllreduce: {what}")
        if not watch:
            raise StateError(f"NeighborAllreduce: nothing in flight can help: {what}")
        try:
            self._ch.block(watch, max(need, 1), seconds if left is None else min(seconds, left))
        except MPIError:
            self._raise_if_failed(what)     # ULFM fails a receive from a dead rank at once
            raise

    def _raise_if_failed(self, what: str) -> None:
        """At a deadline: a peer the MPI reports as failed is an MPIError naming it (backup
        workers may have carried on without it until now, so only a wait that ran out asks)."""
        if self._comms:
            Peers(_engine.comm_handle(self._comms[0]), self.rank, lambda: ("", ())).check_failed(
                f"NeighborAllreduce: {what}")

    def _complete(self, req: NeighborRequest, ready) -> None:
        k = req.iteration
        own = self._tx[k % self.depth, _HDR:_HDR + self._nbytes].view(self.dtype)
        out = req._out if req._out is not None else np.empty(self.count, self.dtype)
        ready = sorted(ready, key=lambda jr: self.sources[jr[0]])
        views = [self._rx[j, r, _HDR:_HDR + self._nbytes].view(self.dtype) for j, r in ready]
        its = [self._rx_iter[j][r] for j, r in ready]
        if self.weights == "staleness":
            w = [1.0] + [1.0 / (1 + k - m) for m in its]
            np.multiply(own, w[0], out=out)
            for v, wi in zip(views, w[1:]):
                out += wi * v
            out /= sum(w)
        else:
            np.copyto(out, own)
            for v in views:
                self._ufunc(out, v, out=out)
            if self.weights == "mean" and views:
                out /= 1 + len(views)
        for j, r in ready:
            self._rx_used[j][r] = True
        self._stats["used"] += len(ready)
        updates = tuple((self.sources[j], m) for (j, _), m in zip(ready, its))
        active = tuple(sorted([self.rank] + [src for src, _ in updates]))
        req._result = NeighborResult(out, k, updates, active)
        self._pending = None
        self._done_iter = k
        self._recycle_all()

    # -- lifetime ----------------------------------------------------------------------
    def _close_done(self, send_to, grant_to) -> bool:
        ch, post_limit, tk_limit = self._ch, self._post_limit, self._tk_limit
        assert post_limit is not None and (tk_limit is not None or self.max_gap is None)   # set by close()
        if any(ch.started[c] != ch.completed[c] for c in range(len(ch.natives))):
            return False
        if any(self._next_post[j] <= post_limit[j] for j in range(len(self.sources))):
            return False
        if any(self._sent[i] <= send_to[i] for i in range(len(self.destinations))):
            return False
        if tk_limit is not None:
            if any(self._tk_next[i] <= tk_limit[i] for i in range(len(self.destinations))):
                return False
            if any(self._granted[j] < grant_to[j] for j in range(len(self.sources))):
                return False
        return True

    def _free(self) -> None:
        self._closed = True
        for nat in self._ch.natives:
            check(_engine.lib.pc_sched_free(nat))
        self._ch.natives = []
        for c in self._comms:
            c.Free()
        self._comms = []

    def _check_open(self) -> None:
        if self._closed:
            raise StateError("this NeighborAllreduce is closed")

    def _check_input(self, x, what: str, writable: bool) -> np.ndarray:
        if not (type(x) is np.ndarray and x.dtype == self.dtype and x.size == self.count
                and x.flags.c_contiguous and (x.flags.writeable or not writable)):
            x = as_array(x, writable=writable, what=what)
            if x.dtype != self.dtype:
                raise InvalidBufferError(f"{what} has dtype {x.dtype}, but this NeighborAllreduce was created "
                                         f"for {self.dtype}")
            if x.size != self.count:
                raise InvalidBufferError(f"{what} has {x.size} elements, but this NeighborAllreduce was created "
                                         f"for {self.count}")
        return x.reshape(-1)

    def _abandon(self) -> None:
        """Dropped without close(): this rank only. Channels still running are withdrawn
        and freed by the engine once drained; their buffers live until finalize."""
        self._closed = True
        if getattr(_engine, "lib", None) is None:
            return
        deferred_any = False
        deferred = _engine.ffi.new("int *")
        for nat in self._ch.natives:
            _engine.lib.pc_sched_abandon(nat, deferred)
            deferred_any = deferred_any or bool(deferred[0])
        self._ch.natives = []
        if deferred_any:
            _engine.keep_until_finalize(getattr(self, "_rx", None), getattr(self, "_tx", None),
                                        getattr(self, "_token", None), *self._comms)
        else:                            # freed on the next application call (never from __del__)
            for c in self._comms:
                _engine.free_later(c)
        self._comms = []

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            self._abandon()

    def __enter__(self) -> "NeighborAllreduce":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if self._closed:
            return
        if exc_type is None:
            self.close()
        else:
            self._abandon()

    def dump(self) -> str:
        """Every channel's schedule, one per line group."""
        return "\n".join(s.dump() for s in self._ch.dry)

    def __repr__(self) -> str:
        return (f"NeighborAllreduce(count={self.count}, dtype={self.dtype}, sources={self.sources}, "
                f"destinations={self.destinations}, backup={self.backup}, max_staleness={self.max_staleness}, "
                f"max_gap={self.max_gap}, weights={self.weights!r}, depth={self.depth})")
