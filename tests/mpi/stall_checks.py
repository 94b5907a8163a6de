"""A rank stalled under solo (issue 14, item 3), short: python stall_checks.py HOW STALL_S

bench/stall.py's run: the last rank stalls for STALL_S seconds (HOW: sleep, its
application thread sleeps; sigstop, rank 0 stops the whole process) while the others
post and wait. Nothing is lost (every rank's results plus close() equal everything
posted); with sleep the others' rounds go on during the stall (more than 20 rounds a
second here), and the victim's first post afterwards folds every round it missed and
returns at once; its later late posts return at once too, so its lag behind the others'
rounds shrinks after the stall.
"""
from __future__ import annotations

import os
import sys


sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench"))
import stall
from _util import ARGS, run_module

HOW = ARGS[0] if ARGS else "sleep"
STALL = ARGS[1] if len(ARGS) > 1 else "3"


def test_stalled_rank(comm):
    args = stall.parser().parse_args(["--how", HOW, "--stall", STALL, "--before", "1", "--after", "1",
                                      "--sample", "0.5"])
    r = stall.run(comm, args)
    assert r["ok"], "something posted was lost"
    if comm.rank == 0:
        row = r["row"]
        if HOW == "sleep":
            assert row["during_rounds_per_s"] > 20, row
            first = row["victim_first_result_after"]
            assert first["late"] and first["rounds_folded"] > 20, first
            # post #n belongs to round n (DESIGN.md), so it catches up one late post at a
            # time, each returning at once: its lag behind the others' rounds shrinks
            assert row["victim_lag_at_end"] < row["victim_lag_after_stall"], row
        assert all(p > 0 for p in row["posts"]), row


if __name__ == "__main__":
    run_module(__file__)
