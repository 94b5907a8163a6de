"""partialcoll: MPI partial collectives on a native schedule engine.

    from mpi4py import MPI
    import partialcoll as pc
    coll = pc.PartialAllreduce(count, np.float32, op=MPI.SUM, comm=MPI.COMM_WORLD, mode="solo")
    res = coll.post(x).wait()          # res.data, res.round, res.active, res.nap
    final = coll.close()

Names (none shadows a builtin or an mpi4py name):
    ScheduleOp          a handle to one op of a Schedule (what after= takes); MPI.Op is a
                        reduction op, as everywhere in mpi4py
    PartialcollError    base of every error; each also derives from the builtin it refines:
      ArgumentError       (ValueError)   bad argument, or arguments that differ across ranks
      InvalidBufferError  (TypeError)    a buffer's type, dtype, size, layout or writability
      OpError             (TypeError)    a reduction op MPI does not define on the dtype
      StateError          (RuntimeError) used after close/free, or while running
      MPIError            (RuntimeError) MPI failed inside the engine
      Timeout             (TimeoutError) wait(timeout=...) or close(timeout=...) expired
      EngineError         (RuntimeError) the engine cannot run (no MPI_THREAD_MULTIPLE ...)
      OutOfMemory         (MemoryError)  the engine could not allocate memory
      PeerError           (RuntimeError) a peer failed while the collective was open
PartialAllreduce (and its shorthands) agree on errors across ranks: a bad argument
on one rank raises ArgumentError on every rank. Integer options accept any integral number
(Python or NumPy, never bool).
"""
from ._engine import finalize, progress_mode
from ._errors import (ArgumentError, EngineError, InvalidBufferError, MPIError, OpError, OutOfMemory,
                      PartialcollError, PeerError, StateError, Timeout)
from ._info import info
from ._partial import (PartialAllreduce, PartialRequest, Result, allreduce_init, close_all, majority_allreduce,
                       probe_allreduce, quorum_allreduce, solo_allreduce)
from ._rc import rc
from ._stats import Stats
from ._version import __version__
from .activation.candidates import candidates
from .schedule import Request, Schedule, ScheduleOp
from .speed_groups import speed_groups
from .averager import AsyncAverager, AverageRequest
from .hierarchical import HierarchicalAllreduce, HierarchicalRequest

__all__ = [
    "PartialAllreduce", "PartialRequest", "Result", "close_all",
    "solo_allreduce", "majority_allreduce", "probe_allreduce", "quorum_allreduce", "allreduce_init",
    "Schedule", "ScheduleOp", "Request", "candidates", "speed_groups", "AsyncAverager", "AverageRequest",
    "HierarchicalAllreduce", "HierarchicalRequest",
    "rc", "info", "finalize", "progress_mode", "Stats",
    "PartialcollError", "ArgumentError", "InvalidBufferError", "OpError", "StateError", "MPIError",
    "Timeout", "PeerError", "EngineError", "OutOfMemory", "__version__",
]
from .neighbor import NeighborAllreduce, NeighborRequest, NeighborResult
from .topology import double_ring_graph, ring_based_graph, ring_graph
__all__ += ["NeighborAllreduce", "NeighborRequest", "NeighborResult", "ring_graph", "ring_based_graph", "double_ring_graph"]
