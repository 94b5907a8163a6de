"""A rank stalled under solo (issue 14, item 3), short: python stall_checks.py HOW STALL_S

bench/stall.py's run: the last rank stalls for STALL_S seconds (HOW: sleep, its
application thread sleeps; sigstop, rank 0 stops the whole process) while the others
post and wait. Nothing is lost (every rank's results plus close() equal everything
posted); with sleep the others' rounds go on during the stall (at least a quarter of their
rate before it), and the victim's first post afterwards folds every round it missed and
returns at once; its later late posts return at once too, so its lag behind the others'
rounds shrinks after the stall. With sigstop rounds stop during the stall (at most a
fifth of the rate before and after it) and go on after it.
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
        before, during, after = (row[f"{w}_rounds_per_s"] for w in ("before", "during", "after"))
        if HOW == "sleep":
            # the others' rounds go on at their pace (a ratio: the machine's load cancels)
            assert during >= 0.25 * before, row
            first = row["victim_first_result_after"]
            # its first post afterwards folds every round it missed (those the others ran)
            assert first["late"] and first["rounds_folded"] >= 0.9 * during * float(STALL), first
            # post #n belongs to round n (DESIGN.md), so it catches up one late post at a
            # time, each returning at once: its lag behind the others' rounds shrinks
            assert row["victim_lag_at_end"] < row["victim_lag_after_stall"], row
        else:
            # nothing of the victim runs, so rounds stop (but for those that ran before the
            # stop reached it: rank 0 sends SIGSTOP within 0.05 s), and go on after SIGCONT
            assert 5 * during <= before and 5 * during <= after, row
        assert all(p > 0 for p in row["posts"]), row


if __name__ == "__main__":
    run_module(__file__)
