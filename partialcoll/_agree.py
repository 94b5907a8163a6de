"""Cross-rank argument agreement for collective constructors: one allgather, the same
exception on every rank."""
from __future__ import annotations

from typing import Any, List, Optional

from mpi4py import MPI

from ._errors import ArgumentError, PartialcollError


def as_problem(exc: BaseException, who: str) -> PartialcollError:
    """A local validation failure as the PartialcollError every rank will raise."""
    if isinstance(exc, PartialcollError):
        return exc
    return ArgumentError(f"{who}: invalid arguments ({type(exc).__name__}: {exc})")


def agree(comm: MPI.Comm, who: str, problem: Optional[BaseException], params: Optional[dict],
          extra: Any = None, what: str = "the same count, dtype, op and options") -> List[Any]:
    """Collective over comm (one allgather): every rank learns whether any rank rejected
    its arguments (problem) or whether any of params differs across ranks, and raises the
    same ArgumentError if so. Returns every rank's `extra`, in rank order."""
    rank = comm.Get_rank()
    everyone = comm.allgather((repr(problem) if problem is not None else None, params, extra))
    if problem is not None:
        raise problem
    bad = [(r, err) for r, (err, _, _) in enumerate(everyone) if err]
    if bad:
        raise ArgumentError(f"{who}: rank {bad[0][0]} rejected its arguments: {bad[0][1]} (this is rank {rank})")
    assert params is not None
    for key in params:
        values = [p[key] for _, p, _ in everyone]
        differing = [r for r, v in enumerate(values) if v != values[0]]
        if differing:
            raise ArgumentError(f"{who}: {key} differs across ranks: rank 0 has {values[0]!r}, "
                                f"rank {differing[0]} has {values[differing[0]]!r} (this is rank {rank}); "
                                f"every rank must pass {what}")
    return [e for _, _, e in everyone]
