"""NumPy dtypes and MPI ops as the engine knows them, and each op's identity."""
from __future__ import annotations

import numbers
from typing import Optional

import numpy as np
from mpi4py import MPI

from ._errors import ArgumentError, InvalidBufferError, OpError
from ._lib import lib

# bfloat16 (mixed-precision gradients): ml_dtypes' NumPy dtype where it is installed; else
# a 16-bit unsigned view marked as bfloat16 (np.dtype(np.uint16) plus metadata), so raw
# bits (a torch bfloat16 tensor viewed as int16) can be posted with an explicit dtype.
try:
    import ml_dtypes as _ml_dtypes
    BFLOAT16 = np.dtype(_ml_dtypes.bfloat16)
except ImportError:                       # pragma: no cover - depends on the environment
    BFLOAT16 = np.dtype(np.uint16, metadata={"partialcoll": "bfloat16"})
_BF16_CODE = lib.PC_DT_BFLOAT16

# numpy dtype -> engine dtype code (PC_DT_* in native/pc_engine.h)
DTYPES = {np.dtype(t): getattr(lib, "PC_DT_" + t.__name__.upper().rstrip("_"))
          for t in (np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64,
                    np.float32, np.float64, np.complex64, np.complex128, np.float16)}
if BFLOAT16.metadata is None:
    DTYPES[BFLOAT16] = _BF16_CODE


def as_dtype(dtype) -> np.dtype:
    """np.dtype(dtype), with "bfloat16" meaning BFLOAT16 (also without ml_dtypes)."""
    if isinstance(dtype, str) and dtype.lower() == "bfloat16":
        return BFLOAT16
    try:
        return np.dtype(dtype)
    except (TypeError, ValueError) as exc:
        raise InvalidBufferError(f"dtype {dtype!r} is not a NumPy dtype ({exc})") from None


def dtype_name(dt: np.dtype) -> str:
    """A name that tells every dtype the engine knows apart (bfloat16's .str is '<V2')."""
    return "bfloat16" if dtype_code(dt) == _BF16_CODE else dt.str

# mpi4py op -> (engine op code, name); COPY (10) is internal.
# (mpi4py.MPI.Op objects are not hashable: a list of pairs)
OPS = [(getattr(MPI, name), (getattr(lib, "PC_OP_" + name), name))
       for name in ("SUM", "PROD", "MIN", "MAX", "LAND", "LOR", "LXOR", "BAND", "BOR", "BXOR")]
OP_NAMES = {code: name for _, (code, name) in OPS}
COPY = lib.PC_OP_COPY
OP_NAMES[COPY] = "COPY"
# engine op -> the NumPy ufunc (by name: CuPy has the same names) that folds with it
UFUNCS = {lib.PC_OP_SUM: "add", lib.PC_OP_PROD: "multiply", lib.PC_OP_MIN: "minimum", lib.PC_OP_MAX: "maximum",
          lib.PC_OP_LAND: "logical_and", lib.PC_OP_LOR: "logical_or", lib.PC_OP_LXOR: "logical_xor",
          lib.PC_OP_BAND: "bitwise_and", lib.PC_OP_BOR: "bitwise_or", lib.PC_OP_BXOR: "bitwise_xor"}


def integer(value, name: str, minimum: Optional[int] = None, maximum: Optional[int] = None) -> int:
    """value as an int: any integral number (Python or NumPy), never a bool; in range."""
    if not isinstance(value, numbers.Integral) or isinstance(value, (bool, np.bool_)):
        raise ArgumentError(f"{name} must be an integer, not {value!r}")
    value = int(value)
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        bounds = f">= {minimum}" if maximum is None else f"in {minimum}..{maximum}"
        raise ArgumentError(f"{name} must be an integer {bounds}, not {value}")
    return value


def check_comm(comm, who: str) -> None:
    """comm must be an intracommunicator (mpi4py), not COMM_NULL."""
    if not isinstance(comm, MPI.Comm) or comm == MPI.COMM_NULL:
        raise ArgumentError(f"{who}: comm must be an mpi4py communicator, not {comm!r}")
    if comm.Is_inter():
        raise ArgumentError(f"{who}: intercommunicators are not supported; use an intracommunicator "
                            "(for example intercomm.Merge())")


def dtype_code(dtype) -> int:
    """Engine code of a NumPy dtype, or a clear error."""
    dt = as_dtype(dtype)
    if dt.metadata and dt.metadata.get("partialcoll") == "bfloat16":
        return _BF16_CODE
    if dt.byteorder not in ("=", "|") and dt != dt.newbyteorder("="):
        raise InvalidBufferError(f"dtype {dt} is not in native byte order")
    try:
        return DTYPES[dt.newbyteorder("=")]
    except KeyError:
        raise InvalidBufferError(f"dtype {dt} has no MPI basic type; use one of "
                           f"{', '.join(str(d) for d in DTYPES)}") from None


def op_code(op) -> int:
    """Engine code of an mpi4py reduction op (MPI.SUM ...)."""
    if isinstance(op, numbers.Integral) and not isinstance(op, (bool, np.bool_)) and 0 <= int(op) < COPY:
        return int(op)                    # an engine code (algorithm builders pass these)
    if isinstance(op, str):
        for code, name in OP_NAMES.items():
            if name == op.upper() and code != COPY:
                return code
    elif isinstance(op, MPI.Op):
        for mpi_op, (code, _) in OPS:
            if op == mpi_op:
                return code
    raise ArgumentError(f"unsupported reduction op {op!r}; use MPI.SUM, MPI.PROD, MPI.MIN, MPI.MAX, "
                        "MPI.LAND, MPI.LOR, MPI.LXOR, MPI.BAND, MPI.BOR or MPI.BXOR")


def check_op_dtype(op: int, dtype) -> None:
    """Raise OpError where MPI does not define op on dtype."""
    from ._engine import lib
    if not lib.pc_op_valid(op, dtype_code(dtype)):
        raise OpError(f"MPI.{OP_NAMES[op]} is not defined for dtype {as_dtype(dtype)}")


def check_divisor(divisor, op: int, dtype) -> float:
    """A result divisor as a float (1.0: none): finite, non-zero, and only after SUM (or a
    copy) of a real floating dtype, where an average means something."""
    if isinstance(divisor, (bool, np.bool_)) or not isinstance(divisor, (int, float, np.integer, np.floating)):
        raise ArgumentError(f"divisor must be a number, not {divisor!r}")
    d = float(divisor)
    if d == 1.0:
        return d
    if not np.isfinite(d) or d == 0.0:
        raise ArgumentError(f"divisor must be finite and non-zero, not {divisor!r}")
    from ._engine import lib
    if not lib.pc_div_valid(op, dtype_code(dtype)):
        raise OpError(f"divisor= needs MPI.SUM of a real floating dtype, not MPI.{OP_NAMES[op]} on "
                      f"{as_dtype(dtype)}")
    return d


def identity(op: int, dtype) -> np.ndarray:
    """One element holding op's identity: x (op) identity == x."""
    dt = as_dtype(dtype)
    value: object
    if op in (0, 5, 6, 8, 9):                        # SUM LOR LXOR BOR BXOR
        value = 0
    elif op in (1, 4):                               # PROD LAND
        value = 1
    elif op == 7:                                    # BAND: all bits set
        value = np.iinfo(dt).max if dt.kind == "u" else -1
    elif op in (2, 3):                               # MIN MAX
        if dt.kind == "f" or dtype_code(dt) == _BF16_CODE:
            value = np.inf if op == 2 else -np.inf
        elif dt.kind in "iu":
            value = np.iinfo(dt).max if op == 2 else np.iinfo(dt).min
        else:
            value = op == 2
    else:
        raise ArgumentError(f"no identity for op {op}")
    if dtype_code(dt) == _BF16_CODE:            # bfloat16: the upper half of float32's bits
        bits = np.array([value], np.float32).view(np.uint32) >> 16
        return bits.astype(np.uint16).view(dt)
    return np.array([value], dtype=dt)
