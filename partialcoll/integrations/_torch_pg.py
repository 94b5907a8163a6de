"""The ``partialcoll`` torch.distributed backend: a Python ProcessGroup over an MPI
communicator (torch's ``register_backend`` route for third-party backends).

Nothing of torch changes when this module is imported. ``register_backend()`` (which
``init_process_group()`` calls) registers the backend under the name ``partialcoll``
for CPU and CUDA tensors, and the rendezvous scheme ``mpi://`` (rank, size and a store
from MPI, see ``_torch_comm.py``). Under mpiexec::

    pct.init_process_group()                                     # the one-line way
    dist.init_process_group("partialcoll", init_method="mpi://")  # the same, torch's way
    dist.init_process_group("gloo", init_method="mpi://")         # gloo, no MASTER_ADDR

Collectives:

- allreduce of floating tensors (SUM, AVG) of 64 KiB and more, and of every float16 or
  bfloat16 tensor: a persistent full allreduce of the engine per (count, dtype), posted
  in place; the returned Work completes from a thread when the round completes, so DDP's
  buckets overlap backward as with gloo.
- everything else (small or integer allreduce, the coalesced calls, broadcast,
  allgather, reduce_scatter, barrier, reduce, gather, scatter, alltoall, send/recv):
  MPI's non-blocking call on the group's communicator; collectives are waited for
  before the call returns, send and recv complete from the thread. float16/bfloat16 reductions there are done in float32
  and rounded back. torch's functional collectives (DTensor, FSDP2) reach a Python
  group through its ``*_coalesced`` methods, which are here too.

Every wait honours the group's timeout (``init_process_group(timeout=)``; where none is
passed, ``pc.rc.timeout``, 600 s unless set, rather than torch's 30 minutes): an MPI call that has not completed by then raises Timeout, and the
group refuses further collectives (their order across ranks is lost). CUDA tensors are
staged through pinned host memory (the engine's allreduce: through CuPy where it can use
the GPU, ``_torch_common.buffer_of``).

Lifetime: ``shutdown()`` (``dist.destroy_process_group``) is collective and frees the
communicators; ``abort()`` is neither collective nor blocking: the Works not completed
fail at once, and the engine's collectives are dropped by the completion thread once
the waits it is in are over.
"""
from __future__ import annotations

import functools
import sys
from collections import OrderedDict
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional

import numpy as np
import torch
import torch.distributed as dist
from mpi4py import MPI

from torch.distributed.constants import default_pg_timeout as _TORCH_DEFAULT_TIMEOUT

from .. import _propagate
from .. import _stats
from .._errors import ArgumentError, MPIError, StateError, Timeout
from .._rc import rc
from .._partial import PartialAllreduce, close_all
from .._engine import comm_handle
from .._status import busy_seconds, failed_peers_check, wait_request, wait_until
from . import _torch_comm
from ._torch_common import Completer, buffer_of, for_torch, future, host_copy, host_view, np_dtype, on_device

NAME = "partialcoll"
ENGINE_MIN_BYTES = 64 << 10          # smaller allreduces go to MPI directly (latency)
MAX_CACHED = 32                      # persistent allreduces kept per process group

_R: Any = dist.ReduceOp.RedOpType     # torch's stub lists none of its members
_MPI_OPS = {_R.SUM: MPI.SUM, _R.AVG: MPI.SUM, _R.PRODUCT: MPI.PROD, _R.MIN: MPI.MIN, _R.MAX: MPI.MAX,
            _R.BAND: MPI.BAND, _R.BOR: MPI.BOR, _R.BXOR: MPI.BXOR}
_BOOL_OPS = {_R.SUM: MPI.LOR, _R.MAX: MPI.LOR, _R.BOR: MPI.LOR, _R.PRODUCT: MPI.LAND, _R.MIN: MPI.LAND,
             _R.BAND: MPI.LAND, _R.BXOR: MPI.LXOR}
_HALF = (torch.float16, torch.bfloat16)


def _op_type(op) -> "_R":
    kind = getattr(op, "op", op)          # ReduceOp -> its RedOpType
    for member in _R.__members__.values():
        if kind == member:
            return member
    raise ArgumentError(f"unsupported reduction op {op!r}")


def _never_traced(fn: Callable) -> Callable:
    """fn as a method torch.compile never traces. torch's C++ calls a group's methods from
    compiled code's eager parts (DDP's forward broadcasts and reduces through its group),
    and Dynamo, which traces every Python frame such code enters, cannot trace a process
    group's attributes. Where torch._dynamo is loaded the call goes through
    torch._disable_dynamo (torch.compiler.disable, made at its first call, in a wrapper
    Dynamo does not trace); where it is not, nothing can be compiling and fn runs as it is:
    a program that never compiles never pays for importing Dynamo (a second of CPU)."""
    lazy = torch._disable_dynamo(fn)

    @functools.wraps(fn)
    def method(*args, **kwargs):
        if "torch._dynamo" in sys.modules:
            return lazy(*args, **kwargs)
        return fn(*args, **kwargs)
    return method


def _run_eagerly(cls: type) -> type:
    """The public methods of cls, never traced by torch.compile (_never_traced)."""
    for name, value in list(vars(cls).items()):
        if not name.startswith("_") and callable(value):
            setattr(cls, name, _never_traced(value))
    return cls


@_run_eagerly
class Work(dist.Work):
    """The Work of one call: done when its future is (torch's public way for a Python
    process group: a ``dist.Work`` subclass with ``wait`` and ``get_future``)."""

    def __init__(self, fut: torch.futures.Future, source: "int | Callable[[], int]" = -1) -> None:
        super().__init__()
        self._fut = fut                  # Python's: wait() raises what the call raised
        self._source = source
        self._torch_fut: Optional[torch.futures.Future] = None

    @classmethod
    def done(cls, value, devices=None) -> "Work":
        fut = future(devices)
        fut.set_result(value)
        return cls(fut)

    def wait(self, timeout: Optional[timedelta] = None) -> bool:
        """Block until done; raises what the call raised. The group's own timeout bounds
        every call; a timeout here (torch's: timedelta(0) is none) raises Timeout after it,
        while the call goes on."""
        if timeout and not self._fut.done():
            seconds = timeout.total_seconds()
            if not wait_until(self._fut.done, seconds):
                raise Timeout(f"the Work did not complete within wait()'s timeout ({seconds:g} s); it goes on, "
                              "bounded by the group's timeout")
        self._fut.wait()
        if self._torch_fut is not None:  # its callback runs just after: done when this returns
            self._torch_fut.wait()
        return True

    def get_future(self) -> torch.futures.Future:
        """The future torch's C++ side reads (DDP's reducer): see _torch_common.for_torch."""
        if self._torch_fut is None:
            self._torch_fut = for_torch(self._fut)
        return self._torch_fut

    def is_completed(self) -> bool:
        return self._fut.done() and (self._torch_fut is None or self._torch_fut.done())

    def is_success(self) -> bool:
        if not self._fut.done():
            return False
        try:
            self._fut.value()
            return True
        except Exception:                # noqa: BLE001
            return False

    def exception(self):
        if not self._fut.done():
            return None
        try:
            self._fut.value()
        except Exception as exc:         # noqa: BLE001
            return exc
        return None

    def result(self) -> List[torch.Tensor]:
        return self._fut.value()

    def source_rank(self) -> int:
        self.wait()
        return self._source() if callable(self._source) else self._source

    _source_rank = source_rank


def _result_buffer(out: torch.Tensor, src: Optional[torch.Tensor],
                   dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Where MPI writes a result meant for out: out itself where it is a contiguous host
    tensor of dtype (default its own) apart from src (a host tensor or None), else a fresh host
    tensor to copy into out (a fresh buffer costs its page faults: a 32 MiB reduce_scatter
    took 3x MPI's time)."""
    dtype = out.dtype if dtype is None else dtype
    if (dtype == out.dtype and not on_device(out) and out.is_contiguous()
            and (src is None or not np.may_share_memory(host_view(out), host_view(src)))):
        return out
    return torch.empty(out.shape, dtype=dtype)


def _with_displacements(counts: List[int]):
    """(counts, displacements) of blocks laid end to end, for MPI_Alltoallv."""
    return counts, [sum(counts[:r]) for r in range(len(counts))]


def _devices(tensors) -> List[torch.device]:
    return sorted({t.device for t in tensors if t.is_cuda}, key=str)


@_run_eagerly
class ProcessGroupPartialcoll(dist.ProcessGroup):
    """A torch.distributed process group whose collectives run on MPI and the engine.

    comm: its MPI communicator; the group works on a duplicate (own=True: on comm
    itself, which it then frees). timeout: of every wait (None: none)."""

    def __init__(self, comm: MPI.Comm, timeout: Optional[timedelta] = None, own: bool = False) -> None:
        super().__init__(comm.Get_rank(), comm.Get_size())   # type: ignore[call-arg]  # (rank, size): torch's Python-group constructor, not in its stub
        self.comm = comm if own else comm.Dup()
        self._rank, self._size = self.comm.Get_rank(), self.comm.Get_size()
        self._timeout: Optional[float] = None
        self.set_timeout(timeout)
        self._colls: "OrderedDict[tuple, PartialAllreduce]" = OrderedDict()
        self._completer = Completer("partialcoll-pg")
        self._unusable: Optional[str] = None   # why collectives are refused (timeout, abort, shutdown)

    # -- identity ------------------------------------------------------------------------
    def getBackendName(self) -> str:
        return NAME

    def getRank(self) -> int:
        return self._rank

    def getSize(self) -> int:
        return self._size

    # torch names its groups (functional collectives find them by name); a Python group
    # keeps its own name (the base class would look for it in a backend it does not have)
    def setGroupName(self, name: str) -> None:
        self._group_name = name

    def getGroupName(self) -> str:
        return getattr(self, "_group_name", "")

    def setGroupDesc(self, desc: str) -> None:
        self._group_desc = desc

    def getGroupDesc(self) -> str:
        return getattr(self, "_group_desc", "")

    def set_timeout(self, timeout: Optional[timedelta]) -> None:
        self._timeout = None if timeout is None else max(timeout.total_seconds(), 0.0)

    def __repr__(self) -> str:
        return f"ProcessGroupPartialcoll(rank={self._rank}, size={self._size})"

    def stats(self) -> _stats.Stats:
        """Who is slow over the group's engine allreduces held now (docs/who-is-slow.md;
        collective over the group)."""
        return _stats.merge([c.stats() for c in _stats.ordered(self._colls.values())],
                            "the process group's allreduces")

    # -- helpers ---------------------------------------------------------------------------
    def _usable(self) -> None:
        if self._unusable is not None:
            raise StateError(f"the partialcoll process group cannot be used: {self._unusable}")

    def _wait(self, req: MPI.Request, what: str, keep=(), status: Optional[MPI.Status] = None,
              nbytes: int = 0) -> None:
        """Wait for an MPI request within the group's timeout (MPI's Wait has none); MPIError
        as soon as the MPI reports a member as failed. After either the group refuses
        further collectives. It waits under the engine's idle policy (wait_request), yielding
        the core at least four times the time nbytes take at 1 GB/s (MPI's nonblocking
        collectives move only while tested) before it sleeps."""
        check = failed_peers_check(comm_handle(self.comm), self._rank, f"{what} of the partialcoll process group")
        try:
            done = wait_request(req, self._timeout, keep, status, check, busy_seconds(nbytes))
        except MPIError:
            self._unusable = f"{what} failed"
            raise
        if not done:
            self._unusable = f"{what} timed out"
            raise Timeout(f"{what} of the partialcoll process group did not complete within the group's "
                          f"timeout ({self._timeout:g} s; this is rank {self._rank} of {self._size}); the "
                          f"group refuses further collectives")

    def _run(self, start: Callable[[], MPI.Request], what: str, keep=()) -> None:
        """Start a collective and wait for it; keep: its buffer or a tuple of them."""
        self._usable()
        bufs = keep if isinstance(keep, tuple) else (keep,)
        self._wait(start(), what, keep, nbytes=sum(getattr(b, "nbytes", 0) for b in bufs))

    @staticmethod
    def _reduce_view(t: torch.Tensor, kind):
        """(array to hand MPI, MPI op, write-back or None) for a reduction on host tensor t."""
        if kind == _R.PREMUL_SUM:
            raise ArgumentError("ReduceOp.PREMUL_SUM is not supported by the partialcoll process group")
        if t.dtype == torch.bool:
            return host_view(t).view(np.bool_), _BOOL_OPS[kind], None
        if t.dtype in _HALF:                  # MPI has no half types: reduce in float32
            wide = t.float()
            return host_view(wide), _MPI_OPS[kind], lambda: t.copy_(wide)
        return host_view(t), _MPI_OPS[kind], None

    def _average(self, t: torch.Tensor, kind) -> None:
        if kind == _R.AVG:
            t.div_(self._size) if t.is_floating_point() else t.floor_divide_(self._size)

    # -- allreduce -----------------------------------------------------------------------
    def allreduce(self, tensors: List[torch.Tensor], opts=None) -> "dist.Work":
        self._usable()
        kind = _op_type(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        if len(tensors) == 1 and self._engine_worthy(tensors[0], kind):
            return self._engine_allreduce(tensors[0], kind)
        for t in tensors:
            self._mpi_allreduce(t, kind)
        return Work.done(tensors, _devices(tensors))

    def allreduce_coalesced(self, tensors: List[torch.Tensor], opts=None) -> "dist.Work":
        """dist.all_reduce_coalesced and the functional all_reduce_coalesced: each tensor
        reduced as allreduce reduces it (MPI's call, waited for here)."""
        self._usable()
        kind = _op_type(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        for t in tensors:
            self._mpi_allreduce(t, kind)
        return Work.done(tensors, _devices(tensors))

    def _engine_worthy(self, t: torch.Tensor, kind) -> bool:
        return (kind in (_R.SUM, _R.AVG) and t.is_contiguous() and t.numel() > 0
                and (t.dtype in _HALF or (t.dtype in (torch.float32, torch.float64)
                                          and t.numel() * t.element_size() >= ENGINE_MIN_BYTES)))

    def _engine_allreduce(self, t: torch.Tensor, kind) -> "dist.Work":
        key = (t.numel(), str(t.dtype), kind == _R.AVG)
        coll = self._colls.get(key)
        if coll is None:
            # made collectively: every rank calls allreduce with the same sizes in the same order
            if len(self._colls) >= MAX_CACHED:
                _, old = self._colls.popitem(last=False)
                # the completion thread may still wait for its rounds: it closes it after them
                # (collective: every rank evicts the same one at the same point)
                self._completer.later(old.close)
            coll = PartialAllreduce(t.numel(), np_dtype(t), MPI.SUM, self.comm, mode="full",
                                    divisor=float(self._size) if kind == _R.AVG else 1.0)
            self._colls[key] = coll
        else:
            self._colls.move_to_end(key)
        x, land = buffer_of(t)
        req = coll.post(x, out=x)
        timeout = self._timeout

        def finish():
            req.wait(timeout=timeout)
            if land is not None:
                land()
            return [t]

        return Work(self._completer.submit(finish, _devices([t])))

    def _mpi_allreduce(self, t: torch.Tensor, kind) -> None:
        host, land = host_copy(t, write_back=True)
        arr, mpi_op, widened = self._reduce_view(host, kind)
        self._run(lambda: self.comm.Iallreduce(MPI.IN_PLACE, arr, op=mpi_op), "allreduce", arr)
        if widened is not None:
            widened()
        self._average(host, kind)
        if land is not None:
            land()

    # -- the other collectives ---------------------------------------------------------------
    def broadcast(self, tensors: List[torch.Tensor], opts) -> "dist.Work":
        for t in tensors:
            host, land = host_copy(t, write_back=self._rank != opts.rootRank)
            buf = host_view(host).view(np.uint8)
            self._run(lambda: self.comm.Ibcast(buf, root=opts.rootRank), "broadcast", buf)
            if land is not None:
                land()
        return Work.done(tensors, _devices(tensors))

    def _allgather_into(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        """out (size x inp's elements, contiguous host) = every rank's inp. inp may be a view
        of out, as torch allows (FSDP2 gathers in place): this rank's chunk of out is
        MPI_IN_PLACE; any other overlap is copied first (MPI forbids aliased buffers)."""
        src, _ = host_copy(inp, write_back=False)
        a, b = host_view(src).view(np.uint8), host_view(out).view(np.uint8)
        send: Any = a
        if np.may_share_memory(a, b):
            own = b[self._rank * a.nbytes:(self._rank + 1) * a.nbytes]
            send = MPI.IN_PLACE if own.ctypes.data == a.ctypes.data else a.copy()
        self._run(lambda: self.comm.Iallgather(send, b), "allgather", (a, b, send))

    def allgather(self, output_tensors: List[List[torch.Tensor]], input_tensors: List[torch.Tensor],
                  opts=None) -> "dist.Work":
        for outs, inp in zip(output_tensors, input_tensors):
            if len(outs) != self._size:
                raise ArgumentError(f"allgather needs {self._size} output tensors, not {len(outs)}")
            flat = torch.empty((self._size,) + tuple(inp.shape), dtype=inp.dtype)
            self._allgather_into(flat, inp)
            for o, piece in zip(outs, flat):
                o.copy_(piece)
        return Work.done(output_tensors, _devices(input_tensors))

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts=None) -> "dist.Work":
        if output.numel() != input.numel() * self._size:
            raise ArgumentError(f"all_gather_single: output has {output.numel()} elements, "
                                f"needs {input.numel()} x {self._size}")
        out, land = host_copy(output, write_back=True)
        self._allgather_into(out, input)
        if land is not None:
            land()
        return Work.done([output], _devices([output]))

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs: List[torch.Tensor], inputs: List[torch.Tensor],
                                    opts=None) -> "dist.Work":
        """all_gather_into_tensor of each pair (the functional collectives and DTensor
        gather through this)."""
        for out, inp in zip(outputs, inputs):
            self.all_gather_single(out, inp, opts)
        return Work.done(list(outputs), _devices(outputs))

    # torch's older name (its stub names the arguments differently; torch passes them by position)
    allgather_into_tensor_coalesced = all_gather_single_coalesced   # type: ignore[assignment]

    def allgather_coalesced(self, output_lists: List[List[torch.Tensor]], input_list: List[torch.Tensor],
                            opts=None) -> "dist.Work":
        """dist.all_gather_coalesced: output_lists[r][i] = rank r's input_list[i]."""
        if len(output_lists) != self._size:
            raise ArgumentError(f"all_gather_coalesced needs {self._size} output lists, not {len(output_lists)}")
        for i, inp in enumerate(input_list):
            self.allgather([[outs[i] for outs in output_lists]], [inp], opts)
        return Work.done([t for outs in output_lists for t in outs], _devices(input_list))

    def reduce_scatter(self, output_tensors: List[torch.Tensor], input_tensors: List[List[torch.Tensor]],
                       opts) -> "dist.Work":
        for out, ins in zip(output_tensors, input_tensors):
            if len(ins) != self._size:
                raise ArgumentError(f"reduce_scatter needs {self._size} input tensors, not {len(ins)}")
            self._reduce_scatter_into(out, torch.stack([i.reshape(out.shape) for i in ins]), opts.reduceOp)
        return Work.done(output_tensors, _devices(output_tensors))

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts) -> "dist.Work":
        if input.numel() != output.numel() * self._size:
            raise ArgumentError(f"reduce_scatter_single: input has {input.numel()} elements, "
                                f"needs {output.numel()} x {self._size}")
        self._reduce_scatter_into(output, input, opts.reduceOp)
        return Work.done([output], _devices([output]))

    _reduce_scatter_base = reduce_scatter_single   # type: ignore[assignment]  # the protocol's opts, as above

    def reduce_scatter_single_coalesced(self, outputs: List[torch.Tensor], inputs: List[torch.Tensor],
                                        opts) -> "dist.Work":
        """reduce_scatter_tensor of each pair (the functional collectives, FSDP2)."""
        for out, inp in zip(outputs, inputs):
            self.reduce_scatter_single(out, inp, opts)
        return Work.done(list(outputs), _devices(outputs))

    # torch's older name (its stub's opts may be None; torch always passes them)
    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced   # type: ignore[assignment]

    def _reduce_scatter_into(self, out: torch.Tensor, stacked: torch.Tensor, op) -> None:
        """out = this rank's block of the reduction of every rank's stacked (into out itself
        where it can: _result_buffer)."""
        kind = _op_type(op)
        host, _ = host_copy(stacked, write_back=False)
        src, mpi_op, _ = self._reduce_view(host, kind)
        res = _result_buffer(out, host, torch.float32 if out.dtype in _HALF else out.dtype)
        dst = host_view(res).view(np.bool_) if res.dtype == torch.bool else host_view(res)
        self._run(lambda: self.comm.Ireduce_scatter_block(src, dst, op=mpi_op), "reduce_scatter", (src, dst))
        self._average(res, kind)
        if res is not out:
            out.copy_(res)

    def barrier(self, opts=None) -> "dist.Work":
        self._run(self.comm.Ibarrier, "barrier")
        return Work.done([])

    def reduce(self, tensors: List[torch.Tensor], opts) -> "dist.Work":
        kind, root = _op_type(opts.reduceOp), opts.rootRank
        for t in tensors:
            host, land = host_copy(t, write_back=self._rank == root)
            arr, mpi_op, widened = self._reduce_view(host, kind)
            send = MPI.IN_PLACE if self._rank == root else arr
            self._run(lambda: self.comm.Ireduce(send, arr, op=mpi_op, root=root), "reduce", arr)
            if self._rank == root:
                if widened is not None:
                    widened()
                self._average(host, kind)
                if land is not None:
                    land()
        return Work.done(tensors, _devices(tensors))

    def gather(self, output_tensors: List[List[torch.Tensor]], input_tensors: List[torch.Tensor],
               opts) -> "dist.Work":
        root, inp = opts.rootRank, input_tensors[0]
        src, _ = host_copy(inp, write_back=False)
        flat = torch.empty((self._size,) + tuple(inp.shape), dtype=inp.dtype) if self._rank == root else None
        a = host_view(src).view(np.uint8)
        b = host_view(flat).view(np.uint8) if flat is not None else None
        self._run(lambda: self.comm.Igather(a, b, root=root), "gather", (a, b))
        if flat is not None:
            for o, piece in zip(output_tensors[0], flat):
                o.copy_(piece)
        return Work.done(output_tensors, _devices(input_tensors))

    def scatter(self, output_tensors: List[torch.Tensor], input_tensors: List[List[torch.Tensor]],
                opts) -> "dist.Work":
        root, out = opts.rootRank, output_tensors[0]
        stacked = torch.stack([i.detach().cpu() for i in input_tensors[0]]) if self._rank == root else None
        res = _result_buffer(out, stacked)
        src = host_view(stacked).view(np.uint8) if stacked is not None else None
        dst = host_view(res).view(np.uint8)
        self._run(lambda: self.comm.Iscatter(src, dst, root=root), "scatter", (src, dst))
        if res is not out:
            out.copy_(res)
        return Work.done(output_tensors, _devices(output_tensors))

    def alltoall_base(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: List[int],
                      input_split_sizes: List[int], opts) -> "dist.Work":
        """all_to_all_single: rank r gets input's split r of every rank; the splits are rows
        (dim 0), equal when no sizes are given."""
        src, _ = host_copy(input, write_back=False)
        res = _result_buffer(output, src)
        a, b = host_view(src).view(np.uint8), host_view(res).view(np.uint8)
        send = self._splits(input, input_split_sizes, "input")
        recv = self._splits(output, output_split_sizes, "output")
        if len(set(send[0] + recv[0])) == 1:        # equal splits: MPI_Ialltoall (Ialltoallv took 1.5x)
            self._run(lambda: self.comm.Ialltoall(a, b), "alltoall", (a, b))
        else:
            self._run(lambda: self.comm.Ialltoallv([a, send], [b, recv]), "alltoall", (a, b))
        if res is not output:
            output.copy_(res)
        return Work.done([output], _devices([output]))

    def _splits(self, t: torch.Tensor, sizes: List[int], what: str):
        """(counts, displacements) in bytes of t's dim-0 splits for MPI_Alltoallv."""
        rows = t.shape[0] if t.dim() else 1
        row = t.numel() // rows * t.element_size() if rows else 0
        if not sizes:
            if rows % self._size:
                raise ArgumentError(f"all_to_all_single: the {what}'s {rows} rows do not split evenly over "
                                    f"{self._size} ranks; give the split sizes")
            sizes = [rows // self._size] * self._size
        if len(sizes) != self._size or any(n < 0 for n in sizes) or sum(sizes) != rows:
            raise ArgumentError(f"all_to_all_single: {what} split sizes {list(sizes)} must be {self._size} "
                                f"non-negative numbers of rows summing to {rows}")
        return _with_displacements([n * row for n in sizes])

    def alltoall(self, output_tensors: List[torch.Tensor], input_tensors: List[torch.Tensor],
                 opts=None) -> "dist.Work":
        """dist.all_to_all: output_tensors[r] = rank r's input_tensors[this rank] (any sizes
        that match in pairs)."""
        if len(output_tensors) != self._size or len(input_tensors) != self._size:
            raise ArgumentError(f"all_to_all needs {self._size} input and output tensors")
        src = torch.cat([t.detach().cpu().reshape(-1).view(torch.uint8) for t in input_tensors])
        res = torch.empty(sum(t.numel() * t.element_size() for t in output_tensors), dtype=torch.uint8)
        scount = [t.numel() * t.element_size() for t in input_tensors]
        rcount = [t.numel() * t.element_size() for t in output_tensors]
        a, b = src.numpy(), res.numpy()
        send, recv = _with_displacements(scount), _with_displacements(rcount)
        self._run(lambda: self.comm.Ialltoallv([a, send], [b, recv]), "alltoall", (a, b))
        for out, piece in zip(output_tensors, torch.split(res, rcount)):
            out.copy_(piece.view(out.dtype).reshape(out.shape))
        return Work.done(list(output_tensors), _devices(output_tensors))

    # -- point to point ----------------------------------------------------------------------
    def send(self, tensors: List[torch.Tensor], dstRank: int, tag: int) -> "dist.Work":
        self._usable()
        host, _ = host_copy(tensors[0], write_back=False)
        buf = host_view(host).view(np.uint8)
        req = self.comm.Isend(buf, dest=dstRank, tag=tag)
        return self._p2p(req, "send", buf, None, tensors, MPI.Status())

    def recv(self, tensors: List[torch.Tensor], srcRank: int, tag: int) -> "dist.Work":
        return self._recv(tensors, srcRank, tag)

    def recv_anysource(self, tensors: List[torch.Tensor], tag: int) -> "dist.Work":
        return self._recv(tensors, MPI.ANY_SOURCE, tag)

    def _recv(self, tensors: List[torch.Tensor], source: int, tag: int) -> "dist.Work":
        self._usable()
        host, land = host_copy(tensors[0], write_back=True)
        buf = host_view(host).view(np.uint8)
        req = self.comm.Irecv(buf, source=source, tag=tag)
        return self._p2p(req, "recv", buf, land, tensors, MPI.Status())

    def _p2p(self, req: MPI.Request, what: str, buf, land, tensors, status: MPI.Status) -> "dist.Work":
        """The Work of an MPI send or receive: the completion thread waits for it."""
        def finish():
            self._wait(req, what, buf, status)
            if land is not None:
                land()
            return list(tensors)

        return Work(self._completer.submit(finish, _devices(tensors)), status.Get_source)

    # -- lifetime -------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Collective (dist.destroy_process_group): close the persistent allreduces, free the
        communicator."""
        if self._unusable in ("it was shut down", "it was aborted"):
            return
        self._completer.stop()
        colls = list(self._colls.values())
        self._colls.clear()
        close_all(colls)
        self._unusable = "it was shut down"
        if not MPI.Is_finalized() and self.comm != MPI.COMM_NULL:
            self.comm.Free()

    def abort(self) -> None:
        """This rank only, at once: every Work not completed fails; the engine's collectives
        are dropped by the completion thread after the waits it is in (never under them)."""
        if self._unusable is None:
            self._unusable = "it was aborted"
        colls, self._colls = list(self._colls.values()), OrderedDict()

        def drop() -> None:
            for coll in colls:
                coll._abandon()

        self._completer.abort(StateError(f"the partialcoll process group was aborted (rank {self._rank})"), drop)


def _create(dist_opts, backend_options=None) -> ProcessGroupPartialcoll:
    """The backend's creator (extended API): the group's communicator from its global ranks."""
    comm = _torch_comm.group_comm(list(dist_opts.global_ranks_in_group))
    if dist_opts.group_size not in (-1, comm.Get_size()) or dist_opts.group_rank not in (-1, comm.Get_rank()):
        raise ArgumentError(f"the partialcoll backend takes rank and size from MPI: this process is rank "
                            f"{comm.Get_rank()} of {comm.Get_size()}, but torch was given rank "
                            f"{dist_opts.group_rank} of {dist_opts.group_size}")
    timeout = dist_opts.timeout
    if timeout == _TORCH_DEFAULT_TIMEOUT:        # none was passed: partialcoll's, not torch's 30 minutes
        timeout = _default_timeout()
    _propagate.install()
    return ProcessGroupPartialcoll(comm, timeout, own=True)


def _default_timeout() -> Optional[timedelta]:
    """pc.rc.timeout as a process group's timeout (None: none)."""
    return None if rc.timeout is None else timedelta(seconds=rc.timeout)


def register_backend() -> None:
    """Register the ``partialcoll`` backend (CPU and CUDA tensors) and the ``mpi://``
    rendezvous with torch.distributed (idempotent; never done at import)."""
    if NAME.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(NAME, _create, extended_api=True, devices=["cpu", "cuda"])
    _torch_comm.register_rendezvous()


def init_process_group(comm: Optional[MPI.Comm] = None, backend: str = NAME,
                       timeout: Optional[timedelta] = None) -> None:
    """dist.init_process_group over an MPI communicator (default COMM_WORLD), under
    mpiexec with nothing in the environment: rank and size from comm, and a TCPStore that
    every rank finds over MPI (torch's store, for new_group and other backends), so
    backend may also be "gloo". Sets LOCAL_RANK, LOCAL_WORLD_SIZE, RANK and WORLD_SIZE
    where unset, for scripts written for torchrun. Collective over comm."""
    comm = MPI.COMM_WORLD if comm is None else comm
    register_backend()
    _torch_comm.set_launch_env(comm)
    _torch_comm.set_world(comm)
    _propagate.install()             # an uncaught exception ends the job (rc.abort_on_exception)
    if timeout is None:              # pc.rc.timeout, not torch's 30 minutes
        timeout = _default_timeout() or timedelta(days=365)
    kwargs: Dict[str, Any] = {"timeout": timeout}
    store = _torch_comm.mpi_store(comm, min(timeout, timedelta(minutes=5)))
    dist.init_process_group(backend, store=store, rank=comm.Get_rank(), world_size=comm.Get_size(), **kwargs)
