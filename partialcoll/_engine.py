"""Binding: loads the native module (after mpi4py, whose libmpi it binds to) and runs the engine."""
from __future__ import annotations

import atexit
import os
import threading
from typing import Dict, Optional

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
_node_ranks: Optional[int] = None    # most ranks seen sharing this node (see note_node)
_idle_active = ""                   # "spin" or "sleep": what the running engine does


def idle_policy(setting: str, ranks_on_node: Optional[int], cores: int) -> str:
    """The idle policy that `setting` ("auto", "spin", "sleep") comes to, with
    ranks_on_node ranks (None: not known yet) sharing the `cores` this process may use.

    auto polls ("spin") only where every rank can have a core for its application thread
    and one for its progress thread: a polling progress thread on a shared core slows the
    rank computing there (with more ranks than cores every spinning rank slows the
    others). Until the node is known, auto sleeps.
    """
    if setting != "auto":
        return setting
    if ranks_on_node is None or ranks_on_node < 1 or cores < 1:
        return "sleep"
    return "spin" if 2 * ranks_on_node <= cores else "sleep"


def _poll_code(active: str) -> int:
    """The engine's poll_armed for an active policy: 0 sleep, 1 spin; auto's spin is 2,
    which polls only while the machine has no more runnable threads than cores (a node
    that MPI sees may share its cores with ranks it cannot see: native/progress.c)."""
    if active != "spin":
        return 0
    return 2 if rc.idle == "auto" else 1


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):      # pragma: no cover - not Linux
        return os.cpu_count() or 1


def _launcher_ranks() -> Optional[int]:
    """Ranks on this node as the launcher says (MPICH's Hydra, Open MPI), or None."""
    for key in ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE"):
        try:
            return int(os.environ[key])
        except (KeyError, ValueError):
            continue
    return None


def note_node(comm: MPI.Comm) -> None:
    """Collective over comm: count its ranks on this node (Split_type COMM_TYPE_SHARED), and
    with the idle policy "auto" switch the running engine to what that count calls for.
    Called where a collective object is created, so every rank of comm calls it."""
    global _node_ranks, _idle_active
    if rc.idle != "auto":
        return
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        n = node.Get_size()
    finally:
        node.Free()
    with _lock:
        _node_ranks = max(n, _node_ranks or 0)
        if _started:
            active = idle_policy("auto", _node_ranks, _cores())
            if active != _idle_active:
                check(lib.pc_engine_set_poll(_poll_code(active)))
                _idle_active = active


def idle_state() -> Dict[str, object]:
    """The idle policy: setting, active policy, and what auto based it on."""
    ranks = _node_ranks if _node_ranks is not None else _launcher_ranks()
    cores = _cores()
    active = _idle_active if _started else idle_policy(rc.idle, ranks, cores)
    return {"idle": active, "idle_setting": rc.idle, "ranks_on_node": ranks, "cores": cores}


def ensure_started(comm: Optional[MPI.Comm] = None) -> None:
    """Start the engine (and its progress thread) on first use. comm: the communicator of
    a collective being created (every rank of it calls this): the idle policy "auto"
    counts its ranks on this node."""
    global _started, _idle_active
    if comm is not None:
        note_node(comm)
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
        ranks = _node_ranks if _node_ranks is not None else _launcher_ranks()
        active = idle_policy(rc.idle, ranks, _cores())
        policy.poll_armed = _poll_code(active)
        check(lib.pc_engine_start(1 if rc.progress == "thread" else 0, policy))
        _idle_active = active
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
