"""Allreduce schedules. The registry key is the name users pass as ``algorithm=``."""
from __future__ import annotations

from typing import Callable, Dict

from . import recursive_doubling, ring, tree

ALGORITHMS: Dict[str, Callable] = {
    "recursive_doubling": recursive_doubling.allreduce,
    "ring": ring.allreduce,
    "tree": tree.allreduce,          # takes groups= and seed= (see tree.py)
}

# "auto": recursive doubling up to this many bytes, ring above (measured: see docs/benchmarks.md).
AUTO_RING_BYTES = 64 * 1024


def choose(algorithm: str, nbytes: int, size: int) -> str:
    """Resolve "auto" (and check a name) for a vector of nbytes on size ranks."""
    if algorithm == "auto":
        return "ring" if nbytes > AUTO_RING_BYTES and size > 1 else "recursive_doubling"
    if algorithm not in ALGORITHMS:
        from .._errors import ArgumentError
        raise ArgumentError(f"unknown algorithm {algorithm!r}; use 'auto', " +
                            ", ".join(repr(a) for a in ALGORITHMS))
    return algorithm
