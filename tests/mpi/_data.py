"""Test data: values that differ per rank and per element, safe for every op."""
from __future__ import annotations

import zlib

import numpy as np
from mpi4py import MPI

DTYPES = [np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64,
          np.float32, np.float64, np.complex64, np.complex128]
OPS = [MPI.SUM, MPI.PROD, MPI.MIN, MPI.MAX, MPI.LAND, MPI.LOR, MPI.LXOR, MPI.BAND, MPI.BOR, MPI.BXOR]


def defined(op, dtype) -> bool:
    """Where MPI defines op on dtype (what the engine must accept)."""
    kind = np.dtype(dtype).kind
    if op in (MPI.SUM, MPI.PROD):
        return kind != "b"
    if op in (MPI.MIN, MPI.MAX):
        return kind in "iuf"
    if op in (MPI.LAND, MPI.LOR, MPI.LXOR):
        return kind in "biu"
    return kind in "iu"


def combos():
    return [(dt, op) for dt in DTYPES for op in OPS if defined(op, dt)]


def covering_combos():
    """Each dtype with its first op, and each op with its first dtype: what a large count
    or a larger P adds is the segmentation, the kernels' long loops, the schedule's shape,
    not the pairing of op and dtype (combos() pairs them all, at the small counts and P)."""
    dtypes, ops, out = set(), set(), []
    for dtype, op in combos():
        if np.dtype(dtype).str not in dtypes or op.py2f() not in ops:
            out.append((dtype, op))
            dtypes.add(np.dtype(dtype).str)
            ops.add(op.py2f())
    return out


def values(dtype, op, count: int, rank: int, salt: int = 0) -> np.ndarray:
    """Per-rank, per-element data; PROD stays near 1 so that it cannot overflow."""
    rng = np.random.default_rng([rank, salt, count])
    dt = np.dtype(dtype)
    if dt.kind == "b":
        return rng.random(count) < 0.5
    if dt.kind in "iu":
        if op == MPI.PROD:
            x = rng.choice([1, 1, 1, 2] if dt.kind == "u" else [1, -1, 1, 2], count)
        elif op in (MPI.LAND, MPI.LOR, MPI.LXOR):
            x = rng.integers(0, 2, count)
        else:
            x = rng.integers(0, 100, count)
        return x.astype(dt)
    if dt.kind == "f":
        x = rng.uniform(0.5, 1.5, count) if op == MPI.PROD else rng.normal(size=count)
        return x.astype(dt)
    re = rng.uniform(0.8, 1.2, count) if op == MPI.PROD else rng.normal(size=count)
    im = rng.uniform(-0.2, 0.2, count) if op == MPI.PROD else rng.normal(size=count)
    return (re + 1j * im).astype(dt)


def assert_matches(got: np.ndarray, ref: np.ndarray, op, what: str) -> None:
    """Exact for integers, bools and MIN/MAX; tight relative tolerance for floating SUM/PROD."""
    if got.dtype.kind in "fc" and op in (MPI.SUM, MPI.PROD):
        tol = 1e-5 if got.dtype in (np.float32, np.complex64) else 1e-12
        scale = np.maximum(np.abs(ref), 1)
        bad = np.abs(got - ref) > tol * scale * 8
        assert not bad.any(), f"{what}: {np.count_nonzero(bad)} elements differ, e.g. {got[bad][:3]} vs {ref[bad][:3]}"
    else:
        assert np.array_equal(got, ref), f"{what}: {got[:8]} != {ref[:8]}"


class Bitwise:
    """Results every rank must hold bitwise the same: add() each (its CRC), check() compares
    them all in one allgather (one per result was most of a small case's time at P = 8 on
    two cores) and names each case where some rank's bits differ."""

    def __init__(self, comm):
        self.comm, self.crcs = comm, []

    def add(self, what: str, data: np.ndarray) -> None:
        self.crcs.append((what, zlib.crc32(np.ascontiguousarray(data).view(np.uint8))))

    def check(self) -> None:
        everyone = self.comm.allgather([crc for _, crc in self.crcs])
        for i, (what, crc) in enumerate(self.crcs):
            differ = [r for r, theirs in enumerate(everyone) if theirs[i] != crc]
            assert not differ, f"{what}: ranks {differ} disagree bitwise with rank {self.comm.rank}"
        self.crcs.clear()
