"""Neighbours killed, the others go on (NeighborAllreduce, on_failure="shrink"):
python neighbor_shrink_dies.py ITERATIONS PHASES [HOW,HOW,..]

PHASES is ``graph/mode:victims@iteration;...`` (graph: ring, ring_based, double_ring;
mode: std, backup (backup=1), gap (max_gap=2), stale (max_staleness=1); victims ``r`` or
``r+r``, ranks of COMM_WORLD). Each phase makes one NeighborAllreduce (float64,
weights="mean", on_failure="shrink") on that graph over the survivors of the phases
before; every rank posts and waits ITERATIONS times, values exact in float64 and
different per rank, iteration and element. A victim posts its update of the iteration
and fails before its wait (HOW, per phase: ``kill``, SIGKILL, under Open MPI's ``mpiexec --with-ft
ulfm``; ``raise`` or ``exit`` under MPICH's ``mpiexec -disable-auto-cleanup``; ``noreport``:
os._exit(9), which nobody reports: without ULFM each survivor prints ``UNSURVIVABLE
phase=K rank=R <PeerError>`` and ends); at
iteration ITERATIONS it fails after its last wait, before close(), so the survivors meet
it in close(). Then close(), and the next phase over the survivors.

Each survivor prints, per phase, one line that tests/test_neighbor_shrink.py checks
against the graph and the values it computes itself:

  NSURVIVOR {"phase": K, "rank": R, "failed": [..], "recoveries": n, "log": [[k, active, updates, data], ..]}

(ranks of COMM_WORLD; updates [[rank, iteration], ..]). A victim prints ``KILLED
phase=K rank=R``. Where the construction raises ArgumentError (no ULFM), every rank
prints ``REFUSED rank=R <message>``.
"""
from __future__ import annotations

import json
import os
import signal
import sys

import numpy as np
from mpi4py import MPI

import partialcoll as pc
from partialcoll import topology

ITERATIONS = int(sys.argv[1])
HOWS = (sys.argv[3] if len(sys.argv) > 3 else "kill").split(",")      # per phase, the last repeated
MODES = {"std": {}, "backup": {"backup": 1}, "gap": {"max_gap": 2}, "stale": {"max_staleness": 1}}
PHASES = []
for spec in sys.argv[2].split(";"):
    shape, rest = spec.split(":")
    victims, at = rest.split("@")
    kind, mode = shape.split("/")
    PHASES.append((kind, mode, {int(v) for v in victims.split("+") if v}, int(at)))
N = 3
WORLD = MPI.COMM_WORLD
me = WORLD.Get_rank()
ULFM = pc.info()["shrink"]["ulfm"]


def value(r: int, k: int) -> np.ndarray:
    """Rank r's update of iteration k: exact in float64, different per rank, k and element."""
    return (r + 1) * 1e4 + k * 1e2 + np.arange(N, dtype=np.float64)


def die(phase: int) -> None:
    print(f"KILLED phase={phase} rank={me}", flush=True)
    how = HOWS[min(phase, len(HOWS) - 1)]
    if how == "raise":               # an uncaught exception: the rank reports, then leaves
        raise RuntimeError(f"rank {me} fails (on purpose)")
    ends = {"exit": lambda: sys.exit(3), "noreport": lambda: os._exit(9),
            "kill": lambda: os.kill(os.getpid(), signal.SIGKILL)}
    ends[how]()


def run(phase: int, coll, members, victims, die_at) -> dict:
    """One phase's iterations and close(): this rank's survivor line."""
    log = []
    for k in range(ITERATIONS):
        x = value(me, k)
        if me in victims and k == die_at:
            coll.post(x)
            die(phase)
        res = coll.post(x).wait()
        log.append([res.iteration, [members[a] for a in res.active], [[members[s], i] for s, i in res.updates],
                    res.data.tolist()])
    if me in victims and die_at >= ITERATIONS:
        die(phase)                   # after its last wait: the survivors meet it in close()
    coll.close()
    return {"phase": phase, "rank": me, "failed": [members[r] for r in coll.failed],
            "recoveries": len(coll.recoveries), "log": log,
            "how": [{key: v for key, v in e.items() if key != "cause"} for e in coll.recoveries]}


comm = WORLD
for phase, (kind, mode, victims, die_at) in enumerate(PHASES):
    size = comm.Get_size()
    members = MPI.Group.Translate_ranks(comm.Get_group(), list(range(size)), WORLD.Get_group())
    g = topology.graph(comm, kind)
    try:
        coll = pc.NeighborAllreduce(N, np.float64, comm=g, on_failure="shrink", **MODES[mode])
        line = run(phase, coll, members, victims, die_at)
    except pc.ArgumentError as exc:
        print(f"REFUSED rank={me} {exc}", flush=True)
        print(f"PASSED {me}", flush=True)
        sys.exit(0)
    except pc.PeerError as exc:          # a failure this MPI cannot survive (HOW noreport, MPICH)
        print(f"UNSURVIVABLE phase={phase} rank={me} {exc}", flush=True)
        print(f"PASSED {me}", flush=True)
        os._exit(0)
    print("NSURVIVOR " + json.dumps(line), flush=True)
    if victims:                      # the next phase over the survivors
        comm = comm.Shrink() if ULFM else comm.Create_group(comm.Get_group().Excl([members.index(v) for v in victims]))
        comm.Set_errhandler(MPI.ERRORS_RETURN)
print(f"PASSED {me}", flush=True)
os._exit(0)     # MPI_Finalize could wait for the dead ranks
