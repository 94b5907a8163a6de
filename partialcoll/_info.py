"""partialcoll.info(): what this installation runs on."""
from __future__ import annotations

from typing import Dict


def _first_line(text: str) -> str:
    """The first line of a C string mpi4py returned, whitespace collapsed. Open MPI counts
    the terminating NUL in MPI_Get_library_version's length: the string ends at the first NUL."""
    lines = text.partition("\x00")[0].strip().splitlines()
    return " ".join(lines[0].split()) if lines else ""


def info() -> Dict[str, object]:
    """Library and MPI versions, progress mode, and the buffer paths available (imports CuPy if present)."""
    from mpi4py import MPI

    from . import _device, _engine, _shrink
    from ._version import __version__
    from .algorithms import model
    buffers, path = _device.describe()
    cuda_aware = _engine.lib.pc_mpi_cuda_support()
    return {
        "partialcoll": __version__,
        "mpi_library": _first_line(MPI.Get_library_version()),
        "mpi_version": "%d.%d" % MPI.Get_version(),
        "thread_level": {MPI.THREAD_SINGLE: "single", MPI.THREAD_FUNNELED: "funneled",
                         MPI.THREAD_SERIALIZED: "serialized",
                         MPI.THREAD_MULTIPLE: "multiple"}.get(MPI.Query_thread(), "?"),
        "progress": _engine.progress_mode() or _engine.rc.progress,
        # the idle policy: "spin" or "sleep" (what rc.idle="auto" chose, and from what)
        **_engine.idle_state(),
        "buffers": buffers,
        # how device buffers travel: "staging" (pinned host memory), or None without a GPU
        "gpu_path": path,
        # MPIX_Query_cuda_support() of this MPI (None: the MPI has no such query)
        "mpi_cuda_aware": None if cuda_aware < 0 else bool(cuda_aware),
        # what algorithm="auto" chooses by: the alpha-beta model's parameters on this machine
        # (partialcoll-bench calibrate's cache, or the defaults); a collective uses rank 0's
        # and says what it chose and why in repr() and .algorithm_reason
        "auto_model": model.load().describe(),
        # what on_failure="shrink" can survive here: works, survives, missing (docs/faults.md)
        "shrink": _shrink.support(),
        # this process's peer-error reports: sent, and stale ones dropped (docs/faults.md)
        "reports": _engine.report_counts(),
    }
