"""Allreduce schedules against MPI_Allreduce (issue 3):
python allreduce_checks.py [--large | --chunked] [ALGORITHMS]

--large: count 2^20 + 3 only, every dtype and every op (covering_combos), with recursive doubling and ring ("auto"
picks one of them there, by size alone: partialcoll.algorithms.choose; the small counts
check it). --chunked (under PARTIALCOLL_MAX_MESSAGE=M, messages cut into chunks of at
most M bytes): every op x dtype at a count whose messages span several chunks, with every
algorithm, and the divisor checks; the small counts, whose messages are never cut, are
the plain run's. ALGORITHMS: a comma-separated subset of recursive_doubling,ring,auto."""
from __future__ import annotations

import os

import numpy as np
import pytest
from mpi4py import MPI

import partialcoll as pc
from _data import Bitwise, assert_matches, combos, covering_combos, values
from half_checks import f64 as to_f64, to as as_dtype_exact
from partialcoll._types import BFLOAT16
from _util import ARGS, run_module

LARGE = "--large" in ARGS
CHUNKED = "--chunked" in ARGS
NAMED = [a for a in ARGS if not a.startswith("--")]
ALGORITHMS = NAMED[0].split(",") if NAMED else ["recursive_doubling", "ring"] + ([] if LARGE else ["auto"])


def reference(comm, count, dtype, op, salt=0):
    """(this rank's data, MPI_Allreduce's result of every rank's)."""
    x = values(dtype, op, count, comm.rank, salt)
    ref = np.empty_like(x)
    comm.Allreduce(x, ref, op=op)
    return x, ref


def check_one(comm, bitwise, algorithm, count, dtype, op, salt=0, in_place=False, data=None):
    """The result against MPI_Allreduce's, and into bitwise (a _data.Bitwise) to compare
    across ranks; data: reference()'s (x, ref) where several algorithms check the same data."""
    x, ref = data if data is not None else reference(comm, count, dtype, op, salt)
    coll = pc.allreduce_init(count, dtype, op, comm, algorithm=algorithm)
    if in_place:
        res = coll.post(x, out=x).wait()
        assert res.data is x
    else:
        res = coll.post(x).wait()
    what = f"{algorithm} count={count} {np.dtype(dtype)} {op} P={comm.size}"
    assert_matches(res.data, ref, op, what)
    assert res.round == 0 and res.active == tuple(range(comm.size)) and res.contributed
    bitwise.add(what, res.data)              # every rank holds bitwise the same result
    coll.close()




def test_large_every_op_dtype(comm):
    """--large: count 2^20 + 3, every dtype and every op (covering_combos), each of
    ALGORITHMS on the same data (made, and reduced by MPI_Allreduce, once for all of them)."""
    if not LARGE:
        pytest.skip("--large only")
    bitwise = Bitwise(comm)
    for dtype, op in covering_combos():
        data = reference(comm, 2 ** 20 + 3, dtype, op)
        for algorithm in ALGORITHMS:
            check_one(comm, bitwise, algorithm, 2 ** 20 + 3, dtype, op, data=data)
    bitwise.check()


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_every_count_op_dtype(comm, algorithm):
    if LARGE:
        pytest.skip("--large: test_large_every_op_dtype")
    p, bitwise = comm.size, Bitwise(comm)
    if CHUNKED:               # ring's segments (count / P) in 3 chunks, the whole vector in 2P + 1
        chunk = int(os.environ["PARTIALCOLL_MAX_MESSAGE"])
        # every pair at P = 2; past it each dtype (its element size against the chunk's
        # bytes) and each op: the cut does not depend on the op
        for dtype, op in combos() if p <= 2 else covering_combos():
            check_one(comm, bitwise, algorithm, 2 * p * chunk // np.dtype(dtype).itemsize + 7, dtype, op)
        bitwise.check()
        return
    counts = {0, 1, 2, max(p - 1, 0), p, p + 1, 1000}
    if algorithm == "auto":   # it runs what algorithms.choose() picks, checked here at every count
        counts = {0, p + 1, 1000}
    # every op x dtype pair at P <= 4 (the kernels do not depend on P); at P = 5 and 8, whose
    # schedules fold ranks or take more steps, each dtype and each op (covering_combos) at every count
    pairs = combos() if p <= 4 else covering_combos()
    for count in sorted(counts):
        for dtype, op in pairs:
            check_one(comm, bitwise, algorithm, count, dtype, op)
        bitwise.check()
    check_one(comm, bitwise, algorithm, 1000, np.float64, MPI.SUM, in_place=True)
    bitwise.check()


DIVIDED = [np.float32, np.float64, np.float16, BFLOAT16]


@pytest.mark.parametrize("algorithm", ALGORITHMS + ([] if LARGE else ["tree"]))
def test_divisor(comm, algorithm):
    """divisor=P (DDP's average, fused into the reduction): bitwise the closed form, the sum
    over ranks of every rank's input (computed here in float64, exact) divided by P and
    rounded once to the dtype, the same bits on every rank; small integers, so that the sums
    are exact in every dtype (float16, bfloat16 too) and the only rounding is the division's."""
    p = comm.size
    counts = [2 ** 20 + 3] if LARGE else sorted({0, 1, max(p - 1, 0), p + 1, 1000, 2 ** 14 + 5})
    bitwise = Bitwise(comm)
    for count in counts:
        for dtype in DIVIDED:
            inputs = [((np.arange(count) * 7 + 3 * r) % 17 - 8).astype(np.float64) for r in range(p)]
            x = as_dtype_exact(inputs[comm.rank], dtype)
            want = np.sum(inputs, axis=0) / p if count else np.zeros(0)
            fused = pc.allreduce_init(count, dtype, MPI.SUM, comm, algorithm=algorithm, divisor=p)
            for rep in range(2):                     # persistent: the second round divides once too
                got = fused.post(x).wait(timeout=60).data
                what = f"{algorithm} count={count} {np.dtype(dtype)} P={p} rep={rep}"
                assert got.dtype == np.dtype(dtype), what
                assert np.array_equal(to_f64(got), to_f64(as_dtype_exact(want, dtype))), what
                bitwise.add(what, got)
            fused.close()
    bitwise.check()


def test_divisor_bad_input_raises_everywhere(comm):
    if LARGE or CHUNKED:
        pytest.skip("--large, --chunked: the plain run checks it")
    for kwargs, exc in [({"op": MPI.MAX}, pc.OpError), ({"dtype": np.int32}, pc.OpError),
                        ({"dtype": np.complex64}, pc.OpError), ({"divisor": 0}, pc.ArgumentError),
                        ({"divisor": float("nan")}, pc.ArgumentError), ({"divisor": "2"}, pc.ArgumentError)]:
        args = {"dtype": np.float32, "op": MPI.SUM, "divisor": 2.0, **kwargs}
        with pytest.raises(exc):
            pc.allreduce_init(8, args["dtype"], args["op"], comm, divisor=args["divisor"])
    if comm.size == 1:
        return
    # a divisor that differs across ranks: ArgumentError on every rank, never a hang
    with pytest.raises(pc.ArgumentError, match="divisor differs"):
        pc.allreduce_init(8, np.float32, MPI.SUM, comm, divisor=2.0 + (comm.rank == comm.size - 1))


@pytest.mark.parametrize("algorithm", [a for a in ALGORITHMS if a != "auto"])
def test_persistent_500_executions(comm, algorithm):
    """One persistent allreduce, 500 executions with fresh data each time (at P <= 4; at
    P = 5 and 8, where each execution costs the most on few cores, 100: the schedule and
    its buffers reused execution after execution are the same at every P)."""
    if LARGE or CHUNKED:
        pytest.skip("--large, --chunked: the plain run checks it")
    coll = pc.allreduce_init(37, np.int64, MPI.SUM, comm, algorithm=algorithm)
    for it in range(500 if comm.size <= 4 else 100):
        x = values(np.int64, MPI.SUM, 37, comm.rank, salt=it)
        ref = np.empty_like(x)
        comm.Allreduce(x, ref)
        res = coll.post(x).wait()
        assert np.array_equal(res.data, ref) and res.round == it, (algorithm, it)
    coll.close()


if __name__ == "__main__":
    run_module(__file__)
