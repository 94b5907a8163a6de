"""bench/soak.py, short: python soak_checks.py ROUNDS

Every mode, ROUNDS posts per rank with random skew: nothing lost, every round agrees
across the ranks that got it, full rounds equal the sum of every rank's post."""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench"))
import soak
from _util import ARGS, run_module

ROUNDS = ARGS[0] if ARGS else "2000"


def test_soak_every_mode(comm):
    args = soak.parser().parse_args(["--rounds", ROUNDS, "--sample", "500"])
    for mode in args.modes.split(","):
        assert soak.soak(comm, mode, args)["ok"], mode


if __name__ == "__main__":
    run_module(__file__)
