"""Buffer references: a NumPy array (or a device array's pinned mirror), or a buffer slot
owned by a partial collective.

A BufRef is a contiguous run of `count` elements of `dtype`, starting `offset` bytes
into its base. Builders slice BufRefs (ring segments) without caring which it is.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from ._errors import InvalidBufferError
from ._lib import lib
from ._types import dtype_code

SLOT_NONE, SLOT_WORK, SLOT_MASK, SLOT_SCRATCH = lib.PC_SLOT_NONE, lib.PC_SLOT_WORK, lib.PC_SLOT_MASK, lib.PC_SLOT_SCRATCH
_SLOT_NAMES = {SLOT_WORK: "work", SLOT_MASK: "mask", SLOT_SCRATCH: "scratch"}


def as_array(obj, *, writable: bool, what: str = "buffer") -> np.ndarray:
    """Validate a host buffer: a C-contiguous NumPy array (writable where written).
    Device arrays are recognised before this (_device.backend_of)."""
    if not isinstance(obj, np.ndarray):
        raise InvalidBufferError(f"{what} must be a NumPy or CuPy array, not {type(obj).__name__}")
    if not obj.flags.c_contiguous:
        raise InvalidBufferError(f"{what} must be C-contiguous (use np.ascontiguousarray)")
    if writable and not obj.flags.writeable:
        raise InvalidBufferError(f"{what} is read-only, but it is written")
    dtype_code(obj.dtype)
    return obj


def as_buffer(obj, dtype: np.dtype, count: int, *, writable: bool, what: str, who: str) -> np.ndarray:
    """A host buffer of exactly `count` elements of `dtype` (what a collective was created
    for): the common case checked cheaply, anything else as_array() plus both checks."""
    if (type(obj) is np.ndarray and obj.dtype == dtype and obj.size == count
            and obj.flags.c_contiguous and (obj.flags.writeable or not writable)):
        return obj
    return check_elements(as_array(obj, writable=writable, what=what), dtype, count, what=what, who=who)


def check_elements(arr, dtype: np.dtype, count: int, *, what: str, who: str):
    """arr (host or device) if it holds `count` elements of `dtype`, else InvalidBufferError."""
    if arr.dtype != dtype:
        raise InvalidBufferError(f"{what} has dtype {arr.dtype}, but this {who} was created for {dtype}")
    if arr.size != count:
        raise InvalidBufferError(f"{what} has {arr.size} elements, but this {who} was created for {count}")
    return arr


class BufRef:
    """`count` elements of `dtype` at byte `offset` of an array or a collective's slot."""

    __slots__ = ("array", "slot", "offset", "count", "dtype")

    def __init__(self, array: Optional[np.ndarray], slot: int, offset: int, count: int, dtype) -> None:
        self.array = array
        self.slot = slot
        self.offset = offset
        self.count = count
        self.dtype = np.dtype(dtype)

    @classmethod
    def of(cls, obj, *, writable: bool, what: str = "buffer") -> "BufRef":
        if isinstance(obj, BufRef):
            return obj
        arr = as_array(obj, writable=writable, what=what)
        return cls(arr, SLOT_NONE, 0, arr.size, arr.dtype)

    @classmethod
    def slot_ref(cls, slot: int, count: int, dtype) -> "BufRef":
        return cls(None, slot, 0, count, dtype)

    @property
    def nbytes(self) -> int:
        return self.count * self.dtype.itemsize

    def segment(self, start: int, stop: int) -> "BufRef":
        """Elements [start, stop) of this buffer."""
        if not 0 <= start <= stop <= self.count:
            raise IndexError(f"segment [{start}, {stop}) outside a buffer of {self.count}")
        return BufRef(self.array, self.slot, self.offset + start * self.dtype.itemsize,
                      stop - start, self.dtype)

    def address(self) -> int:
        """Absolute address (plain arrays only; slots are resolved by the engine)."""
        assert self.array is not None, "a slot's address is the engine's"
        return self.array.__array_interface__["data"][0] + self.offset

    def describe(self) -> str:
        base = _SLOT_NAMES.get(self.slot) or f"buf@{id(self.array) & 0xffff:04x}"
        if self.slot == SLOT_SCRATCH:
            return f"scratch@{self.offset}[0:{self.count}]"
        start = self.offset // self.dtype.itemsize
        return f"{base}[{start}:{start + self.count}]"
