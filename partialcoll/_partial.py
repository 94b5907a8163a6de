"""Persistent partial allreduce (eager-SGD's solo/majority, RNA's probe(2), quorum, full).

Python builds two round schedules once, pure functions of (rank, size, count, op,
mode): the mode's activation in front of the data allreduce (kind 0), and a full
round (kind 1, for max_staleness and closing). The tree builds R variants of each
(its aggregators rotated, algorithms/tree.py: rotations); the others one. The native
engine then runs round after round on its own: it arms round n on variant n mod R of
the schedule of its kind with version n, fires the trigger when a local post makes
this rank eligible, and publishes results. Python is never on the per-message path.

Every round (full ones too) reduces, next to the data, two bitmasks with BOR in the same
schedule: the ranks whose post #n was read by round n (active) and the ranks closing.
"""
from __future__ import annotations

import math
import os
import sys
import threading
import time
from collections import deque
from typing import Any, Callable, Deque, Dict, List, Optional, Sequence, Tuple

import numpy as np
from mpi4py import MPI

from . import _device, _engine, _propagate, _shrink, _stats
from . import balance as balance_mod
from ._buffers import SLOT_MASK, SLOT_WORK, BufRef, as_buffer
from ._agree import agree, as_problem
from ._errors import ArgumentError, InvalidBufferError, OpError, OutOfMemory, PartialcollError, StateError, Timeout, as_timeout
from ._status import _SLICE, TIMEOUT_CODE, Peers, check, check_round, peer_error_of, wait_in_slices
from ._rc import rc
from ._typing import Buffer, DTypeLike, ReduceOp
from ._types import (OP_NAMES, as_dtype, check_comm, check_divisor, check_op_dtype, dtype_code, dtype_name, identity,
                     integer, op_code)
from .activation import BUILDERS, flood
from .activation.candidates import candidates
from .algorithms import ALGORITHMS, auto_may_choose_tree, choose, explain, model, ps, tree
from .algorithms.recursive_doubling import allreduce_packed
from .schedule import Schedule, ScheduleOp, _create_native, pair_messages

MODES = ("solo", "majority", "probe", "quorum", "full")
_MODE_CODES = {m: getattr(_engine.lib, "PC_MODE_" + m.upper()) for m in MODES}
_LATE = ("latest", "fold")
_LATE_CODES = {"latest": _engine.lib.PC_LATE_LATEST, "fold": _engine.lib.PC_LATE_FOLD}
# how posts between two reads of the accumulator fold (native/pc_engine.h, PC_ACC_*)
_ACCUMULATE = {"sum": _engine.lib.PC_ACC_SUM, "mean": _engine.lib.PC_ACC_MEAN, "rna": _engine.lib.PC_ACC_RNA}
_BOR = op_code(MPI.BOR)
_PACK_BYTES = 8192          # rounds up to this size pack data and bitmasks into one message per step


def _check_workers(params: dict) -> None:
    """workers=: only with activation modes in which a round needs no post from a rank
    that never posts (solo; quorum with k <= the workers; no max_staleness's full rounds)."""
    mode, workers = params["mode"], params["workers"]
    if mode not in ("solo", "quorum"):
        raise ArgumentError(f"workers= is for modes 'solo' and 'quorum': a round of mode {mode!r} waits for "
                            f"posts of ranks that may be dedicated servers, which never post")
    if mode == "quorum" and params["quorum"] > len(workers):
        raise ArgumentError(f"quorum {params['quorum']} is more than the {len(workers)} workers= can post")
    if params["max_staleness"] is not None:
        raise ArgumentError("workers= with max_staleness: its full rounds wait for the dedicated servers' posts")


def _wait_take(c, index, out, mask, info, seconds):
    """One slice of a wait (see wait_in_slices): wait for round `index`, then take the result."""
    return _engine.lib.pc_coll_wait_take(c, index, seconds, out, mask, info)


def _wait1(c, index, out, res, seconds):
    """The same, on the small-message path (pc_coll_wait1: everything in res)."""
    return _engine.lib.pc_coll_wait1(c, index, seconds, out, res)


_ndarray = np.ndarray
_post1 = _engine.lib.pc_coll_post1
_post_take = _engine.lib.pc_coll_post_take
_copyto = np.copyto
_pc_wait1_same = _engine.lib.pc_coll_wait1_same
_new_bare = object.__new__           # a Result or PartialRequest without __init__ (hot paths)
_refs = sys.getrefcount
# post()'s recycling: the references to the last early request (self._early, post()'s local,
# getrefcount's argument) and to its Result (the request's _result, a local, the argument)
# when nobody else holds them
_ONLY_OURS = 3
_NULL = _engine.ffi.NULL
_NO_FB = (object(), None, None, _NULL, None, None)    # PartialAllreduce._fb: no host post to repeat
_rc_values = rc._values          # rc.timeout without RC.__getattr__ on the hot path
_CLOSE_WHILE_WAITED = ("close() while another thread waits for a request of this PartialAllreduce: close it once "
                       "that wait is over (the thread that waits owns the requests until then)")


def _silent_of(c):
    """For a slow wait's Timeout: the armed round and the peers not heard from in it."""
    def silent():
        ffi = _engine.ffi
        ranks, rnd, n = ffi.new("int[]", 64), ffi.new("int64_t *"), ffi.new("int *")
        check(_engine.lib.pc_coll_silent(c, ranks, 64, rnd, n))
        return f"round {rnd[0]}", tuple(ranks[0:n[0]])
    return silent


class Result:
    """What a round gives back (the same data, round, counts and active set on every rank).

    Attributes:
        data: the reduction, divided by the collective's divisor (a device array where
            the post's buffers were on the device)
        round: round number n (the last one, if several are folded)
        active: ranks whose data is inside data: their post #round, or leftovers of
            earlier posts that no round had read (eager-SGD's s_t; with several
            folded rounds, the ranks active in any of them)
        nap: len(active) for one round; summed over the rounds data covers (RNA's
            number of active processes)
        posts: how many posts' data is inside data: data / posts is the exact mean of
            what was contributed (op SUM, divisor 1); a rank whose accumulator held
            two posts adds two
        contributed: whether this post's data is inside data
        rounds: how many rounds data covers (1; 0 or more with late="fold" and at close)
        closing: ranks that had begun close() when the round read their input
    """

    __slots__ = ("data", "round", "active", "nap", "posts", "contributed", "rounds", "closing")

    def __init__(self, data: Buffer, round: int, active: Tuple[int, ...], contributed: bool, rounds: int,
                 closing: Tuple[int, ...] = (), nap: Optional[int] = None, posts: Optional[int] = None) -> None:
        self.data, self.round, self.active = data, round, active
        self.contributed, self.rounds, self.closing = contributed, rounds, closing
        self.nap = len(active) if nap is None else nap
        self.posts = self.nap if posts is None else posts

    def __repr__(self) -> str:
        return (f"Result(round={self.round}, rounds={self.rounds}, active={self.active}, nap={self.nap}, "
                f"posts={self.posts}, contributed={self.contributed}, closing={self.closing}, data={self.data!r})")


class PartialRequest:
    """The request of one post: ``wait(timeout=None)`` -> Result, ``test()`` -> bool.

    The request owns its result: any number of threads may wait on it or test it, in any
    order; the first to wait takes the result from the engine (once), and every wait
    returns that same Result, with the same data in out. Where the round completed within
    the post (post+wait in one engine call: PartialAllreduce.post), the post took it, and
    wait() only returns it."""

    __slots__ = ("_coll", "index", "late", "_out", "_on_device", "_result", "_fout", "_token")

    def __init__(self, coll: "PartialAllreduce", index: int, late: bool, out: Optional[Buffer],
                 on_device: bool = False, fout=None) -> None:
        self._coll = coll
        self.index = index
        self.late = late
        self._out = out
        self._on_device = on_device
        self._result: Optional[Result] = None
        self._fout = fout                # out as a cffi buffer, made once by post()
        # the right to take the result: the wait that pops it (atomic). A result the post took
        # (early): the mark that no wait has returned it yet, and then, on top, a copy of it
        # if a later post may write out before that (wait)
        self._token: list = [True]

    def test(self) -> bool:
        """True once the round of this post has completed here (the result is then ready)."""
        if self._result is not None:
            return True
        if self._coll._shrink is not None:
            return self._coll._shrink.test(self)
        return self._test()

    def _test(self) -> bool:
        done = _engine.ffi.new("int *")
        coll = self._coll
        coll._waiting.append(None)        # the ownership rule: see PartialAllreduce
        try:
            coll._check_not_closing()
            check_round(_engine.lib.pc_coll_test(coll._native_coll(), self.index, done), coll._peers,
                        f"round {self.index}")
        finally:
            coll._waiting.pop()
            if coll._held is not None:
                coll._let_go()
        return bool(done[0])

    def wait(self, timeout: Optional[float] = None) -> Result:
        """Block until this post's round completed here; raises partialcoll.Timeout."""
        result = self._result
        if result is not None:
            token = self._token
            if token:                     # taken by the post, returned now
                try:
                    kept = token.pop()
                except IndexError:        # another wait returned it just now, or close() took it back
                    return result if self._result is not None else self._wait(timeout)
                if kept is not True:      # a later post kept it: out may hold another result
                    self._coll._returned_late(self._out, kept)
            return result
        if self._coll._shrink is not None:
            return self._coll._shrink.wait(self, timeout)
        return self._wait(timeout)

    def _wait(self, timeout: Optional[float]) -> Result:
        result = self._result
        if result is None:
            if timeout is not None and (type(timeout) is not float or timeout != timeout):
                timeout = as_timeout(timeout, "wait()'s timeout")
            token = self._token
            try:
                token.pop()
            except IndexError:            # another thread takes it: wait for its result
                result = self._follow(timeout)
                if result is not None:
                    return result
            coll = self._coll
            waiting = coll._waiting
            waiting.append(None)          # the ownership rule: see PartialAllreduce
            try:
                if coll._closing:
                    coll._check_not_closing()
                if self._on_device:
                    result = coll._take(self._out, self.index, _rc_values["timeout"] if timeout is None else timeout,
                                        True)
                else:
                    result = coll._take_host(self._out, self._fout, self.index, timeout)
                self._result = result     # the token stays taken: a follower finds the result
            except BaseException:
                token.append(True)        # no result: another waiter may take it now
                raise
            finally:
                waiting.pop()
                if coll._held is not None:
                    coll._let_go()
        return result

    def _follow(self, timeout: Optional[float]) -> Optional[Result]:
        """Another thread is taking this request's result: wait for it (None: that thread
        left without it, a Timeout or an error, and this one took the token now)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        token = self._token
        while True:
            result = self._result
            if result is not None:
                return result
            try:
                token.pop()
                return None
            except IndexError:
                pass
            if deadline is not None and time.monotonic() >= deadline:
                raise Timeout(f"round {self.index} did not complete at rank {self._coll.rank} within {timeout} s "
                              f"(another thread of this rank is waiting for it too)")
            time.sleep(5e-5)

    Wait = wait
    Test = test


class PartialAllreduce(_propagate.Reporting):
    """A persistent partial allreduce over comm (created collectively).

    Args:
        count: elements per rank in every round.
        dtype: element type: any NumPy number type, float16, bfloat16 (ml_dtypes or the
            name "bfloat16"), complex.
        op: the reduction, an MPI.Op (MPI.SUM ... MPI.BXOR) or its name.
        comm: an intracommunicator; the collective runs on its own duplicate.
        mode: who may start a round: "solo" (any rank's post), "majority" (the round's
            one designated rank, chosen from seed), "probe" (the first of q designated
            ranks), "quorum" (the k-th post) or "full" (every rank's post).
        candidates: probe's q (default 2).
        quorum: quorum's k (required there).
        seed: chooses the designated ranks of majority and probe (the same on every rank).
        max_staleness: s makes every s-th round full, so no rank falls more than s rounds
            behind.
        late: what a late post's wait returns: "latest" (the latest completed round) or
            "fold" (every round completed since this rank's last result, folded).
        algorithm: "auto", "recursive_doubling", "rabenseifner" (reduce-scatter by halving,
            allgather by doubling), "ring", "tree" or "ps" (PSLD's block owners: each block
            of the vector is reduced by its owner, which receives it from every rank and
            sends the result back). "auto": the least predicted time in the alpha-beta model
            (algorithms/model.py) with rank 0's parameters, so every rank runs the same;
            ``algorithm`` then names the choice and ``algorithm_reason`` says why.
        groups: the tree's regions (one list per level, or one list): default the
            shared-memory nodes.
        divisor: every round's result is its reduction divided by this (op SUM of a real
            floating dtype; eager-SGD's average is divisor=P), in the pass that makes the
            sum, so an average costs no pass of its own.
        accumulate: what a rank contributes when several of its posts fold into its
            accumulator before a round reads it (a late rank's k posts): "sum" (their
            sum), "mean" (sum / k) or "rna" (RNA's linear weights: the j-th of the k
            posts weighs j, newer weigh more: sum_j j x_j / (k (k + 1) / 2)). "mean" and
            "rna" need MPI.SUM of a real floating dtype and host buffers. Result.posts
            still counts the posts whose data is inside; with "mean" or "rna" each active
            rank contributes one average, so data / nap (not data / posts) is the mean
            over contributors.
        block_bytes: "ps": the size of a block (default 4 MiB; the last block is shorter;
            blocks under 256 KiB cost more than their bytes: docs/psld.md).
        servers: "ps": the ranks that may own blocks (default all; a server need not post).
        workers: "ps": the ranks that post (default all). Any other rank is a dedicated
            server (PSLD's layout): its blocks are not sent, it moves only the workers'
            blocks it owns, its post() raises, and its close() result holds nothing of
            use. Modes "solo" and "quorum" (quorum <= the workers), no max_staleness:
            the others need posts from ranks that never post.
        balance: "ps": "static" (round-robin owners, the default), "proportional" (blocks in
            proportion to each owner's measured speed) or "psld" (PSLD's prediction-guided
            exploitation and exploration); every rank computes the same new assignment
            from the owners' measured times, and all switch to it at the same round.
        epsilon: "psld": the probability of exploring (moving a block to another server).
        rebalance_every: "proportional", "psld": rounds per decision.
        on_failure: what happens when a peer fails: "raise" (every survivor's calls raise
            PeerError or MPIError) or "shrink" (the survivors agree on the failed ranks,
            complete or re-run the round in flight, and go on without them; one
            outstanding request per rank, host buffers; docs/faults.md). Default
            partialcoll.rc.on_failure ("raise"). Where the MPI cannot shrink at all,
            "shrink" raises ArgumentError on every rank (partialcoll.info()["shrink"]).

    Construction is collective over comm, and makes these MPI calls on every rank: one
    allgather (the ranks agree on the arguments), comm.Dup() (the collective's own
    communicator) and an allreduce on it (the tag layout); with algorithm "tree", or
    "auto" where it may pick the tree, a Split_type(COMM_TYPE_SHARED), an allreduce and
    an allgather (the regions); and once per process, with the idle policy "auto",
    Split_type(COMM_TYPE_SHARED) and over the node an allgather, a bcast and a barrier
    (the node's CPUs and a shared memory segment for its interference words). It changes
    no process-wide setting: the idle policy is partialcoll.rc.idle's.

    Threads: the collective belongs to the thread that posts to it and closes it; its
    requests may be waited for (or tested) on other threads, as a framework's completion
    thread does. close() never runs under such a wait: while another thread is inside
    wait() or test() of one of its requests, close() raises StateError (it would free
    what that wait reads), and a wait that starts once close() has begun raises
    StateError. Close after the other thread's waits are over (join it, or close on it).
    """

    def __init__(self, count: int, dtype: DTypeLike = np.float32, op: ReduceOp = MPI.SUM,
                 comm: MPI.Comm = MPI.COMM_WORLD, *,
                 mode: str = "solo", candidates: Optional[int] = None, quorum: Optional[int] = None, seed: int = 0,
                 max_staleness: Optional[int] = None, late: str = "latest",
                 algorithm: str = "auto", groups=None, divisor: float = 1.0, accumulate: str = "sum",
                 block_bytes: Optional[int] = None, servers: Optional[Sequence[int]] = None,
                 balance: Optional[str] = None, epsilon: float = 0.1, rebalance_every: int = 4,
                 workers: Optional[Sequence[int]] = None, on_failure: Optional[str] = None) -> None:
        check_comm(comm, "PartialAllreduce")
        size, rank = comm.Get_size(), comm.Get_rank()
        # Validate locally, then agree across ranks: every rank raises the same error.
        problem = None
        try:
            params = self._validate(count, dtype, op, mode, candidates, quorum, seed, max_staleness,
                                    late, algorithm, size, groups, divisor, accumulate)
            params.update(balance_mod.validate(algorithm, size, block_bytes, servers, balance, epsilon,
                                               rebalance_every, workers))
            if params.get("workers") is not None:
                _check_workers(params)
            params["on_failure"] = on_failure = rc.on_failure if on_failure is None else on_failure
            _shrink.check_support(on_failure)
            if on_failure == "shrink" and algorithm == "ps":
                raise ArgumentError("on_failure='shrink' with algorithm 'ps': its block owners and workers are "
                                    "ranks that a failure would remove; use another algorithm")
        except Exception as exc:         # noqa: BLE001 - reported on every rank below
            problem, params = as_problem(exc, "PartialAllreduce"), None
        # with "auto", each rank's model parameters (its machine's calibration): all choose with rank 0's
        extra = agree(comm, "PartialAllreduce", problem, params,
                      (_engine.node_needed(), int.from_bytes(os.urandom(8), "little"),
                       tuple(model.load()) if algorithm == "auto" else None),
                      "the same count, dtype, op, mode and options")
        # rank 0's random number: the collective's identity in its peer-error reports
        self._ident: int = extra[0][1]
        if any(e[0] for e in extra):     # the idle policy auto learns this node (once)
            _engine.join_node(comm)
        assert params is not None
        self.count, self.dtype, self.mode = params["count"], as_dtype(dtype), mode
        self.op, self.late, self.seed = op, late, params["seed"]
        self.candidates, self.quorum, self.max_staleness = params["candidates"], params["quorum"], params["max_staleness"]
        self.divisor = params["divisor"]
        self.accumulate = accumulate
        # algorithm "ps": blocks, their owners, and how they are balanced (balance.py)
        self.block_bytes: Optional[int] = params.get("block_bytes")
        self.servers: list = params.get("servers") or []
        self.workers: Optional[list] = params.get("workers")     # "ps": None: every rank posts
        self._serves_only = self.workers is not None and rank not in self.workers
        self.balance: str = params.get("balance") or "static"
        self._owners: list = []          # "ps": the first assignment (else empty)
        self._every = 0                  # rounds per epoch of the balancer (0: none)
        self._epsilon = 0.0
        self._balancer: Optional[balance_mod.Balancer] = None
        if self.block_bytes is not None:
            nblocks = ps.block_count(self.count, self.dtype.itemsize, self.block_bytes)
            self._owners = ps.round_robin(nblocks, self.servers)
            if self.balance != "static" and size > 1 and nblocks > 1 and len(self.servers) > 1:
                self._every = params["rebalance_every"]
            self._epsilon = params["epsilon"]
        nbytes = self.count * self.dtype.itemsize
        # the regions: those given, or one per shared-memory node (collective, agreed), found
        # where the tree is named or "auto" may pick it (every rank decides alike)
        groups = params["groups"]
        costs = model.Params(*extra[0][2]) if algorithm == "auto" else model.DEFAULTS
        if groups is None and (algorithm == "tree" or auto_may_choose_tree(algorithm, nbytes, size, costs)):
            groups = tree.host_groups(comm)
        # the same choice on every rank: agreed arguments, agreed regions, rank 0's parameters
        self.algorithm, self.algorithm_reason = explain(algorithm, nbytes, size, groups, costs, self.dtype.itemsize)
        self.groups = groups if self.algorithm == "tree" else params["groups"]
        self._traffic: Optional[np.ndarray] = None     # kept at close()
        self.size, self.rank = size, rank
        self._closed = True              # until _build has made the native collective
        # threads inside wait()/test() of a request (one entry each), and whether close()
        # has begun: each side writes its own before it reads the other's (class docstring).
        # A deque, as are _spare and _res_pool: a list that empties frees its storage and the
        # next append allocates it again, twice per post+wait
        self._waiting: Deque[None] = deque()
        self._closing = False
        # the native collective, held for the threads in _waiting by _abandon() when it
        # dropped it under them; the last of them lets go of it (_let_go)
        self._held = None
        self._mask_cache: dict = {}
        self._staging: Optional[_device.Staging] = None   # created by the first device buffer
        self._last_on_device = False
        self._outs: Dict[int, Buffer] = {}   # post index -> its out= buffer, while the engine may use it
        # the last host post's x, its cffi view, out (or None), its view (or NULL), the native
        # collective, the result words of an early take (_pres); out is kept alive by this
        # while the engine may use it; _fb_index: the last post's index
        self._fb: tuple = _NO_FB
        self._fb_index = -1
        # the last post's request, where that post took its result (early) and the request's
        # wait may not have returned it yet: the next post settles it (_settle_early)
        self._early: Optional[PartialRequest] = None
        self._unreturned: List[PartialRequest] = []     # earlier such requests, settled unreturned
        # the last post's request where it did not take its result (post() recycles it),
        # and Results nobody holds any more, for the next ones made (post(), _result_of)
        self._prev: Optional[PartialRequest] = None
        self._spare: Deque[Result] = deque()
        self._shape: tuple = ()          # the last early take's active, nap, rounds, closing, posts
        self._shrink: Optional[_shrink.Shrinker] = None     # on_failure="shrink": _shrink.py
        # on_failure="shrink": called with the collective after a shrink, before its rounds are
        # built for the survivors (the torch integrations set divisor to the survivors' count)
        self.on_rebuild: Optional[Callable[["PartialAllreduce"], None]] = None
        self._build(comm)
        self._closed = False
        if on_failure == "shrink":
            self._shrink = _shrink.Shrinker(self)
        self._thread = threading.get_ident()     # its maker: threading.excepthook reports on it
        _propagate.register(self)

    @staticmethod
    def _validate(count, dtype, op, mode, q, k, seed, max_staleness, late, algorithm, size, groups=None,
                  divisor=1.0, accumulate="sum") -> dict:
        count = integer(count, "count", 0)
        dt = as_dtype(dtype)
        dtype_code(dt)
        if count * dt.itemsize >= 2 ** 62:          # the engine's sizes are 64-bit
            raise OutOfMemory(f"count {count} of {dt} is {count * dt.itemsize} bytes: no machine holds that")
        code = op_code(op)
        check_op_dtype(code, dt)
        divisor = check_divisor(divisor, code, dt)
        if mode not in MODES:
            raise ArgumentError(f"mode must be one of {', '.join(MODES)}, not {mode!r}")
        if late not in _LATE:
            raise ArgumentError(f"late must be 'latest' or 'fold', not {late!r}")
        if accumulate not in _ACCUMULATE:
            raise ArgumentError(f"accumulate must be 'sum', 'mean' or 'rna', not {accumulate!r}")
        if accumulate != "sum" and not (code == op_code(MPI.SUM) and _engine.lib.pc_div_valid(code, dtype_code(dt))):
            raise OpError(f"accumulate={accumulate!r} averages posts: it needs MPI.SUM of a real floating dtype, "
                          f"not MPI.{OP_NAMES[code]} on {dt}")
        if q is not None and mode != "probe":
            raise ArgumentError(f"candidates= is for mode='probe'; mode {mode!r} has no use for it")
        if k is not None and mode != "quorum":
            raise ArgumentError(f"quorum= is for mode='quorum'; mode {mode!r} has no use for it")
        if mode == "probe":
            q = min(integer(2 if q is None else q, "candidates (probe's q)", 1), size)  # q >= p: solo
        if mode == "quorum":
            if k is None:
                raise ArgumentError(f"quorum mode needs quorum=k with 1 <= k <= {size}")
            k = integer(k, "quorum", 1, size)
        if max_staleness is not None:
            max_staleness = integer(max_staleness, "max_staleness", 1)
        seed = integer(seed, "seed")
        choose(algorithm, count * dt.itemsize, size)
        if groups is not None:
            if algorithm not in ("tree", "auto"):
                raise ArgumentError(f"groups= is for algorithm='tree'; {algorithm!r} has no use for it")
            groups = tree.normalize_groups(groups, size)
        return {"count": count, "dtype": dtype_name(dt), "op": code, "mode": mode, "candidates": q, "quorum": k,
                "seed": seed, "max_staleness": max_staleness, "late": late, "algorithm": algorithm,
                "groups": groups, "divisor": divisor, "accumulate": accumulate}

    # -- construction ---------------------------------------------------------------
    def _round_schedule(self, activation: str, rotation: int = 0, owners: Optional[list] = None) -> Schedule:
        """Pure builder of one round: trigger -> activation -> take -> allreduce(s) -> deliver.
        rotation: the tree's rotated variant (round n runs on variant n mod self._variants).
        owners: algorithm "ps": the owner of each block (default: the first assignment);
        the schedule's _timers are then its blocks' timers (ps.allreduce).
        A small round's flood leaves out the empty messages that its data's first messages
        carry (activation/flood.py: at P = 2 a round is one exchange)."""
        s = Schedule(rank=self.rank, size=self.size)
        trigger = s._trigger()
        packed = self.algorithm == "recursive_doubling" and self.count * self.dtype.itemsize <= _PACK_BYTES

        def data(s: Schedule, after: ScheduleOp) -> List[ScheduleOp]:
            return self._data_phase(s, after, packed, rotation, owners)
        carry = flood.carried(self.rank, self.size, data) if activation == "solo" and packed else None
        if activation == "quorum":
            go = BUILDERS["quorum"](s, trigger, k=self.quorum)
        elif carry is not None:
            go = flood.activation(s, trigger, carry)
        else:
            go = BUILDERS[activation](s, trigger)
        take = s._take(after=go)
        done = data(s, take)
        if carry is not None:
            flood.hear(s, go, carry)
        s._deliver(after=done)
        return s

    def _data_phase(self, s: Schedule, take: ScheduleOp, packed: bool, rotation: int,
                    owners: Optional[list]) -> List[ScheduleOp]:
        """The round's allreduces after take (a pure builder of s.rank): the data with the op
        and the bookkeeping mask with BOR; their last ops."""
        work = BufRef.slot_ref(SLOT_WORK, self.count, self.dtype)
        mask = BufRef.slot_ref(SLOT_MASK, self._slot_mask_len, np.uint64)
        if packed:    # small: data and bitmasks travel in the same messages (half the messages)
            return [allreduce_packed(s, [(work, op_code(self.op), self.divisor), (mask, _BOR, 1.0)], after=take)]
        extra = {"groups": self.groups, "seed": self.seed, "rotation": rotation} if self.algorithm == "tree" else {}
        if self.algorithm == "ps":
            extra = {"block_bytes": self.block_bytes, "assignment": owners or self._owners,
                     "workers": self.workers, "timers": s._timers}
        return [ALGORITHMS[self.algorithm](s, work, op_code(self.op), after=take, divisor=self.divisor, **extra),
                ALGORITHMS["recursive_doubling"](s, mask, _BOR, after=take)]   # active, closing bits

    def _build(self, comm: MPI.Comm) -> None:
        ffi, lib = _engine.ffi, _engine.lib
        _engine.ensure_started()
        self._mask_words = max(1, math.ceil(self.size / 64))     # W: words of active (closing) bits
        self._mask_len = lib.pc_coll_mask_words(self.size)       # the MASK slot: 2 W, then posts per rank
        timed = self.algorithm == "ps"                            # then a row of owner times per rank,
        self._slot_mask_len = self._mask_len + (lib.pc_coll_timed_words(self.size) if timed else 0)   # decisions
        self._res_len = 7 + self._mask_len                       # pc_coll_wait1's res
        self._res_type = ffi.typeof(f"int64_t[{self._res_len}]")
        self._res_used = 7 + 2 * self._mask_words                # ... of which a result reads these
        self._res_pool: deque = deque()
        self._pres = self._new_res()                             # the post's early take (one poster)
        ident = identity(op_code(self.op), self.dtype)
        self._identity = ident
        # the tree: R variants of each round schedule, so that the aggregators rotate with the round
        self._variants = tree.rotations(self.count, self.dtype.itemsize, tree.normalize_groups(self.groups, self.size)) \
            if self.algorithm == "tree" else 1
        spec = ffi.new("pc_collspec *", {
            "mode": _MODE_CODES[self.mode], "late": _LATE_CODES[self.late],
            "candidates": self.candidates or 0, "quorum": self.quorum or 0,
            "max_staleness": self.max_staleness or 0,
            "mask_words": self._slot_mask_len, "variants": self._variants, "seed": self.seed & 0xFFFFFFFFFFFFFFFF,
            "timed": int(timed), "rebalance_every": self._every,
            "dtype": dtype_code(self.dtype), "redop": op_code(self.op), "count": self.count,
            "identity": ffi.cast("void *", ident.ctypes.data), "accumulate": _ACCUMULATE[self.accumulate],
            "never_posts": int(self._serves_only), "ident": self._ident})
        dup = comm.Dup()
        dup.Set_errhandler(MPI.ERRORS_RETURN)
        self._comm: Optional[MPI.Comm] = dup
        out = ffi.new("pc_coll **")
        self._coll = None
        try:
            check(lib.pc_coll_create(spec, _engine.comm_handle(dup), out))
            self._coll = out[0]
            # the dry builds, for dump(): kind -> [variant 0, 1, ...]; the collective owns the natives
            self._schedules: Dict[int, list] = {}
            kinds = {1: "full"} if self.mode == "full" else {0: self._activation_kind(), 1: "full"}
            for kind, activation in kinds.items():
                self._schedules[kind] = [self._round_schedule(activation, v) for v in range(self._variants)]
            every = [sched for scheds in self._schedules.values() for sched in scheds]
            if self._every:      # a later assignment may give every block to one server: room in the tags
                every += [self._round_schedule(a, 0, [self.servers[0]] * len(self._owners)) for a in kinds.values()]
            pairs = dup.allreduce(pair_messages(*every), op=MPI.MAX)      # one tag layout for all ranks
            self._pairs, self._kinds = pairs, kinds
            for kind, scheds in self._schedules.items():
                for v, sched in enumerate(scheds):
                    check(lib.pc_coll_set_sched(self._coll, kind, v, self._native_of(sched)))
            _stats.switch_on(self, comm)             # who is slow (partialcoll/_stats.py): on before
            check(lib.pc_coll_begin(self._coll))     # round 0 is armed, which may end here at once
            if self._every:
                self._balancer = balance_mod.Balancer(self, self._coll, self.balance, self.servers, self._owners,
                                                      self.seed, self._epsilon, self._every)
            self._peers = Peers(_engine.comm_handle(dup), self.rank, _silent_of(self._coll),
                                peer_error_of(_engine.lib.pc_coll_peer_error, self._coll))
        except BaseException:
            self._abandon()
            raise

    def _native_of(self, sched: Schedule):
        """The engine's schedule of a round schedule of this collective (its timers set)."""
        assert self._comm is not None
        native = _create_native(sched, self._comm, self._coll, self._pairs)
        timers = sched._timers
        if timers:
            check(_engine.lib.pc_sched_set_timers(native, len(timers), [x for t in timers for x in t]))
        return native

    def _native_rounds(self, owners: list):
        """[balancer thread] The engine's round schedules (kind 0, kind 1; NULL where the
        mode has no such kind) for the assignment owners."""
        built: dict = {}
        try:
            for kind, a in self._kinds.items():
                built[kind] = self._native_of(self._round_schedule(a, 0, owners))
        except BaseException:
            for native in built.values():      # never handed to the engine: freed here
                _engine.lib.pc_sched_discard(native)
            raise
        return built.get(0, _engine.ffi.NULL), built[1]

    def assignment(self, round: Optional[int] = None) -> np.ndarray:
        """Algorithm "ps": the owner of each block (int array) that round `round` ran with
        (a round not run yet: the assignment the rounds run with now); default: the latest
        decision (rounds switch to it a few rounds later)."""
        if self.block_bytes is None:
            raise ArgumentError(f"assignment() is for algorithm 'ps'; this allreduce runs {self.algorithm!r}")
        b = self._balancer
        if b is None:
            return np.array(self._owners, np.int64)
        if b.error is not None:
            raise b.error
        return np.array(b.current if round is None else b.assignment_of(round), np.int64)

    def owner_times(self) -> np.ndarray:
        """Algorithm "ps": each rank's measured service time per block as an owner, in
        seconds (float64, NaN where it served none), agreed by every rank: the latest
        epoch's with balance=, else the mean over every round so far."""
        if self.block_bytes is None:
            raise ArgumentError(f"owner_times() is for algorithm 'ps'; this allreduce runs {self.algorithm!r}")
        return self._owners_measured().per_block

    def _owners_measured(self, epoch: int = -1) -> "balance_mod.OwnerTimes":
        """The engine's sums of the owners' times and the ranks' arrivals, as every rank
        has them: epoch's (waiting for it up to 10 s), or the latest epoch's with
        balance=, else every round's so far."""
        ffi = _engine.ffi
        sums, got = ffi.new("int64_t[]", _engine.lib.PC_TIME_FIELDS * self.size), ffi.new("int *")
        check(_engine.lib.pc_coll_stats(self._native_coll(), epoch, 10.0 if epoch >= 0 else 0.0, sums, got))
        return balance_mod.OwnerTimes(list(sums), self._every if epoch >= 0 else 1)

    def _balancer_failed(self, exc: BaseException) -> None:
        """[balancer thread] A decision could not be made: no round after it can run.
        Report it, sent from this thread (with progress inline no pass may come to send
        it); this rank's calls then raise StateError carrying the message, the peers'
        PeerError."""
        self._report(type(exc).__name__, f"the balancer thread failed: {_propagate.describe(exc)}",
                     _propagate.REPORT_SECONDS)

    def _stop_balancer(self) -> None:
        b = getattr(self, "_balancer", None)
        if b is not None:
            b.stop()

    def _activation_kind(self) -> str:
        return "quorum" if self.mode == "quorum" else "solo"

    def _native_coll(self):
        if self._closed:
            raise StateError("this PartialAllreduce is closed")
        return self._coll

    def _check_not_closing(self) -> None:
        if self._closing or self._closed:
            raise StateError("this PartialAllreduce is closed (close() began while this request "
                             "was not waited for)")

    # -- use -------------------------------------------------------------------------
    def _check_input(self, x, what: str, writable: bool, backend=None):
        """x as a buffer of this allreduce's dtype and count: a NumPy array, or a device
        array of `backend`."""
        if backend is None:
            return as_buffer(x, self.dtype, self.count, writable=writable, what=what, who="allreduce")
        return _device.device_buffer(backend, x, self.dtype, self.count, what=what, who="allreduce")

    def post(self, x: Buffer, out: Optional[Buffer] = None) -> PartialRequest:
        """Fold x into this rank's accumulator (and start round n if eligible); returns a request.

        out: optional array that receives the result (the full mode then runs the round in it).
        x and out may be NumPy or device (CuPy) arrays; the result lives where out lives,
        or where x lives when out is None. out is lent to the request until its wait
        returns: the engine writes it only for this request, and never after. Several
        outstanding posts may name one out: each wait writes its own request's result
        into it (the engine runs a round in a caller's buffer only for a post made while
        no other request of this collective is outstanding, as in a post+wait loop).
        """
        if self._shrink is not None:
            return self._shrink.post(self, x, out)
        waiting = self._waiting
        waiting.append(None)             # inside the engine: see _abandon
        try:
            fb = self._fb
            if fb[0] is x and fb[2] is out:
                # the host arrays of the last post, checked then (an array's memory cannot move
                # while a cffi view of it exists): the small-message path, bench/small.py.
                # One engine call: the post, and the take where the round completes in it
                early = self._early
                r = _post_take(fb[4], fb[1], fb[3], fb[5],
                               0 if early is None else 1 if not early._token else self._settle_early(early))
                if r < 0:
                    self._check_post(-r)
            else:
                self._prev = None                # its out or x is not this post's
                if self._early is not None and self._settle_early(self._early):
                    check(_engine.lib.pc_coll_returned(self._native_coll()))
                return self._post(x, out)
        finally:
            waiting.pop()
            if self._held is not None:
                self._let_go()
        index = r >> 3
        self._fb_index = index
        late = (r & 1) == 1
        req = self._prev if early is None else early
        if req is not None and not req._token and _refs(req) == _ONLY_OURS + (req is early):
            # the last post's request is done (its wait returned) and nobody but this
            # collective holds it: nobody can see it change, so it serves this post (a
            # post+wait loop that keeps no request; same x, out and collective). So does its
            # Result where nobody holds it: for this post's early take if shaped alike, else
            # for the next Result made (_spare). A request or Result anyone holds is never
            # touched.
            res = req._result
            if res is not None and _refs(res) == _ONLY_OURS:
                if r & 4 and req is early:
                    req.index, req.late, res.round = index, late, index
                    req._token.append(True)
                    return req
                self._spare.append(res)
            req.index, req.late, req._result = index, late, None
            req._token.append(True)
        else:
            # PartialRequest(self, index, late, out, False, fb[3]) without the __init__ call
            req = _new_bare(PartialRequest)
            req._coll, req.index, req.late, req._out = self, index, late, out
            req._on_device, req._fout, req._token, req._result = False, fb[3], [True], None
        if r & 4:                         # the post took the result, shaped as the last one
            res = self._fresh_result()
            res.data, res.round, res.contributed = out, index, True
            res.active, res.nap, res.rounds, res.closing, res.posts = self._shape
            req._result = res
            self._early, self._prev = req, None
        elif r & 2:                       # the post took the result: wait() returns it
            req._result = res = self._result_of(self._pres[1], out, index)
            self._shape = (res.active, res.nap, res.rounds, res.closing, res.posts)
            self._early, self._prev = req, None
        else:
            self._early, self._prev = None, req
        return req

    def _fresh_result(self) -> Result:
        """A Result to fill: one nobody holds any more (post() kept it), or a new one."""
        spare = self._spare
        if spare:
            try:
                return spare.pop()       # atomic: another thread may have taken the last
            except IndexError:
                pass
        return _new_bare(Result)

    def _settle_early(self, early: "PartialRequest") -> int:
        """Before the next post: 1 if the last post's early-taken request has been returned
        (its wait returned: the engine counts it taken now). Else 0: the engine counts it
        outstanding (no post is alone: none writes a user buffer) until its wait returns,
        which puts this copy of its result back into out (a later request's wait may
        write out meanwhile) and tells the engine (_returned_late); close() takes it back."""
        self._early = None
        token = early._token
        try:
            token[0] = np.array(early._out, copy=True)     # atomic against its wait's pop
        except IndexError:
            return 1
        self._unreturned.append(early)
        return 0

    def _returned_late(self, out: Any, kept: np.ndarray) -> None:
        """An early-taken request's wait returns after a later post: its result back in out,
        and the engine counts it taken from now on."""
        _copyto(out, kept)
        waiting = self._waiting
        waiting.append(None)             # inside the engine: see _abandon
        try:
            if not (self._closing or self._closed):
                check(_engine.lib.pc_coll_returned(self._coll))
        finally:
            waiting.pop()
            if self._held is not None:
                self._let_go()

    def _give_back(self) -> None:
        """close() began: early-taken results that no wait returned go back to the engine,
        which folds them into the final result (nothing posted is dropped); their waits
        raise StateError from now on, as waits of requests not taken do."""
        early, unreturned = self._early, self._unreturned
        self._early, self._unreturned = None, []
        for req in unreturned + ([early] if early is not None else []):
            res = req._result
            if res is None:
                continue
            req._result = None            # before the claim: a wait that loses it sees None
            try:
                kept = req._token.pop()
            except IndexError:            # its wait returned it
                req._result = res
                continue
            req._token = [True]
            words = _engine.ffi.new(self._res_type)
            words[0:7] = [res.round, res.rounds, res.nap, 0, 0, 0, res.posts]
            bits = _engine.ffi.cast("uint64_t *", words) + 7
            W = self._mask_words
            for j, ranks in enumerate((res.active, res.closing)):
                for r in ranks:
                    bits[j * W + r // 64] |= 1 << (r % 64)
            data = req._out if kept is True else kept
            check(_engine.lib.pc_coll_give_back(self._coll, _engine.ffi.from_buffer(data), words))

    def _post(self, x: Buffer, out: Optional[Buffer]) -> PartialRequest:
        if self._serves_only:
            raise ArgumentError(f"rank {self.rank} is a dedicated server (not in workers={self.workers}): "
                                f"it never posts")
        if type(x) is _ndarray and (out is None or type(out) is _ndarray) and self._staging is None:
            # host arrays: check them, keep them with their cffi views in _fb, post on the path above
            c = self._native_coll()
            x = self._check_input(x, "post buffer", writable=False)
            if out is not None:
                out = self._check_input(out, "out buffer", writable=True)
            ffi = _engine.ffi
            self._forget_fb(out)
            self._fb = fb = (x, ffi.from_buffer(x), out, _NULL if out is None else ffi.from_buffer(out), c,
                             self._pres[0])
            r = _post1(c, fb[1], fb[3])
            if r < 0:
                self._check_post(-r)
            index = r >> 1
            self._fb_index = index
            return PartialRequest(self, index, (r & 1) == 1, out, False, fb[3])
        c = self._native_coll()
        xdev = _device.backend_of(x)
        odev = None if out is None else _device.backend_of(out)
        x = self._check_input(x, "post buffer", writable=False, backend=xdev)
        if out is not None:
            out = self._check_input(out, "out buffer", writable=True, backend=odev)
        self._last_on_device = xdev is not None
        if xdev is None and odev is None:
            if self._staging is not None:
                self._staging.pending_valid = False       # this post folds on the host
            index, late = self._post_host(x, out, c)
            if out is not None:
                # the engine may run a round in out, or hold it as the accumulator (an
                # in-place post lends x) until the request is waited for: keep it alive
                self._keep_out(index, out)
            return PartialRequest(self, index, late, out)
        # device buffers: staged through pinned host memory (see _device.py)
        stage = self._staging_for(xdev or odev, x if xdev is not None else out)
        if xdev is not None and self.accumulate != "sum":
            # the staging folds later posts on the device with the op alone
            raise InvalidBufferError(f"accumulate={self.accumulate!r} folds posts on the host: post host "
                                     "(NumPy) arrays, or use accumulate='sum'")
        if xdev is not None:
            stage.check_device(x, "post buffer")
            index, late = stage.post(x, self)
        else:
            stage.pending_valid = False
            index, late = self._post_host(x, None)
        on_device = odev is not None or out is None
        return PartialRequest(self, index, late, out, on_device)

    def _check_post(self, rc: int) -> None:
        """A post's return code: an error the progress thread met since the last wait
        surfaces here, named as a wait's would be."""
        check_round(rc, self._peers, "the next round")

    def _post_host(self, x: np.ndarray, out: Optional[np.ndarray], c=None) -> Tuple[int, bool]:
        ffi = _engine.ffi
        index, late = ffi.new("int64_t *"), ffi.new("int *")
        self._check_post(_engine.lib.pc_coll_post(c or self._native_coll(), ffi.from_buffer(x),
                                                  ffi.from_buffer(out) if out is not None else ffi.NULL, index, late))
        return int(index[0]), bool(late[0])

    def _keep_out(self, index: int, out: np.ndarray) -> None:
        """Keep out alive while the engine may use it: a wait drops its own entry; the
        entries of requests never waited for are pruned by asking the engine which user
        buffers it still holds."""
        outs = self._outs
        outs[index] = out
        if len(outs) > 4:
            bufs = _engine.ffi.new("void *[3]")
            check(_engine.lib.pc_coll_user_buffers(self._native_coll(), bufs))
            held = {int(_engine.ffi.cast("uintptr_t", b)) for b in bufs} - {0}
            # list(): one call that copies under the GIL; a waiting thread pops its own entry
            for i in [i for i, o in list(outs.items()) if i != index and o.ctypes.data not in held]:
                outs.pop(i, None)

    def _forget_fb(self, out=None) -> None:
        """Post no more through _fb; its out (unless it is out) goes to _outs, as the engine
        may still run the last post's round in it."""
        earlier, self._fb = self._fb[2], _NO_FB
        self._prev = None                # post() recycles no request of other buffers
        if earlier is not None and earlier is not out:
            self._keep_out(self._fb_index, earlier)

    def _staging_for(self, backend, like) -> _device.Staging:
        if self._staging is None:
            self._forget_fb()            # host posts now go through the staging's bookkeeping
            self._staging = _device.Staging(backend, like, self.count, self.dtype, op_code(self.op))
        elif self._staging.backend is not backend:
            raise InvalidBufferError("this allreduce already stages through another array library")
        return self._staging

    def _acc_full(self) -> bool:
        full = _engine.ffi.new("int *")
        check(_engine.lib.pc_coll_acc_full(self._native_coll(), full))
        return bool(full[0])

    def _post_replace(self, x: np.ndarray) -> Tuple[int, bool, bool]:
        ffi = _engine.ffi
        index, late, replaced = ffi.new("int64_t *"), ffi.new("int *"), ffi.new("int *")
        self._check_post(_engine.lib.pc_coll_post_replace(self._native_coll(), ffi.from_buffer(x), index, late,
                                                          replaced))
        return int(index[0]), bool(late[0]), bool(replaced[0])

    def _take(self, out, index: int, timeout: Optional[float],
              on_device: bool = False, what: str = "") -> Result:
        """Wait until round `index` completed here (timeout None: forever), then take the result.

        A peer the MPI reports as failed raises MPIError naming it (checked every slice of
        the wait); a Timeout names the peers not heard from in the armed round."""
        ffi = _engine.ffi
        staging = self._staging
        if on_device:
            assert staging is not None        # posts to the device path made it
            data = staging.outbox
        else:
            data = out if out is not None else np.empty(self.count, self.dtype)
        mask = ffi.new("uint64_t[]", self._mask_len)
        info = ffi.new("pc_result *")
        wait_in_slices(_wait_take, timeout, self._native_coll(), index, ffi.from_buffer(data), mask, info,
                       peers=self._peers, what=what or f"round {index}")
        self._outs.pop(index, None)       # the engine is done with this request's out
        if staging is not None and on_device:
            data = staging.deliver(out)
        active, closing = self._ranks_of(tuple(mask[0:2 * self._mask_words]))
        return Result(data=data, round=info.round, active=active, nap=info.nap, posts=info.posts,
                      contributed=info.post_lo <= index < info.post_hi, rounds=info.rounds, closing=closing)

    def _take_host(self, out, fout, index: int, timeout: Optional[float]) -> Result:
        """_take for host buffers, with one engine call when the round completes within
        the first slice of the wait (the small-message path). timeout None: rc.timeout."""
        c = self._coll
        if c is None:
            raise StateError("this PartialAllreduce is closed")
        if out is None:
            out = np.empty(self.count, self.dtype)
            fout = _engine.ffi.from_buffer(out)
        elif fout is None:                       # a request of the device path's host out
            fout = _engine.ffi.from_buffer(out)
        pool = self._res_pool                    # deque.pop/append: safe across threads
        try:
            entry = pool.pop()
        except IndexError:
            entry = [*self._new_res(), None]
        res = entry[0]
        first = _SLICE if timeout is None or timeout >= _SLICE else max(timeout, 0.0)
        # -1: the result is shaped as the last one taken into res, whose fields entry[2] keeps
        code = _pc_wait1_same(c, index, first, fout, res)
        if code > 0:
            if code != TIMEOUT_CODE:
                check_round(code, self._peers, f"round {index}")
            # not done within the first slice: wait out the rest of the timeout in slices
            if timeout is None:
                timeout = _rc_values["timeout"]
            wait_in_slices(_wait1, max(float(timeout) - first, 0.0), c, index, fout, res, shown=timeout,
                           peers=self._peers, what=f"round {index}")
        if self._outs:
            self._outs.pop(index, None)          # the engine is done with this request's out
        shape = entry[2]
        if code < 0 and shape is not None:       # its own round, this post inside, shaped as the last
            r = self._fresh_result()
            r.data, r.round, r.contributed = out, index, True
            r.active, r.nap, r.rounds, r.closing, r.posts = shape
        else:
            r = self._result_of(entry[1], out, index)
            entry[2] = (r.active, r.nap, r.rounds, r.closing, r.posts)
        pool.append(entry)
        return r

    def _result_of(self, values, out, index: int) -> Result:
        """The Result of request `index` from a pc_coll_wait1 result array's words."""
        v = values()                             # the words a result reads, as a list
        key = (v[7], v[8]) if self._mask_words == 1 else tuple(v[7:])   # the active and closing bits
        hit = self._mask_cache.get(key)
        active, closing = hit if hit is not None else self._ranks_of(key)
        r = self._fresh_result()
        r.data, r.round, r.active, r.nap, r.rounds, r.closing = out, v[0], active, v[2], v[1], closing
        r.posts = v[6]
        r.contributed = v[3] <= index < v[4]
        return r

    def _new_res(self):
        """A pc_coll_wait1 result array, with its reader: the words a result reads as a
        list (memoryview.tolist, a third of ffi.unpack's time). _res_pool's entries add the
        fields of the last Result made from the array's words (pc_coll_wait1_same)."""
        res = _engine.ffi.new(self._res_type)
        return res, memoryview(_engine.ffi.buffer(res)).cast("q")[:self._res_used].tolist

    def _ranks_of(self, mask: Tuple[int, ...]) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
        """(active, closing) rank tuples of a result's bitmask words (memoized: few distinct masks)."""
        hit = self._mask_cache.get(mask)
        if hit is None:
            def ranks(w):
                return tuple(r for r in range(self.size) if (w[r // 64] >> (r % 64)) & 1)
            hit = (ranks(mask[:self._mask_words]), ranks(mask[self._mask_words:]))
            if len(self._mask_cache) < 4096:
                self._mask_cache[mask] = hit
        return hit

    def candidates_of(self, round: int) -> Tuple[int, ...]:
        """The ranks eligible to start `round` (majority: 1, probe: q, others: all)."""
        q = {"majority": 1, "probe": self.candidates}.get(self.mode)
        if q is None or (self.max_staleness and (round + 1) % self.max_staleness == 0):
            return tuple(range(self.size))
        return candidates(self.seed, round, self.size, q)

    def close(self, timeout: Optional[float] = None) -> Result:
        """Collective: finish rounds in flight, flush every accumulator in a final round, free.

        Returns the final round's result folded with the rounds completed here that no
        wait() returned: with late="fold" all of them, so nothing posted is dropped from
        this rank's results; with late="latest" the latest of them and those after it (a
        round that a later one replaced before close() began is in none of this rank's
        results; see docs/semantics.md). timeout: None is
        ``pc.rc.close_timeout`` (300 s unless set). If it expires, or a peer failed, this
        rank drops the collective (as if abandoned) and raises Timeout or MPIError.
        Several collectives that ranks posted to unevenly: close them together with
        partialcoll.close_all (one at a time, a rank waiting in the first one's close()
        is not yet shadowing the second one's rounds, which may need it).
        """
        if self._shrink is not None:
            return self._shrink.close(self, timeout)
        return self._close(timeout)

    def _close(self, timeout: Optional[float], survivable: tuple = ()) -> Result:
        """close() on this engine. survivable: the errors the caller recovers from (shrink):
        they leave the collective as it is, for the caller to salvage; others drop it."""
        timeout = rc.close_timeout if timeout is None else as_timeout(timeout, "close()'s timeout")
        if not self._closing:
            self._begin_close(survivable)
        try:
            result = self._take(None, 2 ** 62, timeout, self._last_on_device, what="close()'s final round")
        except PartialcollError as exc:
            if not isinstance(exc, survivable):
                self._close_failed(exc)
            raise
        self._stop_balancer()            # the final round is over: no decision is needed any more
        if self._balancer is not None:
            self._balancer.trim(result.round)
        self._traffic = self.traffic()
        _stats.at_close(self)            # who is slow: this rank's record, for stats() after close
        try:
            check(_engine.lib.pc_coll_free(self._coll))
        except PartialcollError:
            self._abandon()              # the engine keeps it until nothing runs
            raise
        self._closed = True
        self._coll = None
        _propagate.forget(self)
        comm = self._comm
        assert comm is not None           # cleared only by _abandon(), which marks it closed
        comm.Free()
        self._outs = {}
        self._fb = _NO_FB
        return result

    def _begin_close(self, survivable: tuple = ()) -> None:
        """close()'s first half, this rank only and without waiting: from here on this
        rank shadows the collective's rounds (it triggers every round it is armed for and
        sets its closing bit); close() then waits for the final round."""
        c = self._native_coll()
        self._closing = True             # no wait() starts from now on (class docstring) ...
        if self._waiting:                # ... and none may be under way
            self._closing = False
            raise StateError(_CLOSE_WHILE_WAITED)
        try:
            check_round(_engine.lib.pc_coll_close(c), self._peers, "close()")   # an error met since the last wait
            self._give_back()
        except PartialcollError as exc:
            if not isinstance(exc, survivable):
                self._close_failed(exc)
            raise

    def _close_failed(self, exc: PartialcollError) -> None:
        """close() cannot complete here: drop the collective (a Timeout is reported to the
        peers, which may be alive, in rounds)."""
        if isinstance(exc, Timeout):
            self._report("Timeout", _propagate.describe(exc), _propagate.REPORT_SECONDS)
        self._abandon()

    def traffic(self) -> np.ndarray:
        """Bytes this rank has sent to each peer since creation (int64, one per rank),
        counted by the engine: data, activation and bookkeeping messages alike."""
        if self._closed and self._traffic is not None:
            return self._traffic.copy()
        sent = np.zeros(self.size, np.int64)
        check(_engine.lib.pc_traffic(self._native_coll(), _engine.ffi.NULL,
                                     _engine.ffi.cast("int64_t *", sent.ctypes.data), self.size))
        return sent

    def stats(self, local: bool = False) -> _stats.Stats:
        """Who is slow (docs/who-is-slow.md). Collective (one allgather, on the collective's
        communicator; after close(), on the one it was created on): every rank returns the
        same view. local=True: this rank's own view, asking nobody."""
        return _stats.of(self, local)

    def _abort(self, exc_type: bytes, message: bytes, seconds: float) -> None:
        if getattr(_engine, "lib", None) is not None:       # not at interpreter shutdown
            check(_engine.lib.pc_coll_abort(self._coll, exc_type, message, seconds))

    def _abandon(self) -> None:
        """Drop the collective without the collective close(): this rank only. The engine
        withdraws the armed round and frees its memory once nothing is in flight; what the
        engine may still touch of ours (out= buffers, staging) is kept until finalize, and so
        is the communicator: the peers' messages of rounds this rank left may still arrive,
        and a freed communicator's context id goes to a later one, where they could match.

        Another thread may be inside wait() or test() (or between reading the handle and
        its engine call): the engine's object is then held for those threads, and freed
        when the last of them lets go of it; their calls raise StateError."""
        self._stop_balancer()            # before the engine may free what it reads
        coll, self._coll, self._closed = getattr(self, "_coll", None), None, True
        comm, self._comm = getattr(self, "_comm", None), None
        fb, self._fb = getattr(self, "_fb", _NO_FB), _NO_FB
        if getattr(_engine, "lib", None) is None:      # interpreter shutdown
            return
        deferred = _engine.ffi.new("int *")
        if coll is not None:
            # held before the look at _waiting: a thread that leaves meanwhile finds it
            # held and lets go (_let_go), or this thread does below
            _propagate.hold_for_waiters(self, coll, _engine.lib.pc_coll_hold)
            _engine.lib.pc_coll_abandon(coll, deferred)
            if self._held is not None:
                self._let_go()
        if deferred[0]:                  # messages still in flight: keep what they may touch
            _engine.keep_until_finalize(self._outs, self._staging, fb[2])
        _engine.keep_until_finalize(comm)

    @property
    def failed(self) -> Tuple[int, ...]:
        """on_failure="shrink": the ranks that failed, in the numbering of the communicator
        the collective was created on (ascending; empty while none has)."""
        return self._shrink.failed if self._shrink is not None else ()

    @property
    def recoveries(self) -> List[dict]:
        """on_failure="shrink": one entry per failure survived: "failed" (the ranks),
        "seconds" (this rank's time from the failed call to the rebuilt collective),
        "round" ("completed": the round in flight completed at some survivors and was
        completed at the others with their result; "rerun": it completed nowhere and ran
        again), "reposted" (this rank's posts posted again), "tries" (shrinks), "cause"
        (the exception that started it), "held" (what this rank held of the stopped
        collective: rounds completed, posts, posts inside completed rounds, posts taken,
        and the rounds the survivors agreed completed)."""
        return list(self._shrink.recoveries) if self._shrink is not None else []

    def _rebuild(self, comm: MPI.Comm) -> None:
        """on_failure="shrink": the collective again, over comm (the survivors), after
        _abandon() dropped the engine's: round schedules built for its size."""
        self.size, self.rank = comm.Get_size(), comm.Get_rank()
        if self.algorithm == "tree":
            self.groups = tree.host_groups(comm)
        if self.candidates is not None:
            self.candidates = min(self.candidates, self.size)
        if self.quorum is not None:
            self.quorum = min(self.quorum, self.size)
        self._mask_cache, self._outs, self._fb, self._fb_index = {}, {}, _NO_FB, -1
        self._closing = False
        if self.on_rebuild is not None:
            self.on_rebuild(self)
        self._build(comm)
        self._closed = False

    def _let_go(self) -> None:
        """The last thread out of wait()/test() of a dropped collective releases what
        _abandon() held for them (the engine frees it then)."""
        _propagate.let_go(self, _engine.lib.pc_coll_release)

    def __repr__(self) -> str:
        return (f"PartialAllreduce(count={self.count}, dtype={self.dtype}, mode={self.mode!r}, "
                f"late={self.late!r}, algorithm={self.algorithm!r}, size={self.size}) "
                f"# algorithm: {self.algorithm_reason}")


def close_all(collectives: Sequence[PartialAllreduce], timeout: Optional[float] = None) -> List[Result]:
    """Collective: close several PartialAllreduces together; their final results, in order.

    Every rank first begins closing each of them (from then on it shadows their rounds:
    it triggers every round it is armed for, whatever the mode), then waits for each final
    round. Closing them one by one can hang where ranks posted unevenly: a rank waiting in
    the first one's close() would not yet take part as a closing rank in the second one's
    rounds, and a majority or full round there may need it. (The torch integrations close
    their buckets' collectives this way.) timeout: each close()'s. If one fails (Timeout,
    PeerError, MPIError, StateError), the others not closed yet are dropped on this rank
    with a report to their peers, as a ``with`` block left by that exception does, and the
    exception propagates. A closed collective, one listed twice, or one whose request
    another thread waits for raises before any closing begins.
    """
    colls = list(collectives)
    for coll in colls:
        if not isinstance(coll, PartialAllreduce):
            raise ArgumentError(f"close_all() closes PartialAllreduce objects, not {type(coll).__name__}")
        if coll._closed:
            raise StateError("close_all(): a PartialAllreduce of the list is closed already")
        if coll._waiting:
            raise StateError(_CLOSE_WHILE_WAITED)
    if len({id(coll) for coll in colls}) < len(colls):
        raise ArgumentError("close_all(): a PartialAllreduce appears twice in the list")
    done: List[Result] = []
    try:
        for coll in colls:
            if not coll._closing:
                coll._begin_close()
        for coll in colls:
            done.append(coll.close(timeout))
    except PartialcollError as exc:
        for coll in colls[len(done):]:
            if not coll._closed:
                try:
                    coll._report(type(exc).__name__, _propagate.describe(exc), _propagate.REPORT_SECONDS)
                finally:
                    coll._abandon()
        raise
    return done


def _shorthand(mode: str):
    def make(count: int, dtype: DTypeLike = np.float32, op: ReduceOp = MPI.SUM,
             comm: MPI.Comm = MPI.COMM_WORLD, **kwargs: Any) -> PartialAllreduce:
        return PartialAllreduce(count, dtype, op, comm, mode=mode, **kwargs)
    make.__name__ = f"{mode}_allreduce" if mode != "full" else "allreduce_init"
    make.__doc__ = (f"PartialAllreduce(..., mode={mode!r}): " +
                    ("a persistent allreduce, like MPI_Allreduce_init (post, then wait)." if mode == "full"
                     else f"the {mode} partial allreduce."))
    return make


solo_allreduce = _shorthand("solo")
majority_allreduce = _shorthand("majority")
probe_allreduce = _shorthand("probe")
quorum_allreduce = _shorthand("quorum")
allreduce_init = _shorthand("full")
