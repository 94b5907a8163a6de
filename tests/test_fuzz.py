"""Hypothesis-driven fuzzing of the public API (issue 14, item 4), and the bugs it found.

tests/mpi/fuzz_checks.py: rank 0 draws each case (derandomized: the same cases every run),
every rank runs it; random counts, dtypes (float16, bfloat16), ops, modes, late=, algorithms,
seeds, in-place/out=/plain posts, wait/test/later/never, skew. Checked against the
nothing-lost invariant (late="fold"), agreement across ranks, and MPI_Allreduce (full).
PC_FUZZ_SEED=N explores another stream of cases; PC_FUZZ_SHRINK=1 shrinks a failure.
"""
import numpy as np
import pytest
from mpi4py import MPI

import partialcoll as pc


# (what, max_examples) per P: random valid uses ("api") at P = 1 - 5; random bad arguments,
# on every rank or one ("bad"): a partialcoll exception that says what is wrong, on every
# rank where the call is collective, never a hang, at P = 2, 3, 5; each P's in one launch
FUZZ = {1: [("api", 30)], 2: [("api", 80), ("bad", 40)], 3: [("api", 60), ("bad", 40)], 4: [("api", 40)],
        5: [("api", 40), ("bad", 25)]}


@pytest.mark.mpiexec
@pytest.mark.parametrize("nprocs", sorted(FUZZ))
def test_fuzz_api_and_bad_input(mpirun, nprocs):
    pytest.importorskip("hypothesis", reason="the fuzzer needs hypothesis (pip install -e '.[test]')")
    out = mpirun("fuzz_checks.py", nprocs, *[a for what, n in FUZZ[nprocs] for a in (what, str(n))], timeout=400)
    for what, n in FUZZ[nprocs]:
        assert f"fuzz {what}: {n} cases at P={nprocs}" in out, (what, n)


@pytest.mark.parametrize("progress_waits", [0, 1])
def test_latest_result_kept_after_in_place_wait(progress_waits):
    """Found by the fuzzer: late="latest", the round ran in a post's own buffer (in place),
    and a wait for another request came after that post's wait: it returned the latest
    round's number with an older round's data (the user's buffer was dropped, the engine's
    stale copy was used)."""
    comm = MPI.COMM_SELF
    for _ in range(20):
        coll = pc.PartialAllreduce(3, np.float64, MPI.SUM, comm, mode="solo", late="latest")
        first = coll.post(np.full(3, 1.0))                 # round 0
        x = np.full(3, 10.0)
        second = coll.post(x, out=x)                       # round 1 runs in x
        if progress_waits:
            second.test()
        r2 = second.wait(timeout=10)
        assert r2.round == 1 and r2.data.tolist() == [10.0] * 3, r2
        x[:] = -5.0                                        # x is the caller's again
        r1 = first.wait(timeout=10)
        assert r1.round == 1 and r1.data.tolist() == [10.0] * 3, r1
        coll.close(timeout=10)


def _half(name):
    if name == "bfloat16":
        from partialcoll._types import BFLOAT16
        return BFLOAT16
    return np.dtype(name)


def _bits(name, values):
    """values (float64) as dtype `name`; bfloat16 by its bits where ml_dtypes is absent."""
    dt = _half(name)
    if dt.metadata:
        return (np.asarray(values, np.float32).view(np.uint32) >> 16).astype(np.uint16).view(dt)
    return np.asarray(values).astype(dt)


@pytest.mark.parametrize("op", [MPI.MIN, MPI.MAX], ids=["MIN", "MAX"])
@pytest.mark.parametrize("name", ["float16", "bfloat16", "float32", "float64"])
def test_min_max_commute_bitwise(name, op):
    """Found by the fuzzer: MIN/MAX of +0 and -0 returned the first operand, so ranks that
    reduce in different operand orders (recursive doubling) got different bits for the same
    round. Now MIN(-0, +0) = -0 and MAX = +0 either way (IEEE 754-2019), and NaN wins."""
    a = _bits(name, [0.0, -0.0, np.nan, 1.0, -0.0, 2.0])
    b = _bits(name, [-0.0, 0.0, 1.0, np.nan, -0.0, 3.0])
    outs = []
    for x, y in ((a, b), (b, a)):
        out = np.empty_like(a)
        s = pc.Schedule(MPI.COMM_SELF)
        s.compute(op, x, y, out=out)
        with s.commit():
            s.start().wait(timeout=30)
        outs.append(out)
    assert outs[0].tobytes() == outs[1].tobytes(), (outs[0], outs[1])
    f = (outs[0].view(np.uint16) if outs[0].itemsize == 2 else outs[0])
    f32 = (f.astype(np.uint32) << 16).view(np.float32) if name == "bfloat16" and _half(name).metadata \
        else outs[0].astype(np.float32)
    assert np.signbit(f32[0]) == (op == MPI.MIN) and np.signbit(f32[1]) == (op == MPI.MIN)
    assert np.isnan(f32[2]) and np.isnan(f32[3])
    assert np.signbit(f32[4]) and f32[5] == (2.0 if op == MPI.MIN else 3.0)


def test_bad_timeouts_are_argument_errors():
    """Found by the fuzzer: wait(timeout="soon") raised a bare ValueError from float()."""
    coll = pc.PartialAllreduce(2, np.float32, MPI.SUM, MPI.COMM_SELF, mode="solo")
    req = coll.post(np.ones(2, np.float32))
    for bad in ("soon", float("nan"), [1], object()):
        with pytest.raises(pc.ArgumentError, match="timeout"):
            req.wait(timeout=bad)
        with pytest.raises(pc.ArgumentError, match="timeout"):
            coll.close(timeout=bad)
    assert req.wait(timeout=np.float32(5)).data.tolist() == [1.0, 1.0]
    s = pc.Schedule(MPI.COMM_SELF)
    s.nop()
    s.commit()
    with pytest.raises(pc.ArgumentError, match="timeout"):
        s.start().wait(timeout="soon")
    coll.close(timeout=10)
