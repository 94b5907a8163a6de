"""partialcoll.info(): what this installation runs on."""
from __future__ import annotations

from typing import Dict


def info() -> Dict[str, object]:
    """Library and MPI versions, progress mode, and the buffer paths available."""
    from mpi4py import MPI

    from . import _engine
    from ._version import __version__
    return {
        "partialcoll": __version__,
        "mpi_library": " ".join(MPI.Get_library_version().splitlines()[0].split()),
        "mpi_version": "%d.%d" % MPI.Get_version(),
        "thread_level": {MPI.THREAD_SINGLE: "single", MPI.THREAD_FUNNELED: "funneled",
                         MPI.THREAD_SERIALIZED: "serialized",
                         MPI.THREAD_MULTIPLE: "multiple"}.get(MPI.Query_thread(), "?"),
        "progress": _engine.progress_mode() or _engine.rc.progress,
        "buffers": "host (NumPy)",
    }
