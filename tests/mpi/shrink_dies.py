"""Ranks killed, the others go on (on_failure="shrink"): python shrink_dies.py ROUNDS PHASES [HOW]

A victim written ``r!`` does not die at the round: it dies inside the survivors'
agreement on the others (ULFM only). Run under Open MPI's ``mpiexec --with-ft ulfm`` (HOW ``kill``: SIGKILL, the default), or
MPICH's ``mpiexec -disable-auto-cleanup`` (HOW ``raise``: an uncaught exception; ``exit``:
sys.exit(3); each reports to the peers; ``noreport``: os._exit(9), which nobody reports:
each survivor prints ``UNSURVIVABLE phase=K rank=R at=T <PeerError>``). PHASES is ``mode:victims@round;...``,
victims ``r`` or ``r+r`` (ranks of COMM_WORLD); a mode written ``mode*k`` makes k
collectives in that phase; mode ``qnet`` is quorum through the sorting network in boxes
(quorum_network.choose patched on every rank, the rebuilt collectives' too: the model
takes it only from P ≈ 900 on; each survivor prints ``NETWORK phase=K rank=R calls=N``). Each phase makes one PartialAllreduce (k)
(float64 SUM, late="fold", on_failure="shrink") over the survivors of the phases before
(the test's own MPIX_Comm_shrink, or MPI_Comm_create_group over the survivors without ULFM); every rank posts and
waits ROUNDS times, values that differ per rank, post and element, all exact in float64;
each victim posts its post #round and fails (HOW) before its wait (the round may be
in flight anywhere), the others go on; then close(). With k collectives every rank
posts to each, then waits for each, in its own order (k collectives rotated by its rank:
survivors meet the failure in different collectives, in a post or in a wait), and a
victim posts to its first one only. A victim at round ROUNDS fails after
its last wait, before close(): the survivors meet the failure in close(). So one launch tries every mode, at
sizes that go down phase by phase.

Each survivor prints per phase and collective (j of k) one line for tests/test_shrink.py, which checks it against
the posts it computes itself (ranks are COMM_WORLD's):

  SURVIVOR phase=K[.j] rank=R failed=(..) rounds=N total=[..] posts=K full_ok=B recovered=T

total: the sum of every result it received plus close()'s; posts: their posts counts;
failed: coll.failed, in COMM_WORLD's numbering; full_ok (mode full): every round after
the deaths equals the sum of the survivors' posts of that round (computed here from the
value formula) with exactly the survivors active; recovered: time.time() when its first
wait after the failure returned. A victim prints ``KILLED phase=K rank=R at=T`` before
the signal. With no ULFM (MPICH) the construction must raise ArgumentError on every
rank: ``REFUSED rank=R <message>``.
"""
from __future__ import annotations

import os
import signal
import sys
import time

import numpy as np
from mpi4py import MPI

import partialcoll as pc
from partialcoll.activation import quorum_network

ROUNDS = int(sys.argv[1])
HOW = sys.argv[3] if len(sys.argv) > 3 else "kill"
PHASES = [(m, {int(v.rstrip("!")) for v in vs.split("+")}, {int(v[:-1]) for v in vs.split("+") if v.endswith("!")}, int(n))
          for m, vs, n in (p.replace("@", ":").split(":") for p in sys.argv[2].split(";"))]
PHASES = [(m.split("*")[0], int((m + "*1").split("*")[1]), v, a, n) for m, v, a, n in PHASES]
N = 5
ULFM = pc.info()["shrink"]["ulfm"]
WORLD = MPI.COMM_WORLD
me = WORLD.Get_rank()


def value(r: int, i: int) -> np.ndarray:
    """Post #i of world rank r: exact in float64 and different per rank, post and element."""
    return (r + 1) * 1e6 + i * 1e2 + np.arange(N, dtype=np.float64)


comm = WORLD
plans = [0, 1, None]        # plans made, the one to die in, the real _plan


def die_agreeing(*args, **kwargs):
    """A victim marked r!: it dies inside the survivors' agreement on another victim (after
    the shrink, before they compare rounds), so they must shrink and agree again; with k
    collectives, in the last one's (the first k - 1 were rebuilt with it: they fail at their
    next use and recover again)."""
    plans[0] += 1
    if plans[0] < plans[1]:
        return plans[2](*args, **kwargs)
    print(f"KILLED phase=agreeing rank={me} at={time.time():.6f}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def die(phase: int, i: int) -> None:
    print(f"KILLED phase={phase} rank={me} at={time.time():.6f}", flush=True)
    if HOW == "raise":
        raise RuntimeError(f"rank {me} fails in round {i} (on purpose)")
    if HOW == "exit":
        sys.exit(3)
    if HOW == "noreport":
        os._exit(9)
    os.kill(os.getpid(), signal.SIGKILL)


def unsurvivable(phase: int, exc: pc.PeerError) -> None:
    """A failure this MPI cannot survive (HOW noreport, MPICH), met in a post, a wait or
    close(): a solo round needs no post, so where the victim's main thread is held up,
    its engine can serve every round of the survivors before it dies, and they meet the
    failure in close()."""
    print(f"UNSURVIVABLE phase={phase} rank={me} at={time.time():.6f} {exc}", flush=True)
    print(f"PASSED {me}", flush=True)
    os._exit(0)


network_calls = [0]
model_choice = quorum_network.choose


def network_forced(size: int, k: int) -> str:
    network_calls[0] += 1
    return "network"


for phase, (mode, ncolls, victims, agreeing, die_at) in enumerate(PHASES):
    quorum_network.choose = network_forced if mode == "qnet" else model_choice
    if mode == "qnet":
        mode, network_calls[0] = "quorum", 0
    if me in agreeing:
        from partialcoll import _shrink
        plans[1:] = [ncolls, _shrink.Shrinker._plan]
        _shrink.Shrinker._plan = die_agreeing
    size = comm.Get_size()
    members = MPI.Group.Translate_ranks(comm.Get_group(), list(range(size)), WORLD.Get_group())
    extra = {"quorum": {"quorum": max(1, size // 2)}}.get(mode, {})
    try:
        colls = [pc.PartialAllreduce(N, np.float64, comm=comm, mode=mode, late="fold", seed=7 + phase,
                                     on_failure="shrink", **extra) for _ in range(ncolls)]
    except pc.ArgumentError as exc:
        print(f"REFUSED rank={me} {exc}", flush=True)
        print(f"PASSED {me}", flush=True)
        sys.exit(0)
    # several collectives: this rank posts to all, then waits for all, in its own order (rotated
    # by its rank), so that survivors meet a failure in different collectives, some in a post
    order = [(j + comm.Get_rank()) % ncolls for j in range(ncolls)]
    total = [np.zeros(N) for _ in colls]
    posts, got, recovered, full_ok = [0] * ncolls, 0, 0.0, [True] * ncolls
    alive = tuple(r for r in members if r not in victims)
    for i in range(ROUNDS):
        x = value(me, i)
        if me in victims - agreeing and i == die_at:
            colls[order[0]].post(x)
            die(phase, i)
        try:
            reqs = {j: colls[j].post(x) for j in order}
            results = {j: reqs[j].wait() for j in order}
        except pc.PeerError as exc:
            unsurvivable(phase, exc)
        if colls[0].failed and not recovered:
            recovered = time.time()
        got += 1
        for j, res in results.items():
            total[j] += res.data
            posts[j] += res.posts
            if mode == "full" and i > die_at:
                want = sum(value(r, i) for r in alive)
                full_ok[j] &= bool(np.array_equal(res.data, want)) and tuple(members[r] for r in res.active) == alive
    if me in victims - agreeing and die_at >= ROUNDS:
        die(phase, die_at)       # after its last wait: the survivors meet it in close()
    for j in range(ncolls):      # close() is collective: in one order everywhere
        try:
            final = colls[j].close()
        except pc.PeerError as exc:
            unsurvivable(phase, exc)
        total[j] += final.data
        posts[j] += final.posts
    for j, coll in enumerate(colls):
        failed = tuple(members[r] for r in coll.failed)
        name = f"{phase}.{j}" if ncolls > 1 else f"{phase}"
        print(f"SURVIVOR phase={name} rank={me} failed={failed} rounds={got} total={total[j].tolist()} "
              f"posts={posts[j]} full_ok={full_ok[j]} recovered={recovered:.6f} recoveries={coll.recoveries}",
              flush=True)
    if network_calls[0]:
        print(f"NETWORK phase={phase} rank={me} calls={network_calls[0]}", flush=True)
    if victims:                  # the next phase over the survivors
        # ULFM: MPIX_Comm_shrink (MPI_Comm_create_group waits on a communicator with dead
        # ranks); MPICH: MPI_Comm_create_group, collective over the survivors only
        comm = comm.Shrink() if ULFM else comm.Create_group(comm.Get_group().Excl([members.index(v) for v in victims]))
        comm.Set_errhandler(MPI.ERRORS_RETURN)
print(f"PASSED {me}", flush=True)
os._exit(0)     # MPI_Finalize could wait for the dead ranks
