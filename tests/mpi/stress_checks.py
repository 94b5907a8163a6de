"""bench/stress.py, short: python stress_checks.py OPS [stress.py's options]

Four threads per rank post, wait, test, close, abandon and drop at random on two
collectives, every mode, late "latest" and "fold": every result checked against what was
posted (nothing lost, nothing twice), two waits of one request alike, rounds agreeing
across ranks, and only the documented exceptions."""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench"))
import stress
from _util import ARGS, run_module

OPS = ARGS[0] if ARGS else "400"


def test_stress_every_mode(comm):
    args = stress.parser().parse_args(["--ops", OPS, "--epoch-ops", "200", "--timeout", "60", *ARGS[1:]])
    assert stress.run(comm, args)


if __name__ == "__main__":
    run_module(__file__)
