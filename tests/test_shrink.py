"""on_failure="shrink" (docs/faults.md, "A dead rank left out"): ranks SIGKILLed mid-round,
the survivors agree on them, shrink and go on (tests/mpi/shrink_dies.py).

Under Open MPI with ULFM (the environment .ci/openmpi-env makes; tests/test_openmpi.py runs
these there) every mode, one launch per P: P = 8 (the modes at 8, 7, 6, 5, 4 ranks, one
rank killed at round 10 in each) and P = 5 (at 5, with three collectives, then 3 ranks
after two killed at once, 2). Phases with several collectives (a training step's buckets)
have each rank wait in its own order, so survivors meet the failure in different ones:
they must recover them in one order (creation order) or wait for each other. Checked against the value formula, here: every survivor completes every round; the
survivors' sums of results (plus close()) are the same everywhere and equal everything
the survivors posted plus a prefix of each victim's posts (what the dead contributed to
completed rounds stays, nothing half-applied: its posts are inside whole, in order), and
the posts counts agree with that prefix; full mode: each round after the deaths is the
sum of the survivors' posts; coll.failed names the victims. Under MPICH (no working
ULFM) the construction raises ArgumentError on every rank.
"""
import re

import numpy as np
import pytest

from conftest import mpi_flavour, run_mpi
from partialcoll.activation import quorum_network

pytestmark = pytest.mark.mpiexec

ROUNDS = 30
N = 5


def value(r, i):
    return (r + 1) * 1e6 + i * 1e2 + np.arange(N, dtype=np.float64)


def survivors_of(out):
    """{(phase, rank, collective): (failed, rounds, total, posts, full_ok)} of the SURVIVOR lines."""
    got = {}
    for m in re.finditer(r"SURVIVOR phase=(\d+)(?:\.(\d+))? rank=(\d+) failed=\(([\d, ]*)\) rounds=(\d+) "
                         r"total=\[([^\]]*)\] posts=(\d+) full_ok=(\w+)", out):
        failed = tuple(int(v) for v in m.group(4).replace(" ", "").split(",") if v)
        got[int(m.group(1)), int(m.group(3)), int(m.group(2) or 0)] = (
            failed, int(m.group(5)), np.array([float(v) for v in m.group(6).split(",")]), int(m.group(7)),
            m.group(8) == "True")
    return got


def prefix(r, j):
    """value(r, 0) + ... + value(r, j - 1), in closed form."""
    return j * (r + 1) * 1e6 + 1e2 * j * (j - 1) / 2 + j * np.arange(N, dtype=np.float64)


def dead_posts_fit(rest, read, victims, most):
    """Whether rest (the survivors' sum less their own posts) is whole posts of the dead:
    a prefix of j_v posts of each victim v (j_v <= most), read posts in all."""
    victims = sorted(victims)
    for js in _choices(victims[:-1], most):
        last = read - sum(j for _, j in js)
        if 0 <= last <= most and np.array_equal(rest, sum((prefix(v, j) for v, j in js), prefix(victims[-1], last))):
            return True
    return False


def check_phases(out, nprocs, phases):
    got = survivors_of(out)
    members = list(range(nprocs))
    for phase, (mode, victims, die_at) in enumerate(phases):
        agreeing = {int(v[:-1]) for v in victims if isinstance(v, str)}   # "r!": died in the agreement
        victims = {int(str(v).rstrip("!")) for v in victims}
        alive = [r for r in members if r not in victims]
        for j in range(int((mode + "*1").split("*")[1])):     # "mode*k": k collectives
            check_collective(out, got, phase, j, mode, victims, agreeing, alive, die_at)
        members = alive


def check_collective(out, got, phase, j, mode, victims, agreeing, alive, die_at):
    """One collective j of a phase: its SURVIVOR lines against the value formula."""
    lines = {rank: got.get((phase, rank, j)) for rank in alive}
    assert all(lines.values()), (phase, j, mode, sorted(r for r, v in lines.items() if not v), out[-4000:])
    totals = {tuple(v[2]) for v in lines.values()}
    assert len(totals) == 1, (phase, j, mode, "survivors disagree", lines)
    for rank, (failed, rounds, _, _, full_ok) in lines.items():
        assert failed == tuple(sorted(victims)), (phase, j, mode, rank, failed)
        assert rounds == ROUNDS and full_ok, (phase, j, mode, rank, rounds, full_ok)
    failed, rounds, total, posts, _ = next(iter(lines.values()))
    rest = total - sum((prefix(r, ROUNDS) for r in alive), np.zeros(N))
    read = posts - len(alive) * ROUNDS
    # a prefix j_v of each victim's posts (j_v <= die_at + 1), and the posts count says the same
    # (a rank that died in the agreement may have posted one more: its round's next)
    assert dead_posts_fit(rest, read, victims, die_at + 1 + bool(agreeing)), \
        (phase, j, mode, "not the survivors' posts plus whole posts of the dead", rest.tolist(), read)


def _choices(victims, most):
    if not victims:
        yield ()
        return
    for j in range(most + 1):
        for rest in _choices(victims[1:], most):
            yield ((victims[0], j),) + rest


def spec(phases):
    return ";".join(f"{m}:{'+'.join(map(str, sorted(v, key=str)))}@{n}" for m, v, n in phases)


CASES = {
    8: [("solo", {5}, 10), ("majority", {0}, 10), ("probe", {7}, 10), ("quorum", {2}, 10), ("full", {3}, ROUNDS)],
    5: [("full*3", {4}, 10), ("majority", {1, 3}, 10), ("solo", {0}, 10)],
    6: [("full*2", {4, "2!"}, 10), ("probe", {3}, 10)],
}


@pytest.mark.parametrize("nprocs", sorted(CASES))
def test_survivors_go_on(nprocs):
    """Every mode at P = 8, 7, 6, 5, 4 (one launch, a rank killed at round 10 of 30 in each
    phase; the last after its last round, so that the survivors meet it in close()), P = 5
    (three collectives, survivors meeting the failure in different ones), 3 (two killed at
    once), 2, and P = 6 with two collectives where a second rank dies inside the survivors'
    agreement in the second one (they shrink and agree again there; the first, rebuilt with
    it, recovers again in a second pass), then 4: see the module docstring."""
    if mpi_flavour() != "openmpi":
        pytest.skip("needs the second MPI's environment: Open MPI with ULFM (mpiexec --with-ft ulfm); "
                    "tests/test_openmpi.py runs it in the environment .ci/openmpi-env makes")
    phases = CASES[nprocs]
    out = run_mpi("shrink_dies.py", nprocs, str(ROUNDS), spec(phases), keep_going=True,
                  expect_passed=nprocs - sum(len(v) for _, v, _ in phases), timeout=120)
    check_phases(out, nprocs, phases)
    if any(isinstance(v, str) for _, vs, _ in phases for v in vs):
        assert re.search(r"'tries': 2", out), out[-3000:]     # the agreement did go round again
    for phase, (mode, vs, _) in enumerate(phases):
        if "*" in mode and any(isinstance(v, str) for v in vs):
            # the second death came in the pass's last collective's agreement: the first
            # collective, rebuilt with that rank, recovered again in a second pass
            first = re.findall(rf"SURVIVOR phase={phase}\.0 rank=\d+ .*", out)
            assert len(first) == nprocs - len(vs) and all(line.count("'failed':") == 2 for line in first), first


MPICH_CASES = {
    3: ("raise", [("solo*3", {2}, 10), ("full", {0}, ROUNDS)]),
    5: ("exit", [("full*2", {4}, 10), ("majority", {1}, 10), ("probe", {3}, ROUNDS), ("quorum", {0}, 10)]),
    # quorum through the sorting network in boxes (forced), a box's host dying at P = 8, 7,
    # 6 (in a round) and 5 (after its last round: the survivors meet it in close())
    8: ("exit", [("qnet", {1}, 10), ("qnet", {2}, 10), ("qnet", {3}, 10), ("qnet", {4}, ROUNDS)]),
}


def check_network(out, nprocs, phases):
    """Phases of mode qnet: each victim hosted a box of its phase's network (k = P // 2, as
    shrink_dies.py makes it), and every survivor's collective, the rebuilt one too, asked
    for the network."""
    members = list(range(nprocs))
    for phase, (mode, victims, _) in enumerate(phases):
        if mode == "qnet":
            hosts = {members[b.host] for b in quorum_network.plan(len(members), len(members) // 2).boxes}
            assert victims <= hosts, (phase, victims, hosts)
            alive = [r for r in members if r not in victims]
            calls = {int(m.group(1)): int(m.group(2))
                     for m in re.finditer(rf"NETWORK phase={phase} rank=(\d+) calls=(\d+)", out)}
            assert sorted(calls) == alive and min(calls.values()) >= 2, (phase, calls)
        members = [r for r in members if r not in victims]


@pytest.mark.parametrize("nprocs", sorted(MPICH_CASES))
def test_survivors_of_a_report_go_on(nprocs):
    """MPICH (no ULFM) under -disable-auto-cleanup: a rank that raises (P = 3, 2) or calls
    sys.exit(3) (P = 5, 4, 3, 2) reports and leaves without aborting the job; the survivors
    go on over MPI_Comm_create_group of the others: the same checks as under ULFM. One
    victim per launch fails after its last round: the survivors meet it in close(). P = 8
    (8, 7, 6, 5): quorum through the sorting network, a box's host dying in each phase."""
    if mpi_flavour() == "openmpi":
        pytest.skip("needs the second MPI's environment: MPICH's path (a report, then MPI_Comm_create_group); "
                    "Open MPI runs test_survivors_go_on")
    how, phases = MPICH_CASES[nprocs]
    out = run_mpi("shrink_dies.py", nprocs, str(ROUNDS), spec(phases), how, keep_going=True,
                  expect_passed=nprocs - sum(len(v) for _, v, _ in phases), timeout=120)
    check_phases(out, nprocs, phases)
    check_network(out, nprocs, phases)


def test_shrink_refused_without_ulfm():
    """Open MPI without `--with-ft ulfm`: ArgumentError at construction on every rank,
    naming what is missing (MPICH constructs: it survives the failures that report)."""
    if mpi_flavour() != "openmpi":
        pytest.skip("needs the second MPI's environment: Open MPI without ULFM enabled; tests/test_openmpi.py runs it")
    out = run_mpi("shrink_dies.py", 3, "5", "solo:2@3", timeout=60)
    refused = re.findall(r"REFUSED rank=(\d+) on_failure='shrink' cannot work here: ULFM is not enabled", out)
    assert sorted(map(int, refused)) == [0, 1, 2], out[-3000:]


@pytest.mark.parametrize("die_at", [10, ROUNDS], ids=["in-a-round", "before-close"])
def test_unreported_failure_is_named_not_survived(die_at):
    """MPICH: a rank that leaves without a report (os._exit; a SIGKILL ends the whole job
    under MPICH's launcher before anyone could go on) cannot be survived without ULFM:
    every survivor raises PeerError saying so, within its liveness bound (the report is
    waited for 1 s, then the MPI asked: 1.5 s measured), never a hang; in a post or a
    wait, or in close() where the victim dies after its last round (so can the victim of
    round 10: a solo round needs no post, and its engine may serve every round of the
    survivors while its main thread is held up: CI, once)."""
    if mpi_flavour() == "openmpi":
        pytest.skip("needs the second MPI's environment: MPICH (ULFM survives a rank that leaves without a "
                    "report: test_survivors_go_on)")
    out = run_mpi("shrink_dies.py", 3, str(ROUNDS), f"solo:2@{die_at}", "noreport", keep_going=True, expect_passed=2,
                  timeout=60)
    killed = float(re.search(r"KILLED phase=0 rank=2 at=([\d.]+)", out).group(1))
    got = {int(m.group(1)): float(m.group(2)) for m in
           re.finditer(r"UNSURVIVABLE phase=0 rank=(\d+) at=([\d.]+) rank\(s\) \(2,\) failed without a report", out)}
    assert sorted(got) == [0, 1], out[-3000:]
    assert all(t - killed < 10 for t in got.values()), (killed, got)
