"""Neighbours killed, the others go on (NeighborAllreduce, on_failure="shrink"):
python neighbor_shrink_dies.py ITERATIONS PHASES [HOW,HOW,..]

PHASES is ``graph/mode:victims@iteration;...`` (graph: ring, ring_based, double_ring;
mode: std, backup (backup=1), gap (max_gap=2), stale (max_staleness=1); victims ``r`` or
``r+r``, ranks of COMM_WORLD). Each phase makes one NeighborAllreduce (float64,
weights="mean", on_failure="shrink") on that graph over the survivors of the phases
before; every rank posts and waits ITERATIONS times, values exact in float64 and
different per rank, iteration and element. A mode written ``mode+pa`` also makes a
PartialAllreduce (mode="full", on_failure="shrink", after the NeighborAllreduce) over
the same ranks: each iteration a rank posts the same update to both, then waits for
both, in its order: the PartialAllreduce first at even ranks of the phase, the neighbour
collective first at odd ones; its victim posts to neither and fails once every survivor
has posted both (each tells it with a message on a side communicator), so survivors meet the failure
in different collectives (the dead rank's odd neighbours in the NeighborAllreduce, the
others in the PartialAllreduce). A victim posts its update of the iteration
and fails before its wait (HOW, per phase: ``kill``, SIGKILL, under Open MPI's ``mpiexec --with-ft
ulfm``; ``raise`` or ``exit`` under MPICH's ``mpiexec -disable-auto-cleanup``; ``noreport``:
os._exit(9), which nobody reports: without ULFM each survivor prints ``UNSURVIVABLE
phase=K rank=R <PeerError>`` and ends); at
iteration ITERATIONS it fails after its last wait, before close(), so the survivors meet
it in close(). Then close(), and the next phase over the survivors.

Each survivor prints, per phase, one line that tests/test_neighbor_shrink.py checks
against the graph and the values it computes itself:

  NSURVIVOR {"phase": K, "rank": R, "failed": [..], "recoveries": n, "log": [[k, active, updates, data], ..]}

(ranks of COMM_WORLD; updates [[rank, iteration], ..]). With ``+pa``, the line also has
"partial": {"failed": [..], "log": [[round, active, data], ..]} and "met": which of the
two met the failure here ("hop" or "partial": the one whose recovery has a cause). A victim prints ``KILLED
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
    PHASES.append((kind, mode.split("+")[0], mode.endswith("+pa"), {int(v) for v in victims.split("+") if v}, int(at)))
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


def run(phase: int, coll, members, victims, die_at, partial=None, side=None) -> dict:
    """One phase's iterations and close(): this rank's survivor line. side (with partial):
    a communicator on which each survivor tells the victims that it posted both (a send
    it does not wait for), so the failure comes after every survivor's posts, in a wait."""
    log, plog = [], []
    for k in range(ITERATIONS):
        x = value(me, k)
        if me in victims and k == die_at:
            if partial is None:
                coll.post(x)
            else:
                for _ in range(side.Get_size() - len(victims)):
                    side.recv(source=MPI.ANY_SOURCE, tag=k)
            die(phase)
        if partial is None:
            res = coll.post(x).wait()
        else:                        # both posted, then waited for in this rank's order
            order = [(partial, 1), (coll, 0)] if coll.rank % 2 == 0 else [(coll, 0), (partial, 1)]
            reqs = [(j, c.post(x)) for c, j in order]
            if k == die_at:
                for v in victims:
                    side.send(None, dest=members.index(v), tag=k)
            got = {j: req.wait() for j, req in reqs}
            res, pres = got[0], got[1]
            plog.append([pres.round, [members[a] for a in pres.active], pres.data.tolist()])
        log.append([res.iteration, [members[a] for a in res.active], [[members[s], i] for s, i in res.updates],
                    res.data.tolist()])
    if me in victims and die_at >= ITERATIONS:
        die(phase)                   # after its last wait: the survivors meet it in close()
    coll.close()                     # collective: in one order everywhere
    line = {"phase": phase, "rank": me, "failed": [members[r] for r in coll.failed],
            "recoveries": len(coll.recoveries), "log": log,
            "how": [{key: v for key, v in e.items() if key != "cause"} for e in coll.recoveries]}
    if partial is not None:
        partial.close()
        line["partial"] = {"failed": [members[r] for r in partial.failed], "log": plog,
                           "recoveries": len(partial.recoveries)}
        line["met"] = [name for name, c in (("hop", coll), ("partial", partial))
                       if c.recoveries and c.recoveries[0]["cause"] != "pass"]
    return line


comm = WORLD
for phase, (kind, mode, with_partial, victims, die_at) in enumerate(PHASES):
    size = comm.Get_size()
    members = MPI.Group.Translate_ranks(comm.Get_group(), list(range(size)), WORLD.Get_group())
    g = topology.graph(comm, kind)
    try:
        coll = pc.NeighborAllreduce(N, np.float64, comm=g, on_failure="shrink", **MODES[mode])
        partial = (pc.PartialAllreduce(N, np.float64, comm=comm, mode="full", on_failure="shrink")
                   if with_partial else None)
        side = comm.Dup() if with_partial else None
        line = run(phase, coll, members, victims, die_at, partial, side)
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
