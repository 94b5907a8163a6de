"""partialcoll: MPI partial collectives on a native schedule engine.

    from mpi4py import MPI
    import partialcoll as pc
    coll = pc.PartialAllreduce(count, np.float32, op=MPI.SUM, comm=MPI.COMM_WORLD, mode="solo")
    res = coll.post(x).wait()          # res.data, res.round, res.active, res.nap
    final = coll.close()
"""
from ._engine import finalize, progress_mode
from ._errors import (ArgumentError, EngineError, InvalidBufferError, MPIError, OpError, OutOfMemory,
                      PartialcollError, StateError, Timeout)
from ._info import info
from ._partial import (PartialAllreduce, PartialRequest, Result, allreduce_init, majority_allreduce,
                       probe_allreduce, quorum_allreduce, solo_allreduce)
from ._rc import rc
from ._version import __version__
from .activation.candidates import candidates
from .schedule import Request, Schedule, ScheduleOp

__all__ = [
    "PartialAllreduce", "PartialRequest", "Result",
    "solo_allreduce", "majority_allreduce", "probe_allreduce", "quorum_allreduce", "allreduce_init",
    "Schedule", "ScheduleOp", "Request", "candidates",
    "rc", "info", "finalize", "progress_mode",
    "PartialcollError", "ArgumentError", "InvalidBufferError", "OpError", "StateError", "MPIError",
    "Timeout", "EngineError", "OutOfMemory", "__version__",
]
