"""Quorum through the comparator network, under MPI: python quorum_network_checks.py [--sizes=P,Q,...]

Every check makes the quorum builder take the network (quorum_network.choose patched on
every rank: the model takes it only from P = 4096 on). The k-th post starts the round,
not the (k - 1)-th: k - 1 chosen ranks post, the round must not complete within 0.3 s;
then the k-th posts, and every rank's result is the sum of exactly those k ranks'
values (computed here from the values, not by the library). With late="fold" and skewed
posts, the results plus close()'s equal MPI_Allreduce of everything posted.
"""
from __future__ import annotations

import time

import numpy as np
from mpi4py import MPI

import partialcoll as pc
from partialcoll.activation import quorum_network
from _util import ARGS, communicators, quiet_barrier, run_module

SIZES = [int(x) for a in ARGS if a.startswith("--sizes=") for x in a[len("--sizes="):].split(",")]
COUNT = 7


class network_forced:
    """Within the block the quorum builder takes the network (and counts its calls)."""

    def __enter__(self):
        self.choose, self.calls = quorum_network.choose, 0

        def choose(size, k):
            self.calls += 1
            return "network"
        quorum_network.choose = choose
        return self

    def __exit__(self, *exc):
        quorum_network.choose = self.choose


def value(rank, rnd):
    return np.arange(COUNT, dtype=np.int64) * 1000 + 10 * rank + rnd + 1


def test_kth_post_starts_the_round(comm):
    for sub in communicators(comm, SIZES):
        _kth_post_starts_the_round(sub)


def _kth_post_starts_the_round(comm):
    p, me = comm.size, comm.rank
    side = comm.Dup()
    for k in sorted({1, 2, (p + 1) // 2, p - 1, p} & set(range(1, p + 1))):
        with network_forced() as forced:
            coll = pc.PartialAllreduce(COUNT, np.int64, MPI.SUM, comm, mode="quorum", quorum=k, seed=k)
        assert forced.calls > 0, "the quorum builder did not ask for the network"
        for rnd in range(2):
            order = [int(r) for r in np.random.default_rng(100 * k + rnd).permutation(p)]
            first, kth = order[:k - 1], order[k - 1]
            req = coll.post(value(me, rnd)) if me in first else None
            quiet_barrier(side)                       # the k - 1 have posted
            if req is not None:
                try:
                    req.wait(timeout=0.3)
                    raise AssertionError(f"P={p} k={k}: the round completed after {k - 1} posts {first}")
                except pc.Timeout:
                    pass
            quiet_barrier(side)
            if me == kth:
                req = coll.post(value(me, rnd))
            if req is not None:
                res = req.wait(timeout=60)
            quiet_barrier(side)                       # the round has read every rank's input
            if req is None:                           # the others' post #rnd: zeros, for later rounds
                res = coll.post(np.zeros(COUNT, np.int64)).wait(timeout=60)
            posters = first + [kth]
            want = sum(value(r, rnd) for r in posters)
            assert res.round == rnd and np.array_equal(res.data, want), (p, k, rnd, posters, res.data, want)
            assert set(posters) <= set(res.active), (p, k, rnd, posters, res.active)
            if rnd == 0:
                assert set(res.active) == set(posters), (p, k, posters, res.active)
            quiet_barrier(side)                       # every rank's post #rnd made: next round
        coll.close(timeout=60)
    side.Free()


def test_fold_equals_mpi_allreduce(comm):
    for sub in communicators(comm, SIZES):
        _fold_equals_mpi_allreduce(sub)


def _fold_equals_mpi_allreduce(comm):
    """Skewed posts, late="fold": every rank's results plus close()'s equal MPI_Allreduce
    of every value posted; every single round holds at least k ranks' data."""
    p, k = comm.size, max(1, (comm.size + 1) // 2)
    rng = np.random.default_rng(7 + comm.rank)
    with network_forced():
        coll = pc.PartialAllreduce(COUNT, np.float64, MPI.SUM, comm, mode="quorum", quorum=k, late="fold")
    got, posted = np.zeros(COUNT), np.zeros(COUNT)
    for i in range(12):
        time.sleep(rng.uniform(0, 0.004))
        x = (np.arange(COUNT) + 100 * comm.rank + i).astype(np.float64)
        posted += x
        res = coll.post(x).wait(timeout=60)
        got += res.data
        if res.rounds == 1 and not res.closing:
            assert res.nap >= k, (p, k, res.round, res.active)
    got += coll.close(timeout=60).data
    ref = np.empty_like(posted)
    comm.Allreduce(posted, ref)
    assert np.array_equal(got, ref), (p, got, ref)


if __name__ == "__main__":
    run_module(__file__)
