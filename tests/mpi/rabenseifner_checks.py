"""Rabenseifner's allreduce and "auto" against MPI_Allreduce (through mpi4py), every mode:
python rabenseifner_checks.py [--quick] [--sizes=P,Q,...]

Full rounds: each op and each dtype at count 37 P + 5 (the kernels are every
algorithm's; what this one adds is where the blocks are cut), float64 SUM and uint8
BXOR at counts 0, 1, P - 1, P + 1, in place too: equal to MPI_Allreduce, the same bits
on every rank; the divisor. Partial modes (solo, majority, probe, quorum, full) with
late="fold" and skewed posts: the sum of every result and close()'s equals
MPI_Allreduce of everything posted, on every rank. "auto": the same choice, and why, on
every rank, rank 0's also where another rank's cache says otherwise.
--quick (the large P, on few cores): counts 1, P + 1, 37 P + 5, four op x dtype pairs,
fewer rounds. --sizes=12,13,16 (under 16 ranks): every check on the first 12, 13 and 16
ranks in turn, in one launch."""
from __future__ import annotations

import time

import numpy as np
from mpi4py import MPI

import partialcoll as pc
from partialcoll.algorithms import model
from _data import Bitwise, assert_matches, combos, values
from _util import ARGS, communicators, run_module

QUICK = "--quick" in ARGS
SIZES = [int(x) for a in ARGS if a.startswith("--sizes=") for x in a[len("--sizes="):].split(",")]
MODES = ("solo", "majority", "probe", "quorum", "full")


def quick_pairs():
    """Each op once and each dtype once."""
    seen, out = set(), []
    for dtype, op in combos():
        if np.dtype(dtype).str not in seen or op.py2f() not in seen:
            out.append((dtype, op))
            seen |= {np.dtype(dtype).str, op.py2f()}
    return out


def test_full_rounds_equal_mpi_allreduce(comm):
    for sub in communicators(comm, SIZES):
        _full_rounds_equal_mpi_allreduce(sub)


def _full_rounds_equal_mpi_allreduce(comm):
    p, bitwise = comm.size, Bitwise(comm)
    odd = 37 * p + 5
    counts = sorted({1, p + 1, odd} if QUICK else {0, 1, max(p - 1, 0), p + 1, odd})
    for count in counts:                 # where the blocks are cut by element size: each dtype and op once
        few = [(np.float64, MPI.SUM), (np.uint8, MPI.BXOR)] + ([(np.int16, MPI.PROD), (np.float32, MPI.MAX)]
                                                              if count == odd else [])
        for dtype, op in (quick_pairs() if count == odd and not QUICK else few):
            x = values(dtype, op, count, comm.rank)
            ref = np.empty_like(x)
            comm.Allreduce(x, ref, op=op)
            coll = pc.allreduce_init(count, dtype, op, comm, algorithm="rabenseifner")
            for in_place in (False, True):
                y = x.copy()
                res = coll.post(y, out=y if in_place else None).wait(timeout=120)
                what = f"rabenseifner count={count} {np.dtype(dtype)} {op} P={p} in_place={in_place}"
                assert_matches(res.data, ref, op, what)
                bitwise.add(what, res.data)
            coll.close()
    bitwise.check()


def test_divisor(comm):
    for sub in communicators(comm, SIZES):
        _divisor(sub)


def _divisor(comm):
    """divisor=P: MPI_Allreduce's sum over P, each element divided once (exact sums)."""
    p = comm.size
    for count in (1, p + 1, 1001):
        x = ((np.arange(count) * 7 + 3 * comm.rank) % 17 - 8).astype(np.float64)
        ref = np.empty_like(x)
        comm.Allreduce(x, ref)
        coll = pc.allreduce_init(count, np.float64, MPI.SUM, comm, algorithm="rabenseifner", divisor=p)
        assert np.array_equal(coll.post(x).wait(timeout=120).data, ref / p), count
        coll.close()


def test_every_mode_with_fold_loses_nothing(comm):
    for sub in communicators(comm, SIZES):
        _every_mode_with_fold_loses_nothing(sub)


def _every_mode_with_fold_loses_nothing(comm):
    """late="fold", skewed posts: at every rank the results plus close()'s add up to
    MPI_Allreduce of every value every rank posted (integers in float64: exact)."""
    p = comm.size
    rounds = 4 if QUICK else 8
    rng = np.random.default_rng(100 + comm.rank)
    for mode in MODES:
        for count in ((p + 1, 1001) if mode in ("solo", "full") and not QUICK else (1001,)):
            kw = {"quorum": max(1, (p + 1) // 2)} if mode == "quorum" else {}
            coll = pc.PartialAllreduce(count, np.float64, MPI.SUM, comm, mode=mode, late="fold",
                                       algorithm="rabenseifner", seed=3, **kw)
            got, posted = np.zeros(count), np.zeros(count)
            for i in range(rounds):
                if p > 1:
                    time.sleep(rng.uniform(0, 0.002))
                x = (np.arange(count) % 13 + 100 * comm.rank + i).astype(np.float64)
                posted += x
                res = coll.post(x).wait(timeout=120)
                got += res.data
                if mode == "full":
                    ref = np.empty_like(x)
                    comm.Allreduce(x, ref)
                    assert np.array_equal(res.data, ref), (mode, count, i)
            got += coll.close(timeout=120).data
            ref = np.empty_like(posted)
            comm.Allreduce(posted, ref)
            assert np.array_equal(got, ref), (mode, count, np.flatnonzero(got != ref)[:5])


def test_auto_runs_what_it_chose(comm):
    for sub in communicators(comm, SIZES):
        _auto_runs_what_it_chose(sub)


def _auto_runs_what_it_chose(comm):
    """"auto": every rank runs the same algorithm and says why; the result is MPI_Allreduce's."""
    p = comm.size
    for count in (3, (1 << 20) // 4 + 1):
        x = values(np.float32, MPI.SUM, count, comm.rank)
        ref = np.empty_like(x)
        comm.Allreduce(x, ref)
        coll = pc.allreduce_init(count, np.float32, MPI.SUM, comm)
        chosen = comm.allgather((coll.algorithm, coll.algorithm_reason))
        assert all(c == chosen[0] for c in chosen), chosen
        # a machine whose cache says otherwise (every rank but 0 here) still runs rank 0's choice
        load = model.load
        model.load = (lambda *a: model.DEFAULTS._replace(alpha=1.0, alpha_node=1.0, source="elsewhere")) \
            if comm.rank else load
        try:
            other = pc.allreduce_init(count, np.float32, MPI.SUM, comm)
        finally:
            model.load = load
        assert (other.algorithm, other.algorithm_reason) == chosen[0], (other.algorithm_reason, chosen[0])
        other.close()
        assert coll.algorithm in repr(coll) and coll.algorithm_reason in repr(coll)
        assert_matches(coll.post(x).wait(timeout=120).data, ref, MPI.SUM, f"auto {coll.algorithm} P={p}")
        coll.close()


if __name__ == "__main__":
    run_module(__file__)
