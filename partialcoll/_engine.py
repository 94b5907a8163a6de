"""Binding: loads the native module (after mpi4py, whose libmpi it binds to) and runs the engine."""
from __future__ import annotations

import atexit
import os
import threading
from typing import Dict, Optional, Union

from mpi4py import MPI  # must come first: loads the libmpi the native module links against

from ._lib import ffi, lib
from ._errors import ArgumentError, EngineError
from ._status import check
from ._rc import rc

_lock = threading.Lock()
_started = False
_node_known = False                 # the engine knows this node's ranks (join_node)
_windows: list = []                 # the node's shared memory segment (join_node)
_free_later: list = []              # communicators of objects the garbage collector dropped

POLL_CODES = {"sleep": 0, "spin": 1, "auto": 2}     # pc_idle_policy.poll_armed


def cpu_budget() -> int:
    """The CPUs this process may use: its affinity mask, capped by its cgroup's CPU quota
    (v2 cpu.max, v1 cpu.cfs_quota_us). The engine computes it once (native/idle.c); the
    idle policy, pc.info()["cpu_budget"] and the tests all use this number."""
    return int(lib.pc_cpu_budget())


def cpu_limits() -> tuple:
    """(affinity CPUs as a frozenset, cgroup quota in CPUs or 0, cgroup directory): the
    parts of cpu_budget(), for adding up a node's CPUs."""
    aff, quota, path = ffi.new("int *"), ffi.new("int *"), ffi.new("char[]", 512)
    check(lib.pc_cpu_limits(aff, quota, path, 512))
    try:
        cpus = frozenset(os.sched_getaffinity(0))
    except (AttributeError, OSError):      # pragma: no cover - not Linux
        cpus = frozenset(range(aff[0]))
    return cpus, int(quota[0]), ffi.string(path).decode(errors="replace")


def node_cpus(limits) -> int:
    """The CPUs a node's ranks may use together, from each rank's cpu_limits(): the union
    of their affinity masks, capped by the sum of their cgroups' quotas (a cgroup shared
    by several ranks counted once; no cap if any rank has no quota)."""
    union = frozenset().union(*(cpus for cpus, _, _ in limits))
    quotas = {path: quota for _, quota, path in limits}
    if all(q > 0 for q in quotas.values()):
        return max(1, min(len(union), sum(quotas.values())))
    return max(1, len(union))


def node_needed() -> bool:
    """Does this rank still need join_node() (the idle policy auto, node not known yet)?"""
    return rc.idle == "auto" and not _node_known


def join_node(comm: MPI.Comm) -> None:
    """Collective over comm: Split_type(COMM_TYPE_SHARED), an allgather of the node's
    ranks' CPU limits, and a bcast and a barrier over the node, which share a small
    memory segment (one word per node rank) through which the idle policy auto decides
    per node (native/idle.c). The segment is a file in /dev/shm that the node's rank 0
    makes and removes once every rank has mapped it: nothing to free collectively, no MPI
    resource held until MPI_Finalize (where /dev/shm is missing, each rank decides alone).
    Constructors call it once, on every rank, where any rank needs it (node_needed,
    agreed in their allgather)."""
    global _node_known
    import mmap
    import tempfile
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        limits = node.allgather(cpu_limits())
        n, me = node.Get_size(), node.Get_rank()
        path = None
        if me == 0:
            try:
                fd, path = tempfile.mkstemp(prefix="partialcoll-node-", dir="/dev/shm")
                os.ftruncate(fd, 8 * n)
                os.close(fd)
            except OSError:
                path = None
        path = node.bcast(path, root=0)
        seg: Union[mmap.mmap, bytearray, None] = None
        if path is not None:
            try:
                with open(path, "r+b") as f:
                    seg = mmap.mmap(f.fileno(), 8 * n)
            except OSError:
                seg = None
        node.Barrier()
        if me == 0 and path is not None:
            os.unlink(path)
        if seg is None:                  # no shared memory: this rank's own word only
            seg = bytearray(8 * n)
        _windows.append(seg)             # mapped until the process ends
        if not _node_known:
            base = ffi.cast("int64_t *", ffi.from_buffer(seg))
            check(lib.pc_engine_set_node(base, me, n, node_cpus(limits)))
            _node_known = True
    finally:
        node.Free()


def _launcher_ranks() -> Optional[int]:
    """Ranks on this node as the launcher says (MPICH's Hydra, Open MPI), or None."""
    for key in ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE"):
        try:
            return int(os.environ[key])
        except (KeyError, ValueError):
            continue
    return None


def idle_state() -> Dict[str, object]:
    """The idle policy: rc.idle, what runs now and why, and what it was decided from."""
    st = ffi.new("pc_idle_info *")
    check(lib.pc_idle_state(st))
    setting = rc.idle if not _started else {v: k for k, v in POLL_CODES.items()}[st.setting]
    return {"idle": "spin" if (st.polling if _started else setting == "spin") else "sleep",
            "idle_setting": setting,
            "idle_reason": ffi.string(st.reason).decode(errors="replace") if _started else "not started yet",
            "cpu_budget": int(st.cpu_budget), "ranks_on_node": st.node_ranks or _launcher_ranks(),
            "node_cpus": st.node_cpus or None, "node_from": "communicator" if st.node_known else "launcher",
            "spin_bound_us": st.spin_bound_us, "busy_bound_us": st.busy_bound_us, "run_delay": st.run_delay,
            "throttled_samples": int(st.throttled), "steal": st.steal}


def report_counts() -> Dict[str, int]:
    """This process's peer-error reports (docs/faults.md): how many it sent (one per
    collective it reported on; none where a peer's report came first) and how many stale
    ones, about a collective freed since, its receives dropped."""
    counts = ffi.new("int64_t[2]")
    check(lib.pc_report_counts(counts, counts + 1))
    return {"sent": int(counts[0]), "stale_dropped": int(counts[1])}


def ensure_started() -> None:
    """Start the engine (and its progress thread) on first use, with the options of
    partialcoll.rc; and free the communicators that objects dropped by the garbage
    collector left (an application thread, never the collector's: no MPI call there)."""
    global _started
    while _free_later:
        comm = _free_later.pop()
        if not MPI.Is_finalized():
            comm.Free()
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
            "busy_bytes": int(rc.busy_bytes), "busy_cap_us": float(rc.busy_cap_us),
            "poll_max_us": float(rc.poll_max_us), "poll_armed": POLL_CODES[rc.idle]})
        if not _node_known:          # until a collective's communicator tells: the launcher
            check(lib.pc_engine_set_node(ffi.NULL, 0, _launcher_ranks() or 0, cpu_budget()))
        check(lib.pc_engine_start(1 if rc.progress == "thread" else 0, policy))
        _started = True


def free_later(comm) -> None:
    """Free comm on the next application call that starts or builds something (never on
    the garbage collector's thread, which may run inside any MPI call)."""
    if comm is not None:
        _free_later.append(comm)


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
        for obj in _kept + _free_later:  # communicators of withdrawn executions: now idle
            if isinstance(obj, MPI.Comm) and obj != MPI.COMM_NULL and not MPI.Is_finalized():
                obj.Free()
        _kept.clear()
        _free_later.clear()


def progress_mode() -> str:
    """'thread' or 'inline': how the running engine progresses ('' when stopped)."""
    if not _started:
        return ""
    return "thread" if lib.pc_engine_threaded() else "inline"


def require_thread(role: str) -> None:
    """Raise ArgumentError where this process progresses inline (the running engine's
    mode, else rc.progress, the mode it will start with): `role` names a rank that serves
    its peers while its own application may make no call of the engine (an averager's
    server). Inline, nothing would serve them: its peers would wait until they time out."""
    if (progress_mode() or rc.progress) == "inline":
        raise ArgumentError(f"{role} serves its peers on the engine's progress thread, but this process "
                            f"progresses inline (partialcoll.rc.progress or PARTIALCOLL_PROGRESS = 'inline'): "
                            f"it would serve only inside its own calls of the engine, and its peers would wait "
                            f"for it; use progress 'thread' on this rank")


def comm_handle(comm: MPI.Comm):
    """C pointer to the MPI_Comm handle of an mpi4py communicator."""
    return ffi.cast("void *", MPI._addressof(comm))


atexit.register(finalize)   # registered after mpi4py's, so it runs before MPI_Finalize
