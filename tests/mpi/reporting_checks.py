"""The in-rank pytest plugin itself (tests/mpi/conftest.py, tests/test_checks.py):
python reporting_checks.py HOW, HOW one of

  pass   every check passes on every rank
  fail   test_fails_on_last_rank fails on the last rank only (the others pass it)
  hang   it fails on the last rank before a barrier the others wait in
"""
from __future__ import annotations

from _util import ARGS, run_module

HOW = ARGS[0] if ARGS else "pass"


def test_first(comm):
    comm.Barrier()


def test_fails_on_last_rank(comm):
    last = comm.rank == comm.size - 1
    if HOW == "hang":
        assert not last, "the last rank fails before the barrier"
        comm.Barrier()
    assert not (HOW == "fail" and last), "the last rank fails"


def test_after(comm):
    comm.Barrier()


if __name__ == "__main__":
    run_module(__file__)
