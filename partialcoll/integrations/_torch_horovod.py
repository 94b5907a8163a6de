"""Horovod's torch API, as Horovod users call it (``horovod.torch``'s names, arguments and
errors), over MPI communicators: a script changes its import, not its calls.

Every call here is collective over ``comm`` (default: MPI.COMM_WORLD, Horovod's global
process set) and blocking; each MPI request is waited for under the engine's idle policy
with ``pc.rc.timeout`` (partialcoll.averager._wait_collective), so a rank that never
reaches the call makes the others raise Timeout instead of hanging.
"""
from __future__ import annotations

import pickle
from typing import Any, Iterable, Optional, Tuple

import numpy as np
import torch
from mpi4py import MPI

from .._errors import ArgumentError
from ..averager import _wait_collective
from ._torch_comm import local_rank as local_rank, local_size as local_size
from ._torch_common import host_copy, host_view

# Horovod's reduction ops (hvd.Average, hvd.Sum, ...).
Average = "average"
Sum = "sum"
Adasum = "adasum"
Min = "min"
Max = "max"
Product = "product"
_MPI_OPS = {Average: MPI.SUM, Sum: MPI.SUM, Min: MPI.MIN, Max: MPI.MAX, Product: MPI.PROD}


class NoneCompressor:
    """Horovod's Compression.none: gradients travel as they are."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> Tuple[torch.Tensor, Any]:
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor


class FP16Compressor:
    """Horovod's Compression.fp16: floating tensors travel as float16 (the engine reduces
    float16 itself), and come back in their own dtype."""

    wire = torch.float16

    @staticmethod
    def compress(tensor: torch.Tensor) -> Tuple[torch.Tensor, Any]:
        if tensor.dtype.is_floating_point:
            return tensor.to(torch.float16), tensor.dtype
        return tensor, tensor.dtype

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor.to(ctx) if ctx is not None and ctx.is_floating_point else tensor


class Compression:
    """Horovod's compression options: ``Compression.none`` and ``Compression.fp16``."""

    none = NoneCompressor
    fp16 = FP16Compressor


def wire_dtype(compression, dtype: torch.dtype) -> torch.dtype:
    """The dtype gradients of dtype travel in under compression (checked)."""
    if compression in (None, NoneCompressor):
        return dtype
    if compression is FP16Compressor:
        return torch.float16 if dtype.is_floating_point else dtype
    raise ArgumentError(f"compression must be Compression.none or Compression.fp16, not {compression!r}")


def _comm(comm: Optional[MPI.Comm], process_set) -> MPI.Comm:
    if process_set is not None:
        raise ArgumentError("process_set= is Horovod's; pass comm= (an MPI communicator of the processes) instead")
    return MPI.COMM_WORLD if comm is None else comm


def init(comm: Optional[MPI.Comm] = None) -> None:
    """Horovod's hvd.init(): nothing to start (MPI is initialised by mpi4py)."""


def shutdown() -> None:
    """Horovod's hvd.shutdown(): nothing to stop (partialcoll's engine stops at exit)."""


def is_initialized() -> bool:
    return MPI.Is_initialized() and not MPI.Is_finalized()


def rank() -> int:
    """This process's rank in MPI.COMM_WORLD (hvd.rank())."""
    return MPI.COMM_WORLD.Get_rank()


def size() -> int:
    """The number of processes in MPI.COMM_WORLD (hvd.size())."""
    return MPI.COMM_WORLD.Get_size()


def barrier(process_set=None, comm: Optional[MPI.Comm] = None) -> None:
    """Every rank has reached it (hvd.barrier())."""
    comm = _comm(comm, process_set)
    _wait_collective(comm.Ibarrier(), "barrier", None, comm=comm)


def _flat(host: torch.Tensor) -> np.ndarray:
    """A NumPy view of a contiguous host tensor, 0-d tensors as one element."""
    return host_view(host.reshape(-1))


def _then(first, then):
    """first(), then then() where there is one."""
    def both() -> None:
        first()
        if then is not None:
            then()
    return both


def _reduce_op(op, average) -> str:
    if average is not None:
        if op is not None:
            raise ValueError("The op parameter supersedes average. Please provide only one of them.")
        return Average if average else Sum
    op = Average if op is None else op
    if op == Adasum:
        raise ArgumentError("Adasum is not offered by partialcoll: use op=Average or op=Sum")
    if op not in _MPI_OPS:
        raise ArgumentError(f"op must be one of Average, Sum, Min, Max, Product, not {op!r}")
    return op


def allreduce_(tensor: torch.Tensor, average=None, name: Optional[str] = None, op=None,
               prescale_factor: float = 1.0, postscale_factor: float = 1.0, process_set=None,
               comm: Optional[MPI.Comm] = None) -> torch.Tensor:
    """In place: the tensor becomes its reduction over the ranks (op=Average by default:
    the sum divided by the number of ranks; integers floor-divided), scaled by
    prescale_factor before and postscale_factor after. Returns the tensor."""
    comm = _comm(comm, process_set)
    op = _reduce_op(op, average)
    with torch.no_grad():
        host, land = host_copy(tensor.detach(), write_back=True)
        if host.dtype in (torch.float16, torch.bfloat16):      # MPI has no such type: reduced in float32
            narrow, host = host, host.float()
            land = _then(lambda: narrow.copy_(host), land)
        if prescale_factor != 1.0:
            host.mul_(prescale_factor)
        arr = _flat(host)
        req = comm.Iallreduce(MPI.IN_PLACE, arr, op=_MPI_OPS[op])
        _wait_collective(req, f"allreduce{f' {name!r}' if name else ''}", None, keep=(host, arr), comm=comm,
                         nbytes=arr.nbytes)
        if op == Average:
            if host.is_floating_point() or host.is_complex():
                host.div_(comm.Get_size())
            else:
                host.copy_(torch.div(host, comm.Get_size(), rounding_mode="floor"))
        if postscale_factor != 1.0:
            host.mul_(postscale_factor)
        if land is not None:
            land()
    return tensor


def allreduce(tensor: torch.Tensor, average=None, name: Optional[str] = None, compression=Compression.none,
              op=None, prescale_factor: float = 1.0, postscale_factor: float = 1.0, process_set=None,
              comm: Optional[MPI.Comm] = None) -> torch.Tensor:
    """A new tensor: the reduction of tensor over the ranks (op=Average by default), the
    input untouched; ``compression=Compression.fp16`` reduces floating tensors in float16."""
    wire, ctx = compression.compress(tensor.detach())
    out = wire.clone() if wire is tensor or wire.data_ptr() == tensor.data_ptr() else wire.contiguous()
    allreduce_(out, average=average, name=name, op=op, prescale_factor=prescale_factor,
               postscale_factor=postscale_factor, process_set=process_set, comm=comm)
    return compression.decompress(out, ctx)


def broadcast_(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None, process_set=None,
               comm: Optional[MPI.Comm] = None) -> torch.Tensor:
    """In place: the tensor becomes root_rank's. Returns the tensor."""
    comm = _comm(comm, process_set)
    _check_root(root_rank, comm)
    with torch.no_grad():
        host, land = host_copy(tensor.detach(), write_back=True)
        arr = _flat(host).view(np.uint8)
        req = comm.Ibcast(arr, root=root_rank)
        _wait_collective(req, f"broadcast{f' {name!r}' if name else ''}", None, keep=(host, arr), comm=comm,
                         nbytes=arr.nbytes)
        if land is not None:
            land()
    return tensor


def broadcast(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None, process_set=None,
              comm: Optional[MPI.Comm] = None) -> torch.Tensor:
    """A new tensor holding root_rank's values (the input untouched)."""
    return broadcast_(tensor.detach().clone(), root_rank, name=name, process_set=process_set, comm=comm)


def allgather(tensor: torch.Tensor, name: Optional[str] = None, process_set=None,
              comm: Optional[MPI.Comm] = None) -> torch.Tensor:
    """The ranks' tensors concatenated along the first dimension, in rank order (their
    first dimensions may differ; the others must agree)."""
    comm = _comm(comm, process_set)
    t = tensor.detach()
    if t.dim() == 0:
        t = t.reshape(1)
    shapes = comm.allgather(tuple(t.shape))
    if any(s[1:] != shapes[0][1:] for s in shapes):
        raise ArgumentError(f"allgather: the ranks' tensors differ beyond the first dimension: {shapes}")
    host, _ = host_copy(t.contiguous(), write_back=False)
    out = torch.empty((sum(s[0] for s in shapes),) + tuple(shapes[0][1:]), dtype=t.dtype)
    row = host.element_size() * int(np.prod(shapes[0][1:], dtype=np.int64))
    counts = [s[0] * row for s in shapes]
    send, recv = _flat(host).view(np.uint8), _flat(out).view(np.uint8)
    req = comm.Iallgatherv(send, [recv, counts])
    _wait_collective(req, f"allgather{f' {name!r}' if name else ''}", None, keep=(host, out, send, recv), comm=comm,
                     nbytes=recv.nbytes)
    return out.to(tensor.device)


def _check_root(root_rank: int, comm: MPI.Comm) -> None:
    if not 0 <= int(root_rank) < comm.Get_size():
        raise ArgumentError(f"root_rank {root_rank} is outside the communicator (size {comm.Get_size()})")


def broadcast_object(obj: Any = None, root_rank: int = 0, name: Optional[str] = None, process_set=None,
                     comm: Optional[MPI.Comm] = None) -> Any:
    """root_rank's obj (pickled there), returned on every rank."""
    comm = _comm(comm, process_set)
    _check_root(root_rank, comm)
    what = f"broadcast_object{f' {name!r}' if name else ''}"
    payload = np.frombuffer(pickle.dumps(obj), dtype=np.uint8) if comm.Get_rank() == root_rank else None
    length = np.array([payload.size if payload is not None else 0], dtype=np.int64)
    _wait_collective(comm.Ibcast(length, root=root_rank), what, None, keep=(length,), comm=comm)
    buf = payload.copy() if payload is not None else np.empty(int(length[0]), dtype=np.uint8)
    _wait_collective(comm.Ibcast(buf, root=root_rank), what, None, keep=(buf,), comm=comm, nbytes=buf.nbytes)
    return obj if comm.Get_rank() == root_rank else pickle.loads(buf.tobytes())


def allgather_object(obj: Any, name: Optional[str] = None, process_set=None,
                     comm: Optional[MPI.Comm] = None) -> list:
    """Every rank's obj, in rank order, on every rank."""
    return _comm(comm, process_set).allgather(obj)


def _named(params) -> list:
    """(name, tensor) pairs of a state_dict (sorted by name, as Horovod) or of a sequence of
    tensors or (name, tensor) pairs (named_parameters(), parameters())."""
    if isinstance(params, dict):
        return sorted(params.items())
    if isinstance(params, (str, bytes)) or not isinstance(params, Iterable):
        raise ValueError(f"invalid params of type: {type(params)}")
    return [p if isinstance(p, tuple) else (None, p) for p in params]


def broadcast_parameters(params, root_rank: int, prefix: str = "Parameter.", process_set=None,
                         comm: Optional[MPI.Comm] = None) -> None:
    """In place: every tensor of params becomes root_rank's (``model.state_dict()``, whose
    buffers and 0-d tensors such as BatchNorm's num_batches_tracked are included, or
    ``model.named_parameters()``). A state_dict is taken in the order of its names, so the
    ranks agree whatever order their dicts were filled in."""
    comm = _comm(comm, process_set)
    for name, p in _named(params):
        if not isinstance(p, torch.Tensor):
            raise ValueError(f"broadcast_parameters: {name or 'an entry'} is a {type(p).__name__}, not a tensor")
        broadcast_(p, root_rank, name=f"{prefix}{name}" if name else None, comm=comm)


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int, model=None, process_set=None,
                              comm: Optional[MPI.Comm] = None) -> None:
    """In place: the optimizer's state and options (learning rate, momentum, ... of every
    param group) become root_rank's; the optimizer's state is taken from root_rank's
    state_dict(), so state that only root_rank has (a resumed checkpoint) reaches every
    rank. A DistributedOptimizer is accepted (its wrapped optimizer's state)."""
    comm = _comm(comm, process_set)
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("cannot broadcast torch.optim.LBFGS state")
    inner = getattr(optimizer, "optimizer", optimizer)
    state = broadcast_object(inner.state_dict() if comm.Get_rank() == root_rank else None, root_rank,
                             name="optimizer state", comm=comm)
    if comm.Get_rank() != root_rank:
        inner.load_state_dict(state)
