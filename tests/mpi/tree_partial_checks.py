"""partial_checks.py's semantics checks with algorithm="tree":
python tree_partial_checks.py CASES [ROUNDS] [SHAPE]
(partial_checks.py's checks, collected from this module; CASES: comma-separated MODE or
MODE:SHAPE, each check runs once per case, SHAPE defaulting to the third argument)

A launcher, not a copy: every PartialAllreduce that partial_checks.py creates gets
algorithm="tree" and the regions of SHAPE over the communicator's ranks:
  uneven   two regions, the first of ceil(P/3) ranks (P = 5: [0, 0, 1, 1, 1])
  levels   hosts of two ranks in two racks ([[0, 0, 1, 1, 2], [0, 0, 0, 1, 1]] at P = 5)
  chunked  uneven, with every vector cut into chunks (tree.CHUNK_BYTES = 8)
"""
from __future__ import annotations

import pytest
from mpi4py import MPI

import partialcoll as pc
from partialcoll.algorithms import tree
from _util import ARGS, run_module

DEFAULT_SHAPE = ARGS[2] if len(ARGS) > 2 else "uneven"
CASES = [(case.partition(":")[0], case.partition(":")[2] or DEFAULT_SHAPE)
         for case in (ARGS[0] if ARGS else "solo").split(",")]
SHAPE = DEFAULT_SHAPE              # the running case's (the mode fixture sets it)


def regions(size: int):
    uneven = [0 if r < -(-size // 3) else 1 for r in range(size)]
    if SHAPE == "levels":
        return [[r // 2 for r in range(size)], [0 if r < size // 2 else 1 for r in range(size)]]
    return uneven


class TreeAllreduce(pc.PartialAllreduce):
    made = 0

    def __init__(self, *args, **kwargs):
        comm = args[3] if len(args) > 3 else kwargs.get("comm", MPI.COMM_WORLD)
        kwargs.setdefault("algorithm", "tree")
        if isinstance(comm, MPI.Intracomm):          # bad_input() also passes an intercommunicator
            kwargs.setdefault("groups", regions(comm.Get_size()))
        super().__init__(*args, **kwargs)
        assert self.algorithm == "tree", self.algorithm
        TreeAllreduce.made += 1


pc.PartialAllreduce = TreeAllreduce
import partial_checks  # noqa: E402,F401  (imported for its effect: reads ROUNDS from ARGS)
from partial_checks import *  # noqa: E402,F403  (its checks, collected here too)


@pytest.fixture(params=CASES, ids=[f"{mode}-{shape}" for mode, shape in CASES])
def mode(request):     # replaces partial_checks' mode: a case is a mode and a shape
    """Each case's mode, every tree made meanwhile with its shape's regions."""
    global SHAPE
    name, SHAPE = request.param
    saved = tree.CHUNK_BYTES
    if SHAPE == "chunked":
        tree.CHUNK_BYTES = 8
    yield name
    tree.CHUNK_BYTES = saved


def test_every_allreduce_was_a_tree(comm):
    assert TreeAllreduce.made >= 8, f"only {TreeAllreduce.made} tree allreduces were made"


if __name__ == "__main__":
    run_module(__file__)
