"""Type aliases of the public API (py.typed ships with the package)."""
from __future__ import annotations

from typing import Any, Union

import numpy as np
from mpi4py import MPI
from numpy.typing import DTypeLike

# A NumPy array, or a device array CuPy can view without a copy (a CuPy array, a CUDA
# torch tensor, anything with __cuda_array_interface__): checked at run time.
Buffer = Union[np.ndarray, Any]
# A reduction op: mpi4py's MPI.SUM ... MPI.BXOR (a name such as "SUM" is accepted too).
ReduceOp = Union[MPI.Op, str]
# What Schedule.compute takes: a ReduceOp, or an engine op code (algorithm builders pass these).
ComputeOp = Union[ReduceOp, int]

__all__ = ["Buffer", "ComputeOp", "DTypeLike", "ReduceOp"]
