"""Every reduction kernel against NumPy, for every dtype x op, through a schedule on
COMM_SELF (one process: this pytest process)."""
import numpy as np
import pytest
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
