"""The balancer thread's round schedules: python balancer_lifetime_checks.py (run under
the engine built with AddressSanitizer by tests/test_lifetimes.py: LeakSanitizer is the
reference).

A decision's round schedules are built by the balancer thread (the engine's
pc_sched_create, owned by the collective) and then handed to the engine
(pc_coll_switch), which frees them with the collective. Where the thread finds, after
building them, that it must stop (the collective closing or dropped, possibly by its own
__del__ on that thread), it returns before the hand-over: those schedules must be freed
there, not leaked.
"""
from __future__ import annotations

import numpy as np

import partialcoll as pc
from partialcoll import _partial, balance
from _util import run_module


def test_rounds_built_then_stopped_are_freed(comm):
    if comm.size == 1:
        return
    real_decide, real_rounds = balance.decide, _partial.PartialAllreduce._native_rounds
    built = []

    def moved(kind, measured, predictor, servers, current, *args):
        return list(current[1:]) + list(current[:1])      # a new assignment: schedules are built

    def rounds_then_stop(self, owners):
        out = real_rounds(self, owners)
        built.append(out)
        self._balancer._stop = True     # the stop arrives while the thread builds
        return out

    balance.decide = moved
    _partial.PartialAllreduce._native_rounds = rounds_then_stop
    try:
        coll = pc.allreduce_init(4000, np.float64, comm=comm, algorithm="ps", block_bytes=8000,
                                 balance="proportional", rebalance_every=1)
        x = np.ones(4000)
        for i in range(3):          # rounds 0-2 run without decision 0
            assert np.array_equal(coll.post(x).wait(timeout=30).data, x * comm.size), i
        coll._balancer.thread.join(30)
        assert not coll._balancer.thread.is_alive()
        assert len(built) == 1, built
        comm.Barrier()
        coll._abandon()             # rounds from 3 on wait for the decision: drop it everywhere
        del coll
    finally:
        balance.decide, _partial.PartialAllreduce._native_rounds = real_decide, real_rounds
    built.clear()
    comm.Barrier()


if __name__ == "__main__":
    run_module(__file__)
