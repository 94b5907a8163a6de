"""PyTorch integration: eager-SGD (and RNA's weighted averaging) in a few lines.

* ``partial_allreduce_hook`` -- a DDP communication hook: each gradient bucket is
  reduced by a persistent partial allreduce (one per bucket, created on first use)::

      state = PartialHookState(mode="solo", comm=MPI.COMM_WORLD)
      ddp.register_comm_hook(state, partial_allreduce_hook)

* ``GradientSynchronizer`` -- for scripts without DDP: after ``backward()``, call
  ``sync()``; it posts the gradients (fused into buckets) and replaces them by the
  round's result, averaged by P (eager-SGD) or by the number of active processes
  (``average="nap"``, RNA). Stale gradients are carried by the library's accumulator.

* ``sync_parameters`` -- periodic model synchronisation (eager-SGD §5): average the
  parameters (or broadcast rank 0's) with a full allreduce, so models do not drift.

CPU tensors go through NumPy without copies. CUDA tensors go to the library as CuPy
views (DLPack, no copy) where CuPy and a GPU are present, so the accumulator's fold runs
on the GPU and only the library's staging touches host memory; without CuPy they are
copied to the host and back.
"""
from typing import Dict, Iterable, List, Optional

import numpy as np
import torch
import torch.distributed as dist
from mpi4py import MPI

from .. import _device
from .._errors import ArgumentError, InvalidBufferError
from .._partial import PartialAllreduce, Result

_AVERAGES = ("world", "nap", "none")


def _as_numpy(t: torch.Tensor) -> np.ndarray:
    """A NumPy view of a contiguous CPU tensor (a host copy of a CUDA one)."""
    if t.is_cuda:
        return t.detach().cpu().numpy()
    return t.detach().numpy()


def _as_buffer(t: torch.Tensor):
    """What to post: a CuPy view of a CUDA tensor where CuPy can use the GPU, else NumPy."""
    if t.is_cuda and _gpu_usable():
        return _device.cupy_backend().adopt(t.detach().contiguous())
    return _as_numpy(t)


def _to_tensor(data, device: torch.device) -> torch.Tensor:
    """A tensor on `device` holding a result (a CuPy result stays on the GPU: DLPack)."""
    if isinstance(data, np.ndarray):
        return torch.from_numpy(data).to(device)
    return torch.from_dlpack(data).to(device)


def _gpu_usable() -> bool:
    try:
        _device.cupy_backend()
        return True
    except InvalidBufferError:
        return False


def _scale(data, res: Result, average: str, size: int):
    if average == "world":
        return data / size
    if average == "nap":
        return data / max(res.nap, 1)
    return data


class PartialHookState:
    """Options and per-bucket collectives of partial_allreduce_hook."""

    def __init__(self, mode: str = "solo", comm: MPI.Comm = MPI.COMM_WORLD, average: str = "world",
                 **options) -> None:
        if average not in _AVERAGES:
            raise ArgumentError(f"average must be one of {_AVERAGES}, not {average!r}")
        self.mode, self.comm, self.average, self.options = mode, comm, average, options
        self.colls: Dict[int, PartialAllreduce] = {}
        self.last: Dict[int, Result] = {}

    def coll_for(self, index: int, numel: int, dtype) -> "PartialAllreduce":
        coll = self.colls.get(index)
        if coll is None:
            coll = PartialAllreduce(numel, dtype, MPI.SUM, self.comm, mode=self.mode, **self.options)
            self.colls[index] = coll
        return coll

    def close(self) -> Dict[int, Result]:
        """Collective: flush every bucket's collective; returns the final results."""
        out = {i: c.close() for i, c in sorted(self.colls.items())}
        self.colls.clear()
        return out


# No `from __future__ import annotations` here: DDP checks these annotations as objects.
def partial_allreduce_hook(state: PartialHookState,
                           bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: reduce the bucket with a persistent partial allreduce."""
    buf = bucket.buffer()
    coll = state.coll_for(bucket.index(), buf.numel(), _np_dtype(buf))
    res = coll.post(_as_buffer(buf)).wait()
    state.last[bucket.index()] = res
    out = _to_tensor(_scale(res.data, res, state.average, state.comm.size).astype(res.data.dtype), buf.device)
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(out)
    return fut


class GradientSynchronizer:
    """Partial-allreduce gradient averaging for models trained without DDP.

        sync = GradientSynchronizer(model.parameters(), mode="solo", average="nap")
        loss.backward(); sync.sync(); optimizer.step()
    """

    def __init__(self, params: Iterable[torch.nn.Parameter], mode: str = "solo",
                 comm: MPI.Comm = MPI.COMM_WORLD, average: str = "world", bucket_mb: float = 25.0,
                 model_sync_every: Optional[int] = None, **options) -> None:
        if average not in _AVERAGES:
            raise ArgumentError(f"average must be one of {_AVERAGES}, not {average!r}")
        self.params: List[torch.nn.Parameter] = [p for p in params if p.requires_grad]
        self.comm, self.average, self.every = comm, average, model_sync_every
        self.steps = 0
        self.last: List[Result] = []
        # fuse parameters (in order) into buckets of at most bucket_mb
        self.buckets: List[List[torch.nn.Parameter]] = [[]]
        limit, size = bucket_mb * (1 << 20), 0
        for p in self.params:
            nbytes = p.numel() * p.element_size()
            if self.buckets[-1] and (size + nbytes > limit or p.dtype != self.buckets[-1][0].dtype):
                self.buckets.append([])
                size = 0
            self.buckets[-1].append(p)
            size += nbytes
        self.buckets = [b for b in self.buckets if b]
        self.colls = [PartialAllreduce(sum(p.numel() for p in b), _np_dtype(b[0]), MPI.SUM, comm, mode=mode,
                                       **options) for b in self.buckets]

    def sync(self) -> List[Result]:
        """Post every gradient; replace it by the averaged round result. Returns the results."""
        self.last = []
        reqs = []
        for bucket, coll in zip(self.buckets, self.colls):
            flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).detach().reshape(-1)
                              for p in bucket])
            reqs.append(coll.post(_as_buffer(flat)))
        for bucket, req in zip(self.buckets, reqs):
            res = req.wait()
            self.last.append(res)
            self._write(bucket, _scale(res.data, res, self.average, self.comm.size))
        self.steps += 1
        if self.every and self.steps % self.every == 0:
            sync_parameters(self.params, self.comm)
        return self.last

    @staticmethod
    def _write(bucket, flat) -> None:
        flat = _to_tensor(flat, bucket[0].device)
        offset = 0
        for p in bucket:
            n = p.numel()
            g = flat[offset:offset + n].reshape(p.shape).to(p.dtype)
            if p.grad is None:
                p.grad = g.clone()
            else:
                p.grad.copy_(g)
            offset += n

    def close(self) -> List[Result]:
        """Collective: flush the accumulators (gradients not yet applied anywhere)."""
        out = [c.close() for c in self.colls]
        self.colls = []
        return out


def sync_parameters(params: Iterable[torch.Tensor], comm: MPI.Comm = MPI.COMM_WORLD, how: str = "average") -> None:
    """Make every rank's parameters identical: their average, or rank 0's (how="broadcast")."""
    if how not in ("average", "broadcast"):
        raise ArgumentError(f"how must be 'average' or 'broadcast', not {how!r}")
    with torch.no_grad():
        for p in params:
            host = _as_numpy(p.data).copy()
            if how == "average":
                out = np.empty_like(host)
                comm.Allreduce(host, out)
                out /= comm.size
            else:
                comm.Bcast(host, root=0)
                out = host
            p.data.copy_(torch.from_numpy(out).to(p.device))


def _np_dtype(p: torch.Tensor) -> np.dtype:
    return np.dtype(str(p.dtype).replace("torch.", ""))
