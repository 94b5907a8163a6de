"""PyTorch integration: eager-SGD (and RNA's weighted averaging) in a few lines.

* ``partial_ddp(model, mode=...)`` -- DistributedDataParallel with a partial-allreduce
  communication hook over DDP's process group, in one call (``partial_allreduce_hook``
  and ``PartialHookState`` by hand, as PowerSGD's).
* ``init_process_group()`` -- the ``partialcoll`` torch.distributed backend over an MPI
  communicator, under mpiexec with no address, port or gloo; ``register_backend()``
  makes ``dist.init_process_group("partialcoll", init_method="mpi://")`` work too.
* ``DistributedOptimizer`` -- without DDP, Horovod's contract: buckets posted while
  backward runs, ``synchronize()``, ``skip_synchronize()``; ``GradientSynchronizer`` is
  the same machinery driven by hand.
* ``sync_parameters`` -- model synchronisation (eager-SGD section 5).
* ``local_rank()``, ``local_size()`` -- this process among those on its node.
* ``SpeedAwareSampler`` -- each rank's share of the epoch in proportion to its speed.
* Horovod's calls: ``broadcast_parameters``, ``broadcast_optimizer_state``,
  ``broadcast_object``, ``allreduce`` (``op=Average|Sum``), ``broadcast``, ``allgather``,
  ``Compression``, ``init``, ``rank``, ``size``: ``import partialcoll.integrations.torch
  as hvd`` runs Horovod's scripts.

Importing this module changes nothing in torch: no backend, rendezvous handler or
environment variable is registered or set until one of the calls above runs.
"""
from ._torch_comm import local_rank, local_size
from ._torch_hook import PartialHookState, partial_allreduce_hook, partial_ddp
from ._torch_optim import DistributedOptimizer, GradientSynchronizer, sync_parameters
from ._torch_pg import ProcessGroupPartialcoll, init_process_group, register_backend
from ._torch_sampler import SpeedAwareSampler
from ._torch_horovod import (Adasum, Average, Compression, Max, Min, Product, Sum, allgather, allgather_object,
                             allreduce, allreduce_, barrier, broadcast, broadcast_, broadcast_object,
                             broadcast_optimizer_state, broadcast_parameters, init, is_initialized, rank, shutdown,
                             size)

__all__ = ["PartialHookState", "partial_allreduce_hook", "partial_ddp", "DistributedOptimizer",
           "GradientSynchronizer", "sync_parameters", "init_process_group", "register_backend",
           "ProcessGroupPartialcoll", "local_rank", "local_size", "SpeedAwareSampler", "Average", "Sum", "Adasum", "Min", "Max",
           "Product", "Compression", "allreduce", "allreduce_", "broadcast", "broadcast_", "allgather",
           "allgather_object", "barrier", "broadcast_object", "broadcast_parameters", "broadcast_optimizer_state", "init",
           "shutdown", "is_initialized", "rank", "size"]
