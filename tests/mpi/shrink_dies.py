"""A rank killed, the others go on (on_failure="shrink"): python shrink_dies.py MODE ROUNDS KILLS

Run under Open MPI's ``mpiexec --with-ft ulfm``. KILLS is ``rank:round[,rank:round]``: that
rank posts its post #round, then SIGKILLs itself (before its wait: the round may be in
flight anywhere). Every rank posts and waits ROUNDS times (float64 SUM, late="fold"),
values that differ per rank, post and element, all exact in float64; then close().

Each survivor prints one line for the test (tests/test_shrink.py) to check against the
posts it computes itself:

  SURVIVOR rank=R failed=(..) rounds=N total=[..] posts=K last=[..] full_ok=B recovered=T killed=T0

total: the sum of every result it received plus close()'s; posts: their posts counts;
last: the round numbers it got, in order; full_ok (mode full): every round after the
last death equals the sum of the survivors' posts of that round, computed here from the
value formula; recovered: time.time() when its first wait after a failure returned.
The victims print ``KILLED rank=R at=T`` just before the signal.
"""
from __future__ import annotations

import os
import signal
import sys
import time

import numpy as np
from mpi4py import MPI

import partialcoll as pc

MODE, ROUNDS = sys.argv[1], int(sys.argv[2])
KILLS = {int(r): int(n) for r, n in (k.split(":") for k in sys.argv[3].split(","))}
N = 5
comm = MPI.COMM_WORLD
rank, P = comm.Get_rank(), comm.Get_size()
EXTRA = {"quorum": {"quorum": max(1, P // 2)}}.get(MODE, {})


def value(r: int, i: int) -> np.ndarray:
    """Post #i of rank r: exact in float64 and different per rank, post and element."""
    return (r + 1) * 1e6 + i * 1e2 + np.arange(N, dtype=np.float64)


coll = pc.PartialAllreduce(N, np.float64, comm=comm, mode=MODE, late="fold", seed=7, on_failure="shrink", **EXTRA)
total = np.zeros(N)
posts, rounds, recovered, full_ok = 0, [], 0.0, True
for i in range(ROUNDS):
    x = value(rank, i)
    if KILLS.get(rank) == i:
        coll.post(x)
        print(f"KILLED rank={rank} at={time.time():.6f}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    failed_before = coll.failed
    res = coll.post(x).wait()
    if coll.failed != failed_before and not recovered:
        recovered = time.time()
    total += res.data
    posts += res.posts
    rounds.append(res.round)
    if MODE == "full" and i > max(KILLS.values()):
        want = sum(value(r, i) for r in range(P) if r not in KILLS)
        full_ok &= bool(np.array_equal(res.data, want)) and res.active == tuple(r for r in range(P) if r not in KILLS)
final = coll.close()
total += final.data
posts += final.posts
killed = 0.0
print(f"SURVIVOR rank={rank} failed={coll.failed} rounds={len(rounds)} total={total.tolist()} posts={posts} "
      f"last={rounds} full_ok={full_ok} recovered={recovered:.6f} recoveries={coll.recoveries}", flush=True)
print(f"PASSED {rank}", flush=True)
os._exit(0)     # MPI_Finalize could wait for the dead ranks
