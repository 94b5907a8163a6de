"""Every reduction kernel against NumPy, for every dtype x op, through a schedule on
COMM_SELF (one process: this pytest process)."""
import numpy as np
import pytest

from conftest import run_shared
from mpi4py import MPI

import partialcoll as pc

from mpi._data import DTYPES, OPS, assert_matches, defined, values

# OPS order: SUM PROD MIN MAX LAND LOR LXOR BAND BOR BXOR (MPI.Op is not hashable)
NAMES = "SUM PROD MIN MAX LAND LOR LXOR BAND BOR BXOR".split()
REF = [np.add, np.multiply, np.minimum, np.maximum, np.logical_and, np.logical_or, np.logical_xor,
       np.bitwise_and, np.bitwise_or, np.bitwise_xor]


def _name(op):
    return NAMES[[o == op for o in OPS].index(True)]


@pytest.mark.parametrize("op", OPS, ids=_name)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_kernel(dtype, op):
    a = values(dtype, op, 1001, 1)
    b = values(dtype, op, 1001, 2)
    out = np.empty_like(a)
    s = pc.Schedule(MPI.COMM_SELF)
    if not defined(op, dtype):
        with pytest.raises(pc.OpError, match="not defined"):
            s.compute(op, a, b, out=out)
        return
    s.compute(op, a, b, out=out)
    with s.commit():
        s.start().wait(timeout=30)
    expect = REF[NAMES.index(_name(op))](a, b)
    if _name(op) in ("LAND", "LOR", "LXOR"):
        expect = expect.astype(dtype)
    if np.dtype(dtype).kind in "fc" and _name(op) in ("SUM", "PROD"):
        assert_matches(out, expect, op, f"{np.dtype(dtype)} {_name(op)}")   # rounding may differ by an ulp
    else:
        assert np.array_equal(out, expect)


def test_integer_overflow_wraps_like_numpy():
    a = np.array([127, -128], np.int8)
    b = np.array([1, -1], np.int8)
    s = pc.Schedule(MPI.COMM_SELF)
    s.compute(MPI.SUM, a, b)            # b = a + b
    with s.commit():
        s.start().wait(timeout=30)
    assert b.tolist() == [-128, 127]


def test_nop_chain_and_any():
    s = pc.Schedule(MPI.COMM_SELF)
    one, count = np.ones(1, np.int64), np.zeros(1, np.int64)
    heads = [s.nop() for _ in range(3)]
    x = s.nop(after=heads, need="any")
    s.compute(MPI.SUM, one, count, after=x)          # count += 1 per firing of x
    with s.commit():
        for _ in range(5):
            s.start().wait(timeout=30)
    assert count[0] == 5


def test_rc_rejects_unknown_keys():
    with pytest.raises(AttributeError, match="unknown partialcoll option"):
        pc.rc.spinning = 3
    with pytest.raises(ValueError):
        pc.rc.progress = "sometimes"
    assert "progress" in repr(pc.rc)


def test_info():
    info = pc.info()
    assert info["partialcoll"] == pc.__version__
    assert "MPICH" in info["mpi_library"] or "Open MPI" in info["mpi_library"]


def _half_dtypes():
    out = [np.float16]
    try:
        import ml_dtypes
        out.append(ml_dtypes.bfloat16)
    except ImportError:
        pass
    return out


@pytest.mark.parametrize("op", OPS[:4], ids=_name)
@pytest.mark.parametrize("dtype", _half_dtypes(), ids=lambda d: np.dtype(d).name)
def test_half_kernels_every_bit_pattern(dtype, op):
    """float16 and bfloat16: every one of the 65536 values against another, reduced in
    float32 and rounded back to nearest-even, as NumPy (and torch) round a float32."""
    a = np.arange(1 << 16, dtype=np.uint16).view(dtype)
    b = np.random.default_rng(7).permutation(a)
    out = np.empty_like(a)
    s = pc.Schedule(MPI.COMM_SELF)
    s.compute(op, a, b, out=out)
    with s.commit():
        s.start().wait(timeout=30)
    f = {"SUM": np.add, "PROD": np.multiply, "MIN": np.minimum, "MAX": np.maximum}[_name(op)]
    with np.errstate(invalid="ignore", over="ignore"):
        expect = f(a.astype(np.float32), b.astype(np.float32)).astype(dtype)
    got32, exp32 = out.astype(np.float32), expect.astype(np.float32)
    nan_in = np.isnan(a.astype(np.float32)) | np.isnan(b.astype(np.float32))
    if _name(op) in ("SUM", "PROD"):
        assert np.array_equal(np.isnan(got32), np.isnan(exp32))
        ok = np.isnan(exp32) | (out.view(np.uint16) == expect.view(np.uint16))
    else:                      # MIN/MAX of a NaN follows MPI's C kernels, not NumPy; +0 == -0
        ok = nan_in | (got32 == exp32)
    assert ok.all(), f"{np.flatnonzero(~ok).size} of 65536 differ, first at {np.flatnonzero(~ok)[:4]}"


def test_bfloat16_without_ml_dtypes_by_name():
    """'bfloat16' names the type also where ml_dtypes is absent (then a marked uint16 view)."""
    from partialcoll._types import BFLOAT16, as_dtype, dtype_code, identity
    assert as_dtype("bfloat16") == BFLOAT16 and dtype_code("bfloat16") == 14
    assert dtype_code(np.float16) == 13
    raw = np.dtype(np.uint16, metadata={"partialcoll": "bfloat16"})
    assert dtype_code(raw) == 14
    assert identity(2, raw).view(np.uint16)[0] == 0x7F80          # MIN's identity: +inf
    assert identity(1, raw).view(np.uint16)[0] == 0x3F80          # PROD's: 1.0
    a = np.array([1.5, -2.0, 3.0], np.float32).view(np.uint32) >> 16
    x, y = a.astype(np.uint16).view(raw), a.astype(np.uint16).view(raw).copy()
    s = pc.Schedule(MPI.COMM_SELF)
    s.compute(MPI.SUM, x, y)                                       # y = x + y
    with s.commit():
        s.start().wait(timeout=30)
    got = (y.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    assert got.tolist() == [3.0, -4.0, 6.0]


@pytest.mark.mpiexec
@pytest.mark.shared_job("half_checks.py")
@pytest.mark.parametrize("nprocs", [2, 3, 4])
def test_half_precision_partial_modes(mpirun, request, nprocs):
    """float16/bfloat16 in every partial mode (nothing lost), full in place, a schedule."""
    run_shared(mpirun, request, nprocs)
