"""The native module's ffi and lib, loaded after mpi4py (whose libmpi it binds to).
Every C constant the Python side uses is read from lib.PC_*, never repeated here."""
from mpi4py import MPI  # noqa: F401 - must come first: loads the libmpi the native module links against

try:
    from ._native import ffi, lib
except ImportError as exc:  # pragma: no cover - depends on the installation
    raise ImportError(
        "partialcoll's native engine is not built. Reinstall with `pip install -e .` "
        "(it needs an MPI C compiler wrapper: the 'mpich' wheel, mpicc on PATH, or MPICC=...). "
        f"Original error: {exc}") from exc

__all__ = ["ffi", "lib"]
