"""Buffers of the kind a test run asks for: PC_TEST_BUFFERS = host | cupy | emulated.

host      NumPy arrays (the default).
cupy      CuPy arrays on a real GPU.
emulated  partialcoll's device path with NumPy standing in for the GPU library: an
          ndarray subclass that partialcoll treats as device memory, and a backend that
          does the same steps as the CuPy one (fold, copies, "streams") with NumPy. It runs
          the staging protocol (pending accumulator, pc_coll_post_replace and its race,
          schedule mirrors) on machines without a GPU, which is where CI runs.
"""
from __future__ import annotations

import os

import numpy as np

from partialcoll import _device

KIND = os.environ.get("PC_TEST_BUFFERS", "host")


class EmulatedArray(np.ndarray):
    """Host memory that partialcoll must treat as device memory."""


class EmulatedBackend:
    name = "emulated (NumPy)"
    _ufuncs = {op: getattr(np, name) for op, name in _device.UFUNCS.items()}

    def owns(self, obj) -> bool:
        return isinstance(obj, EmulatedArray)

    def adopt(self, obj):
        return obj

    def device_id(self, arr) -> int:
        return 0

    def address(self, arr) -> int:
        return arr.ctypes.data

    def stream(self, arr):
        return None

    def pinned(self, count, dtype):
        return np.empty(count, dtype)

    def empty(self, like, count, dtype):
        return np.empty(count, dtype).view(EmulatedArray)

    def follow(self, stream, arr):
        pass

    def to_host(self, stream, src, dst):
        np.copyto(dst, src.view(np.ndarray))

    def to_device(self, stream, src, dst):
        np.copyto(dst.view(np.ndarray), src)

    def copy(self, stream, dst, src):
        np.copyto(dst.view(np.ndarray), src.view(np.ndarray))

    def fold(self, stream, redop, acc, x):
        a = acc.view(np.ndarray)
        self._ufuncs[redop](a, x.view(np.ndarray), out=a)

    def synchronize(self, stream):
        pass


if KIND == "emulated":
    _device._registered.append(EmulatedBackend())
elif KIND == "cupy":
    import cupy


def to_device(x: np.ndarray):
    """x as a buffer of this run's kind."""
    if KIND == "cupy":
        return cupy.asarray(x)
    if KIND == "emulated":
        return np.array(x).view(EmulatedArray)
    return x


def to_host(d) -> np.ndarray:
    """A NumPy copy of a buffer of this run's kind; fails if it is not of that kind."""
    if KIND == "cupy":
        assert isinstance(d, cupy.ndarray), f"expected a CuPy result, got {type(d).__name__}"
        return cupy.asnumpy(d)
    if KIND == "emulated":
        assert isinstance(d, EmulatedArray), f"expected a device result, got {type(d).__name__}"
        return d.view(np.ndarray).copy()
    assert type(d) is np.ndarray, type(d)
    return d


class OnDevice:
    """A PartialAllreduce whose posts and results are buffers of this run's kind; the
    checks see NumPy results (converted after asserting their kind)."""

    def __init__(self, coll) -> None:
        self.coll = coll

    def __getattr__(self, name):
        return getattr(self.coll, name)

    def post(self, x, out=None):
        if out is x:                                   # in place: on the device, in place
            d = to_device(x)
            return _Request(self.coll.post(d, out=d))
        return _Request(self.coll.post(to_device(x), out=out))

    def close(self, **kw):
        return _host_result(self.coll.close(**kw))


class _Request:
    def __init__(self, req) -> None:
        self.req = req
        self.index, self.late = req.index, req.late

    def test(self):
        return self.req.test()

    def wait(self, **kw):
        return _host_result(self.req.wait(**kw))


def _host_result(res):
    res.data = to_host(res.data)
    return res


def on_buffers(coll):
    """coll as the checks should use it in this run."""
    return coll if KIND == "host" else OnDevice(coll)
