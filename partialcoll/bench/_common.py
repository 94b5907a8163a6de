"""Shared by the benchmark commands: size parsing, modes, data that differs per rank."""
from __future__ import annotations

import time
from typing import List

import numpy as np
from mpi4py import MPI

import partialcoll as pc

MODES = ("mpi", "impi", "full", "solo", "majority", "probe", "quorum")
_UNITS = {"": 1, "b": 1, "k": 1024, "kb": 1024, "kib": 1024, "m": 1 << 20, "mb": 1 << 20, "mib": 1 << 20,
          "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30}


def parse_bytes(text: str) -> int:
    t = text.strip().lower()
    num = t.rstrip("kmgib")
    unit = t[len(num):]
    if not num or unit not in _UNITS:
        raise ValueError(f"bad size {text!r} (use e.g. 8, 64K, 16M)")
    return int(float(num) * _UNITS[unit])


def sizes(spec: str) -> List[int]:
    """MIN:MAX -> MIN, 4*MIN, 16*MIN ... up to MAX (MAX always included)."""
    lo, _, hi = spec.partition(":")
    lo_b, hi_b = parse_bytes(lo), parse_bytes(hi or lo)
    if lo_b < 1 or hi_b < lo_b:
        raise ValueError(f"bad size range {spec!r}")
    out, s = [], lo_b
    while s < hi_b:
        out.append(s)
        s *= 4
    out.append(hi_b)
    return out


def modes(spec: str) -> List[str]:
    out = [m.strip() for m in spec.split(",") if m.strip()]
    bad = [m for m in out if m not in MODES]
    if bad or not out:
        raise ValueError(f"unknown mode(s) {bad}; choose from {','.join(MODES)}")
    return out


def data(count: int, dtype, rank: int) -> np.ndarray:
    """Values that differ per rank and per element (to verify results)."""
    return ((np.arange(count) % 97) + rank).astype(dtype)


def as_buffers(x: np.ndarray, buffers: str):
    """x where the benchmark's buffers live: host (NumPy) or cupy (the GPU)."""
    if buffers == "host":
        return x
    from .._device import cupy_backend
    return cupy_backend().cp.asarray(x)          # a clear error without CuPy or a GPU


def to_numpy(y) -> np.ndarray:
    return y if isinstance(y, np.ndarray) else y.get()


class Collective:
    """One mode behind one interface: call(x, y) -> nap (blocking), close().

    With device buffers, mpi and impi are what a user of a MPI that is not CUDA-aware
    writes: copy to pinned host memory, MPI_Allreduce, copy back.
    """

    def __init__(self, mode: str, count: int, dtype, comm, algorithm: str, quorum: int, candidates: int,
                 seed: int = 0, buffers: str = "host", late: str = "latest"):
        self.mode, self.comm = mode, comm
        self.staged = None
        self.calls = 0
        self.everyone = tuple(range(comm.size))
        if mode in ("mpi", "impi"):
            self.coll = None
            if buffers != "host":
                import cupyx
                self.staged = (cupyx.empty_pinned(count, dtype), cupyx.empty_pinned(count, dtype))
            return
        kw = {"quorum": quorum} if mode == "quorum" else {"candidates": candidates} if mode == "probe" else {}
        self.coll = pc.PartialAllreduce(count, dtype, MPI.SUM, comm, mode=mode, algorithm=algorithm, seed=seed,
                                        late=late, **kw)

    def call(self, x, y) -> int:
        if self.staged is not None:
            xh, yh = self.staged
            x.get(out=xh)
            self._mpi(xh, yh)
            y.set(yh)
            y.device.synchronize()
            return self.comm.size
        if self.coll is None:
            return self._mpi(x, y)
        return self.coll.post(x, out=y).wait().nap

    def call_result(self, x: np.ndarray, y: np.ndarray):
        """(result, late): the Result of post(x, out=y).wait() and whether the post was late;
        for mpi/impi a Result of round = the call's number in which every rank is active."""
        if self.coll is None:
            self._mpi(x, y)
            n, self.calls = self.calls, self.calls + 1
            return pc.Result(y, n, self.everyone, True, 1), False
        req = self.coll.post(x, out=y)
        return req.wait(), req.late

    def close(self):
        """The result of close() (None for mpi/impi)."""
        return self.coll.close() if self.coll is not None else None

    def _mpi(self, x: np.ndarray, y: np.ndarray) -> int:
        if self.mode == "mpi":
            self.comm.Allreduce(x, y)
        else:                                   # impi: MPI_Iallreduce waited with a sleeping test loop
            req = self.comm.Iallreduce(x, y)
            while not req.Test():
                time.sleep(20e-6)
        return self.comm.size

