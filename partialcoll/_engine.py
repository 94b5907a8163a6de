"""Binding: loads the native module (after mpi4py, whose libmpi it binds to) and runs the engine."""
from __future__ import annotations

import atexit
import threading

from mpi4py import MPI  # must come first: loads the libmpi the native module links against

try:
    from ._native import ffi, lib
except ImportError as exc:  # pragma: no cover - depends on the installation
    raise ImportError(
        "partialcoll's native engine is not built. Reinstall with `pip install -e .` "
        "(it needs an MPI C compiler wrapper: the 'mpich' wheel, mpicc on PATH, or MPICC=...). "
        f"Original error: {exc}") from exc

from ._errors import EngineError, check
from ._rc import rc

_lock = threading.Lock()
_started = False


def ensure_started() -> None:
    """Start the engine (and its progress thread) on first use."""
    global _started
    if _started:
        return
    with _lock:
        if _started:
            return
        if not MPI.Is_initialized():
            raise EngineError("MPI is not initialized")
        if MPI.Is_finalized():
            raise EngineError("MPI is already finalized")
        policy = ffi.new("pc_idle_policy *", {
            "spin_us": float(rc.spin_us), "yield_us": float(rc.yield_us),
            "sleep_min_us": float(rc.sleep_min_us), "sleep_max_us": float(rc.sleep_max_us),
            "deep_after_us": float(rc.deep_after_us), "deep_sleep_us": float(rc.deep_sleep_us),
            "busy_bytes": int(rc.busy_bytes), "busy_cap_us": float(rc.busy_cap_us)})
        check(lib.pc_engine_start(1 if rc.progress == "thread" else 0, policy))
        _started = True


_kept: list = []


def keep_until_finalize(*objects) -> None:
    """Keep Python memory that a withdrawn (abandoned) execution may still touch alive
    until the engine has stopped: a dropped object never leaves MPI pointing at freed memory."""
    _kept.extend(o for o in objects if o is not None)


def finalize() -> None:
    """Stop the engine and its progress thread; the next use starts it again."""
    global _started
    with _lock:
        if _started:
            check(lib.pc_engine_stop())
            _started = False
        for obj in _kept:                # communicators of withdrawn executions: now idle
            if isinstance(obj, MPI.Comm) and obj != MPI.COMM_NULL and not MPI.Is_finalized():
                obj.Free()
        _kept.clear()


def progress_mode() -> str:
    """'thread' or 'inline': how the running engine progresses ('' when stopped)."""
    if not _started:
        return ""
    return "thread" if lib.pc_engine_threaded() else "inline"


def comm_handle(comm: MPI.Comm):
    """C pointer to the MPI_Comm handle of an mpi4py communicator."""
    return ffi.cast("void *", MPI._addressof(comm))


atexit.register(finalize)   # registered after mpi4py's, so it runs before MPI_Finalize
