"""Horovod's torch calls that its pytorch_mnist.py and pytorch_synthetic_benchmark.py make,
written directly on mpi4py's blocking collectives: every step's gradients summed by
MPI_Allreduce and divided by the size, as Horovod's op=Average does. The synchronous
reference of tests/test_examples.py (horovod_port.py mpi4py) and bench/horovod_examples.py
(bench/straggle.py --hvd mpi4py); no partialcoll.
"""
import contextlib
import os
import pickle

import torch
from mpi4py import MPI

Average, Sum, Adasum = "average", "sum", "adasum"
_comm = MPI.COMM_WORLD


class Compression:
    none = "none"
    fp16 = "fp16"


def init():
    pass


def rank():
    return _comm.Get_rank()


def size():
    return _comm.Get_size()


def local_rank():
    return int(os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK", os.environ.get("MPI_LOCALRANKID", rank())))


def local_size():
    return int(os.environ.get("OMPI_COMM_WORLD_LOCAL_SIZE", os.environ.get("MPI_LOCALNRANKS", size())))


def nccl_built():
    return False


def _allreduce_sum(t):
    host = t.detach().contiguous().cpu().numpy().copy()
    _comm.Allreduce(MPI.IN_PLACE, host, op=MPI.SUM)
    return torch.from_numpy(host)


def allreduce(tensor, average=None, name=None, op=Average):
    total = _allreduce_sum(tensor)
    return total / size() if op == Average else total


def broadcast_parameters(params, root_rank):
    items = sorted(params.items()) if isinstance(params, dict) else list(params)
    for _, p in items:
        host = p.detach().contiguous().cpu().numpy().copy()
        _comm.Bcast(host, root=root_rank)
        with torch.no_grad():
            p.copy_(torch.from_numpy(host))


def broadcast_optimizer_state(optimizer, root_rank):
    inner = getattr(optimizer, "optimizer", optimizer)
    state = _comm.bcast(pickle.dumps(inner.state_dict()) if rank() == root_rank else None, root=root_rank)
    inner.load_state_dict(pickle.loads(state))


class DistributedOptimizer:
    """Every step: each gradient MPI_Allreduce'd (sum) and divided by the size, then the
    wrapped optimizer's step."""

    def __init__(self, optimizer, named_parameters=None, compression=Compression.none, op=Average,
                 gradient_predivide_factor=1.0):
        if compression != Compression.none or op != Average or gradient_predivide_factor != 1.0:
            raise ValueError("the reference reduces as op=Average without compression only")
        self.optimizer = optimizer
        self.params = [p for g in optimizer.param_groups for p in g["params"]]
        self._skip = False

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def state_dict(self):
        return self.optimizer.state_dict()

    def load_state_dict(self, state):
        self.optimizer.load_state_dict(state)

    def zero_grad(self, set_to_none=True):
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def synchronize(self):
        for p in self.params:
            if p.grad is not None:
                p.grad.copy_(_allreduce_sum(p.grad) / size())

    @contextlib.contextmanager
    def skip_synchronize(self):
        self._skip = True
        try:
            yield
        finally:
            self._skip = False

    def step(self, closure=None):
        if not self._skip:
            self.synchronize()
        return self.optimizer.step(closure)
