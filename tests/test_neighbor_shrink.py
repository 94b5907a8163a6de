"""NeighborAllreduce(on_failure="shrink") (docs/faults.md): a neighbour dies, the graph
closes over it, the survivors go on (tests/mpi/neighbor_shrink_dies.py).

One launch per MPI and P: the phases run at sizes that go down (P = 5, 4, 3 in one job;
under ULFM also 8, then 6 after two killed at once). Checked here, against Hop's
graphs and their closing over the dead written in this file (not the library's): every
survivor completes every iteration; coll.failed names the victims; each result is
exactly the mean of this rank's update and the updates it lists (the values are exact
in float64, the mean one division), and its updates come from either the old graph's
in-neighbours (the iteration completed before the failure, the dead rank's update
inside) or the closed graph's (it ran again over the survivors): never a mix, never a
dead rank's update after the iteration it died in (with max_staleness=1: the one after),
and only the closed graph after that.
The victim of the last phase fails after its last wait: the survivors meet it in close().
"""
import json
import random
import re

import numpy as np
import pytest

from conftest import mpi_flavour, run_mpi
from partialcoll import topology

pytestmark = pytest.mark.mpiexec

ITERATIONS = 20
N = 3
STRIDES = {"ring": lambda p: (1,), "ring_based": lambda p: (1, p // 2), "double_ring": lambda p: (1, 2)}


def value(r, k):
    return (r + 1) * 1e4 + k * 1e2 + np.arange(N, dtype=np.float64)


def in_neighbours(kind, members):
    """{world rank: set of world in-neighbours} of Hop's graph `kind` over members (in order)."""
    p = len(members)
    return {members[i]: {members[(i + s * d) % p] for d in STRIDES[kind](p) for s in (1, -1)} - {members[i]}
            for i in range(p)}


def closed_over(ins, dead):
    """The survivors' in-neighbours once `dead` left: s feeds r where a path s -> .. -> r
    runs through dead ranks only (the graph closes over the gap)."""
    out = {}
    for r in ins:
        if r in dead:
            continue
        found, frontier, seen = set(), [r], {r}
        while frontier:
            v = frontier.pop()
            for s in ins[v]:
                if s in seen:
                    continue
                seen.add(s)
                if s in dead:
                    frontier.append(s)
                else:
                    found.add(s)
        out[r] = found - {r}
    return out


@pytest.mark.parametrize("kind", sorted(STRIDES))
def test_bridged_closes_over_the_dead(kind):
    """topology.bridged (what the survivors build) against the paths through dead ranks
    computed here, for every graph at P = 2..9 and up to three dead ranks; a ring stays a
    ring (every survivor keeps two neighbours while three or more are left)."""
    rng = random.Random(kind)
    for p in range(2, 10):
        ins = in_neighbours(kind, list(range(p)))
        graph = {r: (sorted(ins[r]), sorted(s for s in range(p) if r in ins[s])) for r in range(p)}
        for _ in range(6):
            dead = set(rng.sample(range(p), rng.randint(1, min(3, p - 1))))
            got = topology.bridged(graph, dead)
            want = closed_over(ins, dead)
            assert {r: set(got[r][0]) for r in got} == want, (kind, p, dead, got)
            assert all(set(got[r][1]) == {s for s in want if r in want[s]} for r in got), (kind, p, dead, got)
            if kind == "ring" and p - len(dead) >= 3:
                assert all(len(want[r]) == 2 for r in want), (p, dead, want)


def check(out, nprocs, phases):
    lines = {}
    for m in re.finditer(r"NSURVIVOR ", out):
        line = json.JSONDecoder().raw_decode(out, m.end())[0]     # ranks' lines may run together
        lines[line["phase"], line["rank"]] = line
    members = list(range(nprocs))
    for phase, (kind, mode, victims, die_at) in enumerate(phases):
        old = in_neighbours(kind, members)
        new = closed_over(old, victims)
        alive = [r for r in members if r not in victims]
        for r in alive:
            line = lines.get((phase, r))
            assert line, (phase, r, "no survivor line", out[-4000:])
            assert line["failed"] == sorted(victims) and line["recoveries"] == (1 if victims else 0), (phase, r, line)
            assert [e[0] for e in line["log"]] == list(range(ITERATIONS)), (phase, r, "iterations")
            for k, active, updates, data in line["log"]:
                want = value(r, k) + sum((value(s, i) for s, i in updates), np.zeros(N))
                assert np.array_equal(np.array(data), want / (1 + len(updates))), (phase, r, k, data, updates)
                srcs = {s for s, _ in updates}
                assert active == sorted(srcs | {r}), (phase, r, k, active, updates)
                stale = 1 if mode == "stale" else 0     # max_staleness=1: the dead's update of die_at may serve die_at + 1
                graphs = [new[r]] if k > die_at + stale else [old[r], new[r]]
                if mode == "backup":     # backup=1: all but one in-neighbour (all where only one is left)
                    fits = [g for g in graphs if srcs <= g and len(srcs) >= max(len(g) - 1, min(len(g), 1))]
                else:                    # every in-neighbour of one of the graphs
                    fits = [g for g in graphs if srcs == g]
                assert fits, (phase, r, k, "not the old graph's nor the closed graph's in-neighbours", updates,
                              old[r], new[r])
                assert all(k - stale <= i <= k for _, i in updates), (phase, r, k, updates)
        members = alive


def spec(phases):
    return ";".join(f"{kind}/{mode}:{'+'.join(map(str, sorted(v)))}@{n}" for kind, mode, v, n in phases)


ULFM_CASES = {
    5: [("ring", "std", {2}, 8), ("ring_based", "backup", {0}, 8), ("ring", "gap", {4}, ITERATIONS)],
    8: [("ring_based", "std", {5}, 8), ("double_ring", "stale", {2, 6}, 8), ("ring", "std", set(), 0)],
}
MPICH_CASES = {
    5: ([("ring", "std", {2}, 8), ("ring_based", "backup", {0}, 8), ("ring", "gap", {4}, ITERATIONS),
         ("ring", "std", {3}, 5)], "raise,exit,raise,noreport"),
}


@pytest.mark.parametrize("nprocs", sorted(ULFM_CASES))
def test_neighbours_go_on_ulfm(nprocs):
    """Open MPI with ULFM, SIGKILL: P = 5, 4, 3 (ring, standard; ring_based, backup
    workers; ring with tokens, the victim dying before close()); P = 8, 7 (ring_based;
    double_ring with staleness, two killed at once), then 5 (a ring, no failure)."""
    if mpi_flavour() != "openmpi":
        pytest.skip("needs the second MPI's environment: Open MPI with ULFM (mpiexec --with-ft ulfm); "
                    "tests/test_openmpi.py runs it in the environment .ci/openmpi-env makes")
    phases = ULFM_CASES[nprocs]
    out = run_mpi("neighbor_shrink_dies.py", nprocs, str(ITERATIONS), spec(phases), keep_going=True,
                  expect_passed=nprocs - sum(len(v) for _, _, v, _ in phases), timeout=120)
    check(out, nprocs, phases)


@pytest.mark.parametrize("nprocs", sorted(MPICH_CASES))
def test_neighbours_go_on_mpich(nprocs):
    """MPICH (no ULFM) under -disable-auto-cleanup: the victim raises (P = 5, ring;
    P = 3, ring with tokens, before close()) or calls sys.exit(3) (P = 4, ring_based,
    backup workers); its report names it to every survivor, MPI_Comm_create_group over
    the others: the same checks. Then P = 2 where the victim calls os._exit (no report):
    the survivor raises PeerError naming it."""
    if mpi_flavour() == "openmpi":
        pytest.skip("needs the second MPI's environment: MPICH's path (a report, then MPI_Comm_create_group); "
                    "Open MPI runs test_neighbours_go_on_ulfm")
    phases, how = MPICH_CASES[nprocs]
    out = run_mpi("neighbor_shrink_dies.py", nprocs, str(ITERATIONS), spec(phases), how, keep_going=True,
                  expect_passed=nprocs - sum(len(v) for _, _, v, _ in phases), timeout=120)
    check(out, nprocs, phases[:-1])
    # the last phase's victim leaves without a report (os._exit): its survivor raises
    # PeerError naming it, never a hang
    members = [r for r in range(nprocs) if all(r not in v for _, _, v, _ in phases[:-1])]
    (victim,) = phases[-1][2]
    named = members.index(victim)        # in the numbering of that phase's communicator
    unsurvived = re.findall(rf"UNSURVIVABLE phase={len(phases) - 1} rank=(\d+) rank\(s\) \({named},\) failed "
                            rf"without a report", out)
    assert sorted(map(int, unsurvived)) == [r for r in members if r != victim], out[-3000:]
