"""partial_checks.py's semantics checks with algorithm="ps" and balance=:
python ps_partial_checks.py CASES [ROUNDS] [BALANCE]
(partial_checks.py's checks, collected from this module; CASES: comma-separated MODE or
MODE:BALANCE, each check runs once per case, BALANCE defaulting to the third argument)

A launcher, not a copy: every PartialAllreduce that partial_checks.py creates gets
algorithm="ps" with every vector cut into 5 blocks,
balance=BALANCE (default psld), a new epoch every 2 rounds and epsilon 0.5, so the
assignment switches often while ranks post at random times: nothing posted may be lost
or counted twice across a switch, in every mode. At the end, every rank must have
seen the same assignments for the same rounds in every collective it closed.
"""
from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

import partialcoll as pc
from _util import ARGS, run_module

DEFAULT_BALANCE = ARGS[2] if len(ARGS) > 2 else "psld"
CASES = [(case.partition(":")[0], case.partition(":")[2] or DEFAULT_BALANCE)
         for case in (ARGS[0] if ARGS else "solo").split(",")]
BALANCE = DEFAULT_BALANCE          # the running case's (the mode fixture sets it)


class PsAllreduce(pc.PartialAllreduce):
    made = 0
    closed: list = []              # per closed collective: (balance, its (first round, assignment) history)

    def __init__(self, *args, **kwargs):
        comm = args[3] if len(args) > 3 else kwargs.get("comm", MPI.COMM_WORLD)
        kwargs.setdefault("algorithm", "ps")
        if isinstance(comm, MPI.Intracomm) and kwargs["algorithm"] == "ps":
            dtype = args[1] if len(args) > 1 else kwargs.get("dtype", np.float32)
            count = args[0] if args else kwargs["count"]
            size = np.dtype(dtype).itemsize
            kwargs.setdefault("block_bytes", size * max(1, -(-count // 5)))     # 5 blocks
            kwargs.setdefault("balance", BALANCE)
            kwargs.setdefault("rebalance_every", 2)
            kwargs.setdefault("epsilon", 0.5)
        super().__init__(*args, **kwargs)
        assert self.algorithm == "ps", self.algorithm
        PsAllreduce.made += 1

    def close(self, *args, **kwargs):
        res = super().close(*args, **kwargs)
        b = self._balancer
        PsAllreduce.closed.append((BALANCE, [(first, list(a)) for first, a in b.history] if b else None))
        return res


pc.PartialAllreduce = PsAllreduce
import partial_checks  # noqa: E402,F401  (imported for its effect: reads ROUNDS from ARGS)
from partial_checks import *  # noqa: E402,F403  (its checks, collected here too)


@pytest.fixture(params=CASES, ids=[f"{mode}-{balance}" for mode, balance in CASES])
def mode(request):     # replaces partial_checks' mode: a case is a mode and a balance
    """Each case's mode, every ps allreduce made meanwhile with its balance."""
    global BALANCE
    name, BALANCE = request.param
    return name


def test_zz_assignments_agree(comm):
    """(zz: collected last) every closed collective switched its assignment at the same
    rounds to the same owners on every rank; balance= other than static switched."""
    assert PsAllreduce.made >= 8, f"only {PsAllreduce.made} ps allreduces were made"
    everyone = comm.allgather(PsAllreduce.closed)
    assert all(theirs == PsAllreduce.closed for theirs in everyone), "ranks disagree on the assignments"
    for balance in {b for _, b in CASES} - {"static"}:
        switches = sum(len(h) - 1 for b, h in PsAllreduce.closed if h and b == balance)
        assert switches > 0 or comm.size == 1, f"no collective with balance={balance} ever switched its assignment"


if __name__ == "__main__":
    run_module(__file__)
