"""Quorum through the sorting network in boxes, under MPI: python quorum_network_checks.py [--sizes=P,Q,...]
(or --quorum-sizes=P,Q,..., which takes precedence: in a job with rabenseifner_checks.py)

Every check makes the quorum builder take the network (quorum_network.choose patched on
every rank: the model takes it only from P ≈ 900 on). The k-th post starts the round,
not the (k - 1)-th: k - 1 chosen ranks post, the round must not complete within 0.3 s
(one window serves every k of a P: their collectives are open together); then the k-th
posts, and every rank's result is the sum of exactly those k ranks'
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

# --quorum-sizes=P,Q,... where the job's --sizes are another module's (one launch for both)
_OPT = "--quorum-sizes=" if any(a.startswith("--quorum-sizes=") for a in ARGS) else "--sizes="
SIZES = [int(x) for a in ARGS if a.startswith(_OPT) for x in a[len(_OPT):].split(",")]
COUNT = 7
# the negative window: a round that k - 1 posts completed would complete within milliseconds
# of their posts (the k - 1 posted before it opens), on a loaded machine within tens
WINDOW = 0.3


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
    """Every k's collective at once: in each round the k - 1 chosen ranks of every k post,
    then one window of WINDOW s serves every k (the first pending wait times out after it,
    the others' rounds are then tested: each had WINDOW s since its posts); then each k's
    k-th rank posts and the round's result is checked."""
    p, me = comm.size, comm.rank
    side = comm.Dup()
    colls = {}
    for k in sorted({1, 2, (p + 1) // 2, p - 1, p} & set(range(1, p + 1))):
        with network_forced() as forced:
            colls[k] = pc.PartialAllreduce(COUNT, np.int64, MPI.SUM, comm, mode="quorum", quorum=k, seed=k)
        assert forced.calls > 0, "the quorum builder did not ask for the network"
    for rnd in range(2):
        orders = {k: [int(r) for r in np.random.default_rng(100 * k + rnd).permutation(p)] for k in colls}
        reqs = {k: colls[k].post(value(me, rnd)) if me in orders[k][:k - 1] else None for k in colls}
        quiet_barrier(side)                           # every k's k - 1 have posted
        pending = [k for k in colls if reqs[k] is not None]
        if pending:
            try:
                reqs[pending[0]].wait(timeout=WINDOW)
                pending = pending[:1]
            except pc.Timeout:
                pending = [k for k in pending[1:] if reqs[k].test()]
            assert not pending, f"P={p} k={pending}: the round completed after k - 1 posts {orders}"
        quiet_barrier(side)
        for k, coll in colls.items():
            first, kth = orders[k][:k - 1], orders[k][k - 1]
            req = coll.post(value(me, rnd)) if me == kth else reqs[k]
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
    for coll in colls.values():
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
