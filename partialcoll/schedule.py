"""The public schedule API (fflib2's model): a DAG of send, recv, compute and nop ops.

    s = Schedule(comm)
    r = s.recv(buf, source=left)
    c = s.compute(MPI.SUM, acc, buf, out=acc, after=r)    # acc = acc (SUM) buf
    t = s.send(acc, dest=right, after=c)
    s.nop(after=[t, c], need="all")                      # need: "all" | "any" | k
    s.commit(persistent=True)                            # collective over comm
    req = s.start(); req.wait()

Building is pure Python: a Schedule made with ``Schedule(rank=r, size=p)`` records ops
that ``dump()`` prints, without MPI. ``commit`` hands the DAG to the native engine and
runs it on a duplicate of the communicator, so schedules never share tags.
"""
from __future__ import annotations

from typing import Iterable, List, Optional, Sequence, Tuple, Union

from mpi4py import MPI

from . import _device, _engine
from ._buffers import SLOT_SCRATCH, BufRef
from ._errors import ArgumentError, InvalidBufferError, StateError
from ._status import Peers, check, wait_in_slices
from ._rc import rc
from ._typing import Buffer, ComputeOp, DTypeLike
from ._types import COPY, OP_NAMES, check_comm, check_divisor, check_op_dtype, integer, op_code

SEND, RECV, COMPUTE, NOP, TRIGGER, TAKE, DELIVER = range(7)
_KIND_NAMES = ("send", "recv", "compute", "nop", "trigger", "take", "deliver")

Need = Union[str, int]
After = Union["ScheduleOp", Iterable["ScheduleOp"], None]


class ScheduleOp:
    """A handle to one op of a schedule (what ``after=`` takes)."""

    __slots__ = ("schedule", "index", "kind", "peer", "redop", "bufs", "deps", "need", "label", "divisor")

    def __init__(self, schedule: "Schedule", index: int, kind: int, *, peer: int = -1, redop: int = COPY,
                 bufs: Sequence[BufRef] = (), deps: Sequence[int] = (), need: int = 0, label: str = "",
                 divisor: float = 1.0) -> None:
        self.schedule = schedule
        self.index = index
        self.kind = kind
        self.peer = peer
        self.redop = redop
        self.bufs = tuple(bufs)
        self.deps = tuple(deps)
        self.need = need
        self.label = label
        self.divisor = divisor

    def __repr__(self) -> str:
        return f"<ScheduleOp {self.index}: {self.describe()}>"

    def describe(self) -> str:
        kind = _KIND_NAMES[self.kind]
        if self.kind == SEND:
            text = f"send {self.bufs[0].describe()} ({self.bufs[0].nbytes} B) -> rank {self.peer}"
        elif self.kind == RECV:
            text = f"recv {self.bufs[0].describe()} ({self.bufs[0].nbytes} B) <- rank {self.peer}"
        elif self.kind == COMPUTE:
            a, b, out = self.bufs
            text = (f"{out.describe()} = {a.describe()}" if self.redop == COPY else
                    f"{out.describe()} = {a.describe()} ({OP_NAMES[self.redop]}) {b.describe()}")
            if self.divisor != 1:
                text += f" / {self.divisor:g}"
        else:
            text = kind
        if self.deps:
            n = len(self.deps)
            mode = "all" if self.need == n else "any" if self.need == 1 else f"{self.need} of {n}"
            text += f"  after {list(self.deps)} ({mode})"
        return text + (f"  # {self.label}" if self.label else "")


class Request:
    """One execution of a committed schedule: ``wait(timeout=None)`` and ``test()``."""

    def __init__(self, schedule: "Schedule", execution: int) -> None:
        self._schedule = schedule
        self._execution = execution
        self._finished = False

    def test(self) -> bool:
        """True once the execution has completed (inline progress: also makes progress)."""
        if self._finished:
            return True
        done = _engine.ffi.new("int *")
        check(_engine.lib.pc_sched_test(self._schedule._native, self._execution, done))
        if done[0]:
            self._finish()
        return bool(done[0])

    def wait(self, timeout: Optional[float] = None) -> None:
        """Block until the execution completes; raises partialcoll.Timeout after `timeout` s."""
        if self._finished:
            return
        timeout = rc.timeout if timeout is None else timeout
        sched = self._schedule
        wait_in_slices(_engine.lib.pc_sched_wait, timeout, sched._native, self._execution,
                       peers=sched._peers(), what=f"schedule execution {self._execution}")
        self._finish()

    def _finish(self) -> None:
        """Once complete: device buffers the schedule wrote get their data (staging)."""
        self._finished = True
        if self._schedule._unstaged is self:       # set only where there are mirrors
            self._schedule._unstaged = None
            self._schedule._mirrors.stage_out()

    Wait = wait
    Test = test


class Schedule:
    """A DAG of point-to-point and local ops over a communicator."""

    def __init__(self, comm: Optional[MPI.Comm] = None, *, rank: Optional[int] = None,
                 size: Optional[int] = None) -> None:
        if comm is None and (rank is None or size is None):
            raise ArgumentError("Schedule needs a communicator, or rank= and size= for a dry build")
        if comm is not None:
            check_comm(comm, "Schedule")
        self.comm = comm
        if comm is not None:
            self.rank, self.size = comm.Get_rank(), comm.Get_size()
        else:
            self.size = integer(size, "size", 1)
            self.rank = integer(rank, "rank", 0, self.size - 1)
        self.ops: List[ScheduleOp] = []
        self._native = None
        self._dup: Optional[MPI.Comm] = None
        self._persistent = True
        self._scratch_bytes = 0        # scratch memory the engine allocates for this schedule
        self._timers: List[Tuple[int, int, int]] = []   # timed owners ("ps"): (send, recv, owner) per block
        self._mirrors = _device.Mirrors()  # pinned host mirrors of device buffers
        self._unstaged: Optional[Request] = None   # an execution whose outputs are not on the device yet

    def _peers(self) -> Optional[Peers]:
        """For slow waits: failed peers (MPIError), peers not heard from (Timeout)."""
        if self._dup is None or self._native is None:
            return None
        native = self._native

        def silent():
            ffi = _engine.ffi
            ranks, n = ffi.new("int[]", 64), ffi.new("int *")
            check(_engine.lib.pc_sched_silent(native, ranks, 64, n))
            return "this execution", tuple(ranks[0:n[0]])
        return Peers(_engine.comm_handle(self._dup), self.rank, silent)

    # -- building --------------------------------------------------------------------
    def _deps(self, after: After, need: Need) -> tuple:
        if after is None:
            deps: tuple = ()
        elif isinstance(after, ScheduleOp):
            deps = (after,)
        else:
            deps = tuple(after)
        for d in deps:
            if not isinstance(d, ScheduleOp) or d.schedule is not self:
                raise ArgumentError(f"after= takes ops of this schedule, got {d!r}")
        n = len(deps)
        if need == "all":
            k = n
        elif need == "any":
            k = min(n, 1)
        else:
            try:
                k = integer(need, "need", 1, n)
            except ArgumentError:
                raise ArgumentError(f"need must be 'all', 'any' or k in 1..{n} (ops in after=), "
                                    f"not {need!r}") from None
        return tuple(d.index for d in deps), k

    def _check_building(self) -> None:
        if self._native is not None:
            raise StateError("the schedule is committed; build a new one to add ops")

    def _add(self, kind: int, *, after: After = None, need: Need = "all", **fields) -> ScheduleOp:
        self._check_building()
        deps, k = self._deps(after, need)
        op = ScheduleOp(self, len(self.ops), kind, deps=deps, need=k, **fields)
        self.ops.append(op)
        return op

    def _peer(self, peer: int, what: str) -> int:
        try:
            return integer(peer, what, 0, self.size - 1)
        except ArgumentError:
            raise ArgumentError(f"{what} {peer!r} is out of range for a communicator of size {self.size} "
                                f"(this is rank {self.rank})") from None

    def send(self, buf: Buffer, dest: int, *, after: After = None, need: Need = "all", label: str = "") -> ScheduleOp:
        """Send buf to rank dest (MPI_Isend once the dependencies are met)."""
        ref = self._ref(buf, writable=False, what="send buffer")
        return self._add(SEND, peer=self._peer(dest, "dest"), bufs=(ref,), after=after, need=need, label=label)

    def recv(self, buf: Buffer, source: int, *, after: After = None, need: Need = "all", label: str = "") -> ScheduleOp:
        """Receive into buf from rank source (exactly buf's size; MPI_Irecv once ready)."""
        ref = self._ref(buf, writable=True, what="receive buffer")
        return self._add(RECV, peer=self._peer(source, "source"), bufs=(ref,), after=after, need=need, label=label)

    def compute(self, op: ComputeOp, a: Buffer, b: Buffer, out: Optional[Buffer] = None, *, after: After = None,
                need: Need = "all", label: str = "", divisor: float = 1.0) -> ScheduleOp:
        """out = a (op) b elementwise; out defaults to b (MPI_Reduce_local's inoutbuf).

        divisor: out = (a + b) / divisor in the same pass (op SUM, a real floating dtype):
        an average with no pass of its own."""
        code = op_code(op)
        ra = self._ref(a, writable=False, what="compute input a")
        rb = self._ref(b, writable=out is None, what="compute output (b)" if out is None else "compute input b")
        ro = rb if out is None else self._ref(out, writable=True, what="compute output")
        self._check_same(ra, rb, ro)
        check_op_dtype(code, ra.dtype)
        return self._add(COMPUTE, redop=code, bufs=(ra, rb, ro), after=after, need=need, label=label,
                         divisor=check_divisor(divisor, code, ra.dtype))

    def copy(self, src: Buffer, dst: Buffer, *, after: After = None, need: Need = "all", label: str = "",
             divisor: float = 1.0) -> ScheduleOp:
        """dst = src (dst = src / divisor with a divisor: a real floating dtype)."""
        rs = self._ref(src, writable=False, what="copy source")
        rd = self._ref(dst, writable=True, what="copy destination")
        self._check_same(rs, rd, rd)
        return self._add(COMPUTE, redop=COPY, bufs=(rs, rs, rd), after=after, need=need, label=label,
                         divisor=check_divisor(divisor, COPY, rs.dtype))

    def nop(self, *, after: After = None, need: Need = "all", label: str = "") -> ScheduleOp:
        """An op that completes as soon as it fires: joins and fans out dependencies."""
        return self._add(NOP, after=after, need=need, label=label)

    def _ref(self, obj, *, writable: bool, what: str) -> BufRef:
        """A host buffer as it is; a device buffer through its pinned mirror (staging)."""
        backend = _device.backend_of(obj)
        if backend is None:
            return BufRef.of(obj, writable=writable, what=what)
        self._check_building()             # before a mirror is added that no op would use
        return self._mirrors.ref(backend, obj, writable=writable, what=what)

    @staticmethod
    def _check_same(*refs: BufRef) -> None:
        first = refs[0]
        for r in refs[1:]:
            if r.dtype != first.dtype:
                raise InvalidBufferError(f"compute buffers differ in dtype: {first.dtype} and {r.dtype}")
            if r.count != first.count:
                raise InvalidBufferError(f"compute buffers differ in size: {first.count} and {r.count} elements")

    def scratch(self, count: int, dtype: DTypeLike) -> BufRef:
        """A scratch buffer owned by the schedule (for algorithm builders). The engine
        allocates it at commit and frees it with the schedule, so a receive into scratch
        never outlives its memory; dry builds (tests/simulate.py) give it memory of their own."""
        import numpy as np
        dt = np.dtype(dtype)
        offset = -(-self._scratch_bytes // 64) * 64          # 64-byte aligned
        self._scratch_bytes = offset + max(count, 0) * dt.itemsize
        return BufRef(None, SLOT_SCRATCH, offset, max(count, 0), dt)

    @property
    def scratch_bytes(self) -> int:
        """Scratch memory the engine allocates for this schedule at commit (bytes)."""
        return self._scratch_bytes

    def _also_after(self, op: ScheduleOp, after: After) -> None:
        """More predecessors for an op that needs any one of them (an OR built before them:
        the flood's activation, joined by data receives built after it)."""
        self._check_building()
        if op.need != 1:
            raise ArgumentError(f"only an op that needs any one of its predecessors takes more later: {op!r}")
        deps, _ = self._deps(after, "any")
        op.deps = op.deps + deps

    # internal ops of partial collectives
    def _trigger(self) -> ScheduleOp:
        return self._add(TRIGGER, label="a local post starts the round")

    def _take(self, after) -> ScheduleOp:
        return self._add(TAKE, after=after, label="work = accumulator; set active bit")

    def _deliver(self, after) -> ScheduleOp:
        return self._add(DELIVER, after=after, label="publish the round's result")

    # -- inspection ------------------------------------------------------------------
    def dump(self) -> str:
        """The schedule, one op per line."""
        lines = [f"schedule: rank {self.rank} of {self.size}, {len(self.ops)} ops"]
        lines += [f"  {op.index:4d}: {op.describe()}" for op in self.ops]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.dump()

    # -- running ---------------------------------------------------------------------
    def commit(self, persistent: bool = True) -> "Schedule":
        """Hand the DAG to the engine (collective over comm: an allreduce, which agrees on
        the tag layout, and comm.Dup())."""
        if self._native is not None:
            raise StateError("the schedule is already committed")
        if self.comm is None:
            raise StateError("a dry-built schedule (no communicator) cannot be committed")
        _engine.ensure_started()
        pairs = self.comm.allreduce(pair_messages(self), op=MPI.MAX)    # one tag layout for all ranks
        dup = self.comm.Dup()
        dup.Set_errhandler(MPI.ERRORS_RETURN)
        try:
            self._native = _create_native(self, dup, None, pairs)
        except BaseException:
            dup.Free()
            raise
        self._dup = dup
        self._persistent = persistent
        return self

    def _commit_on(self, comm: MPI.Comm, pairs: int) -> "Schedule":
        """Commit on a communicator the caller owns and shares with other schedules (no
        Dup, no collective call): pairs is their agreed tag layout (pair_messages)."""
        _engine.ensure_started()
        self._native = _create_native(self, comm, None, pairs)
        return self

    def start(self) -> Request:
        """Start one execution (MPI_Start); a persistent schedule can be started again after it completes."""
        if self._native is None:
            raise StateError("commit() the schedule before start()")
        if not self._persistent and _engine.lib.pc_sched_executions(self._native) > 0:
            raise StateError("a non-persistent schedule runs once; commit(persistent=True) to rerun it")
        if self._unstaged is not None and not self._unstaged.test():
            raise StateError("the previous execution is still running; wait() for it before start()")
        if self._mirrors:
            self._mirrors.stage_in()
        execution = _engine.ffi.new("int64_t *")
        check(_engine.lib.pc_sched_start(self._native, execution))
        req = Request(self, execution[0])
        self._unstaged = req if self._mirrors else None
        return req

    def free(self) -> None:
        """Release the native schedule and the duplicated communicator (collective)."""
        if self._native is not None:
            check(_engine.lib.pc_sched_free(self._native))
            self._native = None
        if self._dup is not None:
            self._dup.Free()
            self._dup = None

    def __del__(self) -> None:
        # Dropped without free(): the engine frees the native schedule now if it is idle,
        # or withdraws its execution and frees it once nothing posted is in flight; the
        # buffers that execution may still touch stay alive until finalize.
        self._abandon()

    def _abandon(self) -> None:
        """Drop the schedule on this rank only (no collective call)."""
        if getattr(self, "_native", None) is not None and getattr(_engine, "lib", None) is not None:
            deferred = _engine.ffi.new("int *")
            _engine.lib.pc_sched_abandon(self._native, deferred)
            self._native = None
            if deferred[0]:              # messages still in flight: keep what they may touch
                _engine.keep_until_finalize(self.ops, self._mirrors, self._dup)
                self._dup = None
        if getattr(self, "_dup", None) is not None:   # freed on the next application call, not here
            _engine.free_later(self._dup)
            self._dup = None

    def __enter__(self) -> "Schedule":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is None:
            self.free()
        else:
            self._abandon()              # an exception on this rank: no collective call

    Start = start
    Free = free


def pair_messages(*scheds: Schedule) -> int:
    """The most messages one rank sends to, or receives from, one peer in any of scheds:
    what the tag's sequence bits must count (every rank's schedules on a communicator
    must use the same tag layout, so callers agree on the maximum over ranks)."""
    most = 1
    for sched in scheds:
        count: dict = {}
        for op in sched.ops:
            if op.kind in (_engine.lib.PC_SEND, _engine.lib.PC_RECV):
                key = (op.kind, op.peer)
                count[key] = count.get(key, 0) + 1
        most = max([most, *count.values()])
    return most


def _create_native(sched: Schedule, comm: MPI.Comm, coll, pairs: int):
    """Build the engine's op table and edge list from a schedule; pairs: pair_messages()
    of every schedule on comm, the same on every rank (the tag layout)."""
    ffi, lib = _engine.ffi, _engine.lib
    n, specs, nedges, cedges = op_table(sched)
    out = ffi.new("pc_sched **")
    check(lib.pc_sched_create(_engine.comm_handle(comm), n, specs, nedges, cedges,
                              coll if coll is not None else ffi.NULL, sched._scratch_bytes, pairs, out))
    return out[0]


def op_table(sched: Schedule) -> tuple:
    """The engine's view of a schedule: (ops, pc_opspec[ops], edges, int[2 * edges])."""
    ffi = _engine.ffi
    n = len(sched.ops)
    specs = ffi.new("pc_opspec[]", max(n, 1))
    edges: List[int] = []
    for op in sched.ops:
        s = specs[op.index]
        s.kind, s.peer, s.redop, s.need = op.kind, op.peer, op.redop, op.need
        s.divisor = op.divisor
        for i, ref in enumerate(op.bufs):
            if ref.slot:
                s.slot[i], s.off[i] = ref.slot, ref.offset
            else:
                s.ptr[i] = ffi.cast("void *", ref.address())
        if op.bufs:
            s.dtype = _dtype_of(op.bufs[0])
            s.count = op.bufs[0].count
            s.nbytes = op.bufs[0].nbytes
        for d in op.deps:
            edges += (d, op.index)
    return n, specs, len(edges) // 2, ffi.new("int[]", edges or [0])


def _dtype_of(ref: BufRef) -> int:
    from ._types import dtype_code
    return dtype_code(ref.dtype)
