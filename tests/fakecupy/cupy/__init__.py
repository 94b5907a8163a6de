"""A stand-in for CuPy, for tests only: the part of CuPy's API that partialcoll's
CupyBackend calls, on host memory. With PYTHONPATH=tests/fakecupy the backend's own code
(streams, events, async copies, ufuncs with out=) runs on machines without a GPU; what
only a real GPU can show is left to the gpu-marked tests. Copies happen at once and
"streams" order nothing, so this checks the calls, not their timing."""
from __future__ import annotations

import ctypes
import types

import numpy as np

__version__ = "0.0+fake"


class _Device:
    def __init__(self, id: int = 0) -> None:
        self.id = id

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def synchronize(self) -> None:
        pass


class _Pointer:
    def __init__(self, a: np.ndarray) -> None:
        self._a = a
        self.ptr = a.ctypes.data

    def copy_to_host_async(self, mem, size, stream=None) -> None:
        _check_stream(stream)
        ctypes.memmove(int(mem), self.ptr, size)

    def copy_from_host_async(self, mem, size, stream=None) -> None:
        _check_stream(stream)
        ctypes.memmove(self.ptr, int(mem), size)


class ndarray:
    """Device memory, as far as partialcoll can tell."""

    def __init__(self, a: np.ndarray) -> None:
        self._a = a

    device = property(lambda self: _Device(0))
    data = property(lambda self: _Pointer(self._a))
    flags = property(lambda self: self._a.flags)
    dtype = property(lambda self: self._a.dtype)
    size = property(lambda self: self._a.size)
    nbytes = property(lambda self: self._a.nbytes)
    shape = property(lambda self: self._a.shape)

    def __getitem__(self, key) -> "ndarray":
        return ndarray(self._a[key])

    def get(self, stream=None, order="C", out=None, blocking=True) -> np.ndarray:
        if out is None:
            return self._a.copy()
        np.copyto(out, self._a)
        return out

    def set(self, arr, stream=None) -> None:
        np.copyto(self._a, arr)

    def copy(self) -> "ndarray":
        return ndarray(self._a.copy())

    def __dlpack__(self, **kwargs):
        return self._a.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self._a.__dlpack_device__()


class _Event:
    pass


class Stream:
    _current: list = []

    def __init__(self, null=False, non_blocking=False, ptds=False, priority=None) -> None:
        self.non_blocking = non_blocking

    def __enter__(self):
        Stream._current.append(self)
        return self

    def __exit__(self, *exc):
        Stream._current.pop()
        return False

    def record(self, event=None) -> _Event:
        return event or _Event()

    def wait_event(self, event) -> None:
        assert isinstance(event, _Event), event

    def synchronize(self) -> None:
        pass


def _check_stream(stream) -> None:
    assert stream is None or isinstance(stream, Stream), f"not a stream: {stream!r}"


_NULL = Stream(null=True)
cuda = types.SimpleNamespace(Stream=Stream, Event=_Event, is_available=lambda: True,
                             get_current_stream=lambda: Stream._current[-1] if Stream._current else _NULL)


def asarray(x) -> ndarray:
    return x if isinstance(x, ndarray) else ndarray(np.array(x))


def asnumpy(x: ndarray) -> np.ndarray:
    return x._a.copy()


def empty(count, dtype) -> ndarray:
    return ndarray(np.empty(count, dtype))


def copyto(dst: ndarray, src: ndarray) -> None:
    np.copyto(dst._a, src._a)


def from_dlpack(x) -> ndarray:
    """A view of x's host memory (torch's emulated device path: CPU tensors posing as CUDA
    ones, tests/mpi/torch_checks.py); what is not host memory is refused."""
    return ndarray(np.from_dlpack(x))


def _ufunc(f):
    def apply(a: ndarray, b: ndarray, out: ndarray) -> ndarray:
        assert Stream._current, "device ops must run inside partialcoll's stream"
        f(a._a, b._a, out=out._a)
        return out
    return apply


add, multiply, minimum, maximum = (_ufunc(f) for f in (np.add, np.multiply, np.minimum, np.maximum))
logical_and, logical_or, logical_xor = (_ufunc(f) for f in (np.logical_and, np.logical_or, np.logical_xor))
bitwise_and, bitwise_or, bitwise_xor = (_ufunc(f) for f in (np.bitwise_and, np.bitwise_or, np.bitwise_xor))
